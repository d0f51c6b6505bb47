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

// While a BuildSink is installed on this thread (SinkScope), a built-in model hands it each
// layer as soon as the layer is built, before the next one is: ZeRO-3 keeps this worker's piece
// of the layer and lets go of the rest (parallel/full_shard.h, PieceKeeper), so the model is
// never whole on a worker. Without one, nothing happens.
class BuildSink {
 public:
  virtual ~BuildSink() = default;
  virtual void layer_built(torch::nn::Module& layer) = 0;
};
BuildSink*& build_sink();  // this thread's, or null
struct SinkScope {
  explicit SinkScope(BuildSink* sink) : previous(build_sink()) { build_sink() = sink; }
  ~SinkScope() { build_sink() = previous; }
  SinkScope(const SinkScope&) = delete;
  SinkScope& operator=(const SinkScope&) = delete;
  BuildSink* previous;
};
// What a built-in model's constructor calls after building each layer.
inline void layer_built(torch::nn::Module& layer) {
  if (BuildSink* sink = build_sink()) sink->layer_built(layer);
}

// Runs `body` through `gather` if one is set, else directly.
inline at::Tensor run_layer(LayerGather* gather, torch::nn::Module& layer, const std::vector<at::Tensor>& inputs,
                            const LayerGather::Body& body) {
  return gather ? gather->run(layer, inputs, body) : body(inputs);
}

}  // namespace nebula::model
