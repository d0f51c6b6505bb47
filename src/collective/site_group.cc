#include "collective/site_group.h"

#include <algorithm>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "nebula/error.h"

namespace nebula::collective {

struct SiteGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo::Options> options;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
};

struct SiteGroup::PendingSend {
  c10::intrusive_ptr<c10d::Work> work;
  std::vector<at::Tensor> values;  // kept alive until the send completes
};

namespace {
bool is_loopback(const std::string& host) {
  return host == "127.0.0.1" || host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}
}  // namespace

SiteGroup::SiteGroup(const std::string& site, const std::string& store_host, uint16_t store_port, int rank,
                     int size, std::chrono::milliseconds timeout,
                     const std::function<void(uint16_t)>& on_store_listening, bool external_store)
    : impl_(std::make_unique<Impl>()), site_(site), rank_(rank), size_(size), store_port_(store_port) {
  NEBULA_CHECK(size >= 1 && rank >= 0 && rank < size, "site ", site, ": rank ", rank, " of ", size);
  NEBULA_CHECK((rank == 0 && !external_store) || store_port != 0, "site ", site, ": rank ", rank,
               " needs the store's real port (only rank 0 may pass 0)");
  try {
    c10d::TCPStoreOptions opts;
    opts.port = store_port;
    opts.isServer = rank == 0 && !external_store;
    opts.numWorkers = size;
    opts.waitWorkers = false;  // the constructor returns once the store listens: see on_store_listening
    opts.timeout = timeout;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(store_host, opts);
    store_port_ = tcp->getPort();  // the bound port on rank 0 (port 0 → the kernel's pick)
    NEBULA_CHECK(store_port_ != 0, "site ", site, ": the store reports port 0");
    if (on_store_listening) on_store_listening(store_port_);
    impl_->store = c10::make_intrusive<c10d::PrefixStore>("nebula/" + site, tcp);
    auto gloo = c10d::ProcessGroupGloo::Options::create(timeout);
    // Gloo binds its own sockets; on loopback stay on loopback, else use the host's address.
    gloo->devices.push_back(is_loopback(store_host)
                                ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                                : c10d::ProcessGroupGloo::createDefaultDevice());
    gloo->threads = 1;
    impl_->options = gloo;
    impl_->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(impl_->store, rank, size, gloo);
  } catch (const c10::Error& e) {
    throw Timeout(site, str_cat("site ", site, " rank ", rank, "/", size, ": rendezvous at ", store_host, ":",
                                store_port_, " failed: ", e.what_without_backtrace()));
  }
}

SiteGroup::SiteGroup(std::unique_ptr<Impl> impl, std::string site, int rank, int size, uint16_t store_port)
    : impl_(std::move(impl)), site_(std::move(site)), rank_(rank), size_(size), store_port_(store_port) {}

std::unique_ptr<SiteGroup> SiteGroup::derive(const std::string& prefix, int rank, int size, const std::string& what) {
  auto impl = std::make_unique<Impl>();
  impl->options = impl_->options;
  impl->store = c10::make_intrusive<c10d::PrefixStore>(prefix, impl_->store);
  try {
    impl->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(impl->store, rank, size, impl->options);
  } catch (const c10::Error& e) {
    throw Timeout(site_, str_cat("site ", site_, " rank ", rank_, "/", size_, ": ", what, " failed to form: ",
                                 e.what_without_backtrace()));
  }
  return std::unique_ptr<SiteGroup>(new SiteGroup(std::move(impl), site_, rank, size, store_port_));
}

std::unique_ptr<SiteGroup> SiteGroup::fork(const std::string& name) {
  return derive("fork/" + name, rank_, size_, str_cat("second group '", name, "'"));
}

