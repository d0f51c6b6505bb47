#include "collective/hierarchical.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <span>

#include "nebula/error.h"
#include "wire/frame.h"

namespace nebula::collective {
namespace {

// Why the update guard rejects a contribution with these NaN and infinity counts and L2 norm,
// or "" if it passes.
std::string guard_verdict(int64_t nans, int64_t infs, double norm, double max_norm) {
  if (nans + infs > 0) return str_cat("non-finite values (", nans, " NaN, ", infs, " infinite)");
  if (max_norm > 0 && norm > max_norm)
    return str_cat("L2 norm ", norm, " above the bound ", max_norm, " (strategy.max_update_norm)");
  return {};
}

// What the update guard reads of a contribution: its NaN and infinity counts and the sum of its
// squares (in double, over the finite values), in one pass over the floats with no temporary
// tensor. (An exchange's guard ran isnan, isinf and a float64 copy squared: for a 12.5 MiB
// fragment, 56 MiB of temporaries on top of the exchange's buffers.)
struct GuardStats {
  int64_t nans = 0, infs = 0;
  double squares = 0;
  void add(const float* x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      const float v = x[i];
      if (std::isnan(v))
        ++nans;
      else if (std::isinf(v))
        ++infs;
      else
        squares += static_cast<double>(v) * v;
    }
  }
  void add(const at::Tensor& x) {
    const at::Tensor c = x.to(at::kCPU).contiguous();
    add(c.data_ptr<float>(), c.numel());
  }
  std::string verdict(double max_norm) const { return guard_verdict(nans, infs, std::sqrt(squares), max_norm); }
};

std::string guard_verdict(const at::Tensor& x, double max_norm) {
  GuardStats g;
  g.add(x);
  return g.verdict(max_norm);
}

// The largest weight a site may send with its contribution (a sum of its workers' weights, e.g.
// tokens per step: 2^40 is far above any real one, and far below where it would swamp float64).
constexpr double kMaxSiteWeight = 1099511627776.0;

// Why a peer's weight is refused, or "". A peer's weight is checked like any number it sends:
// NaN, a negative or an absurd weight would poison the mean on every site.
std::string weight_verdict(double w) {
  if (std::isfinite(w) && w >= 0 && w <= kMaxSiteWeight) return {};
  return str_cat("weight ", w, " is not a number in [0, ", kMaxSiteWeight, "]");
}

std::string span_str(const Span& x) { return str_cat("[", x.begin, ", ", x.end, ")"); }

// Checks `holdings` against the job's workers per site and normalises them in place: each
// worker's touching spans merged, empty ones dropped (so that sites writing the same holding
// differently agree on the segments).
void normalise_holdings(Holdings& holdings, const std::vector<int64_t>& workers) {
  NEBULA_CHECK(holdings.size() == workers.size(), "exchange_parts: holdings for ", holdings.size(),
               " sites, the job has ", workers.size());
  int64_t n = 0;  // site 0's
  for (size_t s = 0; s < holdings.size(); ++s) {
    auto& site = holdings[s];
    NEBULA_CHECK(static_cast<int64_t>(site.size()) == workers[s], "exchange_parts: holdings for ", site.size(),
                 " workers of site #", s, ", it has ", workers[s]);
    struct Tile {
      Span span;
      size_t worker;
    };
    std::vector<Tile> tiles;  // every worker's spans, to check that they cover [0, n) once
    for (size_t q = 0; q < site.size(); ++q) {
      std::vector<Span> merged;
      for (size_t i = 0; i < site[q].size(); ++i) {
        const Span x = site[q][i];
        NEBULA_CHECK(x.begin <= x.end, "exchange_parts: site #", s, " worker ", q, ": span #", i, " ", span_str(x),
                     " ends before it begins");
        if (x.begin == x.end) continue;
        if (!merged.empty()) {
          const Span last = merged.back();
          NEBULA_CHECK(x.begin >= last.begin, "exchange_parts: site #", s, " worker ", q, ": spans out of order, ",
                       span_str(x), " after ", span_str(last));
          NEBULA_CHECK(x.begin >= last.end, "exchange_parts: site #", s, " worker ", q, ": spans ", span_str(last),
                       " and ", span_str(x), " overlap");
          if (x.begin == last.end) {
            merged.back().end = x.end;
            continue;
          }
        }
        merged.push_back(x);
      }
      for (const Span& x : merged) tiles.push_back({x, q});
      site[q] = std::move(merged);
    }
    std::sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.span.begin < b.span.begin; });
    int64_t covered = 0;  // [0, covered) is held by exactly one worker so far
    for (size_t i = 0; i < tiles.size(); ++i) {
      const Tile& t = tiles[i];
      NEBULA_CHECK(t.span.begin >= 0, "exchange_parts: site #", s, " worker ", t.worker, ": span ", span_str(t.span),
                   " begins below 0");
      NEBULA_CHECK(t.span.begin >= covered, "exchange_parts: site #", s, ": worker ", t.worker, "'s span ",
                   span_str(t.span), " overlaps worker ", tiles[i - 1].worker, "'s ", span_str(tiles[i - 1].span));
      NEBULA_CHECK(t.span.begin == covered, "exchange_parts: site #", s, ": values ", span_str({covered, t.span.begin}),
                   " are held by no worker");
      covered = t.span.end;
    }
    if (s == 0) n = covered;
    NEBULA_CHECK(covered == n, "exchange_parts: site #", s, "'s workers hold [0, ", covered, "), site #0's [0, ", n,
                 "): every site must hold the same vector");
  }
}

