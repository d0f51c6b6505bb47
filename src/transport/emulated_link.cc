#include "transport/emulated_link.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>

namespace nebula::transport {
namespace {

double to_ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

}  // namespace

EmulatedLink::EmulatedLink(std::unique_ptr<Link> inner, WanEmulation emulation)
    : inner_(std::move(inner)), emulation_(emulation) {
  NEBULA_CHECK(inner_ != nullptr, "EmulatedLink needs an inner link");
  NEBULA_CHECK(std::isfinite(emulation_.bandwidth_bits_per_s) && emulation_.bandwidth_bits_per_s >= 0,
               "WAN emulation bandwidth must be >= 0 bit/s (0 = unlimited), got ", emulation_.bandwidth_bits_per_s);
  NEBULA_CHECK(emulation_.one_way_delay.count() >= 0, "WAN emulation delay must be >= 0, got ",
               emulation_.one_way_delay.count(), " ns");
  pump_thread_ = std::thread([this] { pump(); });
}

EmulatedLink::~EmulatedLink() { close(); }

Clock::duration EmulatedLink::serialization_time(uint64_t wire_bytes) const {
  if (emulation_.bandwidth_bits_per_s <= 0) return Clock::duration::zero();
  // Capped at ~30 years so the conversion cannot overflow.
  double secs = std::min(static_cast<double>(wire_bytes) * 8.0 / emulation_.bandwidth_bits_per_s, 1e9);
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(secs));
}

size_t EmulatedLink::in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size();
}

LinkStats EmulatedLink::stats() const { return counters_.snapshot(); }

void EmulatedLink::throw_if_failed(const char* what) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (error_) std::rethrow_exception(error_);
  if (closing_) throw PeerLost(inner_->peer(), str_cat(what, " ", inner_->peer(), ": link was closed locally"));
}

void EmulatedLink::send(const wire::Frame& frame, Deadline deadline) {
  NEBULA_CHECK(frame.payload.size() == frame.header.payload_len, "send to ", inner_->peer(), ": payload has ",
               frame.payload.size(), " bytes but header.payload_len is ", frame.header.payload_len);
  std::unique_lock<std::mutex> send_lock(send_mu_);
  throw_if_failed("send to");
  const uint64_t wire_bytes = wire::kHeaderSize + frame.payload.size();
  const auto now = Clock::now();
  const auto start = std::max(now, last_end_);
  const auto end = start + serialization_time(wire_bytes);
  if (end > deadline.at()) {
    throw Timeout(inner_->peer(),
                  str_cat("send to ", inner_->peer(), ": the emulated WAN (", emulation_.bandwidth_bits_per_s / 1e6,
                          " Mbit/s) would finish serialising this ", wire_bytes, "-byte frame in ",
                          to_ms(end - now), " ms (", to_ms(start - now), " ms of it queued behind earlier frames), ",
                          "past the deadline in ", to_ms(deadline.remaining()), " ms"));
  }
  last_end_ = end;
  // Copy while the bottleneck is busy with it: the caller keeps its frame.
  InFlight item{frame, end + emulation_.one_way_delay,
                deadline.is_never() ? Deadline::never() : Deadline(deadline.at() + emulation_.one_way_delay)};
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_until(lock, end, [&] { return closing_; });
    if (error_) std::rethrow_exception(error_);
    if (closing_)
      throw PeerLost(inner_->peer(), str_cat("send to ", inner_->peer(), ": link was closed locally while sending"));
    queue_.push_back(std::move(item));
  }
  cv_.notify_all();
  LinkCounters::add(counters_.bytes_sent, wire_bytes);
  LinkCounters::add(counters_.frames_sent, 1);
}

wire::Frame EmulatedLink::recv(Deadline deadline) {
  throw_if_failed("recv from");
  wire::Frame frame = inner_->recv(deadline);
  LinkCounters::add(counters_.bytes_received, wire::kHeaderSize + frame.payload.size());
  LinkCounters::add(counters_.frames_received, 1);
  return frame;
}

void EmulatedLink::pump() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (queue_.empty()) {
      if (closing_) break;  // drained
      cv_.wait(lock);
      continue;
    }
    const auto due = queue_.front().due;
    if (Clock::now() < due) {
      cv_.wait_until(lock, due);
      continue;
    }
    InFlight item = std::move(queue_.front());
    queue_.pop_front();
    pump_busy_ = true;
    lock.unlock();
    std::exception_ptr err;
    try {
      inner_->send(item.frame, item.deadline);
    } catch (const std::exception& e) {
      err = std::current_exception();
      spdlog::warn("emulated WAN link to {}: delivering a frame failed: {}", inner_->peer(), e.what());
    } catch (...) {
      err = std::current_exception();
    }
    lock.lock();
    pump_busy_ = false;
    if (err) {
      if (!error_) error_ = err;
      queue_.clear();
    }
    cv_.notify_all();
  }
  pump_done_ = true;
  cv_.notify_all();
}

void EmulatedLink::close() {
  std::lock_guard<std::mutex> close_lock(close_mu_);
  if (closed_) return;
  closed_ = true;
  {
    std::unique_lock<std::mutex> lock(mu_);
    closing_ = true;
    const auto now = Clock::now();
    const auto last_due = queue_.empty() ? now : std::max(now, queue_.back().due);
    cv_.notify_all();
    if (!cv_.wait_until(lock, last_due + kDrainGrace, [&] { return pump_done_; }))
      spdlog::warn("emulated WAN link to {}: {} frame(s) still in flight at close; dropping them", inner_->peer(),
                   queue_.size() + (pump_busy_ ? 1 : 0));
  }
  inner_->close();  // wakes a pump stuck in inner_->send()
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (pump_thread_.joinable()) pump_thread_.join();
}

}  // namespace nebula::transport
