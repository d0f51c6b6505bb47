// Hierarchical collectives across every worker of every site:
//   reduce inside the site (c10d, full precision) → gateways exchange over the WAN →
//   broadcast inside the site.
// Cross-site sums are added in site order on every gateway, so all sites end with
// bit-identical results. With a lossy codec each gateway encodes its site's sum exactly once
// and all gateways decode the same bytes (their own included), so the results stay
// bit-identical and the error never compounds, however many sites there are.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "codec/codec.h"
#include "collective/gateway_mesh.h"
#include "collective/site_group.h"
#include "collective/worker_mesh.h"
#include "util/thread_annotations.h"

namespace nebula::collective {

enum class ReduceOp {
  kSum,           // Σ over all workers
  kWeightedMean,  // Σ w_i x_i / Σ w_i, w_i = the worker's weight (e.g. tokens in its batch)
};

struct AllreduceOptions {
  ReduceOp op = ReduceOp::kWeightedMean;
  double weight = 1.0;  // this worker's weight (kWeightedMean); >= 0, and Σ over all workers > 0
  // The lossy codec of the inter-site leg; null = exact float32. Only the gateway encodes,
  // once per site per call (exchange_parts_async: each worker its own segments); inside the
  // site everything stays full precision.
  const codec::Codec* codec = nullptr;
  // Names the logical tensor (e.g. a gradient bucket) whose codec state (error feedback,
  // PowerSGD's Q) this call uses and updates. Same tag, same tensor, every step.
  uint64_t tag = 0;
  // Encode each tensor of a bucket on its own, in its own shape (PowerSGD needs matrices);
  // otherwise the bucket is encoded as one flat vector.
  bool per_tensor = false;
  // A few numbers about this site that travel with the exchange (exchange_async only; e.g.
  // its measured step time and link estimates); every gateway receives every site's.
  std::vector<double> site_info;
  // exchange_async only: the update guard. A site's decoded contribution that holds a NaN or
  // an infinity, or whose L2 norm exceeds max_norm (> 0), is left out of the mean, as if that
  // site had weight 0. Every gateway decodes the same bytes, so every site (the sender too)
  // rejects the same contributions and the results stay bit-identical; Work::rejected() says
  // which and why. If every contribution is rejected the result is zero (no update).
  double max_norm = 0;
};

// A site's contribution that the update guard left out.
struct Rejection {
  size_t site = 0;
  std::string reason;  // e.g. "non-finite values (3 NaN, 0 infinite)", "L2 norm 1e+09 above the bound 100"
};

struct CommStats {
  // This worker's WAN bytes, headers included: the gateway's, or with wan.mode =
  // "every_worker" each worker's own (0 off-gateway in gateway mode).
  uint64_t wan_bytes_sent = 0;
  uint64_t wan_bytes_received = 0;
  // The same on the network: TLS records, acks, probes, heartbeats, re-sends, handshakes.
  uint64_t wan_wire_bytes_sent = 0;
  uint64_t wan_wire_bytes_received = 0;
  uint64_t allreduces = 0;
  // The inter-site leg on the gateway: float32 bytes this site's contributions would have
  // been, what the codec made of them, and the time spent encoding / decoding.
  uint64_t codec_bytes_in = 0;
  uint64_t codec_bytes_out = 0;
  double encode_seconds = 0;
  double decode_seconds = 0;
  // On the gateway: the measured path to each site (by site index; empty for this site and
  // off-gateway). For strategies and the adaptive controller, and written to metrics.
  std::vector<transport::LinkEstimates> links;
};

// The handle of an asynchronous collective (like c10d's Work).
class Work {
 public:
  // Blocks until the operation is done and rethrows its error; Timeout naming the operation
  // if `deadline` passes first (the operation itself goes on).
  void wait(Deadline deadline) EXCLUDES(mu_);
  bool done() const EXCLUDES(mu_);
  // After wait(): every site's AllreduceOptions::site_info, by site index (exchange_async).
  const std::vector<std::vector<double>>& site_info() const { return site_info_; }
  // After wait(): the contributions the update guard left out (exchange_async).
  const std::vector<Rejection>& rejected() const { return rejected_; }
  // After wait(): how long the operation ran on the communication thread (queueing not
  // included), and the WAN bytes this gateway sent for it (0 off-gateway). The time includes
  // waiting for the other sites' contributions, so bytes / seconds is no measure of the WAN:
  // the link estimates (CommStats::links) time the transfer alone.
  double seconds() const { return seconds_; }
  uint64_t wan_bytes_sent() const { return wan_bytes_sent_; }

