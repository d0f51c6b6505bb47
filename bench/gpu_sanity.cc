// GPU sanity check for a CUDA build of LibTorch (built only then; run by bench/gpu_check.sh):
// one fp32 matrix product on the GPU against the same product on the CPU. Exit 0 if they agree.
#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <cstdio>

int main() {
  if (!torch::cuda::is_available()) {
    std::printf("gpu_sanity: CUDA is not available to LibTorch\n");
    return 2;
  }
  at::manual_seed(0);
  const at::Tensor a = at::randn({1024, 1024}), b = at::randn({1024, 1024});
  const at::Tensor cpu = at::mm(a, b);
  const at::Tensor gpu = at::mm(a.to(at::kCUDA), b.to(at::kCUDA)).cpu();
  const double err = (cpu - gpu).abs().max().item<double>() / cpu.abs().max().item<double>();
  std::printf("gpu_sanity: %d CUDA device(s); 1024^3 fp32 matmul, max |cpu-gpu| / max |cpu| = %.2e\n",
              int(torch::cuda::device_count()), err);
  return err < 1e-4 ? 0 : 1;
}
