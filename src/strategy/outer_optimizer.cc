#include "strategy/outer_optimizer.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace nebula::strategy {

void OuterSgd::step(at::Tensor& global, at::Tensor& momentum, at::Tensor update) const {
  const double mu = options_.momentum;
  if (mu > 0) {
    momentum.mul_(mu).add_(update);
    if (options_.nesterov) {  // update + (mu m), the product rounded first
      const int64_t len = global.numel();
      for (int64_t at = 0; at < len; at += kSlice) {
        const int64_t k = std::min(kSlice, len - at);
        update.narrow(0, at, k).add_(momentum.narrow(0, at, k) * mu);
      }
    } else {
      update = momentum;
    }
  }
  global.sub_(update, options_.lr);
}

}  // namespace nebula::strategy
