// A teacher's output distribution per token, cut to its k most probable entries, and the
// compact byte format it crosses the WAN in (cross-site knowledge distillation: a teacher on
// one site answers a student on another; see teacher_service.h).
//
// Sending full logits costs 4·V bytes per token (128 kB for V = 32000). The top k entries
// carry almost all of a trained model's mass, and 8-bit probabilities are as precise as the
// KD loss needs, so a token costs k·(w+1) + 1 bytes (w = 2 for V <= 65536, else 4):
// 25 bytes for k = 8, V <= 65536, i.e. 160x (V = 1000) to 5120x (V = 32000) less than logits.
//
// Format (little-endian; version 1):
//    0  version  u8   kTopKVersion
//    1  tokens   u32  N, the rows
//    5  k        u32  entries per row, 1 <= k <= vocab
//    9  vocab    u32  V, 1 <= V; every index is < V
//   13  indices  N·k  u16 if V <= 65536, else u32; row-major; distinct within a row
//       p0       N    u16: each row's largest probability, code c0 in [1, 65535], p̂0 = c0 / 65535
//       codes    N·(k-1) u8: the row's other entries, c_i in [0, c_{i-1}] (non-increasing,
//                     c_1 <= 255), p̂_i = p̂0 · c_i / 255
// so topk_bytes(N, k, V) = 13 + N·(k·w + 2 + (k−1)).
//
// Quantisation: c0 = clamp(round(p0 · 65535), 1, 65535), then c_i = min(255, round(p_i / p̂0 ·
// 255)): probabilities are scaled to the row's own maximum, so an uncertain teacher (flat
// rows, small p0) keeps its relative precision. Error bound, for every entry of a row:
//     |p̂_i − p_i| <= max(p̂0 / 510, 1 / 65535)   (<= 1/510 always, since p̂0 <= 1)
// The order is kept (p̂ non-increasing along the row); entries round to 0 below p̂0/510.
//
// Decoding validates like wire input: every failure is a nebula::FrameError, kTruncated when
// the bytes end before the header's counts say, kBadPayload for anything else (unknown
// version, k = 0 or k > vocab, vocab = 0, N·k overflowing, trailing bytes, an index >= vocab
// or repeated in its row, p0 code 0, codes not non-increasing); messages start with `what`
// and name the field, the row and the value. Nothing is allocated before the byte count has
// been checked against the header.
//
// Pure functions; thread-safe.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace nebula::distill {

inline constexpr uint8_t kTopKVersion = 1;
inline constexpr size_t kTopKHeaderBytes = 13;

struct TopK {
  at::Tensor index;  // [N, k] int64, each in [0, vocab), distinct within a row
  at::Tensor prob;   // [N, k] float32: teacher softmax(logits / T) of those entries, descending
  int64_t vocab = 0;
};

// The k most probable entries of every row of softmax(logits / temperature), sorted by
// descending probability (ties: either order). logits: [N, V] floating point on any device
// (computed in float32; the result is on the same device). Preconditions (nebula::Error):
// 2-d, 1 <= k <= V, temperature > 0 and finite.
TopK top_k(const at::Tensor& logits, int64_t k, double temperature);

// The format above. Preconditions (nebula::Error): index and prob [N, k] with k >= 1,
// N, k, vocab fitting in u32, indices in [0, vocab), prob finite in [0, 1] (slightly above 1
// from float rounding is clamped) and non-increasing along each row. Tensors may live on
// any device (copied to the CPU).
std::vector<uint8_t> encode_topk(const TopK& topk);

// Inverse of encode_topk, validating (see above). The result lives on the CPU.
TopK decode_topk(std::span<const uint8_t> bytes, const std::string& what);

// The exact size encode_topk produces for `tokens` rows. Preconditions as for encode_topk.
size_t topk_bytes(int64_t tokens, int64_t k, int64_t vocab);

// Bytes per index: 2 when vocab <= 65536, else 4.
inline int topk_index_width(int64_t vocab) { return vocab <= 65536 ? 2 : 4; }

}  // namespace nebula::distill
