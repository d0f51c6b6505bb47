#include "transport/emulated_link.h"

#include <spdlog/spdlog.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <type_traits>

namespace nebula::transport {
namespace {

double to_ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

const char* fault_name(WanFault::Kind k) {
  switch (k) {
    case WanFault::Kind::kCut: return "cut";
    case WanFault::Kind::kStall: return "stall";
    case WanFault::Kind::kCorrupt: return "corrupt";
    case WanFault::Kind::kBlackhole: return "blackhole";
  }
  return "?";
}

// `d` past `t`, saturating instead of overflowing for Deadline::never().
Clock::time_point later(Clock::time_point t, Clock::duration d) {
  return t >= Clock::time_point::max() - d ? Clock::time_point::max() : t + d;
}

// A Bottleneck's clock: Clock's nanoseconds as an int64, in a file of this size if shared.
constexpr off_t kClockFileBytes = sizeof(int64_t);
int64_t to_ns(Clock::time_point t) { return t.time_since_epoch().count(); }
Clock::time_point from_ns(int64_t ns) { return Clock::time_point(Clock::duration(ns)); }

}  // namespace

// ---------------------------------------------------------------------------------------

// The clock is an int64 count of Clock's nanoseconds, in memory that other processes may map.
// Clock must be steady_clock: on Linux that is CLOCK_MONOTONIC, the same clock in every
// process of the machine, so their moments compare.
static_assert(std::is_same_v<Clock, std::chrono::steady_clock>);
static_assert(std::is_same_v<Clock::duration, std::chrono::nanoseconds>);
static_assert(std::atomic_ref<int64_t>::is_always_lock_free);

Bottleneck::Bottleneck(double bandwidth_bits_per_s, std::shared_ptr<Bottleneck> next)
    : bandwidth_(bandwidth_bits_per_s), next_(std::move(next)) {
  NEBULA_CHECK(std::isfinite(bandwidth_) && bandwidth_ >= 0,
               "WAN emulation bandwidth must be >= 0 bit/s (0 = unlimited), got ", bandwidth_);
}

std::shared_ptr<Bottleneck> Bottleneck::in_file(double bandwidth_bits_per_s, const std::string& path,
                                                std::shared_ptr<Bottleneck> next) {
  auto b = std::make_shared<Bottleneck>(bandwidth_bits_per_s, std::move(next));
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  auto fail = [&](const char* what) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    return Error(str_cat("WAN emulation bottleneck file ", path, ": ", what, " failed: ", std::strerror(err),
                         "; give a path in an existing, writable directory on a local filesystem"));
  };
  if (fd < 0) throw fail("open");
  // Creation races are harmless: a file is grown only from under 8 bytes to 8 (zeros), and
  // growing one that another process already grew, and perhaps used, changes nothing.
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw fail("fstat");
  if (st.st_size < kClockFileBytes && ::ftruncate(fd, kClockFileBytes) != 0) throw fail("ftruncate");
  void* mapping = ::mmap(nullptr, kClockFileBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (mapping == MAP_FAILED) throw fail("mmap");
  ::close(fd);  // the mapping keeps the file
  b->mapping_ = mapping;
  b->last_end_ns_ = static_cast<int64_t*>(mapping);  // page-aligned
  return b;
}

Bottleneck::~Bottleneck() {
  if (mapping_) ::munmap(mapping_, kClockFileBytes);
}

Clock::duration Bottleneck::stage_time(uint64_t wire_bytes) const {
  if (bandwidth_ <= 0) return Clock::duration::zero();
  // Capped at ~30 years so the conversion cannot overflow.
  double secs = std::min(static_cast<double>(wire_bytes) * 8.0 / bandwidth_, 1e9);
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(secs));
}

Clock::duration Bottleneck::serialization_time(uint64_t wire_bytes) const {
  const auto t = stage_time(wire_bytes);
  return next_ ? std::max(t, next_->serialization_time(wire_bytes)) : t;
}

