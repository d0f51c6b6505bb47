#include "collective/gateway_mesh.h"

#include <algorithm>
#include <future>
#include <iterator>

#include <spdlog/spdlog.h>

#include "nebula/error.h"
#include "wire/frame.h"

namespace nebula::collective {
namespace {
std::vector<std::shared_ptr<transport::Link>> shared(std::vector<std::unique_ptr<transport::Link>> links) {
  std::vector<std::shared_ptr<transport::Link>> out(std::make_move_iterator(links.begin()),
                                                    std::make_move_iterator(links.end()));
  return out;
}
}  // namespace

GatewayMesh::GatewayMesh(MeshOptions options, std::vector<std::unique_ptr<transport::Link>> links)
    : GatewayMesh(std::move(options), shared(std::move(links))) {}

GatewayMesh::GatewayMesh(MeshOptions options, std::vector<std::shared_ptr<transport::Link>> links)
    : options_(std::move(options)) {
  const size_t n = options_.site_names.size(), me = options_.site_index;
  NEBULA_CHECK(me < n && links.size() == n, "site index ", me, " of ", n, " sites, ", links.size(), " links");
  for (size_t j = 0; j < n; ++j)
    NEBULA_CHECK((j == me) == (links[j] == nullptr), "link to site ", options_.site_names[j], " is ",
                 links[j] ? "set" : "missing");
  MutexLock lock(mu_);
  for (auto& l : links) links_.push_back(std::move(l));
  joining_ = options_.joining;
  live_.assign(n, !joining_);
  live_[me] = true;
  ready_.resize(n);
  attempts_.resize(n);
}

std::vector<GatewayMesh::LinkPtr> GatewayMesh::links_snapshot() const {
  MutexLock lock(mu_);
  return links_;
}

bool GatewayMesh::live(size_t j) const {
  MutexLock lock(mu_);
  return live_.at(j);
}

std::vector<std::pair<size_t, std::string>> GatewayMesh::lost() const {
  MutexLock lock(mu_);
  return lost_;
}

std::vector<size_t> GatewayMesh::rejoined() const {
  MutexLock lock(mu_);
  return rejoined_;
}

uint64_t GatewayMesh::ready_joiners() {
  if (!options_.elastic || !options_.rejoin) return 0;
  MutexLock lock(mu_);
  uint64_t mask = 0;
  for (size_t j = 0; j < live_.size() && j < 64; ++j) {
    if (live_[j] || joining_) continue;
    auto& attempt = attempts_[j];
    if (attempt.valid() && attempt.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
      try {
        if (auto link = attempt.get()) ready_[j] = std::move(link);
      } catch (const std::exception& e) {
        spdlog::debug("rejoin attempt of site {}: {}", options_.site_names[j], e.what());
      }
    }
    if (ready_[j]) {
      mask |= uint64_t{1} << j;
    } else if (!attempt.valid()) {
      attempt = std::async(std::launch::async, [this, j] {
        return options_.rejoin(j, Deadline::after(std::chrono::seconds(2)));
      });
    }
  }
  return mask;
}

void GatewayMesh::admit(uint64_t mask) {
  // Under the lock throughout, so ready_joiners() never sees a site half admitted (and starts
  // another attempt for it). The send only queues the frame on a ResilientLink.
  MutexLock lock(mu_);
  for (size_t j = 0; j < live_.size() && j < 64; ++j) {
    if (!(mask >> j & 1)) continue;
    NEBULA_CHECK(!live_[j] && ready_[j], "admit site ", options_.site_names[j], ": not a lost site with a fresh link");
    wire::ByteWriter w;
    w.put_u64(next_op_);
    if (links_[j]) {  // closed when the site was lost; freed by the last snapshot holding it
      transport::add(retired_, links_[j]->stats());
    }
    links_[j] = std::move(ready_[j]);
    links_[j]->send(wire::make_frame(wire::FrameType::kData, 0, 0, w.take()), Deadline::after(options_.timeout));
    live_[j] = true;
    rejoined_.push_back(j);
    spdlog::warn("site {} rejoins at operation {}", options_.site_names[j], next_op_);
  }
}

void GatewayMesh::join(Deadline deadline) {
  uint64_t op = 0;
  const std::vector<LinkPtr> links = links_snapshot();
  for (size_t j = 0; j < links.size(); ++j) {
    if (j == options_.site_index) continue;
    wire::Frame f = links[j]->recv(deadline);
    wire::ByteReader r(f.payload, "admission from site " + options_.site_names[j]);
    const uint64_t theirs = r.u64();
    r.expect_done();
    if (f.header.type != wire::FrameType::kData || f.header.op_id != 0 || (op != 0 && theirs != op))
      throw Error(str_cat("site ", options_.site_names[j], " admitted this site at operation ", theirs,
                          op ? str_cat(", another site at ", op) : std::string(), ": the sites disagree"));
    op = theirs;
    MutexLock lock(mu_);
    live_[j] = true;
  }
  if (op != 0) next_op_ = op;
  {
    MutexLock lock(mu_);
    joining_ = false;
  }
  spdlog::info("rejoined the job at operation {}", next_op_);
}

size_t GatewayMesh::first_live() const {
  MutexLock lock(mu_);
  for (size_t j = 0; j < live_.size(); ++j)
    if (live_[j]) return j;
  return options_.site_index;
}

void GatewayMesh::lose(size_t j, const std::string& why) {
  LinkPtr link;
  size_t left = 0, total = 0;
  {
    MutexLock lock(mu_);
    live_[j] = false;
    lost_.emplace_back(j, why);
    link = links_[j];
    for (bool l : live_) left += l;
    total = live_.size();
  }
  link->close();  // whatever it still delivers belongs to exchanges we no longer wait for
  spdlog::warn("site {} is lost ({}): going on with {} of {} sites", options_.site_names[j], why, left, total);
}

GatewayMesh::~GatewayMesh() { close(); }

void GatewayMesh::close() {
  std::vector<LinkPtr> links;
  std::vector<bool> live;
  {
    MutexLock lock(mu_);
    for (auto& a : attempts_)
      if (a.valid()) a.wait();  // a rejoin attempt in flight ends by its own deadline
    links = links_;
    live = live_;
  }
  // An orderly end: a link's close() may discard frames the peer has not acknowledged yet,
  // so the last exchange's payload could be lost to a peer still receiving it. First every
  // peer gets what was sent to it (bounded: a peer that is gone or stuck is not waited for
  // long), then the links close.
  const Deadline deadline = Deadline::after(std::min<std::chrono::milliseconds>(options_.timeout, std::chrono::seconds(5)));
  for (size_t j = 0; j < links.size(); ++j) {
    auto& l = links[j];
    if (!l || !live[j]) continue;
    try {
      l->flush(deadline);
    } catch (const std::exception&) {
      // Lost or stuck: nothing more to deliver.
    }
  }
  for (auto& l : links)
    if (l) l->close();
}

std::vector<std::vector<uint8_t>> GatewayMesh::all_gather(std::vector<uint8_t> payload) {
  const size_t n = num_sites(), me = options_.site_index;
  const uint64_t op = next_op_++;
  Deadline deadline = Deadline::after(options_.timeout);
  std::vector<std::vector<uint8_t>> out(n);
  if (n == 1) {
    out[me] = std::move(payload);
    return out;
  }
  // This exchange's links and members: admit() (same thread) cannot change them meanwhile,
  // lose() below updates both the mesh and this copy.
  std::vector<LinkPtr> links;
  std::vector<bool> live;
  {
    MutexLock lock(mu_);
    links = links_;
    live = live_;
  }
  // One frame for every peer, shared with the links: a resilient link keeps it until
  // acknowledged instead of a copy per peer.
  const auto frame = std::make_shared<const wire::Frame>(wire::make_frame(wire::FrameType::kData, op, 0, std::move(payload)));
  // Sends run in parallel (an emulated or real WAN send blocks for the serialisation time);
  // receives run on this thread meanwhile, so two gateways sending big frames never deadlock.
  std::vector<std::pair<size_t, std::future<void>>> sends;
  for (size_t j = 0; j < n; ++j)
    if (j != me && live[j])
      sends.emplace_back(j, std::async(std::launch::async, [&, j] { links[j]->send_shared(frame, deadline); }));
  // Elastic: a peer that is gone (PeerLost) or silent past the deadline (Timeout) is lost.
  auto lost_peer = [&](size_t j, std::exception_ptr e) {
    if (!options_.elastic || !live[j]) return false;
    try {
      std::rethrow_exception(e);
    } catch (const PeerLost& x) {
      lose(j, x.what());
    } catch (const Timeout& x) {
      lose(j, x.what());
    } catch (...) {
      return false;
    }
    live[j] = false;
    return true;
  };
  std::exception_ptr error;
  for (size_t j = 0; j < n && !error; ++j) {
    if (j == me || !live[j]) continue;
    try {
      wire::Frame f = links[j]->recv(deadline);
      if (f.header.type != wire::FrameType::kData || f.header.op_id != op)
        throw Error(str_cat("site ", options_.site_names[j], " sent frame type ", static_cast<int>(f.header.type),
                            " for operation ", f.header.op_id, " while this site is at operation ", op,
                            ": the gateways ran different collectives"));
      out[j] = std::move(f.payload);
    } catch (...) {
      if (!lost_peer(j, std::current_exception())) error = std::current_exception();
    }
  }
  for (auto& [j, s] : sends) {
    try {
      s.get();
    } catch (...) {
      if (!lost_peer(j, std::current_exception()) && !error && live[j]) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
  for (size_t j = 0; j < n; ++j)
    if (!live[j]) out[j].clear();  // lost during this exchange: nothing of it counts
  out[me] = frame->payload;  // a copy: the links may still hold the frame
  return out;
}

std::vector<transport::LinkEstimates> GatewayMesh::estimates() const {
  const std::vector<LinkPtr> links = links_snapshot();
  std::vector<transport::LinkEstimates> out(links.size());
  for (size_t j = 0; j < links.size(); ++j)
    if (links[j]) out[j] = links[j]->estimates();
  return out;
}

transport::LinkStats GatewayMesh::totals() const {
  std::vector<LinkPtr> links;
  transport::LinkStats t;
  {
    MutexLock lock(mu_);
    links = links_;
    t = retired_;
  }
  for (const auto& l : links)
    if (l) transport::add(t, l->stats());
  return t;
}

}  // namespace nebula::collective
