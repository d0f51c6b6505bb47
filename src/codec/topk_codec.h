// top-k sparsification (see codec.h for the format and bounds).
#pragma once

#include "codec/codec.h"

namespace nebula::codec {

// The number of values topk keeps: max(1, ceil(density * numel)), at most numel (0 for an
// empty tensor), and at least numel / kMaxTopKExpansion (only matters for density < 2^-20).
int64_t topk_count(int64_t numel, double density);

// Keeps the k largest |x| (k = topk_count), sent as increasing u32 indices + float32
// values; with error feedback (the default) the rest stays in state.residual. Selection is
// a radix select on the magnitude bits (one histogram pass, a small nth_element on the
// threshold bucket, one pass collecting indices in order): the whole encode is 3x (1M
// floats) to 8x (16M) faster than at::topk on |x| alone, one core (bench/codec_bench.cc).
// Ties at the threshold go to lower indices.
class TopKCodec final : public Codec {
 public:
  explicit TopKCodec(const CodecOptions& options);
  CodecId id() const override { return CodecId::kTopK; }
  std::string name() const override { return codec_name(id()); }
  std::vector<uint8_t> encode(const at::Tensor& t, CodecState& state) const override;
  at::Tensor decode(std::span<const uint8_t> payload, int64_t expected_numel = -1) const override;
  at::Tensor error_bound(const at::Tensor& t) const override;

 private:
  CodecOptions options_;
};

}  // namespace nebula::codec
