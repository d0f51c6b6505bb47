// PowerSGD low-rank compression (Vogels et al., NeurIPS 2019; see codec.h for the format).
#pragma once

#include "codec/codec.h"

namespace nebula::codec {

// Whether a tensor of `shape` is sent as a rank-`rank` product or raw: low rank iff
// ndim >= 2, numel >= 4096 and (n + m) * rank < n * m, with n = shape[0] and
// m = numel / n (so rank < min(n, m) and the product is smaller than the tensor).
bool powersgd_low_rank(at::IntArrayRef shape, int64_t rank);

// One power iteration per encode with a warm-start Q kept in state.q (initialised from a
// normal distribution seeded by options.seed): P = M Q, P = orthonormal basis of P
// (Householder QR), Q = M^T P; sends P and Q, M ~ P Q^T; state.q = Q. Columns of Q that
// come out exactly zero are redrawn so the iteration cannot get stuck. Error feedback
// (default on) keeps M - P Q^T in state.residual.
class PowerSgdCodec final : public Codec {
 public:
  explicit PowerSgdCodec(const CodecOptions& options);
  CodecId id() const override { return CodecId::kPowerSgd; }
  std::string name() const override { return codec_name(id()); }
  std::vector<uint8_t> encode(const at::Tensor& t, CodecState& state) const override;
  at::Tensor decode(std::span<const uint8_t> payload, int64_t expected_numel = -1) const override;
  at::Tensor error_bound(const at::Tensor& t) const override;

 private:
  CodecOptions options_;
};

}  // namespace nebula::codec