Bottleneck::Slot Bottleneck::reserve(uint64_t wire_bytes, Clock::time_point now) {
  Slot s{now, now};  // an unlimited stage keeps no clock
  if (bandwidth_ > 0) {
    const auto t = stage_time(wire_bytes);
    std::atomic_ref<int64_t> last_end(*last_end_ns_);
    int64_t prev = last_end.load();
    do {
      s.start = std::max(now, from_ns(prev));
      s.end = s.start + t;
    } while (!last_end.compare_exchange_weak(prev, to_ns(s.end)));
  }
  if (next_) {
    // Cut-through: the segment enters the next stage as it starts leaving this one.
    const Slot n = next_->reserve(wire_bytes, s.start);
    s = {std::max(s.start, n.start), std::max(s.end, n.end)};
  }
  return s;
}

Clock::time_point Bottleneck::free_at(Clock::time_point now) const {
  auto t = now;
  if (bandwidth_ > 0) t = std::max(now, from_ns(std::atomic_ref<int64_t>(*last_end_ns_).load()));
  return next_ ? std::max(t, next_->free_at(now)) : t;
}

// ---------------------------------------------------------------------------------------

EmulatedLink::EmulatedLink(std::unique_ptr<Link> inner, WanEmulation emulation)
    : EmulatedLink(std::move(inner), emulation, std::make_shared<Bottleneck>(emulation.bandwidth_bits_per_s)) {}

EmulatedLink::EmulatedLink(std::unique_ptr<Link> inner, WanEmulation emulation, std::shared_ptr<Bottleneck> bottleneck)
    : inner_(std::move(inner)),
      emulation_(std::move(emulation)),
      bottleneck_(std::move(bottleneck)),
      created_(Clock::now()),
      rng_(emulation_.seed) {
  NEBULA_CHECK(inner_ != nullptr, "EmulatedLink needs an inner link");
  NEBULA_CHECK(bottleneck_ != nullptr, "EmulatedLink needs a bottleneck");
  NEBULA_CHECK(emulation_.bandwidth_bits_per_s == bottleneck_->bandwidth_bits_per_s(),
               "WAN emulation of the link to ", inner_->peer(), ": bandwidth ", emulation_.bandwidth_bits_per_s,
               " bit/s differs from its shared bottleneck's ", bottleneck_->bandwidth_bits_per_s(), " bit/s");
  NEBULA_CHECK(emulation_.one_way_delay.count() >= 0, "WAN emulation delay must be >= 0, got ",
               emulation_.one_way_delay.count(), " ns");
  NEBULA_CHECK(emulation_.jitter.count() >= 0, "WAN emulation jitter must be >= 0, got ", emulation_.jitter.count(),
               " ns");
  for (size_t i = 0; i < emulation_.faults.size(); ++i) {
    const WanFault& f = emulation_.faults[i];
    NEBULA_CHECK(f.at.has_value() || f.after_bytes.has_value(), "WAN emulation fault #", i, " (",
                 fault_name(f.kind), ") has neither `at` nor `after_bytes`");
    NEBULA_CHECK(!f.at || f.at->count() >= 0, "WAN emulation fault #", i, ": `at` must be >= 0, got ",
                 f.at ? f.at->count() : 0, " ns");
    NEBULA_CHECK(f.duration.count() >= 0, "WAN emulation fault #", i, ": duration must be >= 0, got ",
                 f.duration.count(), " ns");
    PendingFault p;
    p.fault = f;
    if (f.at) p.at = created_ + std::chrono::duration_cast<Clock::duration>(*f.at);
    faults_.push_back(p);
  }
  pump_thread_ = std::thread([this] { pump(); });
}

EmulatedLink::~EmulatedLink() { close(); }

Clock::duration EmulatedLink::serialization_time(uint64_t wire_bytes) const {
  return bottleneck_->serialization_time(wire_bytes);
}

size_t EmulatedLink::in_flight() const {
  MutexLock lock(mu_);
  return queue_.size();
}

LinkStats EmulatedLink::stats() const {
  LinkStats s = counters_.snapshot();
  const LinkStats inner = inner_->stats();
  s.wire_bytes_sent = inner.wire_bytes_sent;
  s.wire_bytes_received = inner.wire_bytes_received;
  return s;
}

void EmulatedLink::throw_if_failed(const char* what) const {
  if (error_) std::rethrow_exception(error_);
  if (closing_) throw PeerLost(inner_->peer(), str_cat(what, " ", inner_->peer(), ": link was closed locally"));
}