std::unique_ptr<SiteGroup> SiteGroup::subgroup(const std::string& name, const std::vector<int>& ranks) {
  const auto at = std::find(ranks.begin(), ranks.end(), rank_);
  NEBULA_CHECK(at != ranks.end() && std::is_sorted(ranks.begin(), ranks.end()) &&
                   std::adjacent_find(ranks.begin(), ranks.end()) == ranks.end() && ranks.front() >= 0 &&
                   ranks.back() < size_,
               "site ", site_, ": rank ", rank_, " forming subgroup '", name, "' of ranks that are not distinct, ",
               "ascending ranks of the site's ", size_, " including its own");
  return derive("sub/" + name, static_cast<int>(at - ranks.begin()), static_cast<int>(ranks.size()),
                str_cat("subgroup '", name, "' of ", ranks.size(), " ranks"));
}

SiteGroup::~SiteGroup() = default;

namespace {
// A timed-out wait says which key bounds it: one worker's own work between two collectives (the
// gateway's evaluation of a large model, say) can outlast it while its site peers wait.
std::string failed(const std::string& site, const char* op, const std::string& why) {
  std::string message = str_cat("site ", site, ": intra-site ", op, " failed: ", why);
  if (why.find("Timed out") != std::string::npos)
    message += str_cat("; every collective inside a site waits at most [job] timeout: if a worker's own work between "
                       "collectives (e.g. the gateway's evaluation of a large model) takes longer, raise it, e.g. "
                       "--set job.timeout='\"600s\"'");
  return message;
}

// Runs `f` (which posts and waits for c10d work), turning c10d's errors into PeerLost.
template <typename F>
void guarded(const std::string& site, const char* op, F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    throw PeerLost(site, failed(site, op, e.what_without_backtrace()));
  } catch (const std::exception& e) {
    throw PeerLost(site, failed(site, op, e.what()));
  }
}
template <typename F>
void run(const std::string& site, const char* op, F&& f) {
  guarded(site, op, [&] { f()->wait(); });
}
}  // namespace

namespace {
uint64_t bytes_of(const at::Tensor& t) { return static_cast<uint64_t>(t.numel()) * t.element_size(); }

// Gloo moves host memory here (LibTorch 1.13's Gloo; and send/recv in any version), so a tensor
// on a GPU travels through a host copy: made before it is sent (host_copy) or received into
// (host_buffer), and copied back onto its device after it arrives (land). The arithmetic of the
// collectives (a reduce-scatter's sums) stays on the tensor's device. A CPU tensor is its own
// host copy: nothing is copied.
at::Tensor host_copy(const at::Tensor& t) { return t.device().is_cpu() ? t : t.to(at::kCPU); }
at::Tensor host_buffer(const at::Tensor& t) {
  return t.device().is_cpu() ? t : at::empty(t.sizes(), t.options().device(at::kCPU));
}
void land(const at::Tensor& t, const at::Tensor& host) {
  if (!t.device().is_cpu()) t.copy_(host);
}
}  // namespace

void SiteGroup::allreduce_sum(at::Tensor& t) {
  if (size_ == 1) return;
  bytes_sent_ += bytes_of(t) * 2 * static_cast<uint64_t>(size_ - 1) / static_cast<uint64_t>(size_);
  std::vector<at::Tensor> v{host_copy(t)};
  run(site_, "allreduce", [&] { return impl_->pg->allreduce(v); });
  land(t, v[0]);
}

void SiteGroup::reduce_sum_to_root(at::Tensor& t) {
  if (size_ == 1) return;
  std::vector<at::Tensor> v{host_copy(t)};
  c10d::ReduceOptions o;
  o.rootRank = 0;
  if (rank_ != 0) bytes_sent_ += bytes_of(t);
  run(site_, "reduce", [&] { return impl_->pg->reduce(v, o); });
  if (rank_ == 0) land(t, v[0]);
}

void SiteGroup::broadcast_from_root(at::Tensor& t) {
  if (size_ == 1) return;
  std::vector<at::Tensor> v{rank_ == 0 ? host_copy(t) : host_buffer(t)};
  c10d::BroadcastOptions o;
  o.rootRank = 0;
  if (rank_ == 0) bytes_sent_ += bytes_of(t) * static_cast<uint64_t>(size_ - 1);
  run(site_, "broadcast", [&] { return impl_->pg->broadcast(v, o); });
  if (rank_ != 0) land(t, v[0]);
}

