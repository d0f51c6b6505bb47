#!/usr/bin/env bash
# Builds nebula's libFuzzer targets and runs each for a bounded time.
#
#   fuzz/run_fuzzers.sh BUILD_DIR SECONDS [FUZZER...]
#
# Configures BUILD_DIR once (clang++, Ninja, ccache when present), rebuilds it, seeds
# BUILD_DIR/corpus/<fuzzer> from fuzz/corpus/<fuzzer-stem> plus the fuzzer's own seed mode,
# then runs each fuzzer for SECONDS. The corpus in BUILD_DIR grows across runs; the
# source tree is never written. Exits non-zero if any fuzzer fails (crash, sanitizer
# report, leak, timeout, OOM, big allocation) and prints the reproducer's path:
# rerun it with `BUILD_DIR/<fuzzer> <file>`.
set -uo pipefail

if (($# < 2)); then
  echo "usage: $0 BUILD_DIR SECONDS [FUZZER...]" >&2
  exit 2
fi
BUILD_DIR=$(mkdir -p "$1" && cd "$1" && pwd) || exit 2
SECONDS_EACH=$2
shift 2
FUZZERS=("$@")
((${#FUZZERS[@]})) || FUZZERS=(frame_fuzzer hello_fuzzer session_fuzzer stripe_fuzzer)
SRC_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

CXX=${FUZZ_CXX:-clang++}
if ! command -v "$CXX" >/dev/null; then
  echo "run_fuzzers: $CXX not found; install the Debian packages clang and libclang-rt-14-dev (scripts/setup.sh)" >&2
  exit 3
fi
for tool in cmake ninja; do
  command -v $tool >/dev/null || { echo "run_fuzzers: $tool not found (scripts/setup.sh installs it)" >&2; exit 3; }
done

if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  # Probe the libFuzzer runtime first: without it CMake fails with a far less clear link error.
  probe="$BUILD_DIR/probe"
  mkdir -p "$probe"
  printf '%s\n' '#include <cstdint>' '#include <cstddef>' \
    'extern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }' >"$probe/probe.cc"
  if ! "$CXX" -fsanitize=fuzzer,address,undefined "$probe/probe.cc" -o "$probe/probe" 2>"$probe/err"; then
    cat "$probe/err" >&2
    echo "run_fuzzers: $CXX cannot link -fsanitize=fuzzer,address,undefined; install libclang-rt-14-dev" \
         "(scripts/setup.sh)" >&2
    exit 3
  fi
  rm -rf "$probe"
  launcher=()
  command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  cmake -S "$SRC_DIR" -B "$BUILD_DIR" -G Ninja -DCMAKE_CXX_COMPILER="$CXX" "${launcher[@]}" || exit 3
fi
cmake --build "$BUILD_DIR" --target "${FUZZERS[@]}" || exit 3

status=0
for fuzzer in "${FUZZERS[@]}"; do
  stem=${fuzzer%_fuzzer}
  corpus="$BUILD_DIR/corpus/$fuzzer"
  crashes="$BUILD_DIR/crashes/$fuzzer"
  log="$BUILD_DIR/logs/$fuzzer.log"
  mkdir -p "$corpus" "$crashes" "$(dirname "$log")"
  [ -d "$SRC_DIR/corpus/$stem" ] && cp -n "$SRC_DIR/corpus/$stem"/* "$corpus"/ 2>/dev/null
  NEBULA_FUZZ_WRITE_SEEDS="$corpus" "$BUILD_DIR/$fuzzer" || { echo "run_fuzzers: $fuzzer seed mode failed" >&2; status=1; }
  before=$(ls "$crashes" | wc -l)
  echo "== $fuzzer: ${SECONDS_EACH}s, corpus $corpus, log $log"
  # -timeout: these parsers are linear, so one input taking seconds is a hang.
  # -malloc_limit_mb: inputs are <= 64 KiB, so a bigger allocation was sized by a length field.
  "$BUILD_DIR/$fuzzer" "$corpus" \
    -max_total_time="$SECONDS_EACH" -rss_limit_mb=2048 -malloc_limit_mb=64 -max_len=65536 -timeout=10 \
    -print_final_stats=1 -artifact_prefix="$crashes/" >"$log" 2>&1
  rc=$?
  grep -E '^#[0-9]+[[:space:]]+DONE|^Done [0-9]+ runs|^stat::' "$log"
  if ((rc != 0)); then
    status=1
    tail -n 60 "$log"
    echo "run_fuzzers: $fuzzer FAILED (libFuzzer exit $rc); reproducer(s):" >&2
    ls -t "$crashes"/* 2>/dev/null | head -n $(($(ls "$crashes" | wc -l) - before)) | sed 's/^/  /' >&2
  else
    echo "== $fuzzer: ok"
  fi
done
exit $status
