#!/usr/bin/env bash
# ZeRO-1, -2 and -3 inside a site against the whole optimizer, side by side, on one job
# (examples/mlm.toml: two sites of WORKERS and 1 workers, the same steps, data and seed) with
# [parallel] shard = "none", "optimizer" and (not with sync) "gradients", "full" and "full" with
# recompute. Per row: AdamW values per worker, the first site's gateway's and its worker 1's
# peak memory in each phase (summary.json's peak_rss_bytes_by_phase: init, step, outer_sync;
# the kernel's high-water mark reset at each phase's start), worker 1's bytes to its site's other
# workers per step, step time and validation loss.
#   bench/zero.sh [steps, default 150] [strategy, default diloco]
#   EXTRA="--set model.dim=512 ..." bench/zero.sh ...   other options for every run (a bigger model)
#   WORKERS=4 bench/zero.sh ...   the first site's workers (default 2; 1 runs shard = "none" only:
#                                 sharding over one worker changes nothing)
#   WAN_MODE=every_worker bench/zero.sh ...   every worker on the WAN (default: the gateways)
#   SHARDS="none full" bench/zero.sh ...      only these rows ("full+recompute" is a row too)
#   BENCH_TINY=1 bench/zero.sh 6 diloco   (tiny mode, bench/common.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/common.sh
steps="${1:-150}"
kind="${2:-diloco}"
bench_out drop
read -r -a extra <<< "${EXTRA:-}"
workers="${WORKERS:-2}"
[[ "$workers" =~ ^[1-9][0-9]*$ ]] || { echo "WORKERS=$workers: want a positive number of workers" >&2; exit 2; }
wan_mode="${WAN_MODE:-gateway}"
[[ "$wan_mode" == gateway || "$wan_mode" == every_worker ]] || { echo "WAN_MODE=$wan_mode: gateway or every_worker" >&2; exit 2; }
if [ -n "${SHARDS:-}" ]; then
  read -r -a shards <<< "$SHARDS"
else
  shards=(none)
  if ((workers > 1)); then
    shards+=(optimizer)
    [[ "$kind" != sync ]] && shards+=(gradients full full+recompute)
  fi
fi
printf "%-15s %12s %8s | %27s | %27s | %12s %8s %10s %9s\n" "" "AdamW" "" "gateway peak MiB" "worker 1 peak MiB" "site MB/step" "" "" ""
printf "%-15s %12s %8s | %8s %8s %9s | %8s %8s %9s | %12s %8s %10s %9s\n" shard "values/wkr" "vs none" init step outer init step outer \
  "worker 1" "s/step" "vs first" "val loss"
first=""
for shard in "${shards[@]}"; do
  mode="${shard%%+*}"
  recompute=false
  [ "$shard" = full+recompute ] && recompute=true
  [ "$mode" = "$shard" ] || [ "$shard" = full+recompute ] || { echo "SHARDS: unknown row '$shard'" >&2; exit 2; }
  name="${shard/+/-}"
  "$nebula" run examples/mlm.toml --set job.steps="$steps" --set strategy.kind="\"$kind\"" \
    --set strategy.inner_steps=10 --set strategy.heterogeneous=false --set parallel.shard="\"$mode\"" \
    --set parallel.recompute="$recompute" --set wan.mode="\"$wan_mode\"" \
    --set sites.0.workers="$workers" --set metrics.progress='"off"' --set job.run_dir="\"$out/$name\"" "${extra[@]}" "${tiny[@]}" > "$out/$name.log" 2>&1 \
    || { echo "$shard failed: see $out/$name.log"; exit 1; }
  first="${first:-$name}"
  python3 - "$out" "$name" "$first" "$workers" <<'PY'
import sys
sys.path.insert(0, "bench")
from rundir import summary, step_seconds, window
out, name, first, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
run = f"{out}/{name}"
s = summary(run)
state, base = window(run)[1]["adamw_state_values"], window(f"{out}/{first}")[1]["adamw_state_values"]
peaks = s["peak_rss_bytes_by_phase"]
def mib(phase, w):  # worker w of the first site (job order: its ranks come first)
    return peaks[phase][w] / 2**20 if w < workers else float("nan")
site_bytes = s["site_bytes_sent_by_worker"][1] if workers > 1 else 0.0
seconds = step_seconds(run)
print(f"{name:<15} {state:12d} {state / base:7.2f}x | {mib('init', 0):8.0f} {mib('step', 0):8.0f} {mib('outer_sync', 0):9.0f} | "
      f"{mib('init', 1):8.0f} {mib('step', 1):8.0f} {mib('outer_sync', 1):9.0f} | {site_bytes / s['local_steps_site0'] / 1e6:12.2f} "
      f"{seconds:8.3f} {step_seconds(f'{out}/{first}') / seconds:9.2f}x {s['final_val_loss']:9.4f}"
      + ("" if peaks["exact"] else "  (peaks not per phase: /proc/self/clear_refs refused)"))
PY
done
