// DiLoCo's outer optimizer: SGD with (Nesterov) momentum on the pseudo-gradient Δ̄ (the sites'
// mean of θ_global − θ_local), applied to θ_global:
//
//   m ← μ m + Δ̄        θ_global ← θ_global − lr (Δ̄ + μ m)     (Nesterov)
//                      θ_global ← θ_global − lr m            (plain momentum; μ = 0: plain SGD)
//
// Elementwise and in place over whatever part of the model a worker holds (a fragment, or its
// ZeRO shard of one): every worker of every site runs the same float32 operations in the same
// order on the same values, so all end bit-identical, and a sharded run equals the unsharded one
// bit for bit. No state of its own: the momentum is the caller's (one per fragment part).
// Not thread-safe per tensor; the training thread's.
#pragma once

#include <ATen/core/Tensor.h>

namespace nebula::strategy {

struct OuterSgdOptions {
  double lr = 0.7;
  double momentum = 0.9;  // μ; 0 = no momentum (the momentum tensor is left untouched)
  bool nesterov = true;
};

class OuterSgd {
 public:
  explicit OuterSgd(OuterSgdOptions options) : options_(options) {}
  // One outer step on `global` (θ_global, float32, 1-D) with `update` (Δ̄, as many values):
  // `momentum` (as many values) is updated in place; with Nesterov, `update` is overwritten with
  // Δ̄ + μ m (the product rounded to float32 first), computed in slices so that no copy of the
  // model is made. The caller drops `update` afterwards.
  void step(at::Tensor& global, at::Tensor& momentum, at::Tensor update) const;
  const OuterSgdOptions& options() const { return options_; }

  // Elementwise work on the whole model goes in slices of this many values.
  static constexpr int64_t kSlice = 1 << 16;

 private:
  OuterSgdOptions options_;
};

}  // namespace nebula::strategy
