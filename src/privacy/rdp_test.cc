#include "privacy/rdp.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numbers>
#include <string>
#include <vector>

#include "nebula/error.h"

namespace nebula::privacy {
namespace {

std::vector<double> range_orders(int first, int last) {  // first, first + 1, …, last
  std::vector<double> orders;
  for (int a = first; a <= last; ++a) orders.push_back(a);
  return orders;
}

std::vector<double> rdp_of(double q, double sigma, double steps, const std::vector<double>& orders) {
  std::vector<double> rdp;
  for (double a : orders) rdp.push_back(steps * rdp_sampled_gaussian(q, sigma, a));
  return rdp;
}

// The classic conversion (Mironov 2017, Proposition 3), written here for the reference values
// that were published with it: ε = min_α ρ(α) + log(1/δ)/(α − 1).
PrivacySpent classic_epsilon(const std::vector<double>& orders, const std::vector<double>& rdp, double delta) {
  PrivacySpent best{std::numeric_limits<double>::infinity(), 0};
  for (size_t i = 0; i < orders.size(); ++i) {
    const double eps = rdp[i] - std::log(delta) / (orders[i] - 1);
    if (eps < best.epsilon) best = {eps, orders[i]};
  }
  return best;
}

// TF-Privacy's compute_dp_sgd_privacy orders (tensorflow_privacy/privacy/analysis/
// compute_dp_sgd_privacy_lib.py).
std::vector<double> tf_privacy_orders() {
  std::vector<double> orders = {1.25, 1.5, 1.75, 2., 2.25, 2.5, 3., 3.5, 4., 4.5};
  for (int a = 5; a < 64; ++a) orders.push_back(a);
  for (double a : {128., 256., 512.}) orders.push_back(a);
  return orders;
}

// A_α = E_{z∼N(0,σ²)}[(1 − q + q e^{(2z−1)/(2σ²)})^α] by composite Simpson quadrature of the
// definition, in log space (shifted by the largest log-integrand). Independent of the series.
double log_a_by_quadrature(double q, double sigma, double alpha) {
  const double lo = -14 * sigma, hi = alpha + 14 * sigma;  // the q-part peaks at z = α
  const int n = 200000;                                    // even
  const double h = (hi - lo) / n;
  auto log_f = [&](double z) {
    const double a = std::log1p(-q), b = std::log(q) + (2 * z - 1) / (2 * sigma * sigma);
    const double log_base = std::max(a, b) + std::log1p(std::exp(-std::fabs(a - b)));
    return -z * z / (2 * sigma * sigma) - std::log(sigma * std::sqrt(2 * std::numbers::pi)) + alpha * log_base;
  };
  std::vector<double> v(n + 1);
  double m = -std::numeric_limits<double>::infinity();
  for (int i = 0; i <= n; ++i) m = std::max(m, v[i] = log_f(lo + i * h));
  double sum = 0;
  for (int i = 0; i <= n; ++i) sum += (i == 0 || i == n ? 1 : i % 2 ? 4 : 2) * std::exp(v[i] - m);
  return m + std::log(sum * h / 3);
}

// The exact privacy profile of the Gaussian mechanism with sensitivity/σ = μ (Balle & Wang 2018,
// "Improving the Gaussian Mechanism for Differential Privacy", Theorem 8):
//   δ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2).
double exact_gaussian_delta(double mu, double eps) {
  auto phi = [](double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); };
  return phi(-eps / mu + mu / 2) - std::exp(eps) * phi(-eps / mu - mu / 2);
}

void expect_error(const std::function<void()>& fn, const std::vector<std::string>& fragments) {
  try {
    fn();
    ADD_FAILURE() << "no nebula::Error thrown; expected one mentioning " << fragments[0];
  } catch (const Error& e) {
    const std::string what = e.what();
    for (const auto& f : fragments) EXPECT_NE(what.find(f), std::string::npos) << "'" << f << "' not in: " << what;
  }
}

TEST(Rdp, DefaultOrdersAreOpacusDefaultAlphas) {
  const auto orders = default_orders();
  ASSERT_EQ(orders.size(), 99u + 52u);
  EXPECT_DOUBLE_EQ(orders.front(), 1.1);
  EXPECT_DOUBLE_EQ(orders[98], 10.9);
  EXPECT_EQ(orders[99], 12);
  EXPECT_EQ(orders.back(), 63);
  EXPECT_TRUE(std::is_sorted(orders.begin(), orders.end()));
}

TEST(Rdp, FullSamplingIsThePlainGaussian) {
  for (double sigma : {0.3, 1.0, 2.71828, 40.0}) {
    for (double a : {1.01, 1.5, 2.0, 3.7, 32.0, 256.0}) {
      const double expected = a / (2 * sigma * sigma);
      EXPECT_DOUBLE_EQ(rdp_gaussian(sigma, a), expected) << "sigma " << sigma << " order " << a;
      EXPECT_DOUBLE_EQ(rdp_sampled_gaussian(1.0, sigma, a), expected) << "sigma " << sigma << " order " << a;
    }
  }
}

TEST(Rdp, ZeroSamplingIsFree) {
  for (double sigma : {0.1, 1.0, 10.0}) {
    for (double a : {1.5, 2.0, 20.0}) EXPECT_EQ(rdp_sampled_gaussian(0.0, sigma, a), 0.0);
  }
}

TEST(Rdp, GrowsWithSamplingRateShrinksWithNoise) {
  const std::vector<double> rates = {1e-4, 1e-3, 0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 0.999, 1.0};
  const std::vector<double> sigmas = {0.5, 0.8, 1.0, 1.5, 2.0, 4.0, 8.0};
  for (double a : {1.5, 2.0, 4.5, 8.0, 20.0}) {
    for (double sigma : {0.7, 1.0, 3.0}) {
      for (size_t i = 1; i < rates.size(); ++i) {
        EXPECT_LT(rdp_sampled_gaussian(rates[i - 1], sigma, a), rdp_sampled_gaussian(rates[i], sigma, a))
            << "order " << a << " sigma " << sigma << " q " << rates[i - 1] << " -> " << rates[i];
      }
    }
    for (double q : {0.01, 0.3}) {
      for (size_t i = 1; i < sigmas.size(); ++i) {
        EXPECT_GT(rdp_sampled_gaussian(q, sigmas[i - 1], a), rdp_sampled_gaussian(q, sigmas[i], a))
            << "order " << a << " q " << q << " sigma " << sigmas[i - 1] << " -> " << sigmas[i];
      }
    }
  }
}

TEST(Rdp, NondecreasingInOrderAndContinuousAcrossIntegers) {
  // A Rényi divergence never decreases with the order; integer orders (binomial sum) and
  // fractional ones (the two-sided series) are different code, so the curve must also join up.
  for (double q : {0.001, 0.05, 0.6}) {
    for (double sigma : {0.6, 1.2, 5.0}) {
      double last = 0;
      for (double a : default_orders()) {
        const double r = rdp_sampled_gaussian(q, sigma, a);
        EXPECT_GE(r, last * (1 - 1e-12)) << "q " << q << " sigma " << sigma << " order " << a;
        last = r;
      }
      for (double a : {2.0, 3.0, 7.0, 30.0}) {
        const double at = rdp_sampled_gaussian(q, sigma, a);
        for (double off : {-1e-7, 1e-7}) {
          EXPECT_NEAR(rdp_sampled_gaussian(q, sigma, a + off), at, 1e-5 * at)
              << "q " << q << " sigma " << sigma << " order " << a << off;
        }
      }
    }
  }
}

TEST(Rdp, SampledGaussianMatchesQuadratureOfTheDefinition) {
  // ρ(α) = log(A_α)/(α − 1) against A_α integrated numerically from its definition (MTZ19 §3.3),
  // the check TF-Privacy makes with mpmath, here in double precision with Simpson's rule.
  for (double q : {0.01, 0.2, 0.7}) {
    for (double sigma : {0.7, 1.5, 4.0}) {
      for (double a : {1.5, 2.0, 2.5, 6.0, 11.3, 24.0}) {
        const double expected = log_a_by_quadrature(q, sigma, a) / (a - 1);
        EXPECT_NEAR(rdp_sampled_gaussian(q, sigma, a), expected, 1e-7 * expected + 1e-13)
            << "q " << q << " sigma " << sigma << " order " << a;
      }
    }
  }
  // q > ½ with large σ and α: the first terms of both halves of the series are below e^-30 while
  // the bulk comes at k near α; a series that stops at the first small term returns log A < 0.
  for (double a : {60.5, 100.5}) {
    const double far = log_a_by_quadrature(0.6, 30, a) / (a - 1);
    EXPECT_NEAR(rdp_sampled_gaussian(0.6, 30, a), far, 1e-7 * far) << "order " << a;
  }
  // The published TF-Privacy / dp_accounting sequence below at order 1.5 (the two libraries differ
  // there): the quadrature decides.
  const double expected = log_a_by_quadrature(0.01, 2.5, 1.5) / 0.5;
  EXPECT_NEAR(rdp_sampled_gaussian(0.01, 2.5, 1.5), expected, 1e-7 * expected);
}

TEST(Rdp, ComposedGaussianMatchesTheClosedForm) {
  // T rounds of the plain Gaussian: ρ(α) = T α/(2σ²); ε = min over the orders of
  // ρ(α) + log((α−1)/α) − (log δ + log α)/(α−1), written out here.
  const auto orders = default_orders();
  for (int64_t rounds : {1, 10, 1000}) {
    for (double sigma : {0.8, 2.0, 10.0, 50.0}) {
      for (double delta : {1e-5, 1e-8}) {
        RdpAccountant acc;
        acc.add(1.0, sigma, rounds);
        double best = std::numeric_limits<double>::infinity(), best_order = 0;
        for (double a : orders) {
          const double eps = rounds * a / (2 * sigma * sigma) + std::log((a - 1) / a) -
                             (std::log(delta) + std::log(a)) / (a - 1);
          if (eps < best) best = eps, best_order = a;
        }
        best = std::max(best, 0.0);
        const PrivacySpent spent = acc.spent(delta);
        EXPECT_NEAR(spent.epsilon, best, 1e-12 * std::max(1.0, best)) << rounds << " rounds, sigma " << sigma;
        EXPECT_EQ(spent.order, best_order) << rounds << " rounds, sigma " << sigma;
        EXPECT_EQ(acc.steps(), rounds);

        // RDP gives an upper bound on the exact ε of the composed Gaussian (which is the
        // Gaussian with μ = √T/σ; for μ > 10 the exact formula's terms overflow a double), and
        // the classic conversion is never better.
        const double mu = std::sqrt(static_cast<double>(rounds)) / sigma;
        if (mu <= 10) {
          EXPECT_LE(exact_gaussian_delta(mu, spent.epsilon), delta * (1 + 1e-9))
              << rounds << " rounds, sigma " << sigma;
        }
        EXPECT_GE(classic_epsilon(orders, acc.rdp(), delta).epsilon, spent.epsilon);
      }
    }
  }
}

TEST(Rdp, AccountantComposesBySumming) {
  const auto orders = default_orders();
  RdpAccountant once, one_by_one, mixed;
  EXPECT_EQ(once.spent(1e-5).epsilon, 0.0);  // nothing spent yet
  once.add(0.05, 1.1, 7);
  for (int i = 0; i < 7; ++i) one_by_one.add(0.05, 1.1);
  EXPECT_EQ(once.steps(), 7);
  EXPECT_EQ(one_by_one.steps(), 7);
  for (size_t i = 0; i < orders.size(); ++i) {
    EXPECT_NEAR(once.rdp()[i], one_by_one.rdp()[i], 1e-12 * once.rdp()[i]);
    EXPECT_NEAR(once.rdp()[i], 7 * rdp_sampled_gaussian(0.05, 1.1, orders[i]), 1e-12 * once.rdp()[i]);
  }
  mixed.add(0.05, 1.1, 7);
  mixed.add(1.0, 3.0, 2);
  mixed.add(0.0, 0.5, 100);  // never sampled: costs nothing, but the rounds count
  EXPECT_EQ(mixed.steps(), 109);
  for (size_t i = 0; i < orders.size(); ++i) {
    EXPECT_NEAR(mixed.rdp()[i], once.rdp()[i] + 2 * orders[i] / 18, 1e-12 * mixed.rdp()[i]);
  }
  EXPECT_GT(mixed.spent(1e-5).epsilon, once.spent(1e-5).epsilon);
  EXPECT_GT(once.spent(1e-6).epsilon, once.spent(1e-5).epsilon);  // a smaller δ costs more ε
}

// ─── Published reference values ───────────────────────────────────────────────────────────────
// Each is compared with the conversion its source used (noted per value).

TEST(RdpPublished, TfPrivacyComputeRdp) {
  // tensorflow/privacy, tensorflow_privacy/privacy/analysis/rdp_accountant_test.py,
  // test_compute_rdp_scalar: compute_rdp(q=0.1, noise_multiplier=2, steps=10, orders=5) = 0.07737
  // (assertAlmostEqual, places=5). RDP only, no conversion.
  EXPECT_NEAR(10 * rdp_sampled_gaussian(0.1, 2, 5), 0.07737, 5e-6);

  // Same file, test_compute_rdp_sequence: compute_rdp(0.01, 2.5, 50, [1.5, 2.5, 5, 50, 100])
  //   = [6.5007e-04, 1.0854e-03, 2.1808e-03, 2.3846e-02, 1.6742e+02] (assertAllClose rtol=1e-4).
  // google/differential-privacy, python/dp_accounting/dp_accounting/rdp/
  // rdp_privacy_accountant_test.py, test_compute_rdp_poisson_sampled_gaussian, states the same
  // sequence with more digits: [6.70579741e-04, 1.08548710e-03, 2.18075656e-03, 2.38460375e-02,
  // 1.67416308e02] (rtol=1e-4). The two differ at the fractional orders (3 % at 1.5, 6e-5 at
  // 2.5): dp_accounting's current _compute_log_a_frac adds |C(α,k)|·(…) for every k, dropping the
  // signs of the generalized binomial coefficients (an upper bound), where the paper, TF-Privacy's
  // rdp_accountant and Opacus subtract the negative terms. We compute the signed series (the
  // quadrature test above confirms it): every order matches TF-Privacy; the integer orders,
  // where both series are the same finite sum, match dp_accounting's longer digits; at the
  // fractional orders we stay below dp_accounting's upper bound.
  const std::vector<double> orders = {1.5, 2.5, 5, 50, 100};
  const std::vector<double> tf_privacy = {6.5007e-04, 1.0854e-03, 2.1808e-03, 2.3846e-02, 1.6742e+02};
  const std::vector<double> dp_accounting = {6.70579741e-04, 1.08548710e-03, 2.18075656e-03, 2.38460375e-02,
                                             1.67416308e02};
  const auto rdp = rdp_of(0.01, 2.5, 50, orders);
  for (size_t i = 0; i < orders.size(); ++i) {
    EXPECT_NEAR(rdp[i], tf_privacy[i], 1e-4 * tf_privacy[i]) << "order " << orders[i];
    if (orders[i] == std::floor(orders[i])) {
      EXPECT_NEAR(rdp[i], dp_accounting[i], 1e-7 * dp_accounting[i]) << "order " << orders[i];
    } else {
      EXPECT_LT(rdp[i], dp_accounting[i]) << "order " << orders[i];
    }
  }
  EXPECT_GT(dp_accounting[0], rdp[0] * 1.02);  // the unsigned series' upper bound at 1.5
}

TEST(RdpPublished, ImprovedConversion) {
  // google/differential-privacy, python/dp_accounting/dp_accounting/rdp/
  // rdp_privacy_accountant_test.py, test_compute_epsilon_delta_pure_dp (also tensorflow/privacy
  // rdp_accountant_test.py, test_get_privacy_spent_check_target_delta, since the 2020 switch to
  // the improved conversion): orders 2..32, ρ = 1.1 at every order, δ = 1e-5 → ε = 1.32783806176
  // at order 32 (assertAlmostEqual, 7 places).
  const auto orders = range_orders(2, 32);
  const PrivacySpent pure = epsilon_from_rdp(orders, std::vector<double>(orders.size(), 1.1), 1e-5);
  EXPECT_NEAR(pure.epsilon, 1.32783806176, 5e-8);
  EXPECT_EQ(pure.order, 32);

  // Same files, test_compute_epsilon_delta_gaussian: orders 1.000, 1.001, …, 99.999, the plain
  // Gaussian with σ = 4.530877117 "chosen to obtain exactly (1, 1e-6)-DP" → ε = 1 (7 places).
  // (Order 1.0 itself is left out here: we reject orders ≤ 1; there TF gives ε = ∞ anyway.)
  std::vector<double> fine;
  for (int i = 1001; i < 100000; ++i) fine.push_back(0.001 * i);
  RdpAccountant gaussian(fine);
  gaussian.add(1.0, 4.530877117);
  EXPECT_NEAR(gaussian.spent(1e-6).epsilon, 1.0, 5e-8);
}

TEST(RdpPublished, OpacusAccountant) {
  // pytorch/opacus, opacus/tests/accountants_test.py, test_rdp_accountant: RDPAccountant (default
  // alphas, = default_orders()), noise_multiplier 1.5, sample_rate 0.04, steps int(90 / 0.04) =
  // 2250, delta 1e-5 → ε = 7.32911117143 (assertAlmostEqual, 7 places). Opacus'
  // get_privacy_spent (opacus/accountants/analysis/rdp.py) uses the improved conversion, Balle et
  // al. 2020 Theorem 21, as we do.
  // (Opacus keeps repeated identical steps as one (σ, q, count) entry, as add() does.)
  RdpAccountant acc;
  acc.add(0.04, 1.5, 2250);
  EXPECT_NEAR(acc.spent(1e-5).epsilon, 7.32911117143, 5e-8);

  // pytorch/opacus, opacus/accountants/analysis/rdp.py, module docstring (a doctest with
  // +NUMBER, so to the 3 decimals shown): parameters [(q=1e-5, σ=1.0, 10 steps),
  // (q=1e-4, σ=3.0, 4 steps)], orders 2..32, delta 1e-5 → (ε, order) = (0.336, 23).
  RdpAccountant two(range_orders(2, 32));
  two.add(1e-5, 1.0, 10);
  two.add(1e-4, 3.0, 4);
  const PrivacySpent spent = two.spent(1e-5);
  EXPECT_NEAR(spent.epsilon, 0.336, 5e-4);
  EXPECT_EQ(spent.order, 23);
}

TEST(RdpPublished, TfPrivacyDpSgd) {
  // tensorflow/privacy, tensorflow_privacy/privacy/analysis/compute_dp_sgd_privacy_test.py,
  // test_compute_dp_sgd_privacy (n, batch_size, noise_multiplier, epochs, delta) → (ε, order),
  // assertAlmostEqual (7 places) and assertEqual. compute_dp_sgd_privacy_lib.py: q = batch/n,
  // steps = ceil(epochs·n/batch), tf_privacy_orders(), dp_accounting's RdpAccountant (the improved
  // conversion).
  struct Case {
    double n, batch, sigma, epochs, delta, eps, order;
  };
  for (const Case& c : {Case{60000, 150, 1.3, 15, 1e-5, 0.7242234026109595, 19.0},
                        Case{100000, 100, 1.0, 30, 1e-7, 1.4154988495444842, 13.0}}) {
    RdpAccountant acc(tf_privacy_orders());
    acc.add(c.batch / c.n, c.sigma, static_cast<int64_t>(std::ceil(c.epochs * c.n / c.batch)));
    const PrivacySpent spent = acc.spent(c.delta);
    EXPECT_NEAR(spent.epsilon, c.eps, 5e-8) << "n " << c.n;
    EXPECT_EQ(spent.order, c.order) << "n " << c.n;
  }
  // The third case, (1e8, 1024, 0.1, 10, 1e-7) → 5907982.3113978775 at order 1.25: 7 decimal
  // places of a number this size are 14 significant digits, finer than two implementations that
  // sum the fractional-order series differently (term order, stopping point, signs — see
  // TfPrivacyComputeRdp) can agree on; we ask for 1e-10 relative.
  RdpAccountant acc(tf_privacy_orders());
  acc.add(1024 / 1e8, 0.1, static_cast<int64_t>(std::ceil(10 * 1e8 / 1024)));
  const PrivacySpent spent = acc.spent(1e-7);
  EXPECT_NEAR(spent.epsilon, 5907982.3113978775, 1e-10 * 5907982.3113978775);
  EXPECT_EQ(spent.order, 1.25);
}

TEST(RdpPublished, TfPrivacyClassicConversion) {
  // Values TF-Privacy published with the classic conversion ε = ρ + log(1/δ)/(α − 1), before
  // 2020 (tensorflow/privacy, tensorflow_privacy/privacy/analysis/rdp_accountant_test.py at
  // e.g. the 2019 versions; the file still carries the second one, commented out, "These tests
  // use the old RDP -> approx DP conversion"). Compared here with classic_epsilon() over our RDP.
  //
  // test_get_privacy_spent_check_target_delta: orders 2..32, compute_rdp(0.01, 4, 10000),
  // delta 1e-5 → ε = 1.258575 at order 20 (places=5).
  const auto orders = range_orders(2, 32);
  const PrivacySpent first = classic_epsilon(orders, rdp_of(0.01, 4, 10000, orders), 1e-5);
  EXPECT_NEAR(first.epsilon, 1.258575, 5e-6);
  EXPECT_EQ(first.order, 20);

  // test_check_composition: orders (1.25, 1.5, 1.75, 2, 2.5, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20,
  // 24, 28, 32, 64, 256); compute_rdp(q=1e-4, σ=0.4, 40000 steps) + compute_rdp(q=0.1, σ=2, 100
  // steps), delta 1e-5 → ε = 8.509656 at order 2.5 (places=5). A fractional optimum with σ < 1.
  const std::vector<double> mixed_orders = {1.25, 1.5, 1.75, 2., 2.5, 3., 4., 5., 6., 7., 8.,
                                            10.,  12., 14.,  16., 20., 24., 28., 32., 64., 256.};
  RdpAccountant acc(mixed_orders);
  acc.add(1e-4, 0.4, 40000);
  acc.add(0.1, 2, 100);
  const PrivacySpent second = classic_epsilon(mixed_orders, acc.rdp(), 1e-5);
  EXPECT_NEAR(second.epsilon, 8.509656, 5e-6);
  EXPECT_EQ(second.order, 2.5);
  EXPECT_LE(acc.spent(1e-5).epsilon, second.epsilon);  // the improved conversion is never worse
}

TEST(Rdp, RejectsBadInput) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  expect_error([] { rdp_gaussian(0, 2); }, {"sigma", "0"});
  expect_error([] { rdp_gaussian(-1.5, 2); }, {"sigma", "-1.5"});
  expect_error([&] { rdp_gaussian(nan, 2); }, {"sigma", "nan"});
  expect_error([] { rdp_gaussian(1, 1); }, {"order", "1"});
  expect_error([] { rdp_gaussian(1, 0.5); }, {"order", "0.5"});
  expect_error([] { rdp_sampled_gaussian(-0.1, 1, 2); }, {"q", "-0.1"});
  expect_error([] { rdp_sampled_gaussian(1.5, 1, 2); }, {"q", "1.5"});
  expect_error([&] { rdp_sampled_gaussian(nan, 1, 2); }, {"q", "nan"});
  expect_error([] { rdp_sampled_gaussian(0.1, 0, 2); }, {"sigma", "0"});
  expect_error([] { rdp_sampled_gaussian(0.1, 1, 0.9); }, {"order", "0.9"});
  expect_error([] { rdp_sampled_gaussian(0.1, 1, std::numeric_limits<double>::infinity()); }, {"order", "inf"});
  expect_error([] { rdp_sampled_gaussian(0.1, 1, 2e6); }, {"order", "2e+06"});

