// The knowledge-distillation loss of a student against a teacher's top-k distribution
// (topk.h), as received from a remote teacher (teacher_service.h).
//
//   kd_loss = T² · mean over the N tokens of  Σ_{i in top-k} q_i (log q_i − log s_i)
//
// where s = softmax(student_logits / T) over the whole vocabulary and q = the teacher's top-k
// probabilities renormalised to sum 1 per row (terms with q_i = 0 contribute 0). This is
// KL(q ‖ s) restricted to the teacher's support: the student is pulled towards the teacher's
// shape on the entries that carry its mass, and, through the softmax, away from every other
// entry. The T² factor keeps gradient magnitudes comparable across temperatures (Hinton et
// al. 2015), so α need not be retuned when T changes.
//
// The caller mixes it with the usual cross-entropy on the reference tokens:
//     loss = (1 − α) · CE(student_logits, labels) + α · kd_loss(student_logits, teacher, T)
// with the teacher's top-k computed at the same T (top_k(logits, k, T) on the teacher side;
// ServeOptions::temperature). With a one-hot teacher and T = 1, kd_loss equals CE to that token.
//
// Differentiable with respect to student_logits (the teacher is a constant). Computed in
// float32 on the student's device (the teacher's tensors are moved there). Pure; thread-safe.
#pragma once

#include <ATen/core/Tensor.h>

#include "distill/topk.h"

namespace nebula::distill {

// student_logits: [N, V] floating point with V == teacher.vocab; teacher.index/prob: [N, k].
// Returns a scalar (float32). N = 0 gives 0 (still attached to the graph). Preconditions
// (nebula::Error): the shapes above, temperature > 0 and finite, every teacher row with a
// positive sum.
at::Tensor kd_loss(const at::Tensor& student_logits, const TopK& teacher, double temperature);

}  // namespace nebula::distill
