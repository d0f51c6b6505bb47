#!/usr/bin/env bash
# The WAN-efficient strategies side by side (issue [4/7]'s benchmark): two sites pre-training
# the demo's multilingual MLM over an emulated 20 Mbit/s, 100 ms RTT WAN, same seed, same
# steps and tokens per site. Each strategy also runs once over an unlimited link, for
#   compute utilization = (time per token, unlimited link) / (time per token, emulated WAN).
#   bench/strategies.sh [steps, default 300] [H, default 50] [names...]
set -euo pipefail
cd "$(dirname "$0")/.."
steps="${1:-300}"
h="${2:-50}"
shift 2 || true
out="${BENCH_OUT:-$(mktemp -d)}"
mkdir -p "$out"
declare -A runs=(
  [sync-none]="strategy.kind=sync strategy.codec=none"
  [sync-int8]="strategy.kind=sync strategy.codec=int8"
  [diloco-int4]="strategy.kind=diloco strategy.codec=int4 strategy.inner_steps=$h"
  [diloco-sparse]="strategy.kind=diloco strategy.codec=sparseloco strategy.codec_density=0.015625 strategy.codec_block=4096 strategy.outer_momentum=0 strategy.outer_lr=1 strategy.inner_steps=$h"
  [streaming-int4]="strategy.kind=streaming strategy.codec=int4 strategy.inner_steps=$h strategy.fragments=4 strategy.delay=5"
  [peft-diloco]="strategy.kind=diloco strategy.codec=int4 strategy.inner_steps=$h peft.kind=\"lora\""
  # Further points toward 10^4x (run by name: bench/strategies.sh 300 50 sync-none sparse-d16 ...)
  [diloco-int4-h100]="strategy.kind=diloco strategy.codec=int4 strategy.inner_steps=100"
  [diloco-int4-m8]="strategy.kind=diloco strategy.codec=int4 strategy.inner_steps=$h strategy.outer_momentum=0.8"
  [sparse-d16]="strategy.kind=diloco strategy.codec=sparseloco strategy.codec_density=0.0625 strategy.codec_block=4096 strategy.outer_momentum=0 strategy.outer_lr=1 strategy.inner_steps=$h"
  [sparse-d16-nesterov]="strategy.kind=diloco strategy.codec=sparseloco strategy.codec_density=0.0625 strategy.codec_block=4096 strategy.inner_steps=$h"
  [sparse-d4]="strategy.kind=diloco strategy.codec=sparseloco strategy.codec_density=0.25 strategy.codec_block=4096 strategy.outer_momentum=0 strategy.outer_lr=1 strategy.inner_steps=$h"
)
order=(sync-none sync-int8 diloco-int4 diloco-sparse streaming-int4 peft-diloco)
[ $# -gt 0 ] && order=("$@")
tokenizer=""
run() {  # name, wan (emulated|unlimited)
  local name="$1" wan="$2" dir="$out/$1-$2" sets=()
  for kv in ${runs[$1]}; do sets+=(--set "$kv"); done
  if [ "$wan" = unlimited ]; then sets+=(--set 'wan.bandwidth="0bit"' --set 'wan.rtt="0s"'); fi
  [ -n "$tokenizer" ] && sets+=(--set "data.tokenizer=\"$tokenizer\"")
  build/nebula run examples/mlm.toml --set job.steps="$steps" --set job.log_every=10 --set strategy.heterogeneous=false \
    --set 'wan.bandwidth="20Mbit"' --set 'wan.rtt="100ms"' "${sets[@]}" \
    --set metrics.progress='"off"' --set job.run_dir="\"$dir\"" > "$dir.log" 2>&1 \
    || { echo "$name ($wan) failed: see $dir.log"; exit 1; }
  [ -z "$tokenizer" ] && tokenizer="$dir/tokenizer.model"
  return 0
}
for name in "${order[@]}"; do
  run "$name" emulated
  run "$name" unlimited
done
python3 - "$out" "${order[@]}" <<'PY'
import json, sys
out, names = sys.argv[1], sys.argv[2:]
def load(name, wan):
    return json.load(open(f"{out}/{name}-{wan}/summary.json"))
def per_1k_tokens(name, wan):
    # Training time per token in steady state: between the first and last metrics lines of
    # site 0's gateway (start-up, connection set-up and the final evaluation left out).
    lines = [json.loads(l) for l in open(f"{out}/{name}-{wan}/metrics.jsonl")]
    g = [l for l in lines if l["rank"] == 0 and l["site"] == lines[0]["site"]]
    return (g[-1]["elapsed"] - g[0]["elapsed"]) / (g[-1]["tokens"] - g[0]["tokens"]) * 1000
base = load("sync-none", "emulated") if "sync-none" in names else None
print(f"{'run':<15} {'WAN bytes':>12} {'vs sync':>9} {'wall s':>7} {'s/1k tok':>9} {'util':>6} {'val loss':>9} {'vs sync':>8}")
for n in names:
    e, u = load(n, "emulated"), load(n, "unlimited")
    per_tok_e, per_tok_u = per_1k_tokens(n, "emulated"), per_1k_tokens(n, "unlimited")
    red = f"{base['wan_bytes'] / e['wan_bytes']:8.0f}x" if base else "-"
    dl = f"{(e['final_val_loss'] / base['final_val_loss'] - 1) * 100:+7.2f}%" if base else "-"
    print(f"{n:<15} {e['wan_bytes']:12.0f} {red:>9} {e['wall_seconds']:7.1f} {per_tok_e:9.3f} "
          f"{per_tok_u / per_tok_e * 100:5.1f}% {e['final_val_loss']:9.4f} {dl:>8}")
print(f"(steps {len(names) and load(names[0], 'emulated')['steps']}, runs in {out})")
PY
