// A Strategy decides how training uses the WAN. The training loop calls its hooks in plain
// sight (src/train/trainer.cc):
//
//   strategy->init(params)                        once: every replica starts from the same weights
//   loop: forward, zero_grad, backward,
//         strategy->sync_gradients(params, w)     w = this worker's loss terms (its weight)
//         optimizer.step()
//         strategy->after_step(step)              e.g. DiLoCo's outer step every H steps
//
// `sync` is plain synchronous data parallel: every step, full precision, every worker of every
// site. It is the baseline later strategies (diloco, streaming: issue [4/7]) are measured against.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "collective/hierarchical.h"
#include "nebula/config.h"

namespace nebula::strategy {

class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual std::string name() const = 0;
  // Makes every worker's parameters equal to global rank 0's.
  virtual void init(const std::vector<at::Tensor>& params) = 0;
  // Called after backward and before the optimizer step.
  virtual void sync_gradients(const std::vector<at::Tensor>& params, double weight) = 0;
  // Called after the optimizer step `step` (0-based).
  virtual void after_step(int64_t step) {}
};

class SyncStrategy : public Strategy {
 public:
  explicit SyncStrategy(collective::Hierarchy& comm) : comm_(comm) {}
  std::string name() const override { return "sync"; }
  void init(const std::vector<at::Tensor>& params) override;
  // One bucket: all gradients flattened, averaged weighted by `weight` over every worker.
  void sync_gradients(const std::vector<at::Tensor>& params, double weight) override;

 private:
  collective::Hierarchy& comm_;
};

std::unique_ptr<Strategy> make_strategy(const StrategyConfig& config, collective::Hierarchy& comm);

// Flattens tensors into one contiguous float32 vector, and back (in place).
at::Tensor flatten(const std::vector<at::Tensor>& tensors);
void unflatten_into(const at::Tensor& flat, const std::vector<at::Tensor>& tensors);

}  // namespace nebula::strategy