 private:
  friend class Hierarchy;
  void finish(std::exception_ptr error) EXCLUDES(mu_);
  std::string what_;
  // Written by the comm thread before finish(), read after wait(): finish() and wait() take
  // mu_, which orders the two (no lock needed around them).
  std::vector<std::vector<double>> site_info_;
  std::vector<Rejection> rejected_;
  double seconds_ = 0;
  uint64_t wan_bytes_sent_ = 0;
  mutable Mutex mu_;
  std::condition_variable_any cv_;
  bool done_ GUARDED_BY(mu_) = false;
  std::exception_ptr error_ GUARDED_BY(mu_);
};

// A span [begin, end) of the vector exchange_parts_async exchanges, in values.
struct Span {
  int64_t begin = 0, end = 0;
};
// Who holds which values of that vector, for exchange_parts_async: holdings[s][q] are the spans
// worker q of site s holds, ascending and disjoint (touching and empty spans are allowed: they
// are merged and dropped); each site's workers' spans together cover [0, n) exactly once, n the
// same for every site. E.g. an FSDP-like layout of 3 units over 2 workers: worker q holds piece
// q of every unit, three spans.
using Holdings = std::vector<std::vector<std::vector<Span>>>;

// The holdings of contiguous cuts: cuts[s] holds site s's workers(s) + 1 boundaries (0, ..., n,
// non-decreasing), worker q of site s holding the one span [cuts[s][q], cuts[s][q + 1]).
// Unchecked here: exchange_parts_async checks what it makes of them.
Holdings holdings_of_cuts(const std::vector<std::vector<int64_t>>& cuts);

class Hierarchy {
 public:
  // `mesh` is required on the gateway (local rank 0) and must be null elsewhere. With
  // wan.mode = "every_worker", every worker passes its WorkerMesh and `comm_group`, a second
  // group of its site (SiteGroup::fork) for the communication thread's site sums.
  Hierarchy(SiteGroup& site, GatewayMesh* mesh, WorkerMesh* workers = nullptr, SiteGroup* comm_group = nullptr);

  // In place, on a contiguous float32 tensor of any size (0 included); every worker of
  // every site must call it with the same numel, in the same order. CPU or CUDA: a bucket
  // with a GPU tensor is staged through one pinned host buffer (the site's Gloo reduce and
  // the WAN work on host memory), copied back to the device at the end.
  void allreduce(at::Tensor& t, const AllreduceOptions& options = {});
  // The same for a bucket of tensors in one exchange (one WAN round trip for all of them).
  void allreduce(const std::vector<at::Tensor>& bucket, const AllreduceOptions& options = {});

  // Queues the bucket's all-reduce on this worker's communication thread and returns at once,
  // so the WAN exchange of one bucket overlaps with whatever the caller computes next (e.g.
  // the rest of the backward pass). Operations run one at a time, in the order queued, which
  // must be the same on every worker. The tensors are written in place when it is done; do
  // not touch them before wait() returns. Synchronous calls go through the same queue.
  std::shared_ptr<Work> allreduce_async(std::vector<at::Tensor> bucket, AllreduceOptions options);
  ~Hierarchy();

