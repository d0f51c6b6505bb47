// Who holds what of a fragment in an exchange: the fragment [offset, offset + numel) of the flat
// parameter vector cut by ZeRO's shards (parallel/shard_layout.h, the one place that arithmetic
// lives) over a site's workers. A site of w workers cuts at its own S = ceil(total / w), sharded
// or not, so every site knows every other site's cut (wan.mode = "every_worker": worker q of a
// site exchanges its cut with the matching ranges of the other sites' workers). Plain
// arithmetic, no tensors.
#pragma once

#include <cstdint>
#include <vector>

#include "parallel/shard_layout.h"

namespace nebula::strategy {

// A fragment's range [offset, offset + numel) of the flat vector.
struct FragmentRange {
  int64_t offset = 0, numel = 0;
};

// A worker's part of a fragment: values [at, at + len) of it (relative to the fragment).
struct PartRange {
  int64_t at = 0, len = 0;
};

// Every rank's count of the fragment when shards of `shard` values cut it over `workers`.
inline std::vector<int64_t> part_counts(const FragmentRange& fr, int64_t shard, int64_t workers) {
  return parallel::part_counts(shard, workers, fr.offset, fr.numel);
}

// Rank `rank`'s part of the fragment, shards of `shard` values over `workers`.
inline PartRange part_of(const FragmentRange& fr, int64_t shard, int64_t workers, int64_t rank) {
  const std::vector<int64_t> cuts = parallel::part_cuts(shard, workers, fr.offset, fr.numel);
  return {cuts[static_cast<size_t>(rank)], cuts[static_cast<size_t>(rank + 1)] - cuts[static_cast<size_t>(rank)]};
}

// Every site's cut of the fragment over its workers (Hierarchy::exchange_parts_async): site s of
// workers_per_site[s] workers cuts at ZeRO's shard of `total` values over them, w + 1 boundaries.
std::vector<std::vector<int64_t>> wan_cuts(const FragmentRange& fr, int64_t total,
                                           const std::vector<int64_t>& workers_per_site);

// The counts between consecutive cuts.
std::vector<int64_t> counts_of(const std::vector<int64_t>& cuts);

}  // namespace nebula::strategy
