// Lossy tensor codecs for the inter-site leg (DESIGN.md, "Layers": codec).
//
// A codec turns a float32 CPU tensor into a self-describing byte payload and back. Codecs
// are pure functions of (options, tensor, state): a Codec object holds only its options, so
// one object may be shared by any number of threads; everything that changes from step to
// step lives in a CodecState the caller owns, one per logical tensor (bucket). This layer
// knows nothing about links, sites or frames: the collective layer puts payloads into
// frames, and the frame's codec byte is payload_codec(payload).
//
// Payload format (all codecs; little-endian):
//    0  codec    u8   CodecId
//    1  version  u8   kFormatVersion
//    2  dtype    u8   1 = float32 (the only dtype so far)
//    3  ndim     u8   0..kMaxNdim
//    4  dims     ndim x u64, product (numel) <= kMaxNumel
//  then the codec's parameters, then its data:
//    none       -                          numel x f32
//    fp16/bf16  -                          numel x u16 (IEEE binary16 / bfloat16 bits)
//    int8       block u32, flags u32       nblocks x f32 min, nblocks x f32 scale,
//                                          numel x u8 code
//    int4       block u32, flags u32       nblocks x f32 min, nblocks x f32 scale, then per
//                                          block ceil(len/2) bytes: code 2j in the low nibble,
//                                          2j+1 in the high one (an odd block's last high
//                                          nibble is 0)
//    topk       k u64                      k x u32 index (strictly increasing, < numel),
//                                          k x f32 value
//    powersgd   rank u32, reserved u32 (0) rank 0: numel x f32 (raw fallback);
//                                          else P (n x rank) then Q (m x rank), f32 row-major;
//                                          the tensor is P Q^T reshaped
//    sparseloco chunk u32, k u32,          nchunks x f32 lo, nchunks x f32 hi, then the K
//               k_last u32                 kept values' in-chunk indices, ceil(log2(chunk))
//                                          bits each (strictly increasing within a chunk,
//                                          < its length), then their K 2-bit codes (bit 0:
//                                          sign, 1 = negative; bit 1: 1 = level hi, 0 = lo);
//                                          both bit streams in chunk order, LSB-first, each
//                                          zero-padded to a whole byte. With "rice" indices
//                                          (chunk's bits 24-31 = 1; 0 = fixed, bits 0-23 the
//                                          chunk): the levels, then the K codes, then the
//                                          indices as a Rice stream to the payload's end:
//                                          per kept value the gap g = index - previous - 1
//                                          (previous = -1 at a chunk's start) as q = g >> r
//                                          one-bits and a zero, then g's r low bits, with
//                                          r = floor(log2(len / k_c)) for a chunk of len
//                                          values keeping k_c; zero-padded, nothing after.
//                                          With 1-bit values (the chunk's bit 25): one level
//                                          per chunk (nchunks x f32) in place of lo and hi,
//                                          and 1-bit codes (the sign), else the same
//  nblocks = ceil(numel / block); int8/int4 flags: bit 0 = stochastic rounding was used
//  (informational), other bits must be 0. sparseloco: chunk in [2, 65536]; every full chunk
//  keeps k in [1, chunk] values, a partial last chunk (numel % chunk values) keeps k_last in
//  [1, its length] (k_last = 0 when chunk divides numel); nchunks = ceil(numel / chunk),
//  K = k * floor(numel / chunk) + k_last; levels are both NaN or 0 <= lo <= hi < inf. The
//  header is 4 + 8 ndim (+ 8 parameter, 12 for sparseloco) bytes, so the data starts at a
//  multiple of 4. Bulk arrays are the host's little-endian bits (codec.cc refuses to build
//  on a big-endian host).
//
// Every decoder validates a payload like wire input: each failure is a CodecError whose
// kind says which check failed (see nebula/error.h) and whose message names the codec, the
// field, the value and the limit. No decoder reads out of bounds or allocates more than the
// header's numel floats, and only after the byte length has been checked against the
// header (topk, powersgd and sparseloco expand: there numel is bounded by kMaxNumel, by
// numel <= k * kMaxTopKExpansion for topk, by 65536 values per 4 bytes of sparseloco
// levels, and by expected_numel when the caller passes one).
//
// Error bounds (for one encode of t from a fresh state, without error feedback; see
// Codec::error_bound) and non-finite input:
//   none      exact. NaN/Inf pass through unchanged.
//   fp16      round to nearest even: |err| <= 2^-11 |x| + 2^-25. |x| >= 65520 becomes +-inf
//             (no saturation), NaN stays NaN (quiet), +-inf stays +-inf.
//   bf16      round to nearest even: |err| <= 2^-8 |x| + 2^-134. NaN stays NaN, +-inf stays.
//   int8/int4 per block of `block` values, min and scale stored as float32,
//             scale = (max - min) / (2^bits - 1), code = round((x - min) / scale), decoded
//             min + code * scale: |err| <= scale / 2 (nearest, ties up) or < scale
//             (stochastic), plus float rounding (~2^-21 of the block's largest |x|). A block
//             holding any NaN or +-Inf decodes entirely to NaN (min and scale are sent as
//             NaN); blocks with values beyond +-1e38 may decode to +-inf at their edges.
//   topk      the k largest |x| are sent exactly, the rest are 0: |err_i| <= min(|x_i|, T),
//             T the k-th largest |x|. NaN and Inf rank above every finite value, so they
//             are sent (as long as there are at most k of them).
//   powersgd  low rank: the projection P P^T M of M onto an orthonormal basis P, so
//             ||err||_F <= ||M||_F (and -> the tail of M's spectrum as the warm start
//             converges); raw fallback exact. A non-finite M (or an overflow inside the
//             power iteration) is sent as all-NaN P and Q, so the whole tensor decodes to
//             NaN, and state.q is left as it was.
//   sparseloco per chunk, the k largest |x| are kept (ties to lower indices), the rest are 0:
//             |err_i| = |x_i| <= T, T the chunk's k-th largest |x|. The kept magnitudes are
//             cut, in sorted order, into a low and a high group at the cut of least squared
//             error, each sent as its mean (clamped to the group's range): a kept x_i
//             decodes to sign(x_i) * its group's level, |err_i| <= max - min of the group's
//             |x| (so <= the range of the chunk's kept |x|). NaN and Inf rank above every
//             finite value, so they are kept; a chunk holding one sends lo = hi = NaN: all
//             its kept positions decode to NaN, the rest (and non-finite values beyond k) to
//             0. Finite input always decodes finite. With 1-bit values one level per chunk,
//             the mean of all its kept magnitudes: |err_i| <= max - min of the chunk's kept |x|.
//  With error feedback, any non-finite entry of the new residual is set to 0 (the step that
//  produced it decodes to non-finite values, which the update guard rejects; the residual
//  must not poison every later step).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "nebula/error.h"

