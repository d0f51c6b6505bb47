// The library API (include/nebula/session.h) over the same parts `nebula worker` uses:
// connect_site() for the communication, make_strategy() for the strategy.
#include "nebula/session.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <span>

#include "codec/codec.h"
#include "nebula/error.h"
#include "strategy/strategy.h"
#include "site/site_comm.h"
#include "util/allocator.h"
#include "wire/frame.h"

namespace nebula {

void set_cpu_threads(int threads) {
  at::set_num_threads(threads);
  using SetThreads = void (*)(int);
  if (auto f = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) f(threads);
}

struct Session::Impl {
  Config config;
  site::WorkerIdentity who;
  site::SiteComm comm;
  int global_rank = 0;
  std::optional<std::unique_ptr<codec::Codec>> wan_codec;  // allreduce_encoded's, made on first use (null: exact)
};

// `site_index(site)` is a ConfigError naming the sites when there is no such site.
Session::Session(const Config& config, const std::string& site, int local_rank)
    : Session(config, Placement{config.site_index(site), local_rank, "", false, "library"}) {}

Session::Session(const Config& config, const Placement& p) : impl_(std::make_unique<Impl>()) {
  impl_->config = config;
  if (p.site >= config.sites.size())
    throw ConfigError(str_cat(config.source_path, ": site index ", p.site, " does not exist (", config.sites.size(),
                              " sites)"));
  const SiteConfig& site = config.sites[p.site];
  if (p.rank < 0 || p.rank >= site.workers)
    throw ConfigError(str_cat(config.source_path, ": site '", site.name, "' has workers = ", site.workers, "; rank ",
                              p.rank, " does not exist (ranks are 0 to ", site.workers - 1, ")"));
  // [parallel] pipeline and tensor cut nebula's built-in models (`nebula run`); a session trains
  // the caller's own model, which nebula does not cut: refused, not ignored.
  if (config.pipeline_of(site) > 1 || config.tensor_of(site) > 1)
    throw ConfigError(str_cat(config.source_path, ": parallel.pipeline = ", config.pipeline_of(site),
                              " and parallel.tensor = ", config.tensor_of(site), " (site '", site.name,
                              "') cut nebula's built-in models, which `nebula run` trains; a library session (the "
                              "\"nebula\" process group, nebula.DiLoCo) trains your own model and does not cut it: "
                              "set both to 1"));
  // As in the nebula binary: large buffers reused, not mapped afresh per step (a Python job's
  // all-reduce spent ~4 % of its time in page faults without it).
  tune_allocator();
  impl_->who = {p.site, p.rank, p.store, p.external_store};
  impl_->global_rank = static_cast<int>(site::job_index(config, impl_->who));
  impl_->comm = site::connect_site(impl_->config, impl_->who);
}

Session::~Session() = default;

const Config& Session::config() const { return impl_->config; }
const std::string& Session::site() const { return impl_->config.sites[impl_->who.site].name; }
size_t Session::site_index() const { return impl_->who.site; }
int Session::local_rank() const { return impl_->who.local_rank; }
int Session::site_workers() const { return static_cast<int>(impl_->config.sites[impl_->who.site].workers); }
int Session::global_rank() const { return impl_->global_rank; }
int Session::world_size() const { return static_cast<int>(impl_->config.total_workers()); }

namespace {

// A float32 all-reduce over the job. A job of one site needs no WAN leg: c10d's all-reduce over
// the site is the job's.
void float_allreduce(site::SiteComm& comm, at::Tensor& t, const collective::AllreduceOptions& o) {
  if (comm.training_names.size() == 1 && t.device().is_cpu() && o.codec == nullptr)
    comm.comm->site_allreduce(t, o);
  else
    comm.comm->allreduce(t, o);
}

}  // namespace

void Session::allreduce(at::Tensor& t, double weight) {
  float_allreduce(impl_->comm, t, {collective::ReduceOp::kWeightedMean, weight});
}
void Session::allreduce_sum(at::Tensor& t) {
  if (t.scalar_type() == at::kFloat) {
    float_allreduce(impl_->comm, t, {collective::ReduceOp::kSum, 1.0});
    return;
  }
  std::vector<at::Tensor> all = allgather(t);
  at::Tensor sum = at::zeros_like(t);
  for (const auto& x : all) sum.add_(x.view(t.sizes()));
  t.copy_(sum);
}
void Session::broadcast(at::Tensor& t) { impl_->comm.comm->broadcast_from_first(t); }

std::string Session::wan_codec() {
  const StrategyConfig& c = impl_->config.strategy;
  if (!impl_->wan_codec) {
    const bool quantized = c.codec == "int8" || c.codec == "int4";
    if (!(c.codec == "none" || c.codec == "fp16" || c.codec == "bf16" || (quantized && !c.codec_error_feedback)))
      throw ConfigError(str_cat(impl_->config.source_path, ": strategy.codec = \"", c.codec, "\"",
                                quantized ? " with codec_error_feedback = true" : "",
                                ": an all-reduce call cannot say which logical tensor it carries, so it cannot keep "
                                "that codec's per-tensor state; use \"fp16\", \"bf16\", or \"int8\"/\"int4\" with "
                                "strategy.codec_error_feedback = false (nebula.DiLoCo keeps per-tensor state)"));
    impl_->wan_codec = strategy::make_wan_codec(c);
  }
  return c.codec;
}

void Session::allreduce_encoded(at::Tensor& t, double weight, bool sum) {
  wan_codec();
  collective::AllreduceOptions o{sum ? collective::ReduceOp::kSum : collective::ReduceOp::kWeightedMean, weight};
  if (impl_->comm.training_names.size() > 1) {  // one site: no WAN leg to encode
    o.codec = impl_->wan_codec->get();          // null: exact
    o.tag = uint64_t{1} << 62;  // one codec state for every call (these codecs keep only a rounding counter)
  }
  float_allreduce(impl_->comm, t, o);
}

namespace {

// A tensor as bytes for Hierarchy::all_gather_bytes: dtype, shape, then its values.
std::vector<uint8_t> tensor_bytes(const at::Tensor& t) {
  NEBULA_CHECK(t.device().is_cpu() && t.is_contiguous(), "Session: exact collectives take contiguous CPU tensors, got ",
               t.toString(), " of shape ", t.sizes());
  wire::ByteWriter w;
  w.put_u8(static_cast<uint8_t>(t.scalar_type()));
  w.put_u32(static_cast<uint32_t>(t.dim()));
  for (int64_t d : t.sizes()) w.put_u64(static_cast<uint64_t>(d));
  w.put_bytes({static_cast<const uint8_t*>(t.data_ptr()), t.nbytes()});
  return w.take();
}

at::Tensor bytes_tensor(std::span<const uint8_t> bytes, const std::string& from) {
  // Checked like wire input before anything is allocated: a known dtype, a shape whose size is
  // exactly the bytes that follow.
  wire::ByteReader r(bytes, from);
  const uint8_t code = r.u8();
  NEBULA_CHECK(code < static_cast<uint8_t>(at::ScalarType::NumOptions), from, ": dtype code ", int(code));
  const auto dtype = static_cast<at::ScalarType>(code);
  const uint32_t dims = r.u32();
  NEBULA_CHECK(dims <= 64, from, ": ", dims, " dimensions");
  std::vector<int64_t> shape(dims);
  uint64_t numel = 1;
  for (auto& d : shape) {
    const uint64_t n = r.u64();
    NEBULA_CHECK(n <= r.remaining() && (n == 0 || numel <= r.remaining() / n), from, ": dimension ", n,
                 " does not fit the ", r.remaining(), " bytes sent");
    numel *= n;
    d = static_cast<int64_t>(n);
  }
  NEBULA_CHECK(numel * c10::elementSize(dtype) == r.remaining(), from, ": ", numel, " values of ", dtype, " in ",
               r.remaining(), " bytes");
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype));
  auto values = r.bytes(t.nbytes());
  std::memcpy(t.data_ptr(), values.data(), values.size());
  r.expect_done();
  return t;
}

}  // namespace

