// Streaming DiLoCo's schedule (arXiv 2501.18512): what is exchanged when.
//
// What: the flat parameter vector (the trainable parameters flattened in order) is cut into F
// fragments, ranges of about n/F values each, cut between rows of the tensor a cut falls in (up
// to half a row off n/F), so that a per-tensor codec (PowerSGD) gets matrices: a row block of a
// large tensor, such as the token embedding, is a matrix of its own. A fragment is never empty
// (with fewer rows than fragments, cuts fall inside rows).
//
// When: a round is H_s inner steps; fragment j is sent at the end of slot j of the round, i.e.
// after the inner step at which in_round · F >= (j + 1) · H_s, and merged `delay` inner steps
// later; merges that are due go in the order the fragments were sent.
//
// Plain arithmetic on shapes and counters, no tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace nebula::strategy {

// A fragment's part of one parameter tensor: values [at, at + numel) of parameter `param`
// flattened, sent in `shape`: whole rows ([rows, rest of the tensor's shape...]) when the
// fragment's cut falls between rows of a tensor of 2 or more dimensions, the tensor's own shape
// when the fragment holds all of it, else flat ({numel}).
struct Piece {
  size_t param = 0;
  int64_t at = 0, numel = 0;
  std::vector<int64_t> shape;
};

// One fragment: the range [offset, offset + numel) of the flat vector, and its pieces in
// parameter order.
struct FragmentCut {
  int64_t offset = 0, numel = 0;
  std::vector<Piece> pieces;
};

// The fragments of parameters of these shapes (in order): min(fragments, max(total, 1)) of
// them, tiling the flat vector in order.
std::vector<FragmentCut> cut_fragments(const std::vector<std::vector<int64_t>>& shapes, int64_t fragments);

// Whether fragment j (of `fragments`) is due to be sent once `in_round` inner steps of a round
// of `round_steps` are done.
inline bool fragment_due(size_t j, int64_t in_round, int64_t round_steps, size_t fragments) {
  return in_round * static_cast<int64_t>(fragments) >= static_cast<int64_t>(j + 1) * round_steps;
}

// The fragment to merge next at local step `step`: among those in flight whose merge_at <= step,
// the one sent first (lowest seq); fragments.size() if none. `step` = the largest int64_t: any
// in flight (drain). Works on any fragment type with in_flight, merge_at and seq.
template <typename Fragments>
size_t next_merge(const Fragments& fragments, int64_t step = std::numeric_limits<int64_t>::max()) {
  size_t due = fragments.size();
  for (size_t j = 0; j < fragments.size(); ++j) {
    const auto& fr = fragments[j];
    if (fr.in_flight && fr.merge_at <= step && (due == fragments.size() || fr.seq < fragments[due].seq)) due = j;
  }
  return due;
}

}  // namespace nebula::strategy