Clock::time_point EmulatedLink::after_stalls(Clock::time_point t) const {
  // Stalls may overlap or chain; repeat until t is outside all of them (few stalls ever).
  for (bool moved = true; moved;) {
    moved = false;
    for (const Stall& s : stalls_) {
      if (t >= s.from && t < s.until) {
        t = s.until;
        moved = true;
      }
    }
  }
  return t;
}

uint64_t EmulatedLink::window_in_use_locked(Clock::time_point now, Clock::time_point* next_ack) {
  // Arrivals are non-decreasing and after_stalls() is monotone, so ACKs are in order.
  while (!window_.empty() && after_stalls(window_.front().arrival) + emulation_.one_way_delay <= now)
    window_.pop_front();
  uint64_t used = 0;
  for (const Segment& s : window_) used += s.bytes;
  *next_ack = window_.empty() ? now : after_stalls(window_.front().arrival) + emulation_.one_way_delay;
  return used;
}

Clock::time_point EmulatedLink::next_timed_fault_locked() const {
  auto t = Clock::time_point::max();
  for (const PendingFault& f : faults_)
    if (!f.fired && f.at) t = std::min(t, *f.at);
  return t;
}

void EmulatedLink::fire_locked(PendingFault& f, Clock::time_point when, const char* trigger) {
  f.fired = true;
  const std::string peer = inner_->peer();
  switch (f.fault.kind) {
    case WanFault::Kind::kCut:
      spdlog::warn("emulated WAN link to {}: fault fires ({}): cut; {} frame(s) in flight are lost", peer, trigger,
                   queue_.size());
      if (!error_)
        error_ = std::make_exception_ptr(
            PeerLost(peer, str_cat("link to ", peer, " cut by WAN emulation fault (", trigger, ")")));
      queue_.clear();
      window_.clear();
      break;
    case WanFault::Kind::kStall:
      spdlog::warn("emulated WAN link to {}: fault fires ({}): stall, nothing delivered for {:.0f} ms", peer, trigger,
                   to_ms(f.fault.duration));
      stalls_.push_back({when, when + std::chrono::duration_cast<Clock::duration>(f.fault.duration)});
      break;
    case WanFault::Kind::kCorrupt:
      spdlog::warn("emulated WAN link to {}: fault fires ({}): corrupt, the next frame with a payload gets one "
                   "byte flipped",
                   peer, trigger);
      corrupt_next_ = true;
      break;
    case WanFault::Kind::kBlackhole:
      spdlog::warn("emulated WAN link to {}: fault fires ({}): black hole, every byte vanishes from now on both ways "
                   "(no FIN, no RST); {} frame(s) in flight are lost",
                   peer, trigger, queue_.size());
      blackholed_ = true;
      queue_.clear();
      window_.clear();
      break;
  }
  cv_.notify_all();
}

bool EmulatedLink::fire_faults_locked(Clock::time_point now, bool at_send_start) {
  bool cut = false;
  for (PendingFault& f : faults_) {
    if (f.fired) continue;
    if (f.at && now >= *f.at) {
      // A timed fault takes effect at its scheduled moment even if noticed a little late.
      fire_locked(f, *f.at, str_cat("at ", to_ms(*f.at - created_), " ms").c_str());
    } else if (at_send_start && f.fault.after_bytes && bytes_accepted_ >= *f.fault.after_bytes) {
      fire_locked(f, now, str_cat("after ", bytes_accepted_, " bytes sent").c_str());
    } else {
      continue;
    }
    cut |= f.fault.kind == WanFault::Kind::kCut;
  }
  return cut;
}

void EmulatedLink::break_locked(std::exception_ptr error) {
  if (!error_) error_ = std::move(error);
  queue_.clear();
  window_.clear();
  cv_.notify_all();
}

