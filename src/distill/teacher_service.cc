#include "distill/teacher_service.h"

#include <ATen/ATen.h>
#include <spdlog/spdlog.h>

#include <cmath>

#include "nebula/error.h"

namespace nebula::distill {

namespace {

constexpr size_t kMaxErrorMessage = 4096;  // bytes of an error reply; the rest is cut

// c10::Error's what() carries a C++ backtrace; the student wants the message only.
std::string message_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

std::string describe(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return message_of(x);
  } catch (...) {
    return "unknown error";
  }
}

std::string shape_of(const at::Tensor& t) { return t.defined() ? str_cat(t.sizes()) : std::string("undefined"); }

}  // namespace

ServeStats serve_teacher(transport::Link& link, const TeacherFn& fn, const ServeOptions& o) {
  NEBULA_CHECK(o.vocab >= 1 && o.vocab <= UINT32_MAX, "serve_teacher: vocab ", o.vocab);
  NEBULA_CHECK(o.k >= 1 && o.k <= o.vocab, "serve_teacher: k = ", o.k, " must be in [1, vocab = ", o.vocab, "]");
  NEBULA_CHECK(o.max_sequences >= 1 && o.max_len >= 1, "serve_teacher: max_sequences ", o.max_sequences,
               ", max_len ", o.max_len);
  NEBULA_CHECK(o.temperature > 0 && std::isfinite(o.temperature), "serve_teacher: temperature ", o.temperature);
  NEBULA_CHECK(fn, "serve_teacher: empty TeacherFn");
  const std::string peer = link.peer();
  const RequestLimits limits{o.vocab, o.max_sequences, o.max_len};
  ServeStats st;

  // Sends one message; false if the peer is gone (the service then ends normally).
  auto send = [&](wire::Frame frame) {
    const size_t bytes = frame.payload.size();
    try {
      link.send(frame, Deadline::after(o.idle_timeout));
    } catch (const PeerLost& e) {
      spdlog::info("distill teacher: student {} gone while replying: {}", peer, e.what());
      return false;
    }
    st.bytes_sent += bytes;
    return true;
  };

  for (;;) {
    wire::Frame f;
    try {
      f = link.recv(Deadline::after(o.idle_timeout));
    } catch (const PeerLost& e) {
      spdlog::info("distill teacher: student {} gone: {}", peer, e.what());
      return st;
    }
    const uint64_t id = f.header.op_id;
    const uint16_t kind = f.header.flags;
    if (f.header.type == wire::FrameType::kData && kind == static_cast<uint16_t>(MessageKind::kBye)) {
      send(make_message(MessageKind::kBye, id));
      try {
        link.flush(Deadline::after(o.idle_timeout));
      } catch (const PeerLost&) {
      }
      return st;
    }
    ++st.requests;
    st.bytes_received += f.payload.size();
    const std::string what = str_cat("request ", id, " from ", peer);

    std::vector<uint8_t> answer;
    std::string problem;
    try {
      if (f.header.type != wire::FrameType::kData)
        throw Error(str_cat(what, ": unexpected frame type ", wire::frame_type_name(f.header.type),
                            " (expected data)"));
      if (kind != static_cast<uint16_t>(MessageKind::kRequest))
        throw Error(str_cat(what, ": unexpected message kind ", message_kind_name(kind), " (", kind,
                            "; expected request = 1 or bye = 4)"));
      const Request req = decode_request(f.payload, limits, what);
      const int64_t n = target_tokens(req.tgt_in);
      at::Tensor logits;
      try {
        logits = fn(req.src, req.tgt_in);
      } catch (const std::exception& e) {
        throw Error(str_cat(what, ": teacher failed: ", message_of(e)));
      }
      if (!logits.defined() || logits.dim() != 2 || logits.size(0) != n || logits.size(1) != o.vocab ||
          !at::isFloatingType(logits.scalar_type()))
        throw Error(str_cat(what, ": teacher returned logits ", shape_of(logits), ", expected [", n, ", ", o.vocab,
                            "] floating point"));
      answer = encode_topk(top_k(logits, o.k, o.temperature));
      st.tokens += static_cast<uint64_t>(n);
    } catch (const std::exception& e) {
      problem = message_of(e);
    }
    if (!problem.empty()) {
      spdlog::warn("distill teacher: {}", problem);
      if (problem.size() > kMaxErrorMessage) problem.resize(kMaxErrorMessage);
      ++st.errors;
      if (!send(make_message(MessageKind::kError, id, std::vector<uint8_t>(problem.begin(), problem.end()))))
        return st;
    } else if (!send(make_message(MessageKind::kResponse, id, std::move(answer)))) {
      return st;
    }
  }
}

