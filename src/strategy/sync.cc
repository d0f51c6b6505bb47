#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: ATen.h no longer brings it in LibTorch 2.x

#include <cstdio>

#include "nebula/error.h"
#include "wire/frame.h"
#include "strategy/diloco.h"
#include "strategy/strategy.h"

namespace nebula::strategy {

at::Tensor flatten(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> views;  // on the host whatever the tensors' device (GPU sites)
  for (const auto& t : tensors) views.push_back(t.reshape({-1}).to(at::kCPU, at::kFloat));
  if (views.empty()) return at::empty({0}, at::kFloat);
  return at::cat(views);
}

void unflatten_into(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) {
  int64_t offset = 0;
  for (const auto& t : tensors) {
    const int64_t n = t.numel();
    at::Tensor part = flat.narrow(0, offset, n).view(t.sizes());
    // copy_ truncates towards zero: an averaged counter of 2.9999999 must come back as 3.
    t.copy_(at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()) ? part : part.round());
    offset += n;
  }
  NEBULA_CHECK(offset == flat.numel(), "flat buffer has ", flat.numel(), " elements, tensors ", offset);
}

void save_codec_states(const collective::Hierarchy& comm, StrategyState& out) {
  for (const auto& [key, state] : comm.codec_states()) {
    const std::string name = str_cat("codec/", key.first, "/", key.second, "/");
    if (state.residual.defined()) out.tensors[name + "residual"] = state.residual;
    if (state.q.defined()) out.tensors[name + "q"] = state.q;
    out.numbers[name + "rng_counter"] = static_cast<double>(state.rng_counter);
    out.numbers[name + "steps"] = static_cast<double>(state.steps);
  }
}

void load_codec_states(collective::Hierarchy& comm, const StrategyState& in) {
  collective::Hierarchy::CodecStates states;
  for (const auto& [name, value] : in.numbers) {
    unsigned long long tag = 0, index = 0;
    char field[32] = {};
    if (std::sscanf(name.c_str(), "codec/%llu/%llu/%31s", &tag, &index, field) != 3) continue;
    codec::CodecState& st = states[{tag, static_cast<size_t>(index)}];
    if (std::string(field) == "rng_counter") st.rng_counter = static_cast<uint64_t>(value);
    if (std::string(field) == "steps") st.steps = static_cast<uint64_t>(value);
  }
  for (auto& [key, st] : states) {  // each state's tensors, once
    const std::string prefix = str_cat("codec/", key.first, "/", key.second, "/");
    if (auto r = in.tensors.find(prefix + "residual"); r != in.tensors.end()) st.residual = r->second.clone();
    if (auto q = in.tensors.find(prefix + "q"); q != in.tensors.end()) st.q = q->second.clone();
  }
  if (comm.is_gateway() || comm.every_worker()) comm.set_codec_states(std::move(states));
}

void make_replicas_equal(collective::Hierarchy& comm, const std::vector<at::Tensor>& params) {
  at::NoGradGuard no_grad;
  // The CRC of the flat vector, tensor by tensor: no copy of the whole model unless they differ.
  uint32_t crc = 0;
  for (const auto& p : params) {
    const at::Tensor c = p.reshape({-1}).to(at::kCPU, at::kFloat).contiguous();  // CPU float32: the tensor itself
    crc = wire::crc32(crc, {static_cast<const uint8_t*>(c.data_ptr()), static_cast<size_t>(c.numel()) * sizeof(float)});
  }
  // Rank 0's CRC as four bytes (float32 holds them exactly), then how many workers differ.
  at::Tensor digits = at::empty({4}, at::kFloat);
  for (int i = 0; i < 4; ++i) digits[i] = static_cast<float>((crc >> (8 * i)) & 0xFF);
  comm.broadcast_from_first(digits);
  uint32_t first = 0;
  for (int i = 0; i < 4; ++i) first |= static_cast<uint32_t>(digits[i].item<float>()) << (8 * i);
  at::Tensor differ = at::full({1}, first == crc ? 0.0f : 1.0f, at::kFloat);
  comm.allreduce(differ, {collective::ReduceOp::kSum, 1.0});
  if (differ.item<float>() == 0) return;
  at::Tensor flat = flatten(params);
  comm.broadcast_from_first(flat);
  unflatten_into(flat, params);
}

std::vector<std::pair<size_t, size_t>> make_buckets(const std::vector<at::Tensor>& tensors, uint64_t bucket_bytes) {
  std::vector<std::pair<size_t, size_t>> buckets;
  size_t begin = 0;
  uint64_t bytes = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t b = static_cast<uint64_t>(tensors[i].numel()) * sizeof(float);
    if (i > begin && bytes + b > bucket_bytes) {
      buckets.emplace_back(begin, i);
      begin = i;
      bytes = 0;
    }
    bytes += b;
  }
  if (begin < tensors.size()) buckets.emplace_back(begin, tensors.size());
  return buckets;
}

SyncStrategy::SyncStrategy(collective::Hierarchy& comm, std::unique_ptr<codec::Codec> codec, uint64_t bucket_bytes,
                           std::chrono::milliseconds timeout)
    : comm_(comm), codec_(std::move(codec)), bucket_bytes_(bucket_bytes), timeout_(timeout) {}