namespace nebula::codec {

enum class CodecId : uint8_t {
  kNone = 0,
  kFp16 = 1,
  kBf16 = 2,
  kInt8 = 3,
  kInt4 = 4,
  kTopK = 5,
  kPowerSgd = 6,
  kSparseLoco = 7,
};

// "none", "fp16", "bf16", "int8", "int4", "topk", "powersgd", "sparseloco" (the config's
// spelling), or "codec(N)" for a value outside the enum.
std::string codec_name(CodecId id);

inline constexpr uint8_t kFormatVersion = 1;
inline constexpr int64_t kMaxNdim = 16;
// The largest tensor a payload may describe (4 GiB of float32); bigger tensors are split
// into buckets by the caller. Also keeps every topk index within a u32.
inline constexpr int64_t kMaxNumel = int64_t{1} << 30;
// A topk payload with k values may describe at most k * kMaxTopKExpansion elements
// (density >= 2^-20, below the config's minimum of 1e-6).
inline constexpr int64_t kMaxTopKExpansion = int64_t{1} << 20;

// How to encode. Defaults match [strategy] in the config (include/nebula/config.h).
struct CodecOptions {
  std::string kind = "none";   // none | fp16 | bf16 | int8 | int4 | topk | powersgd | sparseloco
  int64_t block = 256;         // int8/int4: values per (min, scale) pair, 1..2^24;
                               // sparseloco: values per chunk, 2..65536
  bool stochastic = false;     // int8/int4: stochastic rounding (unbiased) instead of nearest
  double density = 0.01;       // topk, sparseloco (per chunk): fraction of values kept, in (0, 1]
  int64_t rank = 4;            // powersgd: rank of the approximation, 1..65536
  uint64_t seed = 1;           // stochastic rounding and PowerSGD's initial Q
  bool error_feedback = true;  // int8/int4/topk/powersgd/sparseloco; none/fp16/bf16 ignore it
  // Error feedback's decay beta, in [0, 1]: each encode first scales the residual by it, so what
  // was not sent fades (SparseLoCo's e <- beta e + delta, which stands in for outer momentum);
  // 1 keeps all of it (classic error feedback), 0 none.
  double error_decay = 1.0;
  // sparseloco: how the kept values' in-chunk indices are sent: "fixed" (ceil(log2(chunk))
  // bits each) or "rice" (the gaps between them Rice-coded: ~8 bits each at 1/64 of 4096,
  // where fixed takes 12).
  std::string indices = "fixed";
  // sparseloco: bits per kept value, 2 (its sign and which of the chunk's two magnitude levels)
  // or 1 (its sign; one level per chunk, the mean of the kept magnitudes).
  int value_bits = 2;
};

// Per-tensor state kept by the caller between steps for one logical tensor (bucket). A
// plain, copyable struct (copies share tensor storage; clone the tensors for a snapshot),
// written to checkpoints as is. A default-constructed state is a fresh start.
struct CodecState {
  at::Tensor residual;        // error feedback: what was not sent yet (t's shape, float32)
  at::Tensor q;               // powersgd: warm-start Q (m x rank, float32)
  uint64_t rng_counter = 0;   // stochastic rounding: advanced by one per stochastic encode
  uint64_t steps = 0;         // encodes so far
};

// A codec with fixed options. Immutable, so thread-safe; see the file comment for formats.
class Codec {
 public:
  virtual ~Codec();
  virtual CodecId id() const = 0;
  virtual std::string name() const = 0;

