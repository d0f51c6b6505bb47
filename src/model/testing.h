// Test helpers of the model layer: the smallest MlmEncoder configuration the multi-rank
// strategy tests train (fast enough to run many steps on many threads), and error_of.
#pragma once

#include <string>

#include "nebula/config.h"
#include "nebula/error.h"

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

// The message of the DataError `fn` throws, or "no error".
template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const DataError& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace nebula::model::testing
