// GatewayMesh: the inter-site leg. Each site's gateway (local rank 0) holds one Link to every
// other site's gateway (a full mesh) and exchanges byte payloads with them in lock step, one
// operation id per exchange.
//
// The mesh never names a socket type: it is handed connected, authenticated Links (see
// transport/site_connector.h: TCP, TLS, striping, WAN emulation and reconnection are all
// below this line).
//
// Threads: all_gather(), admit() and join() run on one thread (the Hierarchy's communication
// thread); every other call may come from any thread at any time (the training thread reads
// estimates() and totals() for metrics and the controller while an exchange or an
// admission runs). The links and the membership are under one mutex; an exchange works on a
// snapshot of them (shared_ptr), so admit() replacing a link never frees one in use.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "nebula/deadline.h"
#include "transport/link.h"
#include "util/thread_annotations.h"

namespace nebula::collective {

struct MeshOptions {
  size_t site_index = 0;                // this gateway's site
  std::vector<std::string> site_names;  // every site, in config order
  std::chrono::milliseconds timeout{60000};  // for every exchange
  // A peer lost for good (PeerLost, or no frame by the deadline) is dropped from this and
  // every later exchange instead of failing it: its slot comes back empty.
  bool elastic = false;
  // Elastic rejoin: a fresh link to lost site j, waiting at most until the deadline, or null
  // (SiteConnector::rejoin). Called off the training and communication threads.
  std::function<std::unique_ptr<transport::Link>(size_t, Deadline)> rejoin;
  // This gateway rejoins a running job: the other sites are not live until join().
  bool joining = false;
};

class GatewayMesh {
 public:
  // links[j] is the Link to site j (null for this site).
  GatewayMesh(MeshOptions options, std::vector<std::unique_ptr<transport::Link>> links);
  // The same over links shared with rank 0's WorkerMesh (wan.mode = "every_worker").
  GatewayMesh(MeshOptions options, std::vector<std::shared_ptr<transport::Link>> links);
  ~GatewayMesh();

  size_t num_sites() const { return options_.site_names.size(); }
  size_t site_index() const { return options_.site_index; }

  // Sends `payload` to every other live site and returns every site's payload, indexed by site
  // (this site's own is moved into its slot; a lost site's slot is empty). All gateways must
  // call it in the same order; a frame with another operation id is a protocol error naming
  // both ids and the peer. Throws PeerLost / Timeout naming the peer, unless elastic.
  std::vector<std::vector<uint8_t>> all_gather(std::vector<uint8_t> payload);

  // Elastic: whether site j is still in the mesh (this site always is), and the lost ones
  // with why. With two sites each side of a partition goes on alone; with more, a site lost
  // in the middle of an exchange may have reached some gateways and not others, which the
  // strategies' hash check then reports.
  bool live(size_t j) const EXCLUDES(mu_);
  size_t first_live() const EXCLUDES(mu_);
  std::vector<std::pair<size_t, std::string>> lost() const EXCLUDES(mu_);
  std::vector<size_t> rejoined() const EXCLUDES(mu_);  // sites admitted again, in order

  // Elastic rejoin, surviving side. ready_joiners(): a bitmask of lost sites with a fresh
  // link waiting to be admitted (it starts a background attempt for the others; any thread).
  // admit(mask): between exchanges, on the thread that runs them: sends each of those sites
  // the next operation id and takes it back into the mesh.
  uint64_t ready_joiners() EXCLUDES(mu_);
  void admit(uint64_t mask) EXCLUDES(mu_);
  // Joining side: waits for every other site's admission and takes its operation id.
  void join(Deadline deadline) EXCLUDES(mu_);

  // The link estimates (RTT, bandwidth) to each site, by site index (empty for this site).
  std::vector<transport::LinkEstimates> estimates() const EXCLUDES(mu_);

  // Totals over all of this gateway's links, those replaced by a rejoin included (so they
  // never go down): frame bytes (headers included) and wire bytes (transport::LinkStats).
  transport::LinkStats totals() const EXCLUDES(mu_);

  void close() EXCLUDES(mu_);

 private:
  using LinkPtr = std::shared_ptr<transport::Link>;
  void lose(size_t j, const std::string& why) EXCLUDES(mu_);
  std::vector<LinkPtr> links_snapshot() const EXCLUDES(mu_);

  MeshOptions options_;
  uint64_t next_op_ = 1;  // owned by the thread that runs the exchanges
  mutable Mutex mu_;
  std::vector<LinkPtr> links_ GUARDED_BY(mu_);  // indexed by site; null for self
  std::vector<bool> live_ GUARDED_BY(mu_);
  bool joining_ GUARDED_BY(mu_) = false;  // options_.joining until join() is done
  std::vector<std::pair<size_t, std::string>> lost_ GUARDED_BY(mu_);
  std::vector<size_t> rejoined_ GUARDED_BY(mu_);
  transport::LinkStats retired_ GUARDED_BY(mu_);  // of the links that admit() replaced
  std::vector<std::unique_ptr<transport::Link>> ready_ GUARDED_BY(mu_);  // fresh links by site
  std::vector<std::future<std::unique_ptr<transport::Link>>> attempts_ GUARDED_BY(mu_);
};

}  // namespace nebula::collective
