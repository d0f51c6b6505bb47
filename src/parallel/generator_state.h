// The random generator dropout draws from on a device, saved before a forward and set again
// before the same forward runs a second time (activation recomputation: ZeRO-3's layers,
// parallel/full_shard.h, and pipeline stages, parallel/pipeline.h), so the second run draws the
// same masks and computes what the first did.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <mutex>

namespace nebula::parallel {

// The generator dropout draws from on `device` (the CPU's, or the GPU's).
inline at::Generator generator_of(const at::Device& device) {
  return device.is_cpu() ? at::detail::getDefaultCPUGenerator() : at::globalContext().defaultGenerator(device);
}

inline at::Tensor generator_state(const at::Device& device) {
  at::Generator g = generator_of(device);
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}

inline void set_generator_state(const at::Device& device, const at::Tensor& state) {
  at::Generator g = generator_of(device);
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(state);
}

}  // namespace nebula::parallel
