#include "strategy/exchange_layout.h"

namespace nebula::strategy {

int64_t workers_of(const SiteLayout& layout) {
  return std::visit([](const auto& l) { return l.workers(); }, layout);
}

int64_t total_of(const SiteLayout& layout) {
  return std::visit([](const auto& l) { return l.total(); }, layout);
}

std::vector<parallel::ShardRun> held_of(const SiteLayout& layout, int64_t rank) {
  if (const auto* stages = std::get_if<parallel::StageLayout>(&layout)) {
    const int64_t s = stages->stage_of(rank);
    return {{stages->stage_begin(s), 0, stages->stage_numel(s)}};
  }
  if (const auto* slices = std::get_if<parallel::SliceLayout>(&layout))
    return slices->held_runs(slices->slice_of_rank(rank), 0, slices->total());
  const int64_t total = std::get<parallel::ShardLayout>(layout).total();
  return {{0, 0, total}};
}

int64_t holding_of(const SiteLayout& layout, int64_t rank) {
  if (const auto* stages = std::get_if<parallel::StageLayout>(&layout)) return stages->stage_of(rank);
  if (const auto* slices = std::get_if<parallel::SliceLayout>(&layout)) return slices->slice_of_rank(rank);
  return 0;
}

int64_t replica_of(const SiteLayout& layout, int64_t rank) {
  if (const auto* stages = std::get_if<parallel::StageLayout>(&layout)) return rank % stages->data();
  if (const auto* slices = std::get_if<parallel::SliceLayout>(&layout)) return slices->replica_of(rank);
  return rank;
}

int64_t replicas_of(const SiteLayout& layout) {
  if (const auto* stages = std::get_if<parallel::StageLayout>(&layout)) return stages->data();
  if (const auto* slices = std::get_if<parallel::SliceLayout>(&layout)) return slices->data();
  return workers_of(layout);
}

std::vector<std::vector<parallel::ShardRun>> parts_of(const FragmentRange& fr, const SiteLayout& layout) {
  std::vector<std::vector<parallel::ShardRun>> parts;
  std::visit(
      [&](const auto& l) {
        for (int64_t q = 0; q < l.workers(); ++q) parts.push_back(l.runs(q, fr.offset, fr.numel));
      },
      layout);
  return parts;
}

std::vector<int64_t> counts_of(const std::vector<std::vector<parallel::ShardRun>>& parts) {
  std::vector<int64_t> counts;
  for (const auto& runs : parts) {
    int64_t n = 0;
    for (const auto& r : runs) n += r.len;
    counts.push_back(n);
  }
  return counts;
}

bool in_rank_order(const std::vector<std::vector<parallel::ShardRun>>& parts) {
  int64_t next = -1;
  for (const auto& runs : parts) {
    if (runs.size() > 1) return false;
    if (runs.empty()) continue;
    if (next >= 0 && runs[0].flat != next) return false;
    next = runs[0].flat + runs[0].len;
  }
  return true;
}

collective::Holdings wan_holdings(const FragmentRange& fr, const std::vector<SiteLayout>& layouts) {
  collective::Holdings holdings;
  for (const SiteLayout& layout : layouts) {
    auto& site = holdings.emplace_back();
    for (const auto& runs : parts_of(fr, layout)) {
      auto& spans = site.emplace_back();
      for (const auto& r : runs) spans.push_back({r.flat - fr.offset, r.flat - fr.offset + r.len});
    }
  }
  return holdings;
}

}  // namespace nebula::strategy
