#include "privacy/rdp.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <utility>

#include "nebula/error.h"

namespace nebula::privacy {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

void check_sigma(double sigma) {
  NEBULA_CHECK(sigma > 0 && std::isfinite(sigma), "sigma (noise multiplier) must be finite and > 0, got sigma = ",
               sigma);
}

void check_q(double q) {
  NEBULA_CHECK(q >= 0 && q <= 1, "q (sampling rate) must be in [0, 1], got q = ", q);
}

void check_order(double order) {
  NEBULA_CHECK(order > 1 && std::isfinite(order), "order must be finite and > 1, got order = ", order);
}

// The series loop over k up to past the order; beyond this the loops would be long for no use
// (published order lists stop at 4096).
constexpr double kMaxSampledOrder = 1e6;

void check_sampled_order(double order) {
  check_order(order);
  NEBULA_CHECK(order <= kMaxSampledOrder, "order must be <= ", kMaxSampledOrder,
               " for the sampled Gaussian, got order = ", order);
}

void check_orders(const std::vector<double>& orders) {
  NEBULA_CHECK(!orders.empty(), "orders must not be empty");
  for (size_t i = 0; i < orders.size(); ++i) {
    NEBULA_CHECK(orders[i] > 1 && std::isfinite(orders[i]), "orders must be finite and > 1, got orders[", i,
                 "] = ", orders[i]);
  }
}

// log(e^a + e^b); -inf stands for 0.
double log_add(double a, double b) {
  if (a < b) std::swap(a, b);
  if (b == -kInf) return a;
  return a + std::log1p(std::exp(b - a));
}

// log(e^x - 1) for x > 0.
double log_expm1(double x) { return x > 30 ? x + std::log1p(-std::exp(-x)) : std::log(std::expm1(x)); }

// log(erfc(x)). std::erfc keeps its relative accuracy until it underflows (x ≈ 26.5); beyond 25
// the asymptotic series erfc(x) = e^{-x²}/(x√π) · (1 − 1/(2x²) + 3/(4x⁴) − 15/(8x⁶) + 105/(16x⁸) …),
// whose next term is below 1e-12 there.
double log_erfc(double x) {
  if (x < 25) return std::log(std::erfc(x));
  const double r = 1 / (x * x);
  const double series = 1 - r / 2 + 3 * r * r / 4 - 15 * r * r * r / 8 + 105 * r * r * r * r / 16;
  return -x * x - std::log(x) - 0.5 * std::log(std::numbers::pi) + std::log(series);
}

// log(A_α) for integer α ≥ 2 and 0 < q < 1. Since Σ_k C(α,k)(1−q)^{α−k}q^k = 1,
//   A_α − 1 = Σ_{k=2..α} C(α,k) (1−q)^{α−k} q^k (e^{(k²−k)/(2σ²)} − 1),
// a sum of positive terms (k = 0, 1 contribute nothing). Summing A_α − 1 rather than A_α keeps
// the digits that matter when q is small and A_α is 1 + 1e-12.
double log_a_integer(double q, double sigma, int64_t alpha) {
  const double log_q = std::log(q), log_1mq = std::log1p(-q);
  const double lgamma_alpha1 = std::lgamma(static_cast<double>(alpha) + 1);
  double log_a_minus_1 = -kInf;
  for (int64_t k = 2; k <= alpha; ++k) {
    const double kd = static_cast<double>(k);
    const double log_binom = lgamma_alpha1 - std::lgamma(kd + 1) - std::lgamma(static_cast<double>(alpha - k) + 1);
    const double term = log_binom + static_cast<double>(alpha - k) * log_1mq + kd * log_q +
                        log_expm1((kd * kd - kd) / (2 * sigma * sigma));
    log_a_minus_1 = log_add(log_a_minus_1, term);
  }
  return log_add(0.0, log_a_minus_1);  // log(1 + (A − 1))
}

// log(A_α) for fractional α > 1 and 0 < q < 1: the two-sided series of MTZ19 §3.3 (see rdp.h).
// Positive and negative terms (the generalized binomial coefficient C(α,k) changes sign for
// k > α) are summed apart in log space and subtracted once at the end.
double log_a_fractional(double q, double sigma, double alpha) {
  const double log_q = std::log(q), log_1mq = std::log1p(-q);
  const double z0 = sigma * sigma * (log_1mq - log_q) + 0.5;
  const double two_sigma2 = 2 * sigma * sigma;
  const double sqrt2_sigma = std::sqrt(2.0) * sigma;
  const double log_half = std::log(0.5);

  double log_pos = -kInf, log_neg = -kInf;
  double log_abs_binom = 0;  // log|C(α, 0)|
  bool binom_negative = false;
  // Terms decay at least polynomially once k > α (see rdp.h); this bound is far above what any
  // double-precision input needs (q near ½ with σ = 1e6 and α = 1.1 takes ~1e6 terms).
  constexpr int64_t kMaxTerms = 50'000'000;
  for (int64_t k = 0;; ++k) {
    NEBULA_CHECK(k < kMaxTerms, "the sampled-Gaussian series did not converge for q = ", q, ", sigma = ", sigma,
                 ", order = ", alpha);
    const double kd = static_cast<double>(k);
    const double j = alpha - kd;
    const double s0 = log_abs_binom + (alpha - kd) * log_1mq + kd * log_q + (kd * kd - kd) / two_sigma2 + log_half +
                      log_erfc((kd - z0) / sqrt2_sigma);
    const double s1 = log_abs_binom + j * log_q + kd * log_1mq + (j * j - j) / two_sigma2 + log_half +
                      log_erfc((z0 - j) / sqrt2_sigma);
    NEBULA_CHECK(!std::isnan(s0) && !std::isnan(s1), "the sampled-Gaussian series produced NaN for q = ", q,
                 ", sigma = ", sigma, ", order = ", alpha, " at term ", k);
    const double s = log_add(s0, s1);
    if (binom_negative) {
      log_neg = log_add(log_neg, s);
    } else {
      log_pos = log_add(log_pos, s);
    }
    // A_α ≥ 1, so a term below e^-30 · max(1, sum) no longer matters (relative 1e-13).
    if (kd > alpha && std::max(s0, s1) < std::max(0.0, log_pos) - 30) break;
    // C(α, k+1) = C(α, k) · (α − k) / (k + 1).
    log_abs_binom += std::log(std::fabs(alpha - kd)) - std::log(kd + 1);
    if (alpha - kd < 0) binom_negative = !binom_negative;
  }
  NEBULA_CHECK(log_neg < log_pos, "the sampled-Gaussian series lost all precision for q = ", q, ", sigma = ", sigma,
               ", order = ", alpha);
  if (log_neg == -kInf) return log_pos;
  return log_pos + std::log1p(-std::exp(log_neg - log_pos));
}

}  // namespace

