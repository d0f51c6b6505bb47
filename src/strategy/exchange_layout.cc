#include "strategy/exchange_layout.h"

namespace nebula::strategy {

int64_t workers_of(const SiteLayout& layout) {
  return std::visit([](const auto& l) { return l.workers(); }, layout);
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
