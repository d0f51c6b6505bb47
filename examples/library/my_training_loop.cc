// A user's own LibTorch training loop — its model, data, optimizer and loop — with nebula doing
// the communication across sites (include/nebula/session.h), like wrapping a model in DDP.
//
//   my_training_loop CONFIG [--site NAME --rank N] [--steps N] [--hidden N]
//
// Without --site/--rank it reads NEBULA_SITE/NEBULA_RANK, or torchrun's, Open MPI's or Slurm's
// variables (nebula/placement.h). Start one process per worker of every site in CONFIG
// ([[sites]], [wan], [strategy], [security] as for `nebula run`; the rest is not used);
// examples/library/job.toml and its header show a local run.
//
// The task: regression of a fixed smooth function of 16 inputs with a small MLP. Each site
// draws its inputs from its own region of the space (its data never leaves it); the job
// learns the function on all of them.
#include <nebula/session.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <zlib.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "nebula/error.h"

namespace {

constexpr int64_t kInputs = 16;

// The function to learn: the same on every worker (its own generator, seeded alike).
at::Tensor target(const at::Tensor& x) {
  static const at::Tensor w = [] {
    at::Generator g = at::detail::createCPUGenerator(1234);
    return at::randn({kInputs, 4}, g) * 0.25;
  }();
  return at::sin(at::matmul(x, w)).sum(1, /*keepdim=*/true);
}

// A batch of this site's data: inputs centred on the site's own point.
at::Tensor site_inputs(int64_t rows, size_t site, at::Generator& g) {
  return at::randn({rows, kInputs}, g) * 0.7 + (static_cast<double>(site) - 0.5);
}

// CRC-32 of the parameters' bytes: equal on every worker when the replicas agree.
uint32_t crc_of(const std::vector<at::Tensor>& params) {
  uLong crc = crc32(0, nullptr, 0);
  for (const auto& p : params) {
    const at::Tensor c = p.contiguous();
    crc = crc32(crc, static_cast<const Bytef*>(c.data_ptr()), static_cast<uInt>(c.numel() * sizeof(float)));
  }
  return static_cast<uint32_t>(crc);
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CONFIG [--site NAME --rank N] [--steps N] [--hidden N]\n", argv[0]);
    return 2;
  }
  std::string site, rank;
  int64_t steps = -1;
  int64_t hidden = 64;  // the MLP's width (bench/python.sh also runs a wider one)
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--site") site = argv[i + 1];
    else if (flag == "--rank") rank = argv[i + 1];
    else if (flag == "--steps") steps = std::atoll(argv[i + 1]);
    else if (flag == "--hidden") hidden = std::atoll(argv[i + 1]);
    else throw nebula::ConfigError("unknown option " + flag + " (use --site, --rank, --steps, --hidden)");
  }
  if (hidden < 1) throw nebula::ConfigError("--hidden " + std::to_string(hidden) + ": want a positive width");
  nebula::Config config = nebula::load_config(argv[1]);
  if (steps >= 0) config.job.steps = steps;
  nebula::set_cpu_threads(1);  // several workers per machine in the local run

  // Joins the site's group and, on the site's gateway, the other sites (mutual TLS).
  nebula::Session session(config, nebula::resolve_placement(config, site, rank, [](const char* v) { return std::getenv(v); }));

  at::manual_seed(config.job.seed);  // only global rank 0's initial weights matter: the Synchronizer spreads them
  // The layers are made (and draw their initial weights) in this order: as constructor arguments
  // their order would be the compiler's (GCC makes the last first), and the Python twin
  // (examples/python/my_training_loop.py) would start from other weights.
  torch::nn::Linear first(kInputs, hidden), output(hidden, 1);
  torch::nn::Sequential model(first, torch::nn::Tanh(), output);
  std::vector<at::Tensor> params = model->parameters();
  nebula::Synchronizer sync(session, params);  // [strategy]: every replica starts from global rank 0's weights
  torch::optim::Adam optimizer(params, torch::optim::AdamOptions(3e-3));

  at::Generator data = at::detail::createCPUGenerator(1000 + session.global_rank());
  at::Generator held_out = at::detail::createCPUGenerator(99);  // the same test inputs everywhere: all sites' regions
  const at::Tensor test_x =
      at::cat({site_inputs(256, 0, held_out), site_inputs(256, config.sites.size() - 1, held_out)});
  auto test_loss = [&] {  // averaged over every worker of every site with the hierarchical all-reduce
    at::NoGradGuard no_grad;
    at::Tensor l = torch::nn::functional::mse_loss(model->forward(test_x), target(test_x)).reshape({1});
    session.allreduce(l);
    return l.item<double>();
  };
  const double initial = test_loss();

  constexpr int64_t kBatch = 32;
  int64_t step = 0;
  const auto loop_start = std::chrono::steady_clock::now();
  for (; sync.keep_training(step); ++step) {
    const at::Tensor x = site_inputs(kBatch, session.site_index(), data);
    at::Tensor loss = torch::nn::functional::mse_loss(model->forward(x), target(x));
    optimizer.zero_grad();
    sync.before_backward(kBatch);
    loss.backward();
    sync.sync_gradients(kBatch);  // sync: the gradients are now the job's mean
    optimizer.step();
    sync.observe_loss(loss.item<double>());  // what a controller watching quality reads (max_loss_penalty)
    sync.after_step(step);        // diloco/streaming: the outer step every H inner steps
  }
  sync.finish();
  const double loop_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - loop_start).count();
  const double final_loss = test_loss();

  std::printf("%s/%d: %s, %lld local steps, parameters crc32 %08x, WAN bytes sent %llu\n", session.site().c_str(),
              session.local_rank(), sync.name().c_str(), static_cast<long long>(step), crc_of(params),
              static_cast<unsigned long long>(session.wan_bytes_sent()));
  std::printf("%s/%d: %.0f examples/s in the loop\n", session.site().c_str(), session.local_rank(),
              static_cast<double>(step * kBatch) / loop_seconds);
  if (session.global_rank() == 0)
    std::printf("test loss, mean over %d workers on %zu sites: %.4f -> %.4f\n", session.world_size(),
                config.sites.size(), initial, final_loss);
  return 0;
} catch (const nebula::ConfigError& e) {
  std::fprintf(stderr, "config: %s\n", e.what());
  return 2;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
