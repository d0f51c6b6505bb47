// The inner optimizer's state (AdamW moments and step counts) and LibTorch's default CPU
// generator (dropout) in a checkpoint, so that a resumed worker continues exactly.
//
//   tensors  optim/I/exp_avg, optim/I/exp_avg_sq (and optim/I/max_exp_avg_sq with amsgrad),
//            I = the parameter's index in the optimizer's list; rng/torch_cpu (uint8)
//   state    "optim": {"steps": [step of parameter I ...]}
#pragma once

#include <torch/optim/adamw.h>

#include <vector>

#include "parallel/checkpoint.h"

namespace nebula::parallel {

void save_optimizer(const torch::optim::AdamW& optimizer, const std::vector<at::Tensor>& params, Checkpoint& out);
// DataError naming the entry that is missing or of the wrong shape.
void load_optimizer(torch::optim::AdamW& optimizer, const std::vector<at::Tensor>& params, const Checkpoint& in);

void save_torch_rng(Checkpoint& out);
void load_torch_rng(const Checkpoint& in);

}  // namespace nebula::parallel
