#include "collective/worker_mesh.h"

#include <algorithm>
#include <future>

#include "nebula/error.h"
#include "wire/frame.h"

namespace nebula::collective {

namespace {
constexpr uint64_t kWorkerOps = uint64_t{1} << 63;  // the top bit: this mesh's operation ids
}  // namespace

WorkerMesh::WorkerMesh(size_t self, std::vector<WorkerSlot> slots, std::vector<std::shared_ptr<transport::Link>> links,
                       std::chrono::milliseconds timeout)
    : self_(self), slots_(std::move(slots)), links_(std::move(links)), timeout_(timeout) {
  NEBULA_CHECK(self_ < slots_.size() && links_.size() == slots_.size(), "worker mesh: slot ", self_, " of ",
               slots_.size(), ", ", links_.size(), " links");
  for (size_t j = 0; j < slots_.size(); ++j)
    NEBULA_CHECK((slots_[j].site == slots_[self_].site) == (links_[j] == nullptr), "worker mesh: the link to ",
                 slots_[j].name, " is ", links_[j] ? "set" : "missing");
}

WorkerMesh::~WorkerMesh() { close(); }

size_t WorkerMesh::slot(size_t site, int rank) const {
  for (size_t j = 0; j < slots_.size(); ++j)
    if (slots_[j].site == site && slots_[j].rank == rank) return j;
  throw Error(str_cat("worker mesh: no worker ", rank, " at site #", site));
}

std::vector<int64_t> WorkerMesh::workers_per_site() const {
  std::vector<int64_t> n;
  for (const auto& s : slots_) {
    if (n.size() <= s.site) n.resize(s.site + 1, 0);
    ++n[s.site];
  }
  return n;
}

std::vector<std::vector<uint8_t>> WorkerMesh::exchange(std::vector<std::vector<uint8_t>> to) {
  NEBULA_CHECK(to.size() == slots_.size(), "worker mesh: ", to.size(), " payloads for ", slots_.size(), " slots");
  const uint64_t op = kWorkerOps | next_op_++;
  const Deadline deadline = Deadline::after(timeout_);
  std::vector<std::shared_ptr<const wire::Frame>> frames(slots_.size());
  // Sends run in parallel (a WAN send blocks for its serialisation time); receives run on this
  // thread meanwhile, so two workers sending big frames to each other never deadlock.
  std::vector<std::future<void>> sends;
  for (size_t j = 0; j < slots_.size(); ++j) {
    if (!links_[j]) continue;
    // Shared with the link: a resilient link keeps it until acknowledged, without a copy.
    frames[j] = std::make_shared<const wire::Frame>(wire::make_frame(wire::FrameType::kData, op, 0, std::move(to[j])));
    sends.push_back(std::async(std::launch::async, [&, j] { links_[j]->send_shared(frames[j], deadline); }));
  }
  std::vector<std::vector<uint8_t>> from(slots_.size());
  std::exception_ptr error;
  for (size_t j = 0; j < slots_.size() && !error; ++j) {
    if (!links_[j]) continue;
    try {
      wire::Frame f = links_[j]->recv(deadline);
      if (f.header.type != wire::FrameType::kData || f.header.op_id != op)
        throw Error(str_cat("worker ", slots_[j].name, " sent frame type ", static_cast<int>(f.header.type),
                            " for operation ", f.header.op_id & ~kWorkerOps, " while ", slots_[self_].name,
                            " is at operation ", op & ~kWorkerOps, ": the workers ran different exchanges"));
      from[j] = std::move(f.payload);
    } catch (...) {
      error = std::current_exception();
    }
  }
  for (auto& s : sends) {
    try {
      s.get();
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
  return from;
}

transport::LinkStats WorkerMesh::totals() const {
  transport::LinkStats t;
  for (const auto& l : links_)
    if (l) transport::add(t, l->stats());
  return t;
}

void WorkerMesh::close() {
  if (closed_) return;
  closed_ = true;
  // As GatewayMesh::close: every peer first gets what was sent to it (bounded), then the links close.
  const Deadline deadline = Deadline::after(std::min<std::chrono::milliseconds>(timeout_, std::chrono::seconds(5)));
  for (const auto& l : links_) {
    if (!l) continue;
    try {
      l->flush(deadline);
    } catch (const std::exception&) {
      // Lost or stuck: nothing more to deliver.
    }
  }
  for (const auto& l : links_)
    if (l) l->close();
}

}  // namespace nebula::collective
