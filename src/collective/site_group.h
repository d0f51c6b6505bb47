// SiteGroup: the workers of one site as a c10d process group (Gloo on CPU) over a TCPStore.
// Inside a site the network is fast, so this layer uses c10d as is, in full precision.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace nebula::collective {

class SiteGroup {
 public:
  // Rendezvous at the site's TCPStore `store_host:store_port`; local rank 0 hosts the store.
  // Blocks until all `size` ranks have joined or `timeout` passes (then throws nebula::Timeout).
  //
  // Port 0 on rank 0 means "pick one": the store binds a port of the kernel's choosing, with no
  // window for another process to take it; read it with store_port(). The other ranks need the
  // real port (port 0 on them is an error), and as this constructor only returns once they have
  // joined, rank 0 hands them the port through `on_store_listening`: called once, on the
  // constructing thread, with the bound port as soon as the store listens and before the
  // rendezvous (called for an explicit port too; if it throws, the constructor rethrows).
  // Workers started by the launcher get an explicit port on every rank and need neither.
  // `external_store`: the store exists already (torchrun's agent hosts it): rank 0 is a client too.
  SiteGroup(const std::string& site, const std::string& store_host, uint16_t store_port, int rank, int size,
            std::chrono::milliseconds timeout, const std::function<void(uint16_t)>& on_store_listening = {},
            bool external_store = false);
  ~SiteGroup();
  SiteGroup(const SiteGroup&) = delete;
  SiteGroup& operator=(const SiteGroup&) = delete;

  // A second group of the same ranks over the same store, for another thread's collectives
  // (e.g. the communication thread's, while the training thread uses this one): c10d runs one
  // group's operations in the order posted, so two threads must not share one. Collective:
  // every rank calls it with the same `name`, once.
  std::unique_ptr<SiteGroup> fork(const std::string& name);

  // A group of some of this group's ranks (a pipeline stage's data replicas,
  // parallel/pipeline.h), over the same store: `ranks` in this group's numbering, ascending;
  // its rank i is ranks[i]. Only those ranks call it, each with the same `name` and `ranks`.
  std::unique_ptr<SiteGroup> subgroup(const std::string& name, const std::vector<int>& ranks);

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& site() const { return site_; }
  // The port of the site's TCPStore: on rank 0 the one it bound (the real one when given 0).
  uint16_t store_port() const { return store_port_; }

  // In-place collectives over the site's ranks (contiguous tensors). Each waits at most the
  // group's timeout and rethrows c10d's error as nebula::Error naming the site and operation.
  // Gloo moves host memory: a GPU tensor is sent from a host copy and received into one, then
  // copied onto its device; a reduce-scatter's sums are taken on the tensor's device (NCCL,
  // which would keep it all on the GPUs, is not used inside a site yet).
  void allreduce_sum(at::Tensor& t);
  void reduce_sum_to_root(at::Tensor& t);
  void broadcast_from_root(at::Tensor& t);
  void barrier();

  // Sharded collectives (ZeRO): `full` holds size() equal shards, shard i = elements
  // [i * S, (i + 1) * S) with S = full.numel() / size() (nebula::Error unless it divides).
  // reduce_scatter_sum: `shard` (S elements) becomes shard rank() of the sum of every rank's
  // `full`; `full` is used as scratch and left undefined in value (but for `shard`, which may
  // be `full`'s own chunk rank(): then the sum is taken in place). A ring over Gloo's
  // send/recv (LibTorch 1.13's Gloo has no reduce_scatter): size() - 1 steps, each rank
  // sending and receiving one shard per step, so (size() - 1) / size() of the data per rank
  // each way, as a ring all-reduce's first half.
  void reduce_scatter_sum(at::Tensor& full, at::Tensor& shard);
  // all_gather: `full` becomes every rank's `shard`, in rank order: a ring over send/recv that
  // writes each shard straight into its place (no second full-size buffer). `shard` may be
  // `full`'s own chunk rank() (then nothing is copied).
  void all_gather(const at::Tensor& shard, at::Tensor& full);

