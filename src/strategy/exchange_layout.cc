#include "strategy/exchange_layout.h"

namespace nebula::strategy {

std::vector<std::vector<int64_t>> wan_cuts(const FragmentRange& fr, int64_t total,
                                           const std::vector<int64_t>& workers_per_site) {
  std::vector<std::vector<int64_t>> cuts;
  for (int64_t w : workers_per_site)
    cuts.push_back(parallel::part_cuts(parallel::shard_numel(total, w), w, fr.offset, fr.numel));
  return cuts;
}

std::vector<int64_t> counts_of(const std::vector<int64_t>& cuts) {
  std::vector<int64_t> counts;
  for (size_t q = 0; q + 1 < cuts.size(); ++q) counts.push_back(cuts[q + 1] - cuts[q]);
  return counts;
}

}  // namespace nebula::strategy
