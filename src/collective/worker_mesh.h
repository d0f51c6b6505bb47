// WorkerMesh ([wan] mode = "every_worker"): one worker's links to every worker of the other
// sites, over which each worker exchanges its own part of the model state (Hierarchy::
// exchange_parts_async), so that a site's WAN traffic, encoding and TLS leave from all of its
// hosts instead of one gateway.
//
// The slots are every worker of every site, in site order and rank order within a site; the
// links to this site's own workers are null (they talk over the site group). Every exchange
// puts one frame on every link, and all workers of all sites run the same exchanges in the same
// order. Its operation ids have the top bit set, so that they can never be taken for the
// gateway mesh's, which shares rank 0's links to the other gateways (collective/gateway_mesh.h).
//
// Threads: exchange() runs on one thread (the Hierarchy's communication thread); totals() and
// estimates() may be called from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "transport/link.h"

namespace nebula::collective {

struct WorkerSlot {
  size_t site = 0;
  int rank = 0;
  std::string name;  // "site/rank", for messages
};

class WorkerMesh {
 public:
  // links[j] is the link to slots[j]: null exactly for the slots of this worker's own site.
  WorkerMesh(size_t self, std::vector<WorkerSlot> slots, std::vector<std::shared_ptr<transport::Link>> links,
             std::chrono::milliseconds timeout);
  ~WorkerMesh();
  WorkerMesh(const WorkerMesh&) = delete;
  WorkerMesh& operator=(const WorkerMesh&) = delete;

  size_t self() const { return self_; }
  const std::vector<WorkerSlot>& slots() const { return slots_; }
  // The slot of worker `rank` of `site`.
  size_t slot(size_t site, int rank) const;
  // Workers per site, by site index.
  std::vector<int64_t> workers_per_site() const;
  const std::shared_ptr<transport::Link>& link(size_t slot) const { return links_.at(slot); }

  // Sends to[j] to every slot j of another site (an empty payload is a frame too) and returns
  // what each of them sent, by slot (empty for this site's slots). Throws PeerLost / Timeout
  // naming the worker, or Error if a peer is at another operation.
  std::vector<std::vector<uint8_t>> exchange(std::vector<std::vector<uint8_t>> to);

  // Over all of this worker's links: frame bytes (headers included) and wire bytes.
  transport::LinkStats totals() const;
  // Waits (bounded) until every peer has what was sent to it, then closes the links.
  void close();

 private:
  size_t self_;
  std::vector<WorkerSlot> slots_;
  std::vector<std::shared_ptr<transport::Link>> links_;
  std::chrono::milliseconds timeout_;
  uint64_t next_op_ = 1;  // owned by the thread that runs the exchanges
  bool closed_ = false;
};

}  // namespace nebula::collective