void SyncStrategy::init(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> state = params;
  state.insert(state.end(), buffers_.begin(), buffers_.end());
  make_replicas_equal(comm_, state);

  // Backward produces gradients roughly in reverse order of the parameters, so buckets are
  // cut from the back: the first bucket to fill is the first to go.
  params_ = params;
  std::vector<at::Tensor> reversed(params.rbegin(), params.rend());
  buckets_.clear();
  for (auto [b, e] : make_buckets(reversed, bucket_bytes_)) buckets_.emplace_back(b, e);
  bucket_of_.assign(params.size(), 0);
  for (size_t k = 0; k < buckets_.size(); ++k)
    for (size_t r = buckets_[k].first; r < buckets_[k].second; ++r) bucket_of_[params.size() - 1 - r] = k;
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].requires_grad())
      params[i].register_hook([this, i](const at::Tensor& grad) { on_gradient(i, grad); });
}

void SyncStrategy::before_backward(double weight) {
  NEBULA_CHECK(works_.empty(), "before_backward called twice without sync_gradients");
  armed_ = true;
  weight_ = weight;
  grads_.assign(params_.size(), at::Tensor());
  missing_.assign(buckets_.size(), 0);
  for (size_t k = 0; k < buckets_.size(); ++k) missing_[k] = buckets_[k].second - buckets_[k].first;
  next_bucket_ = 0;
  sent_.assign(buckets_.size(), {});
  if (!buffers_.empty()) {  // forward has updated them: average this step's values
    at::NoGradGuard no_grad;
    buffer_values_ = flatten(buffers_);
    collective::AllreduceOptions o;
    o.weight = weight;
    buffer_work_ = comm_.allreduce_async({buffer_values_}, std::move(o));
  }
}

void SyncStrategy::on_gradient(size_t index, const at::Tensor& grad) {
  if (!armed_ || grads_[index].defined()) return;
  grads_[index] = grad.detach().to(at::kFloat).contiguous().clone();
  if (--missing_[bucket_of_[index]] == 0) launch_ready_buckets();
}

void SyncStrategy::launch_ready_buckets() {
  // Strictly in bucket order, the same on every worker, whatever order the hooks fired in.
  const bool per_tensor = codec_ && codec_->id() == codec::CodecId::kPowerSgd;
  while (next_bucket_ < buckets_.size() && missing_[next_bucket_] == 0) {
    const size_t k = next_bucket_++;
    std::vector<at::Tensor> bucket;
    for (size_t r = buckets_[k].first; r < buckets_[k].second; ++r) bucket.push_back(grads_[params_.size() - 1 - r]);
    sent_[k] = bucket;
    collective::AllreduceOptions o;
    o.weight = weight_;
    o.codec = codec_.get();
    o.tag = k;
    o.per_tensor = per_tensor;
    works_.push_back(comm_.allreduce_async(std::move(bucket), std::move(o)));
  }
}

void SyncStrategy::sync_gradients(const std::vector<at::Tensor>& params, double weight) {
  NEBULA_CHECK(params.size() == params_.size(), "sync_gradients with ", params.size(), " parameters, init had ",
               params_.size());
  if (!armed_) before_backward(weight);  // called without the hook: send everything now
  // Parameters that got no gradient this step take part as zeros, so every worker sends the
  // same buckets.
  for (size_t i = 0; i < params.size(); ++i) {
    if (grads_[i].defined()) continue;
    grads_[i] = params[i].grad().defined() ? params[i].grad().detach().to(at::kFloat).contiguous().clone()
                                           : at::zeros_like(params[i], at::kFloat);
    --missing_[bucket_of_[i]];
  }
  launch_ready_buckets();
  const Deadline deadline = Deadline::after(timeout_);
  for (auto& w : works_) w->wait(deadline);
  if (buffer_work_) {
    buffer_work_->wait(deadline);
    at::NoGradGuard no_grad;
    unflatten_into(buffer_values_, buffers_);
    buffer_work_.reset();
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].grad().defined()) params[i].mutable_grad() = at::zeros_like(params[i]);
    params[i].mutable_grad().copy_(grads_[i]);
  }
  works_.clear();
  armed_ = false;
}

codec::CodecOptions wan_codec_options(const StrategyConfig& config) {
  codec::CodecOptions o;
  o.kind = config.codec;
  o.block = config.codec_block;
  o.stochastic = config.codec_stochastic;
  o.density = config.codec_density;
  o.rank = config.codec_rank;
  o.error_feedback = config.codec_error_feedback;
  return o;
}

std::unique_ptr<codec::Codec> make_wan_codec(const StrategyConfig& config, const std::string& kind) {
  codec::CodecOptions o = wan_codec_options(config);
  if (!kind.empty()) o.kind = kind;
  if (o.kind == "none") return nullptr;  // exact float32, no codec header
  NEBULA_CHECK(o.kind != "auto", "strategy.codec = \"auto\" is the controller's to resolve");
  return codec::make_codec(o);
}

std::unique_ptr<Strategy> make_strategy(const StrategyConfig& config, collective::Hierarchy& comm,
                                        std::chrono::milliseconds timeout, size_t num_sites, size_t site_index,
                                        const PrivacyConfig& privacy) {
  if (config.kind == "sync") {
    NEBULA_CHECK(!privacy.enabled(), "[privacy] needs strategy.kind diloco or streaming");
    return std::make_unique<SyncStrategy>(comm, make_wan_codec(config), config.bucket_bytes, timeout);
  }
  if (config.kind == "diloco" || config.kind == "streaming") {
    DilocoOptions o = DilocoOptions::from(config, timeout, num_sites, site_index);
    o.dp_clip = privacy.clip;
    o.dp_noise_multiplier = privacy.noise_multiplier;
    o.dp_delta = privacy.delta;
    return std::make_unique<DilocoStrategy>(comm, o);
  }
  throw ConfigError(str_cat("strategy.kind = \"", config.kind, "\" is not one of sync, diloco, streaming"));
}

}  // namespace nebula::strategy
