// What a built-in model calls around each of its layers, so that ZeRO-3 ([parallel] shard =
// "full", parallel/full_shard.h) can keep the layer's parameters sharded over the site's workers
// and gather them only while the layer runs. Without a LayerGather set, a model calls its
// layers directly (and nothing here is used).
//
// The model hands over the layer, its differentiable inputs (activations) and a body that
// computes the layer's output from them. The body may be called again later (ZeRO-3 recomputes
// the layer in backward), so it must capture what else it needs (masks, the layer) by value.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <vector>

namespace nebula::model {

class LayerGather {
 public:
  virtual ~LayerGather() = default;
  using Body = std::function<at::Tensor(const std::vector<at::Tensor>& inputs)>;
  // body(inputs) with `layer`'s parameters present; returns its output.
  virtual at::Tensor run(torch::nn::Module& layer, const std::vector<at::Tensor>& inputs, const Body& body) = 0;
};

// Runs `body` through `gather` if one is set, else directly.
inline at::Tensor run_layer(LayerGather* gather, torch::nn::Module& layer, const std::vector<at::Tensor>& inputs,
                            const LayerGather::Body& body) {
  return gather ? gather->run(layer, inputs, body) : body(inputs);
}

}  // namespace nebula::model
