// The merge gap (controller.h, "Watching quality"): from one worker's training losses around an
// outer step, how much worse the merged model does than its local model was heading to:
//
//   expected = mean(last m losses of the round) + slope · m, the slope from the round's second
//              half (mean of its last m minus mean of the m from its middle, over their distance)
//   gap      = (mean(first m losses after the outer step) - expected) / expected
//
// with m = max(1, min(10, round length / 4)). Negative when the merged model does better. One
// gap is noisy (on the demo, two rounds at one setting measured 1.8 % and -1.1 %), so gap() is
// the mean of the gaps measured in a row at one setting, count() how many. Plain numbers, no
// tensors: the strategy feeds it.
#pragma once

#include <cstdint>
#include <vector>

namespace nebula::strategy {

class MergeGap {
 public:
  // A step's training loss (this worker's, before its optimizer step). Non-finite ones are
  // left out.
  void observe(double loss);
  // The round's outer step is applied: the losses from the next step are the merged model's.
  // `reduction`: the setting's (setting_reduction), sent with the gap it gives.
  void merged(double reduction);
  // The mean of the gaps measured in a row at the last setting, their setting's reduction and
  // their count (all 0 before the first).
  double gap() const { return gap_; }
  double reduction() const { return reduction_; }
  int64_t count() const { return count_; }

 private:
  std::vector<double> round_;  // the losses since the last outer step
  int64_t window_ = 0;         // m of the pending measurement (0: none pending)
  double expected_ = 0, pending_reduction_ = 0;
  double gap_ = 0, reduction_ = 0;
  int64_t count_ = 0;
};

}  // namespace nebula::strategy
