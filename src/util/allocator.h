// glibc's allocator, tuned for nebula's buffers. By default glibc serves every allocation above
// its mmap threshold (which adapts up to 32 MiB) with a fresh mmap and returns it with munmap,
// so a 64 MiB tensor or payload allocated once per step pays its page faults every time: at
// 16 M floats every codec, `none` included, ran at 1-2 GB/s instead of 4-9 (bench/codec_bench).
// tune_allocator() raises the mmap and trim thresholds to 1 GiB, so freed large blocks stay in
// the heap and the next allocation of that size reuses them. The cost: a process keeps its peak
// heap (it trims nothing under 1 GiB). Called at the start of the nebula binary and of the
// benchmarks, and by every nebula::Session (so C++ library and Python jobs get it too). Thread-safe; returns false if glibc refused.
#pragma once

namespace nebula {

bool tune_allocator();

}  // namespace nebula
