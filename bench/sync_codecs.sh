#!/usr/bin/env bash
# Bytes on the WAN per step and step time of `sync` with each codec, side by side, under an
# emulated 50 Mbit/s, 80 ms WAN (the demo's model, two sites).
#   bench/sync_codecs.sh [steps, default 60]
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${1:-60}"
out="$(mktemp -d)"
printf "%-9s %14s %12s %10s %12s\n" codec "WAN B/step" "vs none" "s/step" "val loss"
for codec in none fp16 bf16 int8 int4 topk powersgd; do
  build/nebula run examples/mlm.toml --set job.steps="$steps" --set strategy.codec="$codec" \
    --set metrics.progress='"off"' --set job.run_dir="\"$out/$codec\"" > "$out/$codec.log" 2>&1 \
    || { echo "$codec failed: see $out/$codec.log"; exit 1; }
  python3 - "$out" "$codec" "$steps" <<'PY'
import json, sys
out, codec, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = json.load(open(f"{out}/{codec}/summary.json"))
base = json.load(open(f"{out}/none/summary.json"))
per_step = s["wan_bytes"] / steps
# Step time in steady state: between the first and last metrics lines of one gateway.
lines = [json.loads(l) for l in open(f"{out}/{codec}/metrics.jsonl")]
g = [l for l in lines if l["rank"] == 0 and l["site"] == lines[0]["site"]]
step_time = (g[-1]["elapsed"] - g[0]["elapsed"]) / (g[-1]["step"] - g[0]["step"])
print(f"{codec:<9} {per_step:14.0f} {base['wan_bytes'] / s['wan_bytes']:11.1f}x {step_time:10.3f} {s['final_val_loss']:12.4f}")
PY
done
rm -rf "$out"