// This worker's part cut into segments at every site's span boundaries, and who holds each.
struct PartsPlan {
  struct Segment {
    int64_t start = 0, end = 0;  // in the vector
    int64_t offset = 0;          // in the part
  };
  int64_t n = 0;                  // the vector's size
  int64_t numel = 0;              // the part's
  std::vector<Segment> segments;  // ascending, as in the part
  // held[t][q]: the segments (indices, ascending) that worker q of site t holds too, i.e. whose
  // first value its spans hold. Every segment lies inside one span of each site.
  std::vector<std::vector<std::vector<size_t>>> held;
};

PartsPlan plan_parts(const Holdings& holdings, size_t me_site, int me_rank) {
  std::vector<int64_t> bounds;
  for (const auto& site : holdings)
    for (const auto& spans : site)
      for (const Span& x : spans) {
        bounds.push_back(x.begin);
        bounds.push_back(x.end);
      }
  std::sort(bounds.begin(), bounds.end());
  bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
  PartsPlan plan;
  plan.n = bounds.empty() ? 0 : bounds.back();  // every site's spans cover [0, n)
  for (const Span& x : holdings[me_site][static_cast<size_t>(me_rank)]) {
    // The bounds inside (begin, end), then end: each closes a segment.
    int64_t start = x.begin;
    for (auto it = std::upper_bound(bounds.begin(), bounds.end(), x.begin); start < x.end; ++it) {
      const int64_t end = it != bounds.end() && *it < x.end ? *it : x.end;
      plan.segments.push_back({start, end, plan.numel + (start - x.begin)});
      start = end;
    }
    plan.numel += x.end - x.begin;
  }
  plan.held.resize(holdings.size());
  for (size_t t = 0; t < holdings.size(); ++t) {
    plan.held[t].resize(holdings[t].size());
    std::vector<std::pair<int64_t, size_t>> starts;  // each span's begin and its worker; they tile [0, n)
    for (size_t q = 0; q < holdings[t].size(); ++q)
      for (const Span& x : holdings[t][q]) starts.emplace_back(x.begin, q);
    std::sort(starts.begin(), starts.end());
    for (size_t k = 0; k < plan.segments.size(); ++k) {
      const auto it = std::upper_bound(starts.begin(), starts.end(),
                                       std::make_pair(plan.segments[k].start, std::numeric_limits<size_t>::max()));
      plan.held[t][std::prev(it)->second].push_back(k);
    }
  }
  return plan;
}

// Writes into `part` Σ_t W_t x_t / Σ_t W_t (kSum: Σ_t x_t) over the sites' contributions to it
// (by site; every worker of every site calls this, on its own part), leaving out those the
// update guard rejects, which it lists in `rejected`.
void combine_parts(at::Tensor part, std::vector<at::Tensor> contribution, const std::vector<double>& weight,
                   const AllreduceOptions& options, SiteGroup& comm_group, std::vector<Rejection>& rejected) {
  // The update guard on each site's whole contribution: this worker's share of its NaN and
  // infinity counts and squared norm, summed over the site (every worker of every site then
  // holds the same totals; the norm's to the rounding of a sum taken in another order).
  at::Tensor totals = at::zeros({static_cast<int64_t>(3 * weight.size())}, at::kDouble);
  for (size_t t = 0; t < weight.size(); ++t) {
    GuardStats g;
    g.add(contribution[t]);
    totals[static_cast<int64_t>(3 * t)] = static_cast<double>(g.nans);
    totals[static_cast<int64_t>(3 * t + 1)] = static_cast<double>(g.infs);
    totals[static_cast<int64_t>(3 * t + 2)] = g.squares;
  }
  comm_group.allreduce_sum(totals);
  const double* tot = totals.data_ptr<double>();
  at::Tensor sum = part;
  sum.zero_();
  double total_weight = 0;
  size_t left_out = 0;
  for (size_t t = 0; t < weight.size(); ++t) {
    std::string why = weight_verdict(weight[t]);
    if (why.empty())
      why = guard_verdict(static_cast<int64_t>(tot[3 * t]), static_cast<int64_t>(tot[3 * t + 1]),
                          std::sqrt(tot[3 * t + 2]), options.max_norm);
    if (!why.empty()) {
      rejected.push_back({t, why});
      ++left_out;
      continue;
    }
    const double scale = options.op == ReduceOp::kWeightedMean ? weight[t] : 1.0;
    sum.add_(contribution[t], scale);
    contribution[t] = at::Tensor();
    total_weight += weight[t];
  }
  if (options.op == ReduceOp::kWeightedMean) {
    NEBULA_CHECK(total_weight > 0 || left_out > 0, "weighted exchange with total weight ", total_weight);
    if (total_weight > 0) sum.div_(total_weight);
  }
}

}  // namespace


Hierarchy::Hierarchy(SiteGroup& site, GatewayMesh* mesh, WorkerMesh* workers, SiteGroup* comm_group)
    : site_(site), mesh_(mesh), workers_(workers), comm_group_(comm_group) {
  NEBULA_CHECK((site.rank() == 0) == (mesh != nullptr), "site ", site.site(), " rank ", site.rank(),
               ": the gateway mesh belongs to local rank 0 only");
  NEBULA_CHECK((workers == nullptr) == (comm_group == nullptr), "site ", site.site(), " rank ", site.rank(),
               ": every_worker needs both the worker mesh and a second site group");
}

uint64_t Hierarchy::wan_bytes_sent_now() const {
  return workers_ ? workers_->totals().bytes_sent : mesh_ ? mesh_->totals().bytes_sent : 0;
}