namespace {
int64_t shard_numel(const std::string& site, const char* op, const at::Tensor& full, const at::Tensor& shard,
                    int size) {
  NEBULA_CHECK(full.is_contiguous() && shard.is_contiguous() && full.dim() == 1 && shard.dim() == 1 &&
                   full.scalar_type() == shard.scalar_type(),
               "site ", site, ": ", op, " needs contiguous 1-D tensors of one dtype");
  NEBULA_CHECK(full.numel() == shard.numel() * size, "site ", site, ": ", op, " of a ", full.numel(),
               "-element tensor into ", size, " shards of ", shard.numel(), " (pad it to a multiple of ", size, ")");
  return shard.numel();
}
}  // namespace

void SiteGroup::reduce_scatter_sum(at::Tensor& full, at::Tensor& shard) {
  const int64_t s = shard_numel(site_, "reduce_scatter", full, shard, size_);
  reduce_scatter_parts(full, std::vector<int64_t>(static_cast<size_t>(size_), s));
  at::Tensor own = full.narrow(0, rank_ * s, s);
  if (shard.data_ptr() != own.data_ptr()) shard.copy_(own);
}

void SiteGroup::all_gather(const at::Tensor& shard, at::Tensor& full) {
  const int64_t s = shard_numel(site_, "all_gather", full, shard, size_);
  at::Tensor own = full.narrow(0, rank_ * s, s);
  if (own.data_ptr() != shard.data_ptr()) own.copy_(shard);
  all_gather_parts(full, std::vector<int64_t>(static_cast<size_t>(size_), s));
}

namespace {
// Each rank's offset in a tensor of parts (the last entry: the total), after checking the
// parts against the tensor.
std::vector<int64_t> part_offsets(const std::string& site, const char* op, const at::Tensor& full,
                                  const std::vector<int64_t>& counts, int size) {
  NEBULA_CHECK(counts.size() == static_cast<size_t>(size), "site ", site, ": ", op, " with ", counts.size(),
               " part sizes for ", size, " ranks");
  std::vector<int64_t> at(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) {
    NEBULA_CHECK(counts[i] >= 0, "site ", site, ": ", op, ": part ", i, " has ", counts[i], " values");
    at[i + 1] = at[i] + counts[i];
  }
  NEBULA_CHECK(full.is_contiguous() && full.dim() == 1 && full.numel() == at.back(), "site ", site, ": ", op,
               " of parts summing to ", at.back(), " values into a tensor of shape ", full.sizes(),
               " (want 1-D, contiguous, as many values)");
  return at;
}
}  // namespace

void SiteGroup::send(const at::Tensor& t, int dst, int tag) {
  NEBULA_CHECK(t.is_contiguous() && dst >= 0 && dst < size_ && dst != rank_, "site ", site_, ": rank ", rank_,
               " sending a ", t.is_contiguous() ? "" : "non-contiguous ", "tensor to rank ", dst, " of ", size_);
  PendingSend p{{}, {host_copy(t)}};
  bytes_sent_ += bytes_of(t);
  guarded(site_, "send", [&] { p.work = impl_->pg->send(p.values, dst, tag); });
  pending_.push_back(std::move(p));
}

void SiteGroup::recv(const at::Tensor& t, int src, int tag) {
  NEBULA_CHECK(t.is_contiguous() && src >= 0 && src < size_ && src != rank_, "site ", site_, ": rank ", rank_,
               " receiving a ", t.is_contiguous() ? "" : "non-contiguous ", "tensor from rank ", src, " of ", size_);
  std::vector<at::Tensor> v{host_buffer(t)};
  run(site_, "recv", [&] { return impl_->pg->recv(v, src, tag); });
  land(t, v[0]);
}

