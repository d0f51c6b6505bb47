// ZeRO-3's unit all-gather (SiteGroup::all_gather_parts over a unit cut into N even pieces: the
// part ring, every rank sending in every step) against c10d Gloo's own allgather of the same
// bytes, side by side on one site of N ranks (threads of this process, loopback TCP); and the
// unit reduce-scatter's throughput (Debian's Gloo has no reduce_scatter to set beside it).
// Throughput = the unit's bytes over the collective's wall time (the slowest rank's).
//   site_bench [unit MiB, default 16] [seconds per row, default 1]
// The test suite runs `site_bench 1 0.05` (tiny: the bench works, the numbers mean nothing).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdio>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collective/testing.h"
#include "parallel/shard_layout.h"

using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// c10d Gloo groups of `n` ranks on loopback, one per thread, made together.
std::vector<c10::intrusive_ptr<c10d::ProcessGroupGloo>> gloo_groups(int n) {
  c10d::TCPStoreOptions so;
  so.port = 0;
  so.isServer = true;
  so.numWorkers = n;
  so.waitWorkers = false;
  auto server = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  std::vector<std::future<c10::intrusive_ptr<c10d::ProcessGroupGloo>>> made;
  for (int r = 0; r < n; ++r)
    made.push_back(std::async(std::launch::async, [&, r] {
      c10d::TCPStoreOptions o;
      o.port = server->getPort();
      auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
      auto opts = c10d::ProcessGroupGloo::Options::create();
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      return c10::make_intrusive<c10d::ProcessGroupGloo>(store, r, n, opts);
    }));
  std::vector<c10::intrusive_ptr<c10d::ProcessGroupGloo>> out;
  for (auto& f : made) out.push_back(f.get());
  return out;
}

// Runs fn(rank) on n threads `reps` times in lock step; the mean seconds per rep (each rep's
// time is its slowest rank's: a barrier-free collective ends when every rank has its result).
template <typename F>
double timed(int n, int reps, F&& fn) {
  std::vector<std::thread> threads;
  std::vector<double> took(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      fn(r);  // warm-up: connections, buffers
      const auto start = Clock::now();
      for (int i = 0; i < reps; ++i) fn(r);
      took[static_cast<size_t>(r)] = seconds_since(start) / reps;
    });
  for (auto& t : threads) t.join();
  double slowest = 0;
  for (double t : took) slowest = std::max(slowest, t);
  return slowest;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t mib = argc > 1 ? std::stoll(argv[1]) : 16;
  const double seconds = argc > 2 ? std::stod(argv[2]) : 1.0;
  at::set_num_threads(1);  // one LibTorch thread per rank, as a worker runs
  // A unit of `mib` MiB less 3 values: no multiple of 2 or 4, so the pieces differ by one, as a layer's do.
  const int64_t numel = mib * (1 << 18) - 3;
  std::printf("unit of %lld float32 values (%.1f MiB), one site on loopback, %s s per row\n",
              static_cast<long long>(numel), numel * 4.0 / (1 << 20), argv[2] ? argv[2] : "1");
  std::printf("%-3s %-42s %10s %10s\n", "N", "collective", "GB/s", "vs Gloo");
  for (int n : {2, 4}) {
    const nebula::parallel::ShardLayout layout({0, numel}, n);
    const std::vector<int64_t> counts = layout.piece_counts(0);
    // Gloo's allgather needs equal inputs: every rank's piece padded to P_u (the layout's slot).
    const int64_t slot = layout.piece_numel(0);
    auto groups = gloo_groups(n);
    std::vector<std::vector<at::Tensor>> inputs(static_cast<size_t>(n)), gathered(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) {
      inputs[static_cast<size_t>(r)] = {at::full({slot}, static_cast<float>(r))};
      for (int q = 0; q < n; ++q) gathered[static_cast<size_t>(r)].push_back(at::empty({slot}));
    }
    // Enough reps for `seconds` at ~1 GB/s, at least 2.
    const int reps = std::max(2, static_cast<int>(seconds * 1e9 / (numel * 4.0)));
    const double gloo_gather = timed(n, reps, [&](int r) {
      std::vector<std::vector<at::Tensor>> out{gathered[static_cast<size_t>(r)]};
      groups[static_cast<size_t>(r)]->allgather(out, inputs[static_cast<size_t>(r)])->wait();
    });
    double ours_gather = 0, ours_reduce = 0;
    nebula::collective::testing::run_site(
        "site-bench-" + std::to_string(n), n,
        [&](nebula::collective::SiteGroup& site) {
          // Every rank times its own loop; the site's rows are its slowest rank's.
          at::Tensor unit = at::zeros({numel});
          auto loop = [&](auto&& op) {
            op();
            site.barrier();
            const auto start = Clock::now();
            for (int i = 0; i < reps; ++i) op();
            return seconds_since(start) / reps;
          };
          const double g = loop([&] { site.all_gather_parts(unit, counts); });
          const double s = loop([&] { site.reduce_scatter_parts(unit, counts); });
          static std::mutex mu;
          std::lock_guard<std::mutex> lock(mu);
          ours_gather = std::max(ours_gather, g);
          ours_reduce = std::max(ours_reduce, s);
        },
        std::chrono::seconds(300));
    const double bytes = numel * 4.0;
    std::printf("%-3d %-42s %10.2f %9s\n", n, "c10d Gloo allgather (pieces padded to P_u)", bytes / gloo_gather / 1e9, "1.00x");
    std::printf("%-3d %-42s %10.2f %9.2fx\n", n, "unit all_gather_parts (part ring)", bytes / ours_gather / 1e9,
                gloo_gather / ours_gather);
    std::printf("%-3d %-42s %10.2f %9s\n", n, "unit reduce_scatter_parts (part ring)", bytes / ours_reduce / 1e9, "-");
  }
  return 0;
}
