#!/usr/bin/env bash
# ZeRO-1, -2 and -3 inside a site against the whole optimizer, side by side: AdamW state and
# peak RSS (VmHWM) of the first site's gateway and of its worker 1, step time and validation
# loss of the same job (examples/mlm.toml: two sites of WORKERS and 1 workers, the same steps,
# data and seed) with [parallel] shard = "none", "optimizer" and (not with sync) "gradients"
# and "full".
#   bench/zero.sh [steps, default 150] [strategy, default diloco]
#   EXTRA="--set model.dim=512 ..." bench/zero.sh ...   other options for both runs (a bigger model)
#   WORKERS=4 bench/zero.sh ...   the first site's workers (default 2; 1 runs shard = "none" only:
#                                 sharding over one worker changes nothing)
#   BENCH_TINY=1 bench/zero.sh 6 diloco   (tiny mode, bench/common.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/common.sh
steps="${1:-150}"
kind="${2:-diloco}"
bench_out drop
read -r -a extra <<< "${EXTRA:-}"
printf "%-10s %18s %10s %14s %14s %10s %16s %12s\n" shard "AdamW values/wkr" "vs none" "RSS gateway" "RSS worker 1" "s/step" \
  "steps/s vs none" "val loss"
workers="${WORKERS:-2}"
[[ "$workers" =~ ^[1-9][0-9]*$ ]] || { echo "WORKERS=$workers: want a positive number of workers" >&2; exit 2; }
shards=(none)
if ((workers > 1)); then
  shards+=(optimizer)
  [[ "$kind" != sync ]] && shards+=(gradients full)
fi
for shard in "${shards[@]}"; do
  "$nebula" run examples/mlm.toml --set job.steps="$steps" --set strategy.kind="\"$kind\"" \
    --set strategy.inner_steps=10 --set strategy.heterogeneous=false --set parallel.shard="\"$shard\"" \
    --set sites.0.workers="$workers" --set metrics.progress='"off"' --set job.run_dir="\"$out/$shard\"" "${extra[@]}" "${tiny[@]}" > "$out/$shard.log" 2>&1 \
    || { echo "$shard failed: see $out/$shard.log"; exit 1; }
  python3 - "$out" "$shard" <<'PY'
import sys
sys.path.insert(0, "bench")
from rundir import job, summary, step_seconds, training_lines, window
out, shard = sys.argv[1], sys.argv[2]
run = f"{out}/{shard}"
last = window(run)[1]  # the first site's gateway
state, base = last["adamw_state_values"], window(f"{out}/none")[1]["adamw_state_values"]
site = job(run)["sites"][0]["name"]
others = [l["peak_rss_bytes"] for l in training_lines(run) if l["site"] == site and l["rank"] == 1]
other = max(others) if others else float("nan")  # one worker: there is no worker 1
seconds = step_seconds(run)
print(f"{shard:<10} {state:18d} {state / base:9.2f}x {last['peak_rss_bytes'] / 2**20:10.0f} MiB {other / 2**20:10.0f} MiB "
      f"{seconds:10.3f} {step_seconds(f'{out}/none') / seconds:15.2f}x {summary(f'{out}/{shard}')['final_val_loss']:12.4f}")
PY
done