void SiteGroup::wait_sends() {
  std::vector<PendingSend> pending = std::move(pending_);
  pending_.clear();
  for (PendingSend& p : pending) guarded(site_, "send", [&] { p.work->wait(); });
}

void SiteGroup::ring_step(const char* op, const at::Tensor& out, int next, const at::Tensor& in, int prev, int tag) {
  std::vector<at::Tensor> o{host_copy(out)}, i{host_buffer(in)};
  ring_steps_.push_back(static_cast<int64_t>(bytes_of(out)));
  bytes_sent_ += bytes_of(out);
  guarded(site_, op, [&] {
    c10::intrusive_ptr<c10d::Work> sent, got;
    if (out.numel() > 0) sent = impl_->pg->send(o, next, tag);
    if (in.numel() > 0) got = impl_->pg->recv(i, prev, tag);
    if (sent) sent->wait();
    if (got) got->wait();
  });
  if (in.numel() > 0) land(in, i[0]);
}

void SiteGroup::all_gather_parts(const at::Tensor& full, const std::vector<int64_t>& counts) {
  const std::vector<int64_t> at = part_offsets(site_, "all_gather", full, counts, size_);
  auto part = [&](int i) {
    const auto k = static_cast<size_t>(((i % size_) + size_) % size_);
    return full.narrow(0, at[k], counts[k]);
  };
  // A ring in place (Gloo's allgather would stage everything in a second full-size buffer):
  // step k sends the part of rank (rank - k) on and receives that of (rank - k - 1) straight
  // into its place; a part of no values is neither sent nor awaited.
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  ring_steps_.clear();
  for (int k = 0; k + 1 < size_; ++k) {
    ring_step("all_gather", part(rank_ - k), next, part(rank_ - k - 1), prev, k);
  }
}

void SiteGroup::reduce_scatter_parts(const at::Tensor& full, const std::vector<int64_t>& counts) {
  const std::vector<int64_t> at = part_offsets(site_, "reduce_scatter", full, counts, size_);
  if (size_ == 1) return;
  auto index = [&](int i) { return static_cast<size_t>(((i % size_) + size_) % size_); };
  auto part = [&](int i) { return full.narrow(0, at[index(i)], counts[index(i)]); };
  // Step k sends the partial sum of part (rank - k - 1) to the next rank and adds the previous
  // rank's partial sum of part (rank - k - 2) to this rank's own; after size - 1 steps the part
  // received last, rank's own, holds every rank's contribution. Empty parts are skipped.
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  at::Tensor incoming = at::empty({*std::max_element(counts.begin(), counts.end())}, full.options());
  ring_steps_.clear();
  for (int k = 0; k + 1 < size_; ++k) {
    at::Tensor in = incoming.narrow(0, 0, counts[index(rank_ - k - 2)]);
    ring_step("reduce_scatter", part(rank_ - k - 1), next, in, prev, k);
    if (in.numel() > 0) part(rank_ - k - 2).add_(in);
  }
}

void SiteGroup::parts_with_root(bool to_root, const at::Tensor& part, const at::Tensor& full,
                                const std::vector<int64_t>& counts) {
  const char* op = to_root ? "gather" : "scatter";
  NEBULA_CHECK(counts.size() == static_cast<size_t>(size_) && part.numel() == counts[static_cast<size_t>(rank_)] &&
                   part.is_contiguous(),
               "site ", site_, ": ", op, " of a ", part.numel(), "-value part on rank ", rank_,
               " (want counts[rank], contiguous)");
  const int tag = (1 << 20) + (to_root ? 0 : 1);  // apart from the rings' step tags
  // A rank's part goes to (gather) or comes from (scatter) rank 0 in one send/recv pair.
  auto post = [&](std::vector<at::Tensor>& t, int peer) {
    return to_root ? impl_->pg->recv(t, peer, tag) : impl_->pg->send(t, peer, tag);
  };
  if (rank_ != 0) return part_with_root(to_root, part, tag);
  const std::vector<int64_t> at = part_offsets(site_, op, full, counts, size_);
  at::Tensor own = full.narrow(0, 0, counts[0]);
  if (counts[0] > 0 && own.data_ptr() != part.data_ptr()) (to_root ? own : part).copy_(to_root ? part : own);
  guarded(site_, op, [&] {
    std::vector<std::vector<at::Tensor>> theirs(counts.size());
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (size_t i = 1; i < counts.size(); ++i) {
      if (counts[i] == 0) continue;
      const at::Tensor place = full.narrow(0, at[i], counts[i]);
      theirs[i] = {to_root ? host_buffer(place) : host_copy(place)};
      if (!to_root) bytes_sent_ += bytes_of(theirs[i][0]);
      works.push_back(post(theirs[i], static_cast<int>(i)));
    }
    for (auto& w : works) w->wait();
    for (size_t i = 1; i < counts.size() && to_root; ++i)
      if (counts[i] > 0) land(full.narrow(0, at[i], counts[i]), theirs[i][0]);
  });
}