// ---------------------------------------------------------------------------------------

TeacherClient::TeacherClient(transport::Link& link, ClientOptions options)
    : link_(link), options_(options), peer_(link.peer()) {
  sender_ = std::thread([this] { send_loop(); });
  receiver_ = std::thread([this] { recv_loop(); });
}

TeacherClient::~TeacherClient() { close(); }

void TeacherClient::submit(uint64_t id, Sequences src, Sequences tgt_in) {
  std::vector<uint8_t> payload = encode_request(src, tgt_in);
  const int64_t tokens = target_tokens(tgt_in);
  std::lock_guard lock(mu_);
  NEBULA_CHECK(!closing_, "TeacherClient::submit(", id, ") after close()");
  NEBULA_CHECK(!pending_.count(id), "TeacherClient::submit: request ", id, " is already outstanding");
  pending_[id].tokens = tokens;
  ++stats_.requests;
  stats_.tokens += static_cast<uint64_t>(tokens);
  if (failure_) return;  // wait(id) reports the failure
  outbox_.push_back(Outgoing{id, std::move(payload)});
  cv_.notify_all();
}

TopK TeacherClient::wait(uint64_t id, Deadline deadline) {
  const auto start = Clock::now();
  std::unique_lock lock(mu_);
  NEBULA_CHECK(pending_.count(id), "TeacherClient::wait: request ", id,
               " is not outstanding (never submitted, or already waited for)");
  const bool ready = wait_until(cv_, lock, deadline, [&] {
    auto it = pending_.find(id);
    return it == pending_.end() || it->second.done || receiver_done_ || failure_;
  });
  stats_.wait_seconds += std::chrono::duration<double>(Clock::now() - start).count();
  if (!ready) throw Timeout(peer_, str_cat("teacher request ", id, ": no answer from ", peer_, " before the deadline"));
  auto it = pending_.find(id);
  NEBULA_CHECK(it != pending_.end(), "TeacherClient::wait: request ", id, " was waited for by another thread");
  if (!it->second.done) {
    pending_.erase(it);
    if (failure_)
      throw PeerLost(peer_, str_cat("teacher request ", id, ": link to ", peer_, " failed before the answer arrived: ",
                                    failure_text_));
    throw PeerLost(peer_, str_cat("teacher request ", id, ": client closed before the answer arrived"));
  }
  Pending p = std::move(it->second);
  pending_.erase(it);
  if (!p.result) throw Error(p.error);
  return std::move(*p.result);
}

void TeacherClient::close() {
  std::lock_guard close_lock(close_mu_);
  if (closed_) return;
  closed_ = true;
  bool clean;
  {
    std::unique_lock lock(mu_);
    closing_ = true;
    if (!failure_) outbox_.push_back(Outgoing{0, {}, true});
    cv_.notify_all();
    clean = wait_until(cv_, lock, Deadline::after(options_.close_timeout),
                       [&] { return receiver_done_ || failure_; }) &&
            !failure_;
  }
  if (!clean) {
    // The receiver may be blocked in recv(): closing the link is the only way to wake it.
    bool failed;
    {
      std::lock_guard lock(mu_);
      failed = failure_ != nullptr;
    }
    if (!failed)
      spdlog::warn("distill client: no bye from teacher {} within {} ms; closing the link", peer_,
                   options_.close_timeout.count());
    try {
      link_.close();
    } catch (const std::exception& e) {
      spdlog::warn("distill client: closing the link to {}: {}", peer_, e.what());
    }
  }
  {
    std::lock_guard lock(mu_);
    stop_ = true;
    cv_.notify_all();
  }
  if (sender_.joinable()) sender_.join();
  if (receiver_.joinable()) receiver_.join();
}

