#!/usr/bin/env bash
# What spreading a site's WAN traffic over its hosts buys: diloco's outer sync with
# [wan] mode = "gateway" (rank 0 carries the site's exchange) against "every_worker" (each
# worker sends its own cut over its own links), side by side, at 1, 2, 4 ... workers per site.
# Every host has its own egress limit (wan.host_bandwidth, default 50 Mbit/s) in front of the
# site pair's (wan.bandwidth, default 200 Mbit/s); the codec is exact (none), so both modes send
# the same bytes and end with the same weights (the quality cost is read off the table: the
# validation losses, at equal tokens).
#   bench/wan_spread.sh [steps, default 40] [workers per site ..., default 1 2 4]
#   HOST=50Mbit PAIR=200Mbit RTT=20ms bench/wan_spread.sh ...
#   EXTRA="--set model.dim=..." bench/wan_spread.sh ...   other options for every run
#   BENCH_TINY=1 bench/wan_spread.sh 6 1 2   (tiny mode, bench/common.sh)
# Outer sync is the training thread's time blocked in diloco's sends and merges on the first
# site's gateway (strategy_metrics.outer_sync_seconds), per outer step.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/common.sh
steps="${1:-40}"
shift || true
counts=("$@")
((${#counts[@]})) || counts=(1 2 4)
for w in "${counts[@]}"; do
  [[ "$w" =~ ^[1-9][0-9]*$ ]] || { echo "workers per site '$w': want a positive number" >&2; exit 2; }
done
bench_out drop
read -r -a extra <<< "${EXTRA:-}"
printf "%-8s %-13s %16s %10s %14s %12s\n" workers mode "sync s / round" speed-up "WAN MiB" "val loss"
for w in "${counts[@]}"; do
  for mode in gateway every_worker; do
    run="$out/$w-$mode"
    "$nebula" run examples/mlm.toml --set job.steps="$steps" --set strategy.kind='"diloco"' --set strategy.codec='"none"' \
      --set strategy.inner_steps=10 --set strategy.heterogeneous=false --set sites.0.workers="$w" --set sites.1.workers="$w" \
      --set wan.mode="\"$mode\"" --set wan.host_bandwidth="\"${HOST:-50Mbit}\"" --set wan.bandwidth="\"${PAIR:-200Mbit}\"" \
      --set wan.rtt="\"${RTT:-20ms}\"" --set metrics.progress='"off"' --set job.run_dir="\"$run\"" \
      "${extra[@]}" "${tiny[@]}" > "$run.log" 2>&1 || { echo "$w-$mode failed: see $run.log"; exit 1; }
  done
  python3 - "$out" "$w" <<'PY'
import sys
sys.path.insert(0, "bench")
from rundir import summary
out, w = sys.argv[1], sys.argv[2]
per_round = {}
for mode in ("gateway", "every_worker"):
    s = summary(f"{out}/{w}-{mode}")
    m = s["strategy_metrics"]
    if m["outer_steps"] < 1:
        sys.exit(f"{out}/{w}-{mode}: no outer step was taken; give it more steps than strategy.inner_steps")
    per_round[mode] = m["outer_sync_seconds"] / m["outer_steps"]
    speed = per_round["gateway"] / per_round[mode]
    print(f"{w:<8} {mode:<13} {per_round[mode]:16.3f} {speed:9.2f}x {s['wan_bytes'] / 2**20:14.2f} {s['final_val_loss']:12.4f}")
PY
done
