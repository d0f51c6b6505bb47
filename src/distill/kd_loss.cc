#include "distill/kd_loss.h"

#include <ATen/ATen.h>

#include <cmath>

#include "nebula/error.h"

namespace nebula::distill {

at::Tensor kd_loss(const at::Tensor& student_logits, const TopK& teacher, double temperature) {
  NEBULA_CHECK(student_logits.dim() == 2, "kd_loss: student logits must be [N, V], got ", student_logits.sizes());
  NEBULA_CHECK(at::isFloatingType(student_logits.scalar_type()), "kd_loss: student logits must be floating point");
  NEBULA_CHECK(student_logits.size(1) == teacher.vocab, "kd_loss: student vocab ", student_logits.size(1),
               " != teacher vocab ", teacher.vocab);
  NEBULA_CHECK(teacher.index.dim() == 2 && teacher.prob.sizes() == teacher.index.sizes() &&
                   teacher.index.size(0) == student_logits.size(0),
               "kd_loss: teacher index ", teacher.index.sizes(), " and prob ", teacher.prob.sizes(),
               " must be [N, k] with N = ", student_logits.size(0));
  NEBULA_CHECK(temperature > 0 && std::isfinite(temperature), "kd_loss: temperature ", temperature);
  const at::Tensor s = student_logits.to(at::kFloat);
  if (s.size(0) == 0) return s.sum() * 0.0;

  const at::Tensor index = teacher.index.to(s.device(), at::kLong);
  const at::Tensor p = teacher.prob.to(s.device(), at::kFloat);
  const at::Tensor sum = p.sum(1, /*keepdim=*/true);
  NEBULA_CHECK((sum > 0).all().item<bool>(), "kd_loss: a teacher row has no probability mass");
  const at::Tensor q = p / sum;
  const at::Tensor log_s = at::log_softmax(s / temperature, 1).gather(1, index);
  // Σ q log q (xlogy: 0 log 0 = 0) needs no gradient; Σ q log s carries it.
  const at::Tensor per_token = at::xlogy(q, q).sum(1) - (q * log_s).sum(1);
  return per_token.mean() * (temperature * temperature);
}

}  // namespace nebula::distill