void EmulatedLink::send(const wire::Frame& frame, Deadline deadline) {
  NEBULA_CHECK(frame.payload.size() == frame.header.payload_len, "send to ", inner_->peer(), ": payload has ",
               frame.payload.size(), " bytes but header.payload_len is ", frame.header.payload_len);
  const std::string peer = inner_->peer();
  MutexLock send_lock(send_mu_);
  MutexLock lock(mu_);
  if (fire_faults_locked(Clock::now(), /*at_send_start=*/true)) {
    lock.unlock();
    inner_->close();
    lock.lock();
  }
  throw_if_failed("send to");
  if (blackholed_) {
    // What a sender sees on a black-holed path: the window fills and is never acknowledged.
    while (!closing_ && !error_ && !deadline.expired()) cv_.wait_until(mu_, deadline.at());
    throw_if_failed("send to");
    throw Timeout(peer, str_cat("send to ", peer, ": deadline passed; nothing is acknowledged (black-holed by a WAN "
                                "emulation fault)"));
  }

  const uint64_t wire_bytes = wire::kHeaderSize + frame.payload.size();
  {
    // The earliest this frame could finish: behind the bottleneck's backlog, with an idle window.
    const auto now = Clock::now();
    const auto start = bottleneck_->free_at(now);
    const auto end = start + serialization_time(wire_bytes);
    if (end > deadline.at()) {
      throw Timeout(peer, str_cat("send to ", peer, ": the emulated WAN (", emulation_.bandwidth_bits_per_s / 1e6,
                                  " Mbit/s) would finish serialising this ", wire_bytes, "-byte frame in ",
                                  to_ms(end - now), " ms (", to_ms(start - now),
                                  " ms of it queued behind earlier frames), past the deadline in ",
                                  to_ms(deadline.remaining()), " ms"));
    }
  }
  bytes_accepted_ += wire_bytes;
  const auto jitter =
      emulation_.jitter.count() > 0
          ? std::chrono::duration_cast<Clock::duration>(std::chrono::nanoseconds(
                std::uniform_int_distribution<int64_t>(0, emulation_.jitter.count())(rng_)))
          : Clock::duration::zero();
  const auto delay = std::chrono::duration_cast<Clock::duration>(emulation_.one_way_delay) + jitter;

  // Copy while the bottleneck is busy with it: the caller keeps its frame.
  lock.unlock();
  InFlight item{frame, {}, deadline};
  lock.lock();

  // Serialise segment by segment. Each waits for room in the window, takes the next slot
  // of the (possibly shared) bottleneck, and the next one is reserved once this one has
  // started, so the bottleneck never idles for our wake-up latency and links sharing it
  // interleave.
  const uint64_t window = emulation_.window_bytes;
  const uint64_t seg_max = window > 0 ? std::min(kSegmentBytes, window) : kSegmentBytes;
  const uint64_t nseg = std::max<uint64_t>(1, (wire_bytes + seg_max - 1) / seg_max);
  bool started = false;  // a segment took its slot: a failure now breaks the link
  Clock::time_point frame_end{}, arrival{};

  // Called with mu_ held; always throws, releasing it first when it breaks the link (the
  // analysis cannot follow `lock` into a lambda, hence no analysis here).
  auto fail_mid_frame = [&](const std::string& why) NO_THREAD_SAFETY_ANALYSIS {
    const std::string msg = str_cat("send to ", peer, ": ", why);
    if (!started) throw Timeout(peer, msg);
    break_locked(std::make_exception_ptr(
        PeerLost(peer, str_cat("link to ", peer, " broken after a send timed out mid-frame (", why,
                               "); close it and reconnect"))));
    lock.unlock();
    inner_->close();
    throw Timeout(peer, msg + " (the frame was partly serialised; the link is now broken)");
  };
  // Waits until `t` (woken early by faults, errors and close); throws on failure or deadline.
  auto wait_until = [&](Clock::time_point t, const char* waiting_for) REQUIRES(mu_) {
    for (;;) {
      throw_if_failed("send to");
      const auto now = Clock::now();
      if (now >= t) return;
      if (now >= deadline.at())
        fail_mid_frame(str_cat("deadline passed while ", waiting_for, ", ", to_ms(t - now), " ms short"));
      cv_.wait_until(mu_, std::min(t, deadline.at()));
    }
  };

  for (uint64_t k = 0; k < nseg; ++k) {
    const uint64_t bytes = wire_bytes / nseg + (k < wire_bytes % nseg ? 1 : 0);
    if (window > 0) {
      for (;;) {
        throw_if_failed("send to");
        Clock::time_point next_ack;
        const uint64_t used = window_in_use_locked(Clock::now(), &next_ack);
        if (used + bytes <= window) break;
        wait_until(next_ack, str_cat("waiting for the TCP window (", used, " of ", window, " bytes in flight)").c_str());
      }
    }
    const auto slot = bottleneck_->reserve(bytes, Clock::now());
    started = true;
    arrival = std::max(last_arrival_, slot.end + delay);
    last_arrival_ = arrival;
    if (window > 0) window_.push_back({bytes, arrival});
    frame_end = slot.end;
    wait_until(k + 1 < nseg ? slot.start : slot.end, "serialising");
  }

  if (corrupt_next_ && !item.frame.payload.empty()) {
    corrupt_next_ = false;
    item.frame.payload[item.frame.payload.size() / 2] ^= 0xFF;  // the checksum stays as computed
    spdlog::warn("emulated WAN link to {}: corrupted byte {} of the payload of frame op_id {} seq {}", peer,
                 item.frame.payload.size() / 2, item.frame.header.op_id, item.frame.header.seq);
  }
  item.due = arrival;
  if (!deadline.is_never()) item.deadline = Deadline(later(deadline.at(), arrival - frame_end));
  queue_.push_back(std::move(item));
  cv_.notify_all();
  lock.unlock();
  LinkCounters::add(counters_.bytes_sent, wire_bytes);
  LinkCounters::add(counters_.frames_sent, 1);
}

