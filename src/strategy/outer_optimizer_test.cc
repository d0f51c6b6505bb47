// The outer step against the plain formula, value by value in float32 (llm.c style):
//   m ← μ m + Δ      u = Δ + μ m (Nesterov) or m      θ ← θ − lr u
// bit-identical for m and u; θ's last operation is a − lr·b, which ATen's CPU kernels compute
// with one rounding (fused multiply-add) where the CPU has it and two otherwise, so θ must equal
// one of those two values.
#include "strategy/outer_optimizer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace nebula::strategy {
namespace {

std::vector<float> values(int64_t n, float scale, float shift) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = scale * std::sin(0.37f * static_cast<float>(i) + shift);
  return v;
}

at::Tensor tensor(const std::vector<float>& v) { return at::tensor(v).clone(); }

void check(int64_t n, double mu, bool nesterov) {
  SCOPED_TRACE(testing::Message() << n << " values, mu " << mu << (nesterov ? ", nesterov" : ", plain"));
  const double lr = 0.7;
  OuterSgd outer({lr, mu, nesterov});
  std::vector<float> g = values(n, 3.0f, 0.1f), m = values(n, 0.5f, 1.3f);
  at::Tensor global = tensor(g), momentum = tensor(m);
  for (int step = 0; step < 3; ++step) {
    const std::vector<float> d = values(n, 0.01f * static_cast<float>(step + 1), 2.0f * static_cast<float>(step));
    outer.step(global, momentum, tensor(d));
    const auto muf = static_cast<float>(mu), lrf = static_cast<float>(lr);
    for (size_t i = 0; i < g.size(); ++i) {
      float u = d[i];
      if (mu > 0) {
        const float product = m[i] * muf;
        m[i] = product + d[i];
        if (nesterov) {
          const float mm = m[i] * muf;
          u = d[i] + mm;
        } else {
          u = m[i];
        }
      }
      const float lu = lrf * u;
      const float unfused = g[i] - lu, fused = std::fma(-lrf, u, g[i]);
      const float got = global[static_cast<int64_t>(i)].item<float>();
      ASSERT_TRUE(got == fused || got == unfused) << "value " << i << " step " << step << ": " << got << " vs "
                                                  << fused << " / " << unfused;
      g[i] = got;  // the next step starts from what the step gave
      ASSERT_EQ(momentum[static_cast<int64_t>(i)].item<float>(), m[i]) << "momentum " << i << " step " << step;
    }
  }
}

TEST(OuterSgd, NesterovEqualsThePlainFormula) {
  for (int64_t n : {1, 5, 37}) check(n, 0.9, true);
}
TEST(OuterSgd, PlainMomentumEqualsThePlainFormula) {
  for (int64_t n : {1, 5, 37}) check(n, 0.9, false);
}
TEST(OuterSgd, NoMomentumIsPlainSgdAndLeavesTheMomentumAlone) {
  check(37, 0.0, true);
  check(37, 0.0, false);
}
// More values than a slice: the Nesterov term goes in slices, with the same result.
TEST(OuterSgd, SlicesGiveTheSameValuesAsOnePass) {
  const int64_t n = OuterSgd::kSlice * 2 + 123;
  at::Tensor g = at::randn({n}), m = at::randn({n}), d = at::randn({n}) * 0.01;
  at::Tensor g2 = g.clone(), m2 = m.clone();
  OuterSgd({0.7, 0.9, true}).step(g, m, d.clone());
  m2.mul_(0.9).add_(d);
  g2.sub_(d + m2 * 0.9, 0.7);
  EXPECT_TRUE(at::equal(m, m2));
  EXPECT_TRUE(at::equal(g, g2));
}

}  // namespace
}  // namespace nebula::strategy
