// Privacy accounting for the Gaussian mechanism with Rényi differential privacy (RDP): how much
// privacy (ε at a given δ) a run has spent after T synchronization rounds in which each site
// clips its shared update to L2 norm C and adds N(0, (σC)²) noise per coordinate. No torch here:
// this layer uses only nebula_util, so it builds and tests in seconds.
//
// ─── The mechanism ────────────────────────────────────────────────────────────────────────────
//  σ        noise multiplier: noise standard deviation / L2 sensitivity (the clip norm C), so
//           every function here works with sensitivity 1.
//  q        Poisson sampling rate: each record (or site, for site-level privacy) takes part in
//           a round independently with probability q. q = 1 is "everyone, every round".
//  α        an RDP order, α > 1. A mechanism M is (α, ρ)-RDP if D_α(M(D) ‖ M(D')) ≤ ρ for all
//           neighbouring D, D' (add or remove one record), D_α the Rényi divergence
//           (Mironov 2017, "Rényi Differential Privacy", arXiv:1702.07476).
//
// ─── RDP of one round ─────────────────────────────────────────────────────────────────────────
//  Gaussian (q = 1):     ρ(α) = α / (2σ²).
//  Sampled Gaussian:     ρ(α) = log(A_α) / (α − 1), with A_α = E_{z∼N(0,σ²)}[(1 − q + q·e^{(2z−1)/(2σ²)})^α]
//  (Mironov, Talwar, Zhang 2019, "Rényi Differential Privacy of the Sampled Gaussian Mechanism",
//  arXiv:1908.10530, Section 3.3). Computed in log space:
//   integer α:    the binomial expansion
//                   A_α = Σ_{k=0..α} C(α,k) (1−q)^{α−k} q^k e^{(k²−k)/(2σ²)}
//                 (summed as 1 + Σ_{k≥2} C(α,k) (1−q)^{α−k} q^k (e^{(k²−k)/(2σ²)} − 1), which keeps
//                 its digits when q is small and A_α is 1 + 1e-12);
//   fractional α: split the expectation at z0 = σ² log(1/q − 1) + ½, where the two summands of
//                 the base are equal, and expand the larger one in each half (an infinite
//                 series with generalized binomial coefficients, some negative):
//                   A_α = Σ_{k≥0} C(α,k) [ (1−q)^{α−k} q^k e^{(k²−k)/(2σ²)} ½erfc((k − z0)/(√2σ))
//                                        + q^{α−k} (1−q)^k e^{(j²−j)/(2σ²)} ½erfc((z0 − j)/(√2σ)) ],
//                 j = α − k; summed until k > α and both terms are below e^{−30}·max(1, sum so
//                 far). For k past z0 and α the terms decay only polynomially (∝ k^{−α−2}), so
//                 orders close to 1 with q near ½ and very large σ take many terms.
//  TF-Privacy's `rdp_accountant.compute_rdp` and Opacus' `compute_rdp` compute the same signed
//  series (written here from the paper, not from their code), but stop at the first term below
//  e^{−30}; for q > ½ with large σ and α that can be the very first term, far from the bulk at
//  k ≈ α (tested). dp_accounting's current `RdpAccountant` (behind TF-Privacy today) adds the
//  absolute values of all terms instead: an upper bound, 3 % above the exact value at α = 1.5 in
//  its own test case and equal at integer orders (see rdp_test.cc, TfPrivacyComputeRdp).
//  q = 0 gives 0; q = 1 gives α/(2σ²) exactly.
//
// ─── Composition ──────────────────────────────────────────────────────────────────────────────
//  RDP composes additively at each order: T rounds (any mix of q and σ) spend Σ_t ρ_t(α).
//
// ─── Conversion to (ε, δ)-DP ──────────────────────────────────────────────────────────────────
//  For each order (Balle, Barthe, Gaboardi, Hsu, Sato 2020, "Hypothesis Testing Interpretations
//  and Rényi Differential Privacy", arXiv:1905.09982, Theorem 21; Canonne, Kamath, Steinke 2020,
//  "The Discrete Gaussian for Differential Privacy", arXiv:2004.00010, Proposition 12):
//      ε(α) = ρ(α) + log((α − 1)/α) − (log δ + log α)/(α − 1),
//  and ε = max(0, min_α ε(α)). Where δ² ≥ 1 − e^{−ρ(α)}, ε = 0 at that order: D_α ≥ KL, and the
//  total variation distance is at most √(1 − e^{−KL}) (Bretagnolle–Huber), so (0, δ)-DP already
//  holds. This is what TF-Privacy (through dp_accounting's `compute_epsilon`) and Opacus'
//  `get_privacy_spent` compute today. The classic bound (Mironov 2017, Proposition 3),
//      ε(α) = ρ(α) + log(1/δ)/(α − 1),
//  which both libraries used earlier (TF-Privacy until 2020), is never smaller: the improved ε(α)
//  is the classic one plus log(1 − 1/α) − log(α)/(α − 1), which is negative for every α > 1.
//
//  The minimum is taken over a fixed list of orders, so ε is an upper bound that is only as
//  tight as the list; if the best order is the first or last one, a wider list may give a
//  smaller ε.
//
// ─── Thread safety ────────────────────────────────────────────────────────────────────────────
//  The free functions are pure and may be called from any thread. RdpAccountant has no locking:
//  const members may run concurrently, add() needs the caller to serialize it with every other
//  call on the same object (give each accountant one owning thread).
//
// Bad input (σ ≤ 0 or not finite, q outside [0, 1], δ outside (0, 1), an order ≤ 1 or not
// finite, mismatched lengths, a negative RDP value, negative steps) throws nebula::Error naming
// the argument and the value.
#pragma once