wire::Frame EmulatedLink::recv(Deadline deadline) {
  {
    MutexLock lock(mu_);
    throw_if_failed("recv from");
  }
  wire::Frame frame;
  for (;;) {
    try {
      frame = inner_->recv(deadline);
    } catch (const NetworkError&) {
      // A cut (or a broken send side) closed the inner link under us: say why.
      MutexLock lock(mu_);
      if (error_) std::rethrow_exception(error_);
      throw;
    }
    MutexLock lock(mu_);
    if (!blackholed_) break;  // else it vanished on the way
  }
  LinkCounters::add(counters_.bytes_received, wire::kHeaderSize + frame.payload.size());
  LinkCounters::add(counters_.frames_received, 1);
  return frame;
}

void EmulatedLink::pump() {
  MutexLock lock(mu_);
  while (!stop_) {
    const auto now = Clock::now();
    if (fire_faults_locked(now, /*at_send_start=*/false)) {
      lock.unlock();
      inner_->close();
      lock.lock();
      continue;
    }
    const auto next_fault = next_timed_fault_locked();
    if (queue_.empty()) {
      if (closing_) break;  // drained
      if (next_fault == Clock::time_point::max())
        cv_.wait(mu_);
      else
        cv_.wait_until(mu_, next_fault);
      continue;
    }
    const auto due = after_stalls(queue_.front().due);
    if (now < due) {
      cv_.wait_until(mu_, std::min(due, next_fault));
      continue;
    }
    InFlight item = std::move(queue_.front());
    queue_.pop_front();
    // A stall delayed the frame: its deadline moves with it.
    if (!item.deadline.is_never()) item.deadline = Deadline(later(item.deadline.at(), due - item.due));
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
      window_.clear();
    }
    cv_.notify_all();
  }
  pump_done_ = true;
  cv_.notify_all();
}

void EmulatedLink::close() {
  MutexLock close_lock(close_mu_);
  if (closed_) return;
  closed_ = true;
  {
    MutexLock lock(mu_);
    closing_ = true;
    const auto now = Clock::now();
    const auto last_due = queue_.empty() ? now : std::max(now, after_stalls(queue_.back().due));
    cv_.notify_all();
    if (!cv_.wait_until(mu_, last_due + kDrainGrace, [&]() REQUIRES(mu_) { return pump_done_; }))
      spdlog::warn("emulated WAN link to {}: {} frame(s) still in flight at close; dropping them", inner_->peer(),
                   queue_.size() + (pump_busy_ ? 1 : 0));
  }
  inner_->close();  // wakes a pump stuck in inner_->send()
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (pump_thread_.joinable()) pump_thread_.join();
}

}  // namespace nebula::transport
