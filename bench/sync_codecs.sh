#!/usr/bin/env bash
# Bytes on the WAN per step and step time of `sync` with each codec, side by side, under an
# emulated 50 Mbit/s, 80 ms WAN (the demo's model, two sites).
#   bench/sync_codecs.sh [steps, default 60]
#   CODECS="none int4" bench/sync_codecs.sh ...   some codecs only (the first is the baseline)
#   BENCH_TINY=1 CODECS="none int4" bench/sync_codecs.sh 6   (tiny mode, bench/common.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/common.sh
steps="${1:-60}"
read -r -a codecs <<< "${CODECS:-none fp16 bf16 int8 int4 topk powersgd}"
bench_out drop
printf "%-9s %14s %12s %10s %12s\n" codec "WAN B/step" "vs ${codecs[0]}" "s/step" "val loss"
for codec in "${codecs[@]}"; do
  "$nebula" run examples/mlm.toml --set job.steps="$steps" --set strategy.codec="$codec" \
    --set metrics.progress='"off"' --set job.run_dir="\"$out/$codec\"" "${tiny[@]}" > "$out/$codec.log" 2>&1 \
    || { echo "$codec failed: see $out/$codec.log"; exit 1; }
  python3 - "$out" "$codec" "$steps" "${codecs[0]}" <<'PY'
import sys
sys.path.insert(0, "bench")
from rundir import summary, step_seconds
out, codec, steps, first = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
s, base = summary(f"{out}/{codec}"), summary(f"{out}/{first}")
per_step = s["wan_bytes"] / steps
print(f"{codec:<9} {per_step:14.0f} {base['wan_bytes'] / s['wan_bytes']:11.1f}x "
      f"{step_seconds(f'{out}/{codec}'):10.3f} {s['final_val_loss']:12.4f}")
PY
done
