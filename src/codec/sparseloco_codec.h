// SparseLoCo-style chunked top-k with 2-bit or 1-bit values (Sarfi et al., arXiv 2508.15706; see
// codec.h for the format and bounds).
#pragma once

#include "codec/codec.h"

namespace nebula::codec {

// The largest chunk: in-chunk indices must fit in 16 bits.
inline constexpr int64_t kMaxSparseLocoChunk = 65536;

// The number of values sparseloco keeps in a chunk of `len` values:
// max(1, round(density * len)), at most len (0 for an empty chunk).
int64_t sparseloco_count(int64_t len, double density);

// The flattened tensor is cut into chunks of options.block values (the last may be
// shorter); each chunk keeps its k = sparseloco_count values of largest magnitude (ties go
// to lower indices), sent as ceil(log2(chunk))-bit in-chunk indices and 2-bit codes: a
// sign bit and a bit choosing one of the chunk's two magnitude levels. The levels are the
// optimal two-level quantiser of the kept magnitudes (sorted, cut where the squared error
// is least, each side sent as its mean), so the error that error feedback must carry is as
// small as two levels allow. With options.value_bits = 1 a code is the sign alone and the
// chunk has one level, the mean of its kept magnitudes (4 bytes a chunk, not 8). With error feedback (the default, which SparseLoCo relies on:
// it replaces the outer momentum) everything not sent stays in state.residual. Selection
// needs no sort of the chunk: the maxima of runs of 16 values bound which values can be in
// the top k, so a bisection over them and an nth_element over the few values left find it
// (encode + decode ~2x topk's speed at 1M floats, one core; bench/codec_bench.cc). Scratch
// buffers are allocated once per parallel task, not per chunk; chunks are spread over
// ATen's intra-op threads in groups of 8, whose bit streams start on byte boundaries, so
// the payload does not depend on the thread count.
class SparseLocoCodec final : public Codec {
 public:
  // Precondition: options validated by make_codec (block in [2, 65536], density in (0, 1]).
  explicit SparseLocoCodec(const CodecOptions& options);
  CodecId id() const override { return CodecId::kSparseLoco; }
  std::string name() const override { return codec_name(id()); }
  std::vector<uint8_t> encode(const at::Tensor& t, CodecState& state) const override;
  at::Tensor decode(std::span<const uint8_t> payload, int64_t expected_numel = -1) const override;
  at::Tensor error_bound(const at::Tensor& t) const override;

 private:
  CodecOptions options_;
};

}  // namespace nebula::codec