ClientStats TeacherClient::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

void TeacherClient::fail_locked(std::exception_ptr e) {
  if (!failure_) {
    failure_ = e;
    failure_text_ = describe(e);
  }
  cv_.notify_all();
}

void TeacherClient::send_loop() {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return !outbox_.empty() || failure_ || stop_; });
    if (failure_ || outbox_.empty()) return;
    Outgoing o = std::move(outbox_.front());
    outbox_.pop_front();
    lock.unlock();
    const size_t bytes = o.payload.size();
    try {
      link_.send(o.bye ? make_message(MessageKind::kBye, 0) : make_message(MessageKind::kRequest, o.id, std::move(o.payload)),
                 Deadline::after(options_.send_timeout));
    } catch (...) {
      lock.lock();
      fail_locked(std::current_exception());
      return;
    }
    lock.lock();
    stats_.bytes_sent += bytes;
    if (o.bye) return;
  }
}

void TeacherClient::recv_loop() {
  auto finish = [&](std::exception_ptr e) {
    std::lock_guard lock(mu_);
    if (e) fail_locked(e);
    receiver_done_ = true;
    cv_.notify_all();
  };
  for (;;) {
    wire::Frame f;
    try {
      // No deadline: the callers' wait() calls carry theirs, and close() ends this wait.
      f = link_.recv(Deadline::never());
    } catch (...) {
      return finish(std::current_exception());
    }
    const uint64_t id = f.header.op_id;
    const uint16_t kind = f.header.flags;
    const bool data = f.header.type == wire::FrameType::kData;
    if (data && kind == static_cast<uint16_t>(MessageKind::kBye)) {
      std::lock_guard lock(mu_);
      receiver_done_ = true;
      cv_.notify_all();
      return;
    }
    const bool response = data && kind == static_cast<uint16_t>(MessageKind::kResponse);
    const bool error = data && kind == static_cast<uint16_t>(MessageKind::kError);
    int64_t tokens = -1;
    {
      std::lock_guard lock(mu_);
      auto it = pending_.find(id);
      if (it != pending_.end() && !it->second.done) tokens = it->second.tokens;
    }
    if (!(response || error) || tokens < 0) {
      const std::string msg =
          !(response || error)
              ? str_cat("teacher ", peer_, " sent an unexpected ",
                        data ? "message kind " + message_kind_name(kind) : "frame type " + wire::frame_type_name(f.header.type))
              : str_cat("teacher ", peer_, " answered request ", id, ", which is not outstanding");
      return finish(std::make_exception_ptr(Error(msg)));
    }
    Pending answer;
    answer.done = true;
    if (error) {
      answer.error = str_cat("teacher error for request ", id, ": ",
                             std::string(f.payload.begin(), f.payload.end()));
    } else {
      try {
        TopK t = decode_topk(f.payload, str_cat("teacher response to request ", id, " from ", peer_));
        if (t.index.size(0) != tokens)
          throw Error(str_cat("teacher response to request ", id, " from ", peer_, " has ", t.index.size(0),
                              " rows, expected ", tokens));
        answer.result = std::move(t);
      } catch (const std::exception& e) {
        answer.error = message_of(e);
      }
    }
    std::lock_guard lock(mu_);
    stats_.bytes_received += f.payload.size();
    if (error) ++stats_.errors;
    // wait() gives up on an id once the link failed (the sender's failure may come first).
    auto it = pending_.find(id);
    if (it == pending_.end()) continue;
    answer.tokens = it->second.tokens;
    it->second = std::move(answer);
    cv_.notify_all();
  }
}

}  // namespace nebula::distill
