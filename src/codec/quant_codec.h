// int8 / int4 block-wise affine quantization (see codec.h for the format and bounds).
#pragma once

#include "codec/codec.h"

namespace nebula::codec {

// Per block of options.block values: min and scale = (max - min) / (2^bits - 1) as
// float32, then one code per value, round to nearest (ties up) or, with
// options.stochastic, floor(v + u) with u ~ U[0, 1) drawn from a counter-based generator
// keyed by (options.seed, state.rng_counter) and the element index, so a run is
// reproducible and independent of threading. Encode and decode are plain loops over
// float* that the compiler vectorises; blocks are spread over ATen's intra-op threads.
class BlockQuantCodec final : public Codec {
 public:
  // Precondition: bits is 8 or 4; options validated by make_codec.
  BlockQuantCodec(int bits, const CodecOptions& options);
  CodecId id() const override { return bits_ == 8 ? CodecId::kInt8 : CodecId::kInt4; }
  std::string name() const override { return codec_name(id()); }
  std::vector<uint8_t> encode(const at::Tensor& t, CodecState& state) const override;
  at::Tensor decode(std::span<const uint8_t> payload, int64_t expected_numel = -1) const override;
  at::Tensor error_bound(const at::Tensor& t) const override;

 private:
  int bits_;
  CodecOptions options_;
};

}  // namespace nebula::codec
