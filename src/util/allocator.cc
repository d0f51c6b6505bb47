#include "util/allocator.h"

#include <malloc.h>

namespace nebula {

bool tune_allocator() {
  constexpr int kThreshold = 1 << 30;
  return ::mallopt(M_MMAP_THRESHOLD, kThreshold) == 1 && ::mallopt(M_TRIM_THRESHOLD, kThreshold) == 1;
}

void release_free_memory() { ::malloc_trim(0); }

}  // namespace nebula