  // The inter-site leg alone, for values every worker of a site already holds alike (e.g.
  // DiLoCo's pseudo-gradient after the site's own data parallel steps). Gateway only:
  // encodes the bucket once with options.codec, exchanges it with the other gateways and
  // writes the weighted mean over sites, Σ_s W_s x_s / Σ_s W_s with W_s = the site's
  // options.weight. Runs on the communication thread and touches no site-group collective,
  // so the training thread may use the site group meanwhile; broadcasting the result inside
  // the site is the caller's. Several may be in flight; they run in the order queued.
  std::shared_ptr<Work> exchange_async(std::vector<at::Tensor> bucket, AllreduceOptions options);

  // wan.mode = "every_worker": exchange_async's WAN leg, run by every worker of every site on
  // its own part. The exchanged vector (n values) is held by each site's workers as `holdings`
  // says (Holdings, above): holdings[s][q] are the spans worker q of site s holds. `part` is
  // this worker's values of its spans, concatenated in span order (contiguous float32 on the
  // CPU), and ends as Σ_s W_s x_s / Σ_s W_s over them, W_s = options.weight (the same on every
  // worker of a site). The holdings are normalised first (a worker's touching spans merged,
  // empty ones dropped), so sites that write the same holding differently agree. This worker's
  // spans are cut at every site's span boundaries into segments; each segment is encoded once
  // by the worker that holds it and sent to the worker of each other site whose spans hold its
  // first value, which decode the same bytes and add them in site order: every site computes
  // the same floats, whatever its number of workers, and with the exact codec the same as
  // exchange_async. The update guard decides on each site's whole contribution: NaN/infinity
  // counts and squared norms are summed over the site's workers. Work::site_info() is valid on
  // rank 0 (the sites' rank 0s send it). Codec state is kept per (tag, segment start).
  // Bad holdings (a worker's spans out of order or overlapping, a site's not covering [0, n)
  // exactly once, n differing between sites, a part whose numel is not the sum of this
  // worker's spans) throw nebula::Error from this call, naming the site, worker and values.
  std::shared_ptr<Work> exchange_parts_async(at::Tensor part, Holdings holdings, AllreduceOptions options);
  // The same with contiguous cuts: exchange_parts_async(part, holdings_of_cuts(cuts), options).
  std::shared_ptr<Work> exchange_parts_async(at::Tensor part, const std::vector<std::vector<int64_t>>& cuts,
                                             AllreduceOptions options);
  bool every_worker() const { return workers_ != nullptr; }
  // Workers per site (every_worker only).
  std::vector<int64_t> workers_per_site() const;

  // Makes every worker's `t` (float32) equal to global rank 0's (site 0, local rank 0; elastic:
  // the first live site's). A real broadcast over all_gather_bytes: only the source's site
  // sends the values over the WAN.
  void broadcast_from_first(at::Tensor& t);

  // allreduce over this site's workers only: c10d's all-reduce (Gloo's ring: every worker ends
  // with the same floats), full precision, on the communication thread like every collective.
  // For a job of one site this is the job's all-reduce without the gather to rank 0 and the
  // broadcast back (nebula/session.h uses it so). No codec (options.codec must be null).
  void site_allreduce(at::Tensor& t, const AllreduceOptions& options = {});

  // Every worker's bytes, exactly, in job order (sites in mesh order, each site's ranks in
  // order); each worker may give a different number of bytes, 0 included. Inside the site they
  // are gathered to rank 0 (c10d); the gateways exchange their sites' bytes once over the WAN
  // (uncompressed); rank 0 broadcasts the job's bytes inside the site. A worker that gives
  // nothing sends only a few header bytes, so a broadcast from one worker (the others give
  // nothing) crosses the WAN from the source's site alone. The base of the exact collectives of
  // any dtype (all-gather, broadcast from any rank, a job-wide barrier: nebula/session.h).
  std::vector<std::vector<uint8_t>> all_gather_bytes(std::vector<uint8_t> mine);