  const std::vector<double> orders = {1.5, 2, 3};
  expect_error([&] { epsilon_from_rdp(orders, {0.1, 0.2, 0.3}, 0); }, {"delta", "0"});
  expect_error([&] { epsilon_from_rdp(orders, {0.1, 0.2, 0.3}, 1); }, {"delta", "1"});
  expect_error([&] { epsilon_from_rdp(orders, {0.1, 0.2, 0.3}, -1e-5); }, {"delta", "-1e-05"});
  expect_error([&] { epsilon_from_rdp(orders, {0.1, 0.2}, 1e-5); }, {"rdp", "2", "3"});
  expect_error([&] { epsilon_from_rdp(orders, {0.1, -0.2, 0.3}, 1e-5); }, {"rdp[1]", "-0.2"});
  expect_error([&] { epsilon_from_rdp({1.5, 1.0}, {0.1, 0.2}, 1e-5); }, {"orders[1]", "1"});
  expect_error([&] { epsilon_from_rdp({}, {}, 1e-5); }, {"orders"});

  expect_error([] { RdpAccountant({2, 0.5}); }, {"orders[1]", "0.5"});
  expect_error([] { RdpAccountant(std::vector<double>{}); }, {"orders"});
  RdpAccountant acc;
  expect_error([&] { acc.add(2, 1); }, {"q", "2"});
  expect_error([&] { acc.add(0.1, -1); }, {"sigma", "-1"});
  expect_error([&] { acc.add(0.1, 1, -3); }, {"steps", "-3"});
  expect_error([&] { acc.spent(1.5); }, {"delta", "1.5"});
  EXPECT_EQ(acc.steps(), 0);  // the failed calls recorded nothing
}

