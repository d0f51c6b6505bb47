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
// Gives the heap's free memory back to the system (malloc_trim): for the rare moment one kind
// of work hands over to another of its own size, e.g. an outer step after the training step
// freed its activations (and back), so that the process's peak is the larger of the two, not
// their sum. A few milliseconds per GiB freed; the next step pays its page faults once.
void release_free_memory();

}  // namespace nebula
