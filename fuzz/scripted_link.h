// A connection whose peer "sends" a fixed script of frames, then hangs up; what is written to it
// is dropped. For the fuzzers of the layers above a Link (session_fuzzer, stripe_fuzzer).
#pragma once

#include <deque>
#include <mutex>
#include <string>

#include "transport/link.h"

namespace nebula::fuzz {

class ScriptedLink : public transport::Link {
 public:
  void push(wire::Frame f) { script_.push_back(std::move(f)); }  // before the link is used
  void send(const wire::Frame&, Deadline) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) throw PeerLost("peer", "closed");
  }
  wire::Frame recv(Deadline) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_ || script_.empty()) throw PeerLost("peer", "the script ended");
    wire::Frame f = std::move(script_.front());
    script_.pop_front();
    return f;
  }
  void close() override {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }
  std::string peer() const override { return "peer"; }
  transport::LinkStats stats() const override { return {}; }

 private:
  std::mutex mu_;
  std::deque<wire::Frame> script_;
  bool closed_ = false;
};

}  // namespace nebula::fuzz