void SiteGroup::part_with_root(bool to_root, const at::Tensor& part, int tag) {
  if (part.numel() == 0) return;
  std::vector<at::Tensor> mine{to_root ? host_copy(part) : host_buffer(part)};
  if (to_root) bytes_sent_ += bytes_of(part);
  run(site_, to_root ? "gather" : "scatter",
      [&] { return to_root ? impl_->pg->send(mine, 0, tag) : impl_->pg->recv(mine, 0, tag); });
  if (!to_root) land(part, mine[0]);
}

void SiteGroup::parts_each(bool to_root, const at::Tensor& part, const std::vector<int64_t>& counts,
                           const PartFn& at_root) {
  const char* op = to_root ? "gather" : "scatter";
  NEBULA_CHECK(counts.size() == static_cast<size_t>(size_) && part.numel() == counts[static_cast<size_t>(rank_)] &&
                   part.is_contiguous() && part.scalar_type() == at::kFloat,
               "site ", site_, ": ", op, " of a ", part.numel(), "-value part on rank ", rank_,
               " (want counts[rank], contiguous float32)");
  const int tag = (1 << 20) + (to_root ? 0 : 1);  // the same pairs as parts_with_root's
  if (rank_ != 0) return part_with_root(to_root, part, tag);
  at_root(0, part);
  if (size_ == 1) return;
  const int64_t largest = *std::max_element(counts.begin() + 1, counts.end());
  at::Tensor buffer = at::empty({largest}, at::kFloat);
  for (size_t i = 1; i < counts.size(); ++i) {
    if (counts[i] == 0) continue;
    std::vector<at::Tensor> theirs{buffer.narrow(0, 0, counts[i])};
    if (!to_root) {
      at_root(static_cast<int>(i), theirs[0]);
      bytes_sent_ += bytes_of(theirs[0]);
    }
    run(site_, op, [&] {
      return to_root ? impl_->pg->recv(theirs, static_cast<int>(i), tag) : impl_->pg->send(theirs, static_cast<int>(i), tag);
    });
    if (to_root) at_root(static_cast<int>(i), theirs[0]);
  }
}

void SiteGroup::gather_parts_each(const at::Tensor& part, const std::vector<int64_t>& counts, const PartFn& at_root) {
  parts_each(true, part, counts, at_root);
}

void SiteGroup::scatter_parts_each(const at::Tensor& part, const std::vector<int64_t>& counts, const PartFn& at_root) {
  parts_each(false, part, counts, at_root);
}

void SiteGroup::gather_parts_to_root(const at::Tensor& part, const at::Tensor& full,
                                     const std::vector<int64_t>& counts) {
  parts_with_root(true, part, full, counts);
}

void SiteGroup::scatter_parts_from_root(const at::Tensor& full, const at::Tensor& part,
                                        const std::vector<int64_t>& counts) {
  parts_with_root(false, part, full, counts);
}

void SiteGroup::barrier() {
  if (size_ == 1) return;
  run(site_, "barrier", [&] { return impl_->pg->barrier(); });
}

}  // namespace nebula::collective