  // Any thread, any time (the training thread reads it for metrics while the communication
  // thread runs collectives).
  CommStats stats() const EXCLUDES(stats_mu_);
  bool is_gateway() const { return mesh_ != nullptr; }
  // Elastic rejoin on the gateway (GatewayMesh): lost sites ready to come back (0 elsewhere);
  // admitting them, and joining a running job, run on the communication thread between
  // collectives and return when done.
  uint64_t ready_joiners() { return mesh_ ? mesh_->ready_joiners() : 0; }
  void admit(uint64_t mask, Deadline deadline);
  void join(Deadline deadline);
  // The codec states (error feedback, PowerSGD's Q, RNG counters) by (tag, tensor), for
  // checkpoints. Only while no collective is queued or running (the communication thread
  // owns them otherwise); on the gateway, or with every_worker on every worker (empty elsewhere).
  using CodecStates = std::map<std::pair<uint64_t, size_t>, codec::CodecState>;
  const CodecStates& codec_states() const { return codec_state_; }
  void set_codec_states(CodecStates states) { codec_state_ = std::move(states); }
  SiteGroup& site() { return site_; }

 private:
  std::shared_ptr<Work> enqueue(std::string what, std::function<void(Work&)> op) EXCLUDES(queue_mu_);
  void run_allreduce(const std::vector<at::Tensor>& bucket, const AllreduceOptions& options);
  // The gateway's WAN leg on `values` (n floats: the bucket, flattened). `presummed`: values
  // are Σ_i w_i x_i over the site and site_weight = Σ_i w_i (run_allreduce); otherwise they
  // are the site's x and are weighted by site_weight here. Writes Σ_s (..) / Σ_s W_s (or the
  // plain sum for kSum) back into `values`; returns every site's site_info. Exchanges
  // (!presummed) apply the update guard and list what it left out in `rejected`.
  std::vector<std::vector<double>> cross_site(at::Tensor values, const std::vector<at::Tensor>& bucket,
                                              double site_weight, bool presummed, const AllreduceOptions& options,
                                              std::vector<Rejection>* rejected = nullptr);
  // `holdings` normalised and checked (exchange_parts_async).
  void run_exchange_parts(at::Tensor part, const Holdings& holdings, const AllreduceOptions& options, Work& work);
  void comm_main();
  uint64_t wan_bytes_sent_now() const;

  SiteGroup& site_;
  GatewayMesh* mesh_;
  WorkerMesh* workers_;
  SiteGroup* comm_group_;
  // The communication thread and its queue (started by the first collective).
  Mutex queue_mu_;
  std::condition_variable_any queue_cv_;
  std::deque<std::function<void()>> queue_ GUARDED_BY(queue_mu_);
  bool stopping_ GUARDED_BY(queue_mu_) = false;
  std::thread comm_thread_ GUARDED_BY(queue_mu_);
  // Owned by the communication thread, or by the caller while nothing is queued (above).
  CodecStates codec_state_;  // by (tag, tensor); gateway only (every_worker: by (tag, segment start), every worker)
  // Counters the communication thread adds to and stats() reads from any thread.
  mutable Mutex stats_mu_;
  uint64_t allreduces_ GUARDED_BY(stats_mu_) = 0;
  uint64_t codec_bytes_in_ GUARDED_BY(stats_mu_) = 0, codec_bytes_out_ GUARDED_BY(stats_mu_) = 0;
  double encode_seconds_ GUARDED_BY(stats_mu_) = 0, decode_seconds_ GUARDED_BY(stats_mu_) = 0;
};

// Sums counters over every worker of the job, exactly for integers up to 2^44: the hierarchy
// reduces float32 (exact only up to 2^24), so each value travels as a high and a low part.
// Every worker of every site calls it, with as many values.
std::vector<double> sum_counters(Hierarchy& comm, const std::vector<double>& values);

}  // namespace nebula::collective
