#!/usr/bin/env bash
# Pipeline stages and tensor slices inside a site against plain data parallelism, side by side,
# on one job (examples/pipeline.toml: one site of 4 workers, sync, the same steps and seed): data
# 4, pipeline 2 × data 2, pipeline 4 (each step's batch in M micro-batches) and tensor 2 × data 2.
# Every layout trains the same tokens per step: each replica's batch is BATCH (default 16; tiny
# mode 4) times its workers, so data 4 runs 4 batches of BATCH and pipeline 4 one of 4 BATCH. Per
# row: the largest worker's peak memory at set-up and in the steps (summary.json's
# peak_rss_bytes_by_phase), the model's parameters over a replica's workers (a stage's on
# average; a slice holds a little more: the norms and some biases stay whole), steady-state
# seconds per step, the measured pipeline bubble (the stages' time not computing, over the job's
# steps: Pipeline::Timing) against 1F1B's (P − 1)/(M + P − 1), and the validation loss (the same tokens per step, each replica's share of the data drawn in
# its own order: close, not equal; bit-for-bit equality is tests/e2e_test.cc's).
# On this machine's 2 cores the 4 workers share 2 cores, so a stage waiting for another frees a
# core for it: the measured bubble is a wall-clock fraction, not idle hardware.
#   bench/pipeline.sh [steps, default 60] [micro_batches, default 8]
#   EXTRA="--set model.dim=256 --set model.layers=8 ..." bench/pipeline.sh ...   a bigger model
#   BATCH=8 bench/pipeline.sh ...   sequences per replica per stage (see above)
#   BENCH_TINY=1 bench/pipeline.sh 6 4   (tiny mode, bench/common.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/common.sh
steps="${1:-60}"
micro="${2:-8}"
bench_out drop
read -r -a extra <<< "${EXTRA:-}"
batch="${BATCH:-16}"
[ "${#tiny[@]}" -gt 0 ] && batch="${BATCH:-4}"
[[ "$batch" =~ ^[1-9][0-9]*$ ]] || { echo "BATCH=$batch: want a positive number of sequences" >&2; exit 2; }
# Tiny mode's one layer cannot be cut in 4: its model keeps 4 layers.
layers=()
[ "${#tiny[@]}" -gt 0 ] && layers=(--set model.layers=4)
printf "%-9s %6s %6s | %9s %9s | %12s | %7s %8s | %8s %8s | %9s\n" layout workers batch "init MiB" "step MiB" "params/part" \
  "s/step" "vs data" bubble "1F1B" "val loss"
first=""
for row in data4 pipe2x2 pipe4 tensor2x2; do
  tensor=1
  case "$row" in
    data4) pipeline=1 ;;
    pipe2x2) pipeline=2 ;;
    pipe4) pipeline=4 ;;
    tensor2x2) pipeline=1 tensor=2 ;;
  esac
  "$nebula" run examples/pipeline.toml --set job.steps="$steps" --set sites.0.workers=4 \
    --set parallel.pipeline="$pipeline" --set parallel.tensor="$tensor" --set parallel.micro_batches="$micro" \
    --set metrics.progress='"off"' --set job.timeout='"600s"' --set job.run_dir="\"$out/$row\"" "${extra[@]}" \
    "${tiny[@]}" "${layers[@]}" --set data.batch_size=$((batch * pipeline * tensor)) > "$out/$row.log" 2>&1 ||
    { echo "$row failed: see $out/$row.log" >&2; exit 1; }
  first="${first:-$row}"
  python3 - "$out" "$row" "$first" "$batch" <<'PY'
import sys
sys.path.insert(0, "bench")
from rundir import summary, step_seconds
out, name, first = sys.argv[1:4]
s = summary(f"{out}/{name}")
peaks = s["peak_rss_bytes_by_phase"]
mib = lambda phase: max(peaks[phase]) / 2**20
p = s.get("pipeline")
stages = p["stages"] if p else s["tensor"]["slices"] if "tensor" in s else 1  # a replica's workers
t, t0 = step_seconds(f"{out}/{name}"), step_seconds(f"{out}/{first}")
bubble = f"{p['bubble_measured']:8.3f} {p['bubble_formula']:8.3f}" if p else f"{'-':>8} {'-':>8}"
print(f"{name:<9} {s['workers']:6d} {stages * int(sys.argv[4]):6d} | {mib('init'):9.0f} {mib('step'):9.0f} | {s['parameters'] // stages:12d} | "
      f"{t:7.3f} {t / t0:8.2f} | {bubble} | {s['final_val_loss']:9.4f}")
PY
done
