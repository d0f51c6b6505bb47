// A worker's checkpoints: everything it needs to continue (the model, all of it: PEFT's frozen
// part too; the inner optimizer, sharded or not; LibTorch's generator; the task's data
// position; the strategy and its codecs; the worker's own progress), written to its own
// directory CHECKPOINT_DIR/SITE/rank-R, and the resume that finds the newest step every worker
// that must agree holds (the site's with diloco/streaming, whose sites then reconcile; the
// job's with sync) and restores it, resharding when the site's workers or [parallel] shard
// changed since it was written, and cutting the model anew when the site's pipeline stages or
// tensor slices did (each checkpoint records how its worker held the model).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "collective/hierarchical.h"
#include "nebula/config.h"
#include "parallel/full_shard.h"
#include "parallel/inner_optimizer.h"
#include "strategy/strategy.h"
#include "train/task.h"

namespace nebula::train {

// The worker's own counters that a checkpoint carries.
struct WorkerProgress {
  int64_t step = 0;                 // steps done
  int64_t tokens = 0;               // this worker's input tokens so far
  std::vector<double> eval_start;   // the evaluation at step 0 (for the summary)
};

class WorkerCheckpoints {
 public:
  // The parts it saves and restores; all outlive it. `full`: ZeRO-3's, or null. `layout`: how
  // this worker's site holds the whole model's flat vector; `outer_per_part`: the strategy's
  // state is its stage's or slice's (a one-site job's), not the whole model's.
  WorkerCheckpoints(const Config& config, const WorkerIdentity& who, collective::Hierarchy& comm, Task& task,
                    parallel::InnerOptimizer& optimizer, strategy::Strategy& strategy, parallel::FullShard* full,
                    strategy::SiteLayout layout, bool outer_per_part);

  // Writes the checkpoint of `progress.step` (keeping checkpoint.keep). Every worker of the
  // site calls it at the same step, when strategy.can_save().
  void save(const WorkerProgress& progress);
  // --resume / --rejoin: restores the newest step that every worker that must agree holds
  // and returns its progress; nothing when there is none (a warning: start from step 0).
  // A collective over the job. DataError when the checkpoints of that step are not intact.
  std::optional<WorkerProgress> restore_newest();

 private:
  std::string rank_dir(int rank) const;
  // restore_newest onto another layout of stages or slices: the old workers' checkpoints of step
  // `target` (rank 0's state then carries this worker's progress).
  void restore_relaid(std::vector<parallel::Checkpoint>& ranks, int64_t target);

  const Config& c_;
  WorkerIdentity who_;
  collective::Hierarchy& comm_;
  Task& task_;
  parallel::InnerOptimizer& optimizer_;
  strategy::Strategy& strategy_;
  parallel::FullShard* full_;
  strategy::SiteLayout layout_;
  bool outer_per_part_;
  std::string dir_;          // this worker's
  std::string fingerprint_;  // of the training config: a checkpoint of another job is not loaded
};

}  // namespace nebula::train
