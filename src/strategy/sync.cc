#include <ATen/ATen.h>

#include "nebula/error.h"
#include "strategy/strategy.h"

namespace nebula::strategy {

at::Tensor flatten(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> views;
  for (const auto& t : tensors) views.push_back(t.reshape({-1}).to(at::kFloat));
  if (views.empty()) return at::empty({0}, at::kFloat);
  return at::cat(views);
}

void unflatten_into(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) {
  int64_t offset = 0;
  for (const auto& t : tensors) {
    const int64_t n = t.numel();
    t.copy_(flat.narrow(0, offset, n).view(t.sizes()));
    offset += n;
  }
  NEBULA_CHECK(offset == flat.numel(), "flat buffer has ", flat.numel(), " elements, tensors ", offset);
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

SyncStrategy::SyncStrategy(collective::Hierarchy& comm, std::unique_ptr<codec::Codec> codec, uint64_t bucket_bytes)
    : comm_(comm), codec_(std::move(codec)), bucket_bytes_(bucket_bytes) {}

void SyncStrategy::init(const std::vector<at::Tensor>& params) {
  at::NoGradGuard no_grad;
  at::Tensor flat = flatten(params);
  comm_.broadcast_from_first(flat);
  unflatten_into(flat, params);
}

void SyncStrategy::sync_gradients(const std::vector<at::Tensor>& params, double weight) {
  std::vector<at::Tensor> grads;
  for (const auto& p : params) {
    // A parameter that got no gradient this step still takes part (as zeros) so that every
    // worker's flat buffer has the same layout.
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    grads.push_back(p.grad());
  }
  // One exchange per bucket. PowerSGD compresses matrices, so it encodes each gradient of a
  // bucket in its own shape; the other codecs encode the bucket as one vector.
  const bool per_tensor = codec_ && codec_->id() == codec::CodecId::kPowerSgd;
  const auto buckets = make_buckets(grads, bucket_bytes_);
  for (size_t b = 0; b < buckets.size(); ++b) {
    std::vector<at::Tensor> bucket(grads.begin() + static_cast<std::ptrdiff_t>(buckets[b].first),
                                   grads.begin() + static_cast<std::ptrdiff_t>(buckets[b].second));
    comm_.allreduce(bucket, {collective::ReduceOp::kWeightedMean, weight, codec_.get(), b, per_tensor});
  }
}

std::unique_ptr<codec::Codec> make_wan_codec(const StrategyConfig& config) {
  if (config.codec == "none") return nullptr;  // exact float32, no codec header
  codec::CodecOptions o;
  o.kind = config.codec;
  o.block = config.codec_block;
  o.stochastic = config.codec_stochastic;
  o.density = config.codec_density;
  o.rank = config.codec_rank;
  o.error_feedback = config.codec_error_feedback;
  return codec::make_codec(o);
}

std::unique_ptr<Strategy> make_strategy(const StrategyConfig& config, collective::Hierarchy& comm) {
  if (config.kind == "sync") return std::make_unique<SyncStrategy>(comm, make_wan_codec(config), config.bucket_bytes);
  throw ConfigError(str_cat("strategy.kind = \"", config.kind, "\" is not implemented (available: sync)"));
}

}  // namespace nebula::strategy