  // Encodes a float32 CPU tensor of any shape (numel 0 allowed, numel <= kMaxNumel,
  // ndim <= kMaxNdim; non-contiguous is fine) into a payload. With error feedback it
  // encodes t + state.residual and sets state.residual = (t + residual) - decode(payload)
  // (non-finite entries set to 0). A residual or q of another size than t calls for is a
  // caller bug (nebula::Error). Always increments state.steps.
  virtual std::vector<uint8_t> encode(const at::Tensor& t, CodecState& state) const = 0;

  // Decodes a payload of this codec (another codec's payload is kMismatch) into a new
  // contiguous float32 tensor of the payload's shape. expected_numel >= 0 insists on that
  // many elements (kMismatch, checked before anything is allocated). Throws CodecError.
  virtual at::Tensor decode(std::span<const uint8_t> payload, int64_t expected_numel = -1) const = 0;

  // The bound it promises for one encode of t from a fresh state with no residual: a
  // float32 tensor of t's shape, |decode(encode(t)) - t| <= bound elementwise; +inf where
  // no promise is made (non-finite input, fp16/bf16 overflow). For tests and docs.
  virtual at::Tensor error_bound(const at::Tensor& t) const = 0;
};

// Throws nebula::ConfigError naming the config key for an unknown kind or a parameter out
// of range, e.g. `strategy.codec = "int9" is not one of none, fp16, ...`. Options the
// kind does not use are not checked.
std::unique_ptr<Codec> make_codec(const CodecOptions& options);

// Reads the codec id from the payload's header and decodes with that codec.
at::Tensor decode_any(std::span<const uint8_t> payload, int64_t expected_numel = -1);

// The codec of a payload, after validating the common header (id, version, dtype, shape).
CodecId payload_codec(std::span<const uint8_t> payload);

}  // namespace nebula::codec