void Session::broadcast(at::Tensor& t, int root) {
  NEBULA_CHECK(root >= 0 && root < world_size(), "broadcast from rank ", root, ": the job's ranks are 0 to ",
               world_size() - 1);
  const bool source = root == global_rank();
  auto all = impl_->comm.comm->all_gather_bytes(source ? tensor_bytes(t) : std::vector<uint8_t>{});
  auto it = std::find_if(all.begin(), all.end(), [](const auto& b) { return !b.empty(); });
  if (it == all.end()) throw PeerLost(str_cat("rank ", root), str_cat("broadcast from rank ", root, ": no site delivered the root's tensor"));
  if (source) return;
  at::Tensor got = bytes_tensor(*it, str_cat("the broadcast from rank ", root));
  NEBULA_CHECK(got.scalar_type() == t.scalar_type() && got.numel() == t.numel(), "broadcast from rank ", root,
               ": the root sent ", got.toString(), " of ", got.numel(), " values; rank ", global_rank(), " has ",
               t.toString(), " of ", t.numel());
  t.copy_(got.view(t.sizes()));
}

std::vector<at::Tensor> Session::allgather(const at::Tensor& t) {
  auto all = impl_->comm.comm->all_gather_bytes(tensor_bytes(t));
  if (all.size() != static_cast<size_t>(world_size()))
    throw PeerLost("job", str_cat("all-gather: ", all.size(), " of the job's ", world_size(), " workers answered"));
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < all.size(); ++i) out.push_back(bytes_tensor(all[i], str_cat("rank ", i, "'s all-gather part")));
  return out;
}