TEST(Rdp, EdgeCasesOfTheConversion) {
  // Infinite RDP at one order does not poison the others; at every order it gives ε = ∞.
  const PrivacySpent some = epsilon_from_rdp({2, 3}, {std::numeric_limits<double>::infinity(), 0.5}, 1e-5);
  EXPECT_EQ(some.order, 3);
  EXPECT_TRUE(std::isfinite(some.epsilon));
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(epsilon_from_rdp({2, 3}, {inf, inf}, 1e-5).epsilon, inf);
  // ρ so small that δ ≥ √(1 − e^{−ρ}): ε = 0.
  const PrivacySpent none = epsilon_from_rdp({2, 3}, {1e-12, 1e-12}, 1e-5);
  EXPECT_EQ(none.epsilon, 0.0);
  EXPECT_EQ(none.order, 2);  // ties go to the first order
  // Large σ with tiny q (the float rounding regime of A_α ≈ 1): finite, ≥ 0, and tiny.
  const double tiny = rdp_sampled_gaussian(1e-6, 50, 2);
  EXPECT_GT(tiny, 0);
  EXPECT_NEAR(tiny, 1e-12 * std::expm1(1 / 2500.0), 1e-6 * 1e-12 * std::expm1(1 / 2500.0));
}

}  // namespace
}  // namespace nebula::privacy
