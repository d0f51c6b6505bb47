// Test helper: the smallest MlmEncoder configuration the multi-rank strategy tests train
// (fast enough to run many steps on many threads).
#pragma once

#include "nebula/config.h"

namespace nebula::model::testing {

inline ModelConfig tiny_model_config() {
  ModelConfig c;
  c.dim = 16;
  c.layers = 1;
  c.heads = 2;
  c.ffn = 32;
  c.max_len = 12;
  return c;
}

}  // namespace nebula::model::testing
