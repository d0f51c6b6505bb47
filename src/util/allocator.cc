#include "util/allocator.h"

#include <dlfcn.h>
#include <malloc.h>

#include <cstddef>
#include <cstring>

namespace nebula {
namespace {

// jemalloc's control interface, if jemalloc serves this process's malloc: looked up rather than
// linked, so that the library and the Python module, which run under whatever allocator their
// host chose, need no jemalloc; and only when the library that defines the malloc in use is
// jemalloc (a glibc shim preloaded before it, bench/glibc_malloc.c, makes glibc serve instead).
using Mallctl = int (*)(const char*, void*, std::size_t*, void*, std::size_t);
Mallctl jemalloc_ctl() {
  static const Mallctl ctl = []() -> Mallctl {
    Dl_info info{};
    void* serving = ::dlsym(RTLD_DEFAULT, "malloc");
    if (!serving || !::dladdr(serving, &info) || !info.dli_fname || !std::strstr(info.dli_fname, "jemalloc"))
      return nullptr;
    return reinterpret_cast<Mallctl>(::dlsym(RTLD_DEFAULT, "mallctl"));
  }();
  return ctl;
}

}  // namespace

bool tune_allocator() {
  if (jemalloc_ctl()) return true;  // its own defaults (allocator.h says why)
  constexpr int kThreshold = 1 << 30;
  return ::mallopt(M_MMAP_THRESHOLD, kThreshold) == 1 && ::mallopt(M_TRIM_THRESHOLD, kThreshold) == 1;
}

void release_free_memory() {
  if (Mallctl ctl = jemalloc_ctl()) {
    ctl("thread.tcache.flush", nullptr, nullptr, nullptr, 0);
    ctl("arena.4096.purge", nullptr, nullptr, nullptr, 0);  // 4096: MALLCTL_ARENAS_ALL, every arena
    return;
  }
  ::malloc_trim(0);
}

const char* allocator_name() { return jemalloc_ctl() ? "jemalloc" : "glibc"; }

}  // namespace nebula