  // Parts of any sizes (the sharded outer state of diloco: a fragment's range cut by the
  // shard boundaries): `full` (1-D, contiguous) is rank 0's counts[0] values, then rank 1's
  // counts[1], ... (counts.size() == size(), summing to full.numel()); counts may be 0.
  // all_gather_parts: in place; each rank's own part must be in `full` already, and ends with
  // every rank's. A ring as all_gather's, empty parts skipped.
  void all_gather_parts(const at::Tensor& full, const std::vector<int64_t>& counts);
  // reduce_scatter_parts: in place; every rank passes its `full`, and each rank's own part of
  // it ends as the sum of that part over every rank (the rest is left as scratch). The ring of
  // reduce_scatter_sum (which is this with equal parts), empty parts skipped; each element is
  // summed in the same order as there (from the rank after its owner round to the owner).
  void reduce_scatter_parts(const at::Tensor& full, const std::vector<int64_t>& counts);
  // gather_parts_to_root: rank 0's `full` receives every rank's `part` (counts[rank()] values)
  // in its place; `full` is ignored on the other ranks. scatter_parts_from_root: the reverse,
  // each rank's `part` receives its values of rank 0's `full`. On rank 0 `part` may be
  // `full`'s own part (then nothing is copied).
  void gather_parts_to_root(const at::Tensor& part, const at::Tensor& full, const std::vector<int64_t>& counts);
  void scatter_parts_from_root(const at::Tensor& full, const at::Tensor& part, const std::vector<int64_t>& counts);
  // The same pairs with no `full` on rank 0: it takes the ranks' parts one at a time, in rank
  // order, through one buffer of the largest count (`part` itself for its own), and hands each
  // to `at_root(rank, values)`: gather_parts_each after receiving it (the callee puts it where
  // it goes), scatter_parts_each before sending it (the callee fills it). For parts that do not
  // lie in rank order in the whole (ZeRO-3's units): no whole-sized staging copy on rank 0.
  using PartFn = std::function<void(int rank, const at::Tensor& values)>;
  void gather_parts_each(const at::Tensor& part, const std::vector<int64_t>& counts, const PartFn& at_root);
  void scatter_parts_each(const at::Tensor& part, const std::vector<int64_t>& counts, const PartFn& at_root);

  // Point-to-point (pipeline stages): send() posts `t` (contiguous) to rank `dst` under `tag`
  // and returns at once; `t` must stay unchanged until wait_sends(), which completes every send
  // posted so far. recv() blocks until `t` (contiguous, of the sent shape and dtype) holds what
  // rank `src` sent under `tag`. A send and its recv match by (rank, tag), in any order of
  // posting, so a schedule that posts every send before it waits on a recv cannot deadlock.
  // Both wait at most the group's timeout (then PeerLost naming the site).
  void send(const at::Tensor& t, int dst, int tag);
  void recv(const at::Tensor& t, int src, int tag);
  void wait_sends();

  // Bytes this rank has sent to the site's other ranks since the group was made: exactly, for
  // the send/recv of the part rings and of gather/scatter with the root; for c10d's own
  // collectives, the bytes their algorithm sends (an all-reduce as a ring's 2 (N - 1) / N of the
  // tensor, a broadcast or reduce as the tensor once per non-root rank), not a count from Gloo.
  // Any thread (the metrics read it while another thread's collectives run).
  uint64_t bytes_sent() const { return bytes_sent_.load(std::memory_order_relaxed); }
  // The bytes this rank sent at each ring step of its last all_gather_parts or
  // reduce_scatter_parts (one entry per step, 0 for a step it only received in), for the ring's
  // critical path: the largest entry over the ranks at each step is what that step waits for.
  // The calling thread's group only.
  const std::vector<int64_t>& last_ring_steps() const { return ring_steps_; }

 private:
  // One step of the part rings: sends `out` to `next` while receiving `in` from `prev`
  // (an empty tensor is neither sent nor awaited), both with `tag`.
  void ring_step(const char* op, const at::Tensor& out, int next, const at::Tensor& in, int prev, int tag);
  // gather_parts_to_root (to_root) and scatter_parts_from_root: the same pairs, either way.
  void parts_with_root(bool to_root, const at::Tensor& part, const at::Tensor& full, const std::vector<int64_t>& counts);
  void parts_each(bool to_root, const at::Tensor& part, const std::vector<int64_t>& counts, const PartFn& at_root);
  // A non-root rank's side of both: its part sent to (or received from) rank 0.
  void part_with_root(bool to_root, const at::Tensor& part, int tag);
  struct Impl;
  // A group over this one's store (under `prefix`) as rank `rank` of `size`; `what` names it in errors.
  std::unique_ptr<SiteGroup> derive(const std::string& prefix, int rank, int size, const std::string& what);
  struct PendingSend;
  std::vector<PendingSend> pending_;  // send()'s, until wait_sends() (the group's thread)
  SiteGroup(std::unique_ptr<Impl> impl, std::string site, int rank, int size, uint16_t store_port);
  std::unique_ptr<Impl> impl_;
  std::string site_;
  int rank_;
  int size_;
  uint16_t store_port_;
  std::atomic<uint64_t> bytes_sent_{0};
  std::vector<int64_t> ring_steps_;  // the last part ring's bytes sent per step (the group's thread)
};

}  // namespace nebula::collective
