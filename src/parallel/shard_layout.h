// ZeRO's layout of the flat parameter vector (the trainable parameters flattened in order) over
// a site's N workers. The vector is cut into units (consecutive ranges: ZeRO-3's layers and the
// runs of parameters between them; one unit, the whole vector, for ZeRO-1/2), and each unit u of
// n_u values into N pieces of P_u = ceil(n_u / N), as FSDP cuts its flat parameters: worker q
// holds [b_u + q P_u, b_u + (q + 1) P_u) of every unit (the last pieces shorter, or empty, where
// the unit ends). A worker's shard is its pieces one after another, each in a slot of P_u values
// (the tail past a short piece is padding), so every worker's shard has the same S = Σ_u P_u
// values and a unit's all-gather or reduce-scatter moves (N - 1)/N of the unit per worker.
// With one unit this is [q S, (q + 1) S) with S = ceil(total / N).
//
// The inner optimizer and FullShard shard by it, the strategies cut their exchanges by it (each
// worker's runs of a fragment), and checkpoints record its unit bounds so a resume onto another
// layout can put the values back where they belong. Plain arithmetic, no tensors.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace nebula::parallel {

// S for `total` values over `workers` workers, one unit.
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

// Values [flat, flat + len) of the flat vector, held at [local, local + len) of a worker's shard.
struct ShardRun {
  int64_t flat = 0, local = 0, len = 0;
  bool operator==(const ShardRun&) const = default;
};

class ShardLayout {
 public:
  // `bounds`: 0 = b_0 <= b_1 <= ... <= b_U = total, unit u = [b_u, b_{u+1}) (empty units allowed,
  // they hold nothing). Throws std::invalid_argument for bounds that are not so, or workers < 1.
  ShardLayout(std::vector<int64_t> bounds, int64_t workers);
  // One unit: the layout of ZeRO-1/2 and of an unsharded site's exchange cuts.
  static ShardLayout contiguous(int64_t total, int64_t workers) { return ShardLayout({0, total}, workers); }

  int64_t total() const { return bounds_.back(); }
  int64_t workers() const { return workers_; }
  size_t units() const { return bounds_.size() - 1; }
  const std::vector<int64_t>& bounds() const { return bounds_; }
  int64_t unit_begin(size_t u) const { return bounds_[u]; }
  int64_t unit_numel(size_t u) const { return bounds_[u + 1] - bounds_[u]; }
  // P_u, and where unit u's slot starts in every worker's shard.
  int64_t piece_numel(size_t u) const { return piece_[u]; }
  int64_t slot_begin(size_t u) const { return slot_[u]; }
  // S: every worker's shard, padding included.
  int64_t shard_numel() const { return slot_.back(); }
  bool is_contiguous() const { return units() == 1; }

  // Worker q's piece of unit u (len 0 when the unit ends before it).
  ShardRun piece(size_t u, int64_t q) const {
    const int64_t lo = std::min(q * piece_[u], unit_numel(u)), hi = std::min((q + 1) * piece_[u], unit_numel(u));
    return {bounds_[u] + lo, slot_[u], hi - lo};
  }
  // Every worker's count of unit u, in rank order (SiteGroup's *_parts collectives).
  std::vector<int64_t> piece_counts(size_t u) const {
    std::vector<int64_t> counts;
    for (int64_t q = 0; q < workers_; ++q) counts.push_back(piece(u, q).len);
    return counts;
  }
  // Worker q's values of [offset, offset + numel), in flat order (the runs of its pieces that
  // meet the range; none empty).
  std::vector<ShardRun> runs(int64_t q, int64_t offset, int64_t numel) const;
  // Σ len of runs(q, offset, numel).
  int64_t count(int64_t q, int64_t offset, int64_t numel) const;
  // Every worker's count of the range, in rank order.
  std::vector<int64_t> counts(int64_t offset, int64_t numel) const;

 private:
  std::vector<int64_t> bounds_, piece_, slot_;  // slot_: U + 1 values, slot_[U] = S
  int64_t workers_ = 1;
};

// A site of pipeline stages (parallel/pipeline.h) in the same terms: stage s trains the values
// [b_s, b_{s+1}) of the flat vector (a stage's units are consecutive) and each of its `data`
// replicas (site rank s · data + q, SiteGrid's order) holds all of them. For the outer state and
// the WAN exchange, replica q answers for the q-th piece of ceil(L_s / data) of its stage's L_s
// values, as ShardLayout::contiguous cuts a site: so every value has one worker, the site's
// ranks hold the flat vector in order, and a run's `local` is its index among the stage's values
// (where ZeRO-1/2 over the stage's replicas puts it too).
class StageLayout {
 public:
  // `bounds`: 0 = b_0 <= b_1 <= ... <= b_P = total (P >= 1 stages). Throws std::invalid_argument
  // for bounds that are not so, or data < 1.
  StageLayout(std::vector<int64_t> bounds, int64_t data);

  int64_t total() const { return bounds_.back(); }
  int64_t stages() const { return static_cast<int64_t>(bounds_.size()) - 1; }
  int64_t data() const { return data_; }
  int64_t workers() const { return stages() * data_; }
  const std::vector<int64_t>& bounds() const { return bounds_; }
  int64_t stage_of(int64_t rank) const { return rank / data_; }
  int64_t stage_begin(int64_t s) const { return bounds_[static_cast<size_t>(s)]; }
  int64_t stage_numel(int64_t s) const { return bounds_[static_cast<size_t>(s) + 1] - bounds_[static_cast<size_t>(s)]; }
  // Worker `rank`'s values of [offset, offset + numel): at most one run, `local` in its stage.
  std::vector<ShardRun> runs(int64_t rank, int64_t offset, int64_t numel) const;

 private:
  std::vector<int64_t> bounds_;
  int64_t data_ = 1;
};

}  // namespace nebula::parallel