std::vector<int64_t> Hierarchy::workers_per_site() const {
  NEBULA_CHECK(workers_, "workers_per_site: wan.mode is not every_worker");
  return workers_->workers_per_site();
}

void Work::wait(Deadline deadline) {
  MutexLock lock(mu_);
  if (!cv_.wait_until(mu_, deadline.at(), [&]() REQUIRES(mu_) { return done_; }))
    throw Timeout("", str_cat(what_, ": still running at its deadline"));
  if (error_) std::rethrow_exception(error_);
}

bool Work::done() const {
  MutexLock lock(mu_);
  return done_;
}

void Work::finish(std::exception_ptr error) {
  MutexLock lock(mu_);
  done_ = true;
  error_ = error;
  cv_.notify_all();
}

Hierarchy::~Hierarchy() {
  std::thread comm;
  {
    MutexLock lock(queue_mu_);
    stopping_ = true;
    comm = std::move(comm_thread_);
  }
  queue_cv_.notify_all();
  if (comm.joinable()) comm.join();
}

void Hierarchy::comm_main() {
  for (;;) {
    std::function<void()> task;
    {
      MutexLock lock(queue_mu_);
      queue_cv_.wait(queue_mu_, [&]() REQUIRES(queue_mu_) { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

std::shared_ptr<Work> Hierarchy::enqueue(std::string what, std::function<void(Work&)> op) {
  auto work = std::make_shared<Work>();
  work->what_ = std::move(what);
  {
    MutexLock lock(queue_mu_);
    NEBULA_CHECK(!stopping_, "collective queued on a hierarchy that is shutting down");
    if (!comm_thread_.joinable()) comm_thread_ = std::thread([this] { comm_main(); });
    queue_.push_back([this, op = std::move(op), work] {
      try {
        const auto start = Clock::now();
        const uint64_t sent = wan_bytes_sent_now();
        op(*work);
        work->seconds_ = std::chrono::duration<double>(Clock::now() - start).count();
        work->wan_bytes_sent_ = wan_bytes_sent_now() - sent;
        work->finish(nullptr);
      } catch (...) {
        work->finish(std::current_exception());
      }
    });
  }
  queue_cv_.notify_one();
  return work;
}

void Hierarchy::admit(uint64_t mask, Deadline deadline) {
  NEBULA_CHECK(mesh_, "admit on a worker that is not its site's gateway");
  enqueue("admitting rejoining sites", [this, mask](Work&) { mesh_->admit(mask); })->wait(deadline);
}

void Hierarchy::join(Deadline deadline) {
  NEBULA_CHECK(mesh_, "join on a worker that is not its site's gateway");
  enqueue("joining the running job", [this, deadline](Work&) { mesh_->join(deadline); })->wait(deadline);
}

namespace {

void check_bucket_tensor(const at::Tensor& t, const char* what) {
  NEBULA_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && (t.device().is_cpu() || t.device().is_cuda()),
               what, " needs contiguous float32 CPU or CUDA tensors, got ", t.toString());
}

// The host buffer a bucket is gathered into: pinned (page-locked, so the device copies are
// DMA) when any tensor of the bucket lives on a GPU. A CPU-only LibTorch never pins.
at::Tensor host_buffer(int64_t n, const std::vector<at::Tensor>& bucket) {
  const bool gpu = std::any_of(bucket.begin(), bucket.end(), [](const at::Tensor& t) { return t.device().is_cuda(); });
  return at::empty({n}, at::TensorOptions().dtype(at::kFloat).pinned_memory(gpu));
}

// target += scale · the float32 values in `bytes` (not aligned for float), in slices: no
// copy of the whole.
// fn(offset, slice) over the float32 values in `bytes` (any alignment), a slice of up to 64 Ki
// values at a time copied out: no copy of the whole.
template <typename F>
void for_raw_slices(std::span<const uint8_t> bytes, F&& fn) {
  constexpr int64_t kSlice = 1 << 16;
  const int64_t n = static_cast<int64_t>(bytes.size() / sizeof(float));
  at::Tensor slice = at::empty({std::min<int64_t>(kSlice, n)}, at::kFloat);
  for (int64_t at = 0; at < n; at += kSlice) {
    const int64_t k = std::min<int64_t>(kSlice, n - at);
    std::memcpy(slice.data_ptr<float>(), bytes.data() + at * sizeof(float), static_cast<size_t>(k) * sizeof(float));
    fn(at, slice.narrow(0, 0, k));
  }
}

void add_raw_floats(at::Tensor target, std::span<const uint8_t> bytes, double scale) {
  for_raw_slices(bytes.first(static_cast<size_t>(target.numel()) * sizeof(float)),
                 [&](int64_t at, const at::Tensor& slice) { target.narrow(0, at, slice.numel()).add_(slice, scale); });
}

// guard_verdict of the float32 values in `bytes`, read slice by slice.
std::string raw_guard_verdict(std::span<const uint8_t> bytes, double max_norm) {
  GuardStats g;
  for_raw_slices(bytes, [&](int64_t, const at::Tensor& slice) { g.add(slice.data_ptr<float>(), slice.numel()); });
  return g.verdict(max_norm);
}

}  // namespace

std::shared_ptr<Work> Hierarchy::allreduce_async(std::vector<at::Tensor> bucket, AllreduceOptions options) {
  return enqueue(str_cat("site ", site_.site(), ": all-reduce of bucket ", options.tag),
                 [this, bucket = std::move(bucket), options](Work&) { run_allreduce(bucket, options); });
}

std::shared_ptr<Work> Hierarchy::exchange_async(std::vector<at::Tensor> bucket, AllreduceOptions options) {
  NEBULA_CHECK(mesh_ != nullptr, "site ", site_.site(), " rank ", site_.rank(),
               ": exchange_async is the gateway's (local rank 0) alone");
  NEBULA_CHECK(options.weight >= 0, "weight ", options.weight);
  for (const auto& t : bucket) check_bucket_tensor(t, "exchange");
  return enqueue(str_cat("site ", site_.site(), ": exchange of ", options.tag),
                 [this, bucket = std::move(bucket), options](Work& work) {
                   int64_t n = 0;
                   for (const auto& t : bucket) n += t.numel();
                   // One CPU tensor (diloco's pseudo-gradient) is exchanged in place; others
                   // are gathered into one host buffer and written back.
                   const bool in_place = bucket.size() == 1 && bucket[0].device().is_cpu();
                   at::Tensor values = in_place ? bucket[0].view({-1}) : host_buffer(n, bucket);
                   int64_t offset = 0;
                   if (!in_place)
                     for (const auto& t : bucket) {
                       values.narrow(0, offset, t.numel()).copy_(t.reshape({-1}));
                       offset += t.numel();
                     }
                   {
                     MutexLock lock(stats_mu_);
                     ++allreduces_;
                   }
                   work.site_info_ =
                       cross_site(values, bucket, options.weight, /*presummed=*/false, options, &work.rejected_);
                   offset = 0;
                   if (!in_place)
                     for (const auto& t : bucket) {
                       t.view({-1}).copy_(values.narrow(0, offset, t.numel()));
                       offset += t.numel();
                     }
                 });
}

void Hierarchy::allreduce(at::Tensor& t, const AllreduceOptions& options) { allreduce(std::vector<at::Tensor>{t}, options); }

void Hierarchy::allreduce(const std::vector<at::Tensor>& bucket, const AllreduceOptions& options) {
  // Through the queue, so synchronous and asynchronous calls can never interleave.
  allreduce_async(bucket, options)->wait(Deadline::never());
}

void Hierarchy::site_allreduce(at::Tensor& t, const AllreduceOptions& options) {
  check_bucket_tensor(t, "site all-reduce");
  NEBULA_CHECK(t.device().is_cpu() && options.codec == nullptr && options.weight >= 0,
               "site all-reduce: a CPU tensor, no codec, weight >= 0 (got ", t.device(), ", weight ", options.weight, ")");
  enqueue(str_cat("site ", site_.site(), ": site all-reduce of ", t.numel(), " values"), [&](Work&) {
    if (options.op == ReduceOp::kSum) {
      site_.allreduce_sum(t);
      return;
    }
    // The weighted values and the weight, summed together (as run_allreduce does).
    at::Tensor buf = at::empty({t.numel() + 1}, at::kFloat);
    buf.narrow(0, 0, t.numel()).copy_(t.view({-1})).mul_(options.weight);
    buf[t.numel()] = static_cast<float>(options.weight);
    site_.allreduce_sum(buf);
    const float total = buf.data_ptr<float>()[t.numel()];
    NEBULA_CHECK(total > 0, "site ", site_.site(), ": weighted mean with total weight ", total);
    t.view({-1}).copy_(buf.narrow(0, 0, t.numel())).div_(total);
  })->wait(Deadline::never());
}

void Hierarchy::run_allreduce(const std::vector<at::Tensor>& bucket, const AllreduceOptions& options) {
  int64_t n = 0;
  for (const auto& t : bucket) {
    check_bucket_tensor(t, "hierarchical allreduce");
    n += t.numel();
  }
  NEBULA_CHECK(options.weight >= 0, "weight ", options.weight);
  {
    MutexLock lock(stats_mu_);
    ++allreduces_;
  }
  const bool weighted = options.op == ReduceOp::kWeightedMean;

  // One buffer: the (weighted) values, then the weight, reduced together inside the site
  // (float32 is exact for weights up to 2^24); across sites the weight travels as float64.
  at::Tensor buf = host_buffer(n + 1, bucket);
  int64_t offset = 0;
  for (const auto& t : bucket) {
    buf.narrow(0, offset, t.numel()).copy_(t.reshape({-1}));
    offset += t.numel();
  }
  if (weighted) buf.narrow(0, 0, n).mul_(options.weight);
  buf[n] = static_cast<float>(weighted ? options.weight : 1.0);
  site_.reduce_sum_to_root(buf);

  if (mesh_) {
    const double site_weight = buf.data_ptr<float>()[n];
    at::Tensor values = buf.narrow(0, 0, n);
    cross_site(values, bucket, site_weight, /*presummed=*/true, options);
  }
  site_.broadcast_from_root(buf);
  offset = 0;
  for (const auto& t : bucket) {
    t.view({-1}).copy_(buf.narrow(0, offset, t.numel()));
    offset += t.numel();
  }
}

std::vector<std::vector<double>> Hierarchy::cross_site(at::Tensor values, const std::vector<at::Tensor>& bucket,
                                                        double site_weight, bool presummed,
                                                        const AllreduceOptions& options,
                                                        std::vector<Rejection>* rejected) {
  const int64_t n = values.numel();
  const bool weighted = options.op == ReduceOp::kWeightedMean;
  // What this site contributes: its values, encoded once, its weight and its site_info.
  // The parts: each tensor (per_tensor) or the whole bucket as one flat vector.
  std::vector<at::Tensor> parts;
  if (options.codec && options.per_tensor) {
    int64_t offset = 0;
    for (const auto& t : bucket) {
      parts.push_back(values.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  } else {
    parts.push_back(values);
  }
  wire::ByteWriter w;
  // Raw floats: the payload's exact size up front, so the buffer is written once, not grown
  // through copies of up to twice the model.
  if (!options.codec) w.reserve(64 + 8 * options.site_info.size() + static_cast<size_t>(n) * sizeof(float));
  w.put_u64(static_cast<uint64_t>(n));
  w.put_f64(site_weight);
  w.put_u8(presummed ? 1 : 0);
  w.put_u32(static_cast<uint32_t>(options.site_info.size()));
  for (double v : options.site_info) w.put_f64(v);
  w.put_u8(options.codec ? 1 : 0);
  w.put_u32(static_cast<uint32_t>(parts.size()));
  for (size_t i = 0; i < parts.size(); ++i) {
    if (options.codec) {
      auto start = Clock::now();
      auto encoded = options.codec->encode(parts[i], codec_state_[{options.tag, i}]);
      const double took = std::chrono::duration<double>(Clock::now() - start).count();
      w.put_u64(encoded.size());
      w.put_bytes(encoded);
      MutexLock lock(stats_mu_);
      encode_seconds_ += took;
      codec_bytes_out_ += encoded.size();
    } else {
      const auto* p = reinterpret_cast<const uint8_t*>(values.data_ptr<float>());
      w.put_u64(static_cast<uint64_t>(n) * sizeof(float));
      w.put_bytes({p, static_cast<size_t>(n) * sizeof(float)});
      MutexLock lock(stats_mu_);
      codec_bytes_out_ += static_cast<uint64_t>(n) * sizeof(float);
    }
  }
  {
    MutexLock lock(stats_mu_);
    codec_bytes_in_ += static_cast<uint64_t>(n) * sizeof(float);
  }
  auto all = mesh_->all_gather(w.take());

  // Every gateway decodes the same bytes (its own included) and adds them in site order, so
  // all sites compute exactly the same floats. This site's values are in its bytes now: the
  // sum is taken in their place (no other copy of the model), and each site's bytes are
  // freed once added.
  at::Tensor sum = values;
  sum.zero_();
  double total_weight = 0;
  size_t left_out = 0;  // contributions the update guard rejected
  std::vector<std::vector<double>> info(all.size());
  for (size_t s = 0; s < all.size(); ++s) {
    if (all[s].empty()) continue;  // a lost site (elastic): not part of this exchange
    wire::ByteReader r(all[s], "allreduce payload from site " + std::to_string(s));
    uint64_t count = r.u64();
    if (count != static_cast<uint64_t>(n))
      throw Error(str_cat("allreduce: site ", s, " sent ", count, " elements, this site has ", n,
                          ": the sites' models differ"));
    const double weight = r.f64();
    // In an exchange the update guard leaves a site with a bad weight out (below); an
    // all-reduce's sum cannot go on without it, so there it is an error.
    const std::string bad_weight = weight_verdict(weight);
    if (!bad_weight.empty() && presummed) throw Error(str_cat("allreduce: site ", s, " sent ", bad_weight));
    if ((r.u8() != 0) != presummed)
      throw Error(str_cat("allreduce: site ", s, " ran another kind of collective (all-reduce vs exchange)",
                          ": the sites' strategies differ"));
    const uint32_t ninfo = r.u32();
    if (ninfo > 1024) throw Error(str_cat("allreduce: site ", s, " sent ", ninfo, " site_info values (at most 1024)"));
    for (uint32_t i = 0; i < ninfo; ++i) info[s].push_back(r.f64());
    const bool coded = r.u8() != 0;
    const uint32_t nparts = r.u32();
    if (coded != (options.codec != nullptr) || nparts != parts.size())
      throw Error(str_cat("allreduce: site ", s, " sent ", nparts, (coded ? " encoded" : " raw"), " part(s), this site ",
                          parts.size(), (options.codec ? " encoded" : " raw"),
                          ": the sites' [strategy] codec settings differ"));
    // An exchange weights each site's values here; a presummed all-reduce already did. It
    // decodes a site's contribution whole first, for the update guard.
    const double scale = (!presummed && weighted) ? weight : 1.0;
    const bool guard = !presummed;
    // A single decoded part is the contribution itself; raw floats are judged and added
    // where they lie in the site's bytes (slice by slice: no model-sized copy).
    at::Tensor contribution = guard && coded && nparts > 1 ? at::empty({n}, at::kFloat) : at::Tensor();
    std::span<const uint8_t> raw;
    int64_t at = 0;
    for (uint32_t i = 0; i < nparts; ++i) {
      const int64_t numel = parts[i].numel();
      auto bytes = r.bytes(static_cast<size_t>(r.u64()));
      if (coded) {
        auto start = Clock::now();
        at::Tensor part = options.codec->decode(bytes, numel).reshape({-1});
        const double took = std::chrono::duration<double>(Clock::now() - start).count();
        {
          MutexLock lock(stats_mu_);
          decode_seconds_ += took;
        }
        if (guard && nparts == 1)
          contribution = part;
        else if (guard)
          contribution.narrow(0, at, numel).copy_(part);
        else
          sum.narrow(0, at, numel).add_(part, scale);
      } else {
        if (bytes.size() != static_cast<size_t>(numel) * sizeof(float))
          throw Error(str_cat("allreduce: site ", s, " sent ", bytes.size(), " bytes for ", numel, " floats"));
        if (guard) {
          NEBULA_CHECK(nparts == 1, "raw exchange payload of ", nparts, " parts");  // per_tensor parts are coded
          raw = bytes;
        } else {
          add_raw_floats(sum.narrow(0, at, numel), bytes, scale);
        }
      }
      at += numel;
    }
    r.expect_done();
    if (guard) {
      std::string why = !bad_weight.empty() ? bad_weight
                        : contribution.defined() ? guard_verdict(contribution, options.max_norm)
                                                 : raw_guard_verdict(raw, options.max_norm);
      if (!why.empty()) {
        if (rejected) rejected->push_back({s, why});
        ++left_out;
        std::vector<uint8_t>().swap(all[s]);
        continue;  // left out: as if the site had weight 0
      }
      if (contribution.defined())
        sum.add_(contribution, scale);
      else
        add_raw_floats(sum, raw, scale);
    }
    std::vector<uint8_t>().swap(all[s]);
    total_weight += weight;
  }
  if (weighted) {
    // Nothing left after the guard: zero, no update. Otherwise a zero total is a caller's bug.
    NEBULA_CHECK(total_weight > 0 || left_out > 0, "weighted allreduce with total weight ", total_weight);
    if (total_weight > 0) sum.div_(total_weight);
  }
  return info;
}

Holdings holdings_of_cuts(const std::vector<std::vector<int64_t>>& cuts) {
  Holdings holdings(cuts.size());
  for (size_t s = 0; s < cuts.size(); ++s)
    for (size_t q = 0; q + 1 < cuts[s].size(); ++q) holdings[s].push_back({Span{cuts[s][q], cuts[s][q + 1]}});
  return holdings;
}

std::shared_ptr<Work> Hierarchy::exchange_parts_async(at::Tensor part, const std::vector<std::vector<int64_t>>& cuts,
                                                      AllreduceOptions options) {
  return exchange_parts_async(std::move(part), holdings_of_cuts(cuts), std::move(options));
}

std::shared_ptr<Work> Hierarchy::exchange_parts_async(at::Tensor part, Holdings holdings, AllreduceOptions options) {
  NEBULA_CHECK(workers_ != nullptr, "site ", site_.site(), " rank ", site_.rank(),
               ": exchange_parts_async needs wan.mode = \"every_worker\"");
  NEBULA_CHECK(options.weight >= 0 && std::isfinite(options.weight), "weight ", options.weight);
  NEBULA_CHECK(part.scalar_type() == at::kFloat && part.is_contiguous() && part.device().is_cpu() && part.dim() == 1,
               "exchange_parts needs a contiguous 1-D float32 CPU tensor, got ", part.toString());
  NEBULA_CHECK(!options.per_tensor, "exchange_parts encodes flat segments: per_tensor codecs (PowerSGD) cannot run");
  // The mesh's slots are fixed at its construction: reading them here, off the communication
  // thread, is safe, and bad holdings throw from this call.
  normalise_holdings(holdings, workers_->workers_per_site());
  const WorkerSlot& me = workers_->slots()[workers_->self()];
  int64_t held = 0;
  for (const Span& x : holdings[me.site][static_cast<size_t>(me.rank)]) held += x.end - x.begin;
  NEBULA_CHECK(part.numel() == held, "exchange_parts: site #", me.site, " worker ", me.rank, "'s part has ",
               part.numel(), " values, its spans hold ", held);
  return enqueue(str_cat("site ", site_.site(), " rank ", site_.rank(), ": exchange of ", options.tag),
                 [this, part, holdings = std::move(holdings), options](Work& work) {
                   {
                     MutexLock lock(stats_mu_);
                     ++allreduces_;
                   }
                   run_exchange_parts(part, holdings, options, work);
                 });
}

void Hierarchy::run_exchange_parts(at::Tensor part, const Holdings& holdings, const AllreduceOptions& options,
                                   Work& work) {
  const auto& slots = workers_->slots();
  const size_t me_site = slots[workers_->self()].site;
  const int me_rank = slots[workers_->self()].rank;
  const size_t num_sites = holdings.size();
  const PartsPlan plan = plan_parts(holdings, me_site, me_rank);
  const int64_t n = plan.n;
  const auto& segments = plan.segments;
  const size_t nseg = segments.size();
  auto segment_of = [&](const at::Tensor& t, size_t k) {
    return t.narrow(0, segments[k].offset, segments[k].end - segments[k].start);
  };
  const bool coded = options.codec != nullptr;

  // Each segment encoded once; this site's own contribution is decoded from the same bytes.
  std::vector<std::vector<uint8_t>> encoded(nseg);
  for (size_t k = 0; k < nseg; ++k) {
    at::Tensor x = segment_of(part, k);
    if (coded) {
      const auto start = Clock::now();
      encoded[k] = options.codec->encode(x, codec_state_[{options.tag, static_cast<size_t>(segments[k].start)}]);
      MutexLock lock(stats_mu_);
      encode_seconds_ += std::chrono::duration<double>(Clock::now() - start).count();
      codec_bytes_out_ += encoded[k].size();
    } else {
      const auto* p = reinterpret_cast<const uint8_t*>(x.data_ptr<float>());
      encoded[k].assign(p, p + x.numel() * static_cast<int64_t>(sizeof(float)));
      MutexLock lock(stats_mu_);
      codec_bytes_out_ += encoded[k].size();
    }
  }
  {
    MutexLock lock(stats_mu_);
    codec_bytes_in_ += static_cast<uint64_t>(plan.numel) * sizeof(float);
  }
  // To each worker of another site: the header, then the segments it holds too.
  std::vector<std::vector<uint8_t>> to(slots.size());
  for (size_t j = 0; j < slots.size(); ++j) {
    if (slots[j].site == me_site) continue;
    wire::ByteWriter w;
    w.put_u64(static_cast<uint64_t>(n));
    w.put_f64(options.weight);
    w.put_u32(static_cast<uint32_t>(options.site_info.size()));
    for (double v : options.site_info) w.put_f64(v);
    w.put_u8(coded ? 1 : 0);
    const std::vector<size_t>& shared = plan.held[slots[j].site][static_cast<size_t>(slots[j].rank)];
    w.put_u32(static_cast<uint32_t>(shared.size()));
    for (size_t k : shared) {
      w.put_u64(static_cast<uint64_t>(segments[k].start));
      w.put_u64(encoded[k].size());
      w.put_bytes(encoded[k]);
    }
    to[j] = w.take();
  }
  auto from = workers_->exchange(std::move(to));

  // Every site's contribution to this part, decoded, and its weight.
  std::vector<at::Tensor> contribution(num_sites);
  std::vector<double> weight(num_sites, -1);
  std::vector<std::vector<double>> info(num_sites);
  auto decode_into = [&](at::Tensor target, std::span<const uint8_t> bytes, const std::string& who) {
    if (coded) {
      const auto start = Clock::now();
      target.copy_(options.codec->decode(bytes, target.numel()).reshape({-1}));
      MutexLock lock(stats_mu_);
      decode_seconds_ += std::chrono::duration<double>(Clock::now() - start).count();
    } else {
      if (bytes.size() != static_cast<size_t>(target.numel()) * sizeof(float))
        throw Error(str_cat("exchange: ", who, " sent ", bytes.size(), " bytes for ", target.numel(), " floats"));
      if (target.numel()) std::memcpy(target.data_ptr<float>(), bytes.data(), bytes.size());
    }
  };
  contribution[me_site] = at::empty({plan.numel}, at::kFloat);
  for (size_t k = 0; k < nseg; ++k) decode_into(segment_of(contribution[me_site], k), encoded[k], "this worker");
  encoded.clear();
  weight[me_site] = options.weight;
  info[me_site] = options.site_info;
  for (size_t j = 0; j < slots.size(); ++j) {
    if (slots[j].site == me_site) continue;
    const size_t t = slots[j].site;
    const std::string& who = slots[j].name;
    wire::ByteReader r(from[j], "exchange payload from worker " + who);
    if (r.u64() != static_cast<uint64_t>(n))
      throw Error(str_cat("exchange: worker ", who, " exchanges a vector of another size: the sites' models differ"));
    const double w = r.f64();
    if (weight[t] >= 0 && w != weight[t])
      throw Error(str_cat("exchange: worker ", who, " sent weight ", w, ", another worker of its site ", weight[t]));
    weight[t] = w;
    const uint32_t ninfo = r.u32();
    if (ninfo > 1024) throw Error(str_cat("exchange: worker ", who, " sent ", ninfo, " site_info values (at most 1024)"));
    std::vector<double> site_info;
    for (uint32_t i = 0; i < ninfo; ++i) site_info.push_back(r.f64());
    if (slots[j].rank == 0) info[t] = std::move(site_info);
    if ((r.u8() != 0) != coded)
      throw Error(str_cat("exchange: worker ", who, " sent ", coded ? "raw floats" : "encoded values",
                          ": the sites' [strategy] codec settings differ"));
    if (!contribution[t].defined()) contribution[t] = at::empty({plan.numel}, at::kFloat);
    const uint32_t count = r.u32();
    const std::vector<size_t>& expected = plan.held[t][static_cast<size_t>(slots[j].rank)];
    if (count != expected.size())
      throw Error(str_cat("exchange: worker ", who, " sent ", count, " segments, ", expected.size(),
                          " expected: the sites divide the vector differently (different worker counts or layouts",
                          " in their configs?)"));
    for (size_t k : expected) {
      if (r.u64() != static_cast<uint64_t>(segments[k].start))
        throw Error(str_cat("exchange: worker ", who, " sent a segment other than the one at ", segments[k].start));
      decode_into(segment_of(contribution[t], k), r.bytes(static_cast<size_t>(r.u64())), who);
    }
    r.expect_done();
    std::vector<uint8_t>().swap(from[j]);
  }
  combine_parts(part, std::move(contribution), weight, options, *comm_group_, work.rejected_);
  if (me_rank == 0) work.site_info_ = std::move(info);
}

void Hierarchy::broadcast_from_first(at::Tensor& t) {
  check_bucket_tensor(t, "broadcast");
  // Only the source sends its values (all_gather_bytes: the other sites' gateways send a length
  // each); every other worker receives them and copies them in. The mesh lives on local rank 0
  // only; elastic: the source is the first site still (or, joining, so far) in it.
  const bool source = mesh_ && mesh_->site_index() == mesh_->first_live();
  std::vector<uint8_t> mine;
  if (source) {
    const at::Tensor c = t.to(at::kCPU).contiguous();
    const auto* p = static_cast<const uint8_t*>(c.data_ptr());
    mine.assign(p, p + c.numel() * static_cast<int64_t>(sizeof(float)));
  }
  auto all = all_gather_bytes(std::move(mine));
  const auto it = std::find_if(all.begin(), all.end(), [](const auto& b) { return !b.empty(); });
  if (t.numel() == 0) return;
  if (it == all.end()) throw PeerLost("first site", str_cat("site ", site_.site(), ": broadcast: no site sent the values"));
  if (it->size() != static_cast<size_t>(t.numel()) * sizeof(float))
    throw Error(str_cat("site ", site_.site(), ": broadcast of ", t.numel(), " floats, the first site sent ", it->size(),
                        " bytes: the sites' models differ"));
  if (source) return;
  at::Tensor got = at::empty({t.numel()}, at::kFloat);
  std::memcpy(got.data_ptr<float>(), it->data(), it->size());
  t.view({-1}).copy_(got);
}

std::vector<std::vector<uint8_t>> Hierarchy::all_gather_bytes(std::vector<uint8_t> mine) {
  std::vector<std::vector<uint8_t>> out;
  enqueue(str_cat("site ", site_.site(), ": all-gather of ", mine.size(), " bytes"), [&](Work&) {
    // Inside the site: every rank's byte count, then the bytes, to rank 0.
    const auto ranks = static_cast<size_t>(site_.size());
    at::Tensor counts = at::zeros({static_cast<int64_t>(ranks)}, at::kLong);
    counts.data_ptr<int64_t>()[site_.rank()] = static_cast<int64_t>(mine.size());
    site_.allreduce_sum(counts);
    std::vector<int64_t> count(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + ranks);
    int64_t total = 0;
    for (int64_t c : count) total += c;
    at::Tensor part = mine.empty() ? at::empty({0}, at::kByte)
                                   : at::from_blob(mine.data(), {static_cast<int64_t>(mine.size())}, at::kByte);
    at::Tensor site_bytes = site_.rank() == 0 ? at::empty({total}, at::kByte) : at::empty({0}, at::kByte);
    site_.gather_parts_to_root(part, site_bytes, count);

    // Between the gateways: each site's workers' bytes, framed; then the job's bytes inside the site.
    at::Tensor job;
    if (mesh_) {
      wire::ByteWriter w;
      w.put_u32(static_cast<uint32_t>(ranks));
      const uint8_t* p = site_bytes.data_ptr<uint8_t>();
      for (int64_t c : count) {
        w.put_u64(static_cast<uint64_t>(c));
        w.put_bytes({p, static_cast<size_t>(c)});
        p += c;
      }
      // Written straight into the tensor rank 0 broadcasts: each site's length, then its bytes.
      auto sites = mesh_->all_gather(w.take());  // a lost site (elastic) gives nothing
      size_t total = 0;
      for (const auto& site : sites) total += sizeof(uint64_t) + site.size();
      job = at::empty({static_cast<int64_t>(total)}, at::kByte);
      uint8_t* out = job.data_ptr<uint8_t>();
      for (auto& site : sites) {
        wire::ByteWriter length;
        length.put_u64(site.size());
        const std::vector<uint8_t> header = length.take();
        out = std::copy(header.begin(), header.end(), out);
        out = std::copy(site.begin(), site.end(), out);
        std::vector<uint8_t>().swap(site);
      }
    }
    at::Tensor size = at::full({1}, job.defined() ? job.numel() : 0, at::kLong);
    site_.broadcast_from_root(size);
    if (!job.defined()) job = at::empty({size.item<int64_t>()}, at::kByte);
    site_.broadcast_from_root(job);

    wire::ByteReader sites({job.data_ptr<uint8_t>(), static_cast<size_t>(job.numel())}, "the job's all-gathered bytes");
    while (!sites.done()) {
      const uint64_t n = sites.u64();
      if (n == 0) continue;
      wire::ByteReader site(sites.bytes(n), "a site's all-gathered bytes");
      for (uint32_t r = site.u32(); r > 0; --r) {
        auto b = site.bytes(site.u64());
        out.emplace_back(b.begin(), b.end());
      }
      site.expect_done();
    }
  })->wait(Deadline::never());
  return out;
}

CommStats Hierarchy::stats() const {
  CommStats s;
  if (mesh_) {  // the mesh has its own lock
    const transport::LinkStats t = mesh_->totals();
    s.wan_bytes_sent = t.bytes_sent;
    s.wan_bytes_received = t.bytes_received;
    s.wan_wire_bytes_sent = t.wire_bytes_sent;
    s.wan_wire_bytes_received = t.wire_bytes_received;
    s.links = mesh_->estimates();
  }
  if (workers_) {  // a superset of the gateway mesh's links on rank 0
    const transport::LinkStats t = workers_->totals();
    s.wan_bytes_sent = t.bytes_sent;
    s.wan_bytes_received = t.bytes_received;
    s.wan_wire_bytes_sent = t.wire_bytes_sent;
    s.wan_wire_bytes_received = t.wire_bytes_received;
  }
  MutexLock lock(stats_mu_);
  s.allreduces = allreduces_;
  if (mesh_ || workers_) {
    s.codec_bytes_in = codec_bytes_in_;
    s.codec_bytes_out = codec_bytes_out_;
    s.encode_seconds = encode_seconds_;
    s.decode_seconds = decode_seconds_;
  }
  return s;
}

std::vector<double> sum_counters(Hierarchy& comm, const std::vector<double>& values) {
  constexpr double kSplit = 1 << 20;
  at::Tensor t = at::empty({static_cast<int64_t>(2 * values.size())}, at::kFloat);
  for (size_t i = 0; i < values.size(); ++i) {
    const double hi = std::floor(values[i] / kSplit);
    t[static_cast<int64_t>(2 * i)] = static_cast<float>(hi);
    t[static_cast<int64_t>(2 * i + 1)] = static_cast<float>(values[i] - hi * kSplit);
  }
  comm.allreduce(t, {ReduceOp::kSum, 1.0});
  std::vector<double> out(values.size());
  for (size_t i = 0; i < values.size(); ++i)
    out[i] = static_cast<double>(t[static_cast<int64_t>(2 * i)].item<float>()) * kSplit +
             static_cast<double>(t[static_cast<int64_t>(2 * i + 1)].item<float>());
  return out;
}

}  // namespace nebula::collective