#include <cstdint>
#include <vector>

namespace nebula::privacy {

// The orders Opacus' RDPAccountant uses by default (RDPAccountant.DEFAULT_ALPHAS): 1.1, 1.2, …,
// 10.9 (99 orders) and 12, 13, …, 63 (52 orders), ascending. Other lists in use, to pass to
// RdpAccountant's constructor for a like-for-like comparison: dp_accounting's RdpAccountant
// (behind TF-Privacy today) adds 11, 128, 256, 512 and 1024 to these; TF-Privacy's
// compute_dp_sgd_privacy uses 1.25, 1.5, 1.75, 2, 2.25, 2.5, 3, 3.5, 4, 4.5, 5…63, 128, 256, 512.
std::vector<double> default_orders();

// RDP at `order` of one Gaussian mechanism with noise multiplier `sigma` (sensitivity 1):
// order / (2 sigma²).
double rdp_gaussian(double sigma, double order);

// RDP at `order` of one Poisson-sampled Gaussian mechanism with sampling rate `q` (see the top
// of this file). 0 for q = 0; rdp_gaussian(sigma, order) for q = 1. `order` at most 1e6 (the
// series run past the order; published order lists stop at 4096). May be +inf when the value
// overflows a double (σ tiny, order large).
double rdp_sampled_gaussian(double q, double sigma, double order);

// The privacy spent: ε at the δ asked for, and the order at which the minimum was reached.
struct PrivacySpent {
  double epsilon;
  double order;
};

// ε at `delta` from RDP values `rdp[i]` at `orders[i]` (the improved conversion above, minimised
// over the orders; ties go to the first). `orders` non-empty, each finite and > 1; `rdp` the
// same length, each ≥ 0 (+inf allowed: that order gives ε = +inf). Every order giving +inf
// makes ε = +inf with the first order.
PrivacySpent epsilon_from_rdp(const std::vector<double>& orders, const std::vector<double>& rdp,
                              double delta);

// Accumulates the RDP of a run, one synchronization round (or a batch of identical rounds) at a
// time, at a fixed list of orders. Cheap to copy.
class RdpAccountant {
 public:
  // `orders`: non-empty, each > 1 and at most 1e6 (what rdp_sampled_gaussian accepts).
  explicit RdpAccountant(std::vector<double> orders = default_orders());

  // Records `steps` rounds of the Poisson-sampled Gaussian mechanism with rate `q` and noise
  // multiplier `sigma`. steps = 0 records nothing (the arguments are still checked).
  void add(double q, double sigma, int64_t steps = 1);

  // ε at `delta` for everything recorded so far (ε = 0 before the first round).
  PrivacySpent spent(double delta) const;

  // Rounds recorded so far (the sum of add()'s steps).
  int64_t steps() const { return steps_; }

  const std::vector<double>& orders() const { return orders_; }
  // The accumulated RDP, one value per order.
  const std::vector<double>& rdp() const { return rdp_; }

 private:
  std::vector<double> orders_;
  std::vector<double> rdp_;
  int64_t steps_ = 0;
};

}  // namespace nebula::privacy
