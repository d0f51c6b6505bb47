// ZeRO's layout of the flat parameter vector (the trainable parameters flattened in order) over
// a site's N workers: N equal shards of S = ceil(total / N) values, worker r holding
// [r S, (r + 1) S) (the last shard padded past the end). The inner optimizer shards by it, and
// the strategies cut their exchanges by it (a range's part on each worker), so every site, of
// any number of workers, agrees on who holds which values. Plain arithmetic, no tensors.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace nebula::parallel {

// S for `total` values over `workers` workers.
inline int64_t shard_numel(int64_t total, int64_t workers) { return (total + workers - 1) / workers; }

// The boundaries of the range [offset, offset + numel) of the flat vector cut by shards of
// `shard` values over `workers` workers, relative to offset: workers + 1 values from 0 to numel;
// worker q's part is [cuts[q], cuts[q + 1]) (empty when its shard misses the range).
inline std::vector<int64_t> part_cuts(int64_t shard, int64_t workers, int64_t offset, int64_t numel) {
  std::vector<int64_t> cuts;
  cuts.reserve(static_cast<size_t>(workers + 1));
  for (int64_t q = 0; q <= workers; ++q) cuts.push_back(std::clamp(q * shard - offset, int64_t{0}, numel));
  return cuts;
}

// Each worker's count of that range (the differences of part_cuts).
inline std::vector<int64_t> part_counts(int64_t shard, int64_t workers, int64_t offset, int64_t numel) {
  const std::vector<int64_t> cuts = part_cuts(shard, workers, offset, numel);
  std::vector<int64_t> counts(static_cast<size_t>(workers));
  for (size_t q = 0; q < counts.size(); ++q) counts[q] = cuts[q + 1] - cuts[q];
  return counts;
}

}  // namespace nebula::parallel
