#!/usr/bin/env bash
# Sites of different layouts against the same job with equal layouts, side by side
# (examples/mixed_layouts.toml: diloco every 10 steps between site alpha and site beta of BETA
# workers, default 3; the same steps, seed and tokens in every row). alpha runs 2 data replicas,
# plain (equal: both sites data parallel), each as 2 pipeline stages (mixed: 4 workers, the
# model cut in two) or each as 2 tensor slices (sliced: 4 workers, every layer cut in two), in gateway mode and with wan.mode = "every_worker". Per row: the bytes on the
# WAN (summary.json's wan_bytes) and their ratio to the equal row of the same mode, the outer
# steps whose global weights agreed on every site (hash_checks), the validation loss and its
# difference from the equal row's, and steady-state seconds per step (alpha's 4 workers share
# this machine's 2 cores: the step times say what it costs here, not on a site of its own).
#   bench/mixed_layouts.sh [steps, default 60]
#   BETA=1 bench/mixed_layouts.sh ...   beta's workers
#   BENCH_TINY=1 bench/mixed_layouts.sh 6   (tiny mode, bench/common.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/common.sh
steps="${1:-60}"
bench_out drop
beta="${BETA:-3}"
[[ "$beta" =~ ^[1-9][0-9]*$ ]] || { echo "BETA=$beta: want a positive number of workers" >&2; exit 2; }
# Tiny mode's one layer cannot be cut in 2; its inner steps fit its few steps.
small=()
[ "${#tiny[@]}" -gt 0 ] && small=(--set model.layers=2 --set strategy.inner_steps=3)
printf "%-12s %7s | %10s %8s | %6s | %9s %9s | %7s\n" layout workers "WAN bytes" "vs equal" hashes "val loss" "vs equal" "s/step"
for row in equal mixed sliced equal-every mixed-every sliced-every; do
  case "$row" in
    equal*) layout=(--set sites.0.workers=2 --set sites.0.parallel.pipeline=1) ;;
    mixed*) layout=(--set sites.0.workers=4) ;;
    sliced*) layout=(--set sites.0.workers=4 --set sites.0.parallel.pipeline=1 --set sites.0.parallel.tensor=2) ;;
  esac
  mode=()
  [[ "$row" == *-every ]] && mode=(--set wan.mode='"every_worker"')
  "$nebula" run examples/mixed_layouts.toml --set job.steps="$steps" --set sites.1.workers="$beta" \
    --set strategy.heterogeneous=false --set metrics.progress='"off"' --set job.timeout='"600s"' \
    --set job.run_dir="\"$out/$row\"" "${layout[@]}" "${mode[@]}" "${tiny[@]}" "${small[@]}" > "$out/$row.log" 2>&1 ||
    { echo "$row failed: see $out/$row.log" >&2; exit 1; }
  python3 - "$out" "$row" <<'PY'
import sys
sys.path.insert(0, "bench")
from rundir import summary, step_seconds
out, name = sys.argv[1:3]
base = "equal-every" if name.endswith("-every") else "equal"
s, b = summary(f"{out}/{name}"), summary(f"{out}/{base}")
hashes = int(s["strategy_metrics"]["hash_checks"])
if hashes < 1:
    sys.exit(f"{name}: no outer step's global weights were compared between the sites (hash_checks = 0)")
print(f"{name:<12} {s['workers']:7d} | {s['wan_bytes']:10.0f} {s['wan_bytes'] / b['wan_bytes']:8.4f} | {hashes:6d} | "
      f"{s['final_val_loss']:9.4f} {s['final_val_loss'] - b['final_val_loss']:+9.2e} | {step_seconds(f'{out}/{name}'):7.3f}")
PY
done