std::vector<double> default_orders() {
  std::vector<double> orders;
  orders.reserve(99 + 52);
  for (int x = 1; x < 100; ++x) orders.push_back(1 + x / 10.0);
  for (int a = 12; a < 64; ++a) orders.push_back(a);
  return orders;
}

double rdp_gaussian(double sigma, double order) {
  check_sigma(sigma);
  check_order(order);
  return order / (2 * sigma * sigma);
}

double rdp_sampled_gaussian(double q, double sigma, double order) {
  check_q(q);
  check_sigma(sigma);
  check_sampled_order(order);
  if (q == 0) return 0;
  if (q == 1) return rdp_gaussian(sigma, order);
  const double log_a = order == std::floor(order)
                           ? log_a_integer(q, sigma, static_cast<int64_t>(order))
                           : log_a_fractional(q, sigma, order);
  // The Rényi divergence is ≥ 0; rounding can leave log A a hair below 0.
  return std::max(0.0, log_a / (order - 1));
}

PrivacySpent epsilon_from_rdp(const std::vector<double>& orders, const std::vector<double>& rdp, double delta) {
  check_orders(orders);
  NEBULA_CHECK(rdp.size() == orders.size(), "rdp and orders must have the same length, got rdp.size() = ",
               rdp.size(), " and orders.size() = ", orders.size());
  NEBULA_CHECK(delta > 0 && delta < 1, "delta must be in (0, 1), got delta = ", delta);
  const double log_delta = std::log(delta);
  PrivacySpent best{kInf, orders[0]};
  for (size_t i = 0; i < orders.size(); ++i) {
    const double a = orders[i], r = rdp[i];
    NEBULA_CHECK(r >= 0, "rdp must be >= 0 (or +inf), got rdp[", i, "] = ", r);
    double eps;
    if (delta * delta + std::expm1(-r) > 0) {
      eps = 0;  // δ ≥ √(1 − e^{−ρ}) ≥ total variation: (0, δ)-DP (rdp.h, "Conversion").
    } else {
      eps = r + std::log1p(-1 / a) - (log_delta + std::log(a)) / (a - 1);
    }
    if (eps < best.epsilon) best = {eps, a};
  }
  best.epsilon = std::max(0.0, best.epsilon);
  return best;
}

RdpAccountant::RdpAccountant(std::vector<double> orders) : orders_(std::move(orders)) {
  check_orders(orders_);
  for (double order : orders_) check_sampled_order(order);
  rdp_.assign(orders_.size(), 0.0);
}

void RdpAccountant::add(double q, double sigma, int64_t steps) {
  check_q(q);
  check_sigma(sigma);
  NEBULA_CHECK(steps >= 0, "steps must be >= 0, got steps = ", steps);
  if (steps == 0 || q == 0) {
    steps_ += steps;
    return;
  }
  for (size_t i = 0; i < orders_.size(); ++i) {
    rdp_[i] += static_cast<double>(steps) * rdp_sampled_gaussian(q, sigma, orders_[i]);
  }
  steps_ += steps;
}

PrivacySpent RdpAccountant::spent(double delta) const { return epsilon_from_rdp(orders_, rdp_, delta); }

}  // namespace nebula::privacy
