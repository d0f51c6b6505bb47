# shellcheck shell=bash
# Sourced by the bench scripts (after `cd` to the repository root): the nebula binary, the
# output directory and tiny mode, in one place.
#   NEBULA=PATH      the nebula binary (default build/nebula; the test suite passes its own)
#   BENCH_OUT=DIR    where the runs go (kept); default a fresh mktemp -d directory
#   BENCH_TINY=1     tiny mode: a model and data so small that a run takes seconds. The numbers
#                    mean nothing, but every part of the script (the runs, the reading of their
#                    metrics.jsonl / summary.json / audit.jsonl, the table) runs as in a real
#                    benchmark: the test suite runs each script so (ctest -L bench), so a change
#                    to what the scripts read fails a test instead of the next benchmark.
nebula="${NEBULA:-build/nebula}"
[ -x "$nebula" ] || { echo "$nebula: no nebula binary there; build it (scripts/build.sh) or set NEBULA=PATH" >&2; exit 1; }
tiny=()
if [ "${BENCH_TINY:-0}" = 1 ]; then
  # Passed after a script's own --set options, so these win. log_every = 2 keeps at least two
  # training lines per worker (the steady-state window) in a run of a few steps.
  tiny=(--set model.dim=16 --set model.layers=1 --set model.heads=2 --set model.ffn=32 --set model.max_len=16
        --set data.max_pairs_per_language=150 --set data.vocab_size=150 --set data.batch_size=4
        --set job.eval_batches=1 --set job.log_every=2)
fi
# bench_out keep|drop: sets $out (in tiny mode it also builds the tiny corpus there). BENCH_OUT
# is always kept; a temporary directory is removed at exit when the script says drop (its table
# is all it gives) or in tiny mode, unless the script failed: then its logs stay there for the
# message that names them.
bench_out() {
  if [ -n "${BENCH_OUT:-}" ]; then
    out="$BENCH_OUT"
    mkdir -p "$out"
  else
    out="$(mktemp -d)"
    if [ "$1" = drop ] || [ "${#tiny[@]}" -gt 0 ]; then
      trap 'rc=$?; [ $rc -eq 0 ] && rm -rf "$out"; exit $rc' EXIT
    fi
  fi
  tiny_corpus
}
# Tiny mode reads a corpus of 150 pairs per language built once into $out/tiny-corpus: a worker
# that scans the gettext catalogs itself spends ~10 s of a tiny run on that alone.
tiny_corpus() {
  [ "${#tiny[@]}" -gt 0 ] || return 0
  "$nebula" corpus build --languages de,fr,es,it --max-pairs-per-language 150 --out "$out/tiny-corpus" \
    > "$out/tiny-corpus.log" 2>&1 || { echo "nebula corpus build failed: see $out/tiny-corpus.log"; exit 1; }
  tiny+=(--set data.source='"corpus"' --set "data.path=\"$out/tiny-corpus\"")
}
