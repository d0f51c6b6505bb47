#!/usr/bin/env bash
# Thread checks: the clang thread-safety analysis and ThreadSanitizer. Not part of the default
# build or of ctest: both builds are CPU heavy (about 25 min on 2 cores with a cold cache).
#   scripts/check_threads.sh          # both
#   scripts/check_threads.sh ts       # only build-clang-ts/ (the annotations, compile only)
#   scripts/check_threads.sh tsan     # only build-tsan/ (build and run the tests)
#
# build-clang-ts/: clang++ with -DNEBULA_THREAD_SAFETY=ON (-Wthread-safety as errors) on the
#   annotated code that clang can compile. Clang (14 and 16 tried) cannot parse Debian's LibTorch
#   headers in C++20 ("arithmetic on a pointer to an incomplete type 'c10::IValue'" from
#   ATen/core/ivalue_inl.h), so the targets that include torch (collective's hierarchical.cc
#   and site_group.cc, strategy/) are left out; util, wire, transport (library and tests) and
#   collective/gateway_mesh.cc are checked. GCC, which builds everything, ignores the macros.
# build-tsan/: GCC with -DNEBULA_SANITIZE=thread; builds transport_test, collective_test and
#   strategy_test and runs them with scripts/tsan.supp, which makes TSan ignore the accesses
#   made inside LibTorch, Gloo, OpenMP and OpenBLAS (not built with TSan, so their own
#   synchronisation is invisible to it) and exception_ptr's refcount, never our code. Any
#   other report fails the run. First tests/tsan_canary, a deliberate race in our code (on a
#   variable and on tensor memory), must be reported: else the suppressions hide our code.
# JOBS (default 2) sets the build parallelism; TSAN_TESTS (paths under build-tsan/) narrows
# the tests. Exits non-zero if a build fails, or after the runs if a test or TSan failed.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-2}
what=${1:-all}
start=$(date +%s)
export CCACHE_DIR=${CCACHE_DIR:-$PWD/.ccache}

if [[ $what == all || $what == ts ]]; then
  echo "== build-clang-ts: clang -Wthread-safety -Werror=thread-safety"
  cmake -S . -B build-clang-ts -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DNEBULA_THREAD_SAFETY=ON \
    -DNEBULA_BUILD_BENCH=OFF >/dev/null
  cmake --build build-clang-ts -j"$JOBS" --target nebula_util nebula_wire nebula_transport transport_test \
    src/collective/CMakeFiles/nebula_collective.dir/gateway_mesh.cc.o
  echo "== build-clang-ts: clean ($(( $(date +%s) - start )) s so far)"
fi

if [[ $what == all || $what == tsan ]]; then
  echo "== build-tsan: ThreadSanitizer"
  cmake -S . -B build-tsan -G Ninja -DNEBULA_SANITIZE=thread -DNEBULA_BUILD_BENCH=OFF >/dev/null
  export TSAN_OPTIONS="suppressions=$PWD/scripts/tsan.supp halt_on_error=0 exitcode=66 second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
  export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
  failed=0
  cmake --build build-tsan -j"$JOBS" --target tsan_canary
  canary_rc=0
  build-tsan/tests/tsan_canary >build-tsan/tsan_canary.log 2>&1 || canary_rc=$?
  canary_reports=$(grep -c 'WARNING: ThreadSanitizer: data race' build-tsan/tsan_canary.log || true)
  if [[ $canary_rc != 66 || $canary_reports -lt 2 ]]; then
    echo "check_threads: the canary's races were not reported (exit $canary_rc, $canary_reports reports): the" \
      "suppressions in scripts/tsan.supp hide nebula code; see build-tsan/tsan_canary.log"
    exit 1
  fi
  echo "== build-tsan/tests/tsan_canary: its $canary_reports deliberate races reported, as they must be"
  for t in ${TSAN_TESTS:-src/transport/transport_test src/collective/collective_test src/strategy/strategy_test}; do
    echo "== build-tsan/$t"
    t0=$(date +%s)
    cmake --build build-tsan -j"$JOBS" --target "$(basename "$t")"  # each test as soon as it is built
    if ! "build-tsan/$t" --gtest_brief=1 >"build-tsan/$(basename "$t").log" 2>&1; then
      failed=1
      grep -E "WARNING: ThreadSanitizer|FAILED|SUMMARY" "build-tsan/$(basename "$t").log" | sort | uniq -c | head -20 || true
      echo "   see build-tsan/$(basename "$t").log"
    fi
    log="build-tsan/$(basename "$t").log"
    echo "   $(grep -E '^\[  PASSED  \]' "$log" || echo 'not all passed'); $(grep -c 'WARNING: ThreadSanitizer' "$log" || true) TSan reports; $(( $(date +%s) - t0 )) s"
  done
  [[ $failed == 0 ]] || { echo "check_threads: ThreadSanitizer or a test failed"; exit 1; }
fi
echo "check_threads: all clean in $(( $(date +%s) - start )) s"
