// What every strategy shares (strategy.h): flat views of tensors, equal replicas, the codec
// states in checkpoints, and make_strategy.
#include "strategy/strategy.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard: ATen.h no longer brings it in LibTorch 2.x

#include <cstdio>

#include "nebula/error.h"
#include "strategy/diloco.h"
#include "strategy/sync.h"
#include "wire/frame.h"

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

bool replicas_agree(collective::Hierarchy& comm, uint32_t crc, bool counts) {
  // Rank 0's CRC as four bytes (float32 holds them exactly), then how many workers differ.
  at::Tensor digits = at::empty({4}, at::kFloat);
  for (int i = 0; i < 4; ++i) digits[i] = static_cast<float>((crc >> (8 * i)) & 0xFF);
  comm.broadcast_from_first(digits);
  uint32_t first = 0;
  for (int i = 0; i < 4; ++i) first |= static_cast<uint32_t>(digits[i].item<float>()) << (8 * i);
  at::Tensor differ = at::full({1}, counts && first != crc ? 1.0f : 0.0f, at::kFloat);
  comm.allreduce(differ, {collective::ReduceOp::kSum, 1.0});
  return differ.item<float>() == 0;
}

void make_replicas_equal(collective::Hierarchy& comm, const std::vector<at::Tensor>& params) {
  at::NoGradGuard no_grad;
  // The CRC of the flat vector, tensor by tensor: no copy of the whole model unless they differ.
  uint32_t crc = 0;
  for (const auto& p : params) {
    const at::Tensor c = p.reshape({-1}).to(at::kCPU, at::kFloat).contiguous();  // CPU float32: the tensor itself
    crc = wire::crc32(crc, {static_cast<const uint8_t*>(c.data_ptr()), static_cast<size_t>(c.numel()) * sizeof(float)});
  }
  if (replicas_agree(comm, crc)) return;
  at::Tensor flat = flatten(params);
  comm.broadcast_from_first(flat);
  unflatten_into(flat, params);
}

codec::CodecOptions wan_codec_options(const StrategyConfig& config) {
  codec::CodecOptions o;
  o.kind = config.codec;
  o.block = config.codec_block;
  o.stochastic = config.codec_stochastic;
  o.density = config.codec_density;
  o.rank = config.codec_rank;
  o.error_feedback = config.codec_error_feedback;
  o.error_decay = config.codec_error_decay;
  o.indices = config.codec_indices;
  o.value_bits = static_cast<int>(config.codec_value_bits);
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