void Session::barrier() { impl_->comm.comm->all_gather_bytes({}); }
void Session::site_barrier() { impl_->comm.group->barrier(); }
uint64_t Session::wan_bytes_sent() const { return impl_->comm.comm->stats().wan_bytes_sent; }
uint64_t Session::wan_bytes_received() const { return impl_->comm.comm->stats().wan_bytes_received; }

struct Synchronizer::Impl {
  const Config& config;
  std::vector<at::Tensor> params;
  std::unique_ptr<strategy::Strategy> strategy;
};

Synchronizer::Synchronizer(Session& session, std::vector<at::Tensor> params, std::vector<at::Tensor> buffers) {
  Session::Impl& s = *session.impl_;
  NEBULA_CHECK(!s.config.distill.enabled(), "[distill] is `nebula worker`'s (a teacher site serves a student): "
               "a library Session trains without it");
  for (const auto& p : params)
    NEBULA_CHECK(p.defined() && p.scalar_type() == at::kFloat && (p.device().is_cpu() || p.device().is_cuda()),
                 "Synchronizer: every parameter must be a float32 CPU or CUDA tensor, got ", p.toString());
  const auto timeout = std::chrono::duration_cast<std::chrono::milliseconds>(s.config.job.timeout);
  auto strategy = strategy::make_strategy(s.config.strategy, *s.comm.comm, timeout, s.comm.training_names.size(),
                                          s.comm.training_index, s.config.privacy);
  strategy->set_buffers(std::move(buffers));
  strategy->init(params);
  impl_.reset(new Impl{s.config, std::move(params), std::move(strategy)});
}

Synchronizer::~Synchronizer() = default;

bool Synchronizer::keep_training(int64_t step) const { return keep_training(step, impl_->config.job.steps); }
bool Synchronizer::keep_training(int64_t step, int64_t steps) const {
  return impl_->strategy->keep_training(step, steps);
}
void Synchronizer::before_backward(double weight) { impl_->strategy->before_backward(weight); }
void Synchronizer::sync_gradients(double weight) { impl_->strategy->sync_gradients(impl_->params, weight); }
void Synchronizer::observe_loss(double loss) { impl_->strategy->observe_loss(loss); }
bool Synchronizer::watches_quality() const { return impl_->config.strategy.max_loss_penalty > 0; }
void Synchronizer::after_step(int64_t step) { impl_->strategy->after_step(step); }
void Synchronizer::finish() { impl_->strategy->finish(); }
std::string Synchronizer::name() const { return impl_->strategy->name(); }
std::map<std::string, double> Synchronizer::metrics() const { return impl_->strategy->metrics(); }
std::vector<std::string> Synchronizer::decisions() const { return impl_->strategy->decisions(); }
bool Synchronizer::can_save() const { return impl_->strategy->can_save(); }
void Synchronizer::drain() { impl_->strategy->drain(); }

Synchronizer::State Synchronizer::state() const {
  NEBULA_CHECK(impl_->strategy->can_save(), "Synchronizer::state() while an exchange is on the WAN: call drain() "
               "first, or save when can_save()");
  strategy::StrategyState s;
  impl_->strategy->save_state(s);
  return {std::move(s.tensors), std::move(s.numbers), std::move(s.strings), std::move(s.decisions)};
}

void Synchronizer::load_state(const State& state) {
  impl_->strategy->load_state({state.tensors, state.numbers, state.strings, state.decisions});
}

}  // namespace nebula
