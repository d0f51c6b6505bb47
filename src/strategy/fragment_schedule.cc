#include "strategy/fragment_schedule.h"

#include <algorithm>

namespace nebula::strategy {

std::vector<FragmentCut> cut_fragments(const std::vector<std::vector<int64_t>>& shapes, int64_t fragments) {
  auto numel_of = [](const std::vector<int64_t>& s) {
    int64_t n = 1;
    for (int64_t d : s) n *= d;
    return n;
  };
  std::vector<int64_t> start(shapes.size() + 1, 0);  // of each tensor in the flat vector
  for (size_t i = 0; i < shapes.size(); ++i) start[i + 1] = start[i] + numel_of(shapes[i]);
  const int64_t total = start.back();
  const auto f = static_cast<size_t>(std::min<int64_t>(fragments, std::max<int64_t>(total, 1)));
  auto row_length = [&](size_t i) {
    const std::vector<int64_t>& s = shapes[i];
    const int64_t n = numel_of(s);
    return !s.empty() && s[0] > 0 ? n / s[0] : std::max<int64_t>(n, 1);
  };
  std::vector<int64_t> cut(f + 1, total);
  cut[0] = 0;
  for (size_t j = 1; j < f; ++j) {
    const int64_t target = total * static_cast<int64_t>(j) / static_cast<int64_t>(f);
    const auto i = static_cast<size_t>(std::upper_bound(start.begin(), start.end(), target) - start.begin()) - 1;
    const int64_t row = row_length(i);
    int64_t c = start[i] + (target - start[i] + row / 2) / row * row;  // the nearest row boundary
    // Never empty (a model with fewer rows than fragments: cuts inside rows).
    c = std::clamp<int64_t>(c, cut[j - 1] + 1, total - static_cast<int64_t>(f - j));
    cut[j] = c;
  }
  std::vector<FragmentCut> out(f);
  for (size_t j = 0; j < f; ++j) {
    FragmentCut& fr = out[j];
    fr.offset = cut[j];
    fr.numel = cut[j + 1] - cut[j];
    for (size_t i = 0; i < shapes.size(); ++i) {
      const int64_t lo = std::max(fr.offset, start[i]), hi = std::min(fr.offset + fr.numel, start[i + 1]);
      if (lo >= hi) continue;
      Piece pc{i, lo - start[i], hi - lo, {hi - lo}};
      const int64_t row = row_length(i);
      if (shapes[i].size() >= 2 && pc.at % row == 0 && pc.numel % row == 0) {
        pc.shape = shapes[i];
        pc.shape[0] = pc.numel / row;
      } else if (pc.numel == numel_of(shapes[i])) {
        pc.shape = shapes[i];
      }
      fr.pieces.push_back(std::move(pc));
    }
  }
  return out;
}

}  // namespace nebula::strategy
