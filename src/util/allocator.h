// The process's allocator, in one place. The nebula binary is linked with jemalloc
// (src/cli/CMakeLists.txt) and runs it with its defaults: freed pages decay back to the system
// over ~10 s. Measured (a 57.5M-parameter encoder, ZeRO-3, 2 sites x 4 workers, 4 steps, peak RSS
// of the step phase per worker): glibc as tuned below 902-956 MiB and jemalloc 785-810 MiB, back
// to back at e427317; jemalloc with its decay off 918-983 MiB (a later run, the same job): so the
// saving is the decay, which gives back between steps what a heap would keep. Its cost: a large buffer allocated afresh pays its page
// faults again, e.g. 16M-float codec round trips at 1.1-1.3 GB/s instead of 2.6-5.5
// (bench/codec_bench under LD_PRELOAD; per WAN exchange, not per step). ZeRO-3's gathered units
// do not pay it (UnitBlocks keeps them).
//
// Processes that did not choose their allocator (a Python interpreter importing the nebula
// module, a program linking the library, the benchmarks) keep the one they have, usually
// glibc's, which tune_allocator() tunes: by default every allocation above its mmap threshold
// (which adapts up to 32 MiB) is a fresh mmap returned with munmap, so a 64 MiB tensor or
// payload allocated once per step pays its page faults every time (at 16 M floats every codec,
// `none` included, ran at 1-2 GB/s instead of 4-9); the mmap and trim thresholds are raised to
// 1 GiB, so freed large blocks stay in the heap for reuse, and the process keeps its peak heap
// until release_free_memory(). With jemalloc there is nothing to tune. Found at run time, so both
// work in any process. Called at the start of the nebula binary and of the benchmarks, and by
// every nebula::Session. Thread-safe; false if glibc refused.
#pragma once

namespace nebula {

bool tune_allocator();
// Gives the allocator's free memory back to the system (glibc: malloc_trim; jemalloc: purge
// every arena): for the rare moment one kind of work hands over to another of its own size,
// e.g. an outer step after the training step freed its activations (and back), so that the
// process's peak is the larger of the two, not their sum. A few milliseconds per GiB freed; the
// next step pays its page faults once.
void release_free_memory();
// "jemalloc" or "glibc": which allocator serves this process's malloc (for the log).
const char* allocator_name();

}  // namespace nebula
