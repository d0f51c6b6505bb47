#include "parallel/shard_layout.h"

#include <stdexcept>
#include <string>

namespace nebula::parallel {

ShardLayout::ShardLayout(std::vector<int64_t> bounds, int64_t workers) : bounds_(std::move(bounds)), workers_(workers) {
  if (workers_ < 1) throw std::invalid_argument("ShardLayout: " + std::to_string(workers_) + " workers");
  if (bounds_.size() < 2 || bounds_.front() != 0)
    throw std::invalid_argument("ShardLayout: unit bounds must start at 0 and hold at least one unit");
  slot_.push_back(0);
  for (size_t u = 0; u + 1 < bounds_.size(); ++u) {
    if (bounds_[u + 1] < bounds_[u])
      throw std::invalid_argument("ShardLayout: unit bound #" + std::to_string(u + 1) + " (" +
                                  std::to_string(bounds_[u + 1]) + ") before #" + std::to_string(u) + " (" +
                                  std::to_string(bounds_[u]) + ")");
    piece_.push_back(parallel::shard_numel(bounds_[u + 1] - bounds_[u], workers_));
    slot_.push_back(slot_.back() + piece_.back());
  }
}

std::vector<ShardRun> ShardLayout::runs(int64_t q, int64_t offset, int64_t numel) const {
  std::vector<ShardRun> out;
  const int64_t end = offset + numel;
  // The units that meet the range: from the last bound at or before offset.
  size_t u = static_cast<size_t>(std::upper_bound(bounds_.begin(), bounds_.end(), offset) - bounds_.begin());
  u = u == 0 ? 0 : u - 1;
  for (; u < units() && bounds_[u] < end; ++u) {
    const ShardRun p = piece(u, q);
    const int64_t lo = std::max(p.flat, offset), hi = std::min(p.flat + p.len, end);
    if (lo < hi) out.push_back({lo, p.local + (lo - p.flat), hi - lo});
  }
  return out;
}

int64_t ShardLayout::count(int64_t q, int64_t offset, int64_t numel) const {
  int64_t n = 0;
  for (const ShardRun& r : runs(q, offset, numel)) n += r.len;
  return n;
}

std::vector<int64_t> ShardLayout::counts(int64_t offset, int64_t numel) const {
  std::vector<int64_t> out;
  for (int64_t q = 0; q < workers_; ++q) out.push_back(count(q, offset, numel));
  return out;
}

StageLayout::StageLayout(std::vector<int64_t> bounds, int64_t data) : bounds_(std::move(bounds)), data_(data) {
  if (data_ < 1) throw std::invalid_argument("StageLayout: " + std::to_string(data_) + " data replicas");
  if (bounds_.size() < 2 || bounds_.front() != 0)
    throw std::invalid_argument("StageLayout: stage bounds must start at 0 and hold at least one stage");
  for (size_t s = 0; s + 1 < bounds_.size(); ++s)
    if (bounds_[s + 1] < bounds_[s])
      throw std::invalid_argument("StageLayout: stage bound #" + std::to_string(s + 1) + " (" +
                                  std::to_string(bounds_[s + 1]) + ") before #" + std::to_string(s) + " (" +
                                  std::to_string(bounds_[s]) + ")");
}

std::vector<ShardRun> StageLayout::runs(int64_t rank, int64_t offset, int64_t numel) const {
  const int64_t s = stage_of(rank), q = rank % data_;
  if (s < 0 || s >= stages()) return {};
  const int64_t n = stage_numel(s), piece = parallel::shard_numel(n, data_);
  const int64_t begin = stage_begin(s) + std::min(q * piece, n), end = stage_begin(s) + std::min((q + 1) * piece, n);
  const int64_t lo = std::max(begin, offset), hi = std::min(end, offset + numel);
  if (lo >= hi) return {};
  return {{lo, lo - stage_begin(s), hi - lo}};
}

}  // namespace nebula::parallel
