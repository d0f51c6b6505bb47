// A deliberate data race for scripts/check_threads.sh: with scripts/tsan.supp in force,
// ThreadSanitizer must still report a race in nebula code, both on a plain variable and on
// tensor memory that two of our threads write through data_ptr (the suppressions cover
// only accesses made inside LibTorch, Gloo, OpenMP and exception_ptr). If this program
// exits 0 under TSan, the suppressions hide our own code and the check is void.
// Built only with -DNEBULA_SANITIZE=thread; not a test of nebula.
#include <ATen/ATen.h>

#include <cstdio>
#include <thread>

namespace {
int counter = 0;  // unsynchronised on purpose
}

int main() {
  at::Tensor t = at::zeros({16});
  float* p = t.data_ptr<float>();
  auto writer = [&](float v) {
    for (int i = 0; i < 1000; ++i) {
      p[i % 16] = v;
      ++counter;
    }
  };
  std::thread a(writer, 1.0f), b(writer, 2.0f);
  a.join();
  b.join();
  std::printf("canary done (counter %d); ThreadSanitizer must have reported races above\n", counter);
  return 0;
}
