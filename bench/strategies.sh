#!/usr/bin/env bash
# The WAN-efficient strategies side by side (issue [4/7]'s benchmark): two sites pre-training
# the demo's multilingual MLM over an emulated WAN (default 20 Mbit/s, 100 ms RTT), same seed,
# same steps and tokens per site. Each strategy also runs once over an unlimited link (same
# job, same steps), for
#   compute utilization = (time per token, unlimited link) / (time per token, emulated WAN)
# and a second table of steady-state seconds per step over both links and their ratio: the
# WAN's cost that a strategy did not hide (1.00 = fully hidden).
#   bench/strategies.sh [steps, default 300] [H, default 50] [names...]
#   WAN_BANDWIDTH=2Mbit WAN_RTT=300ms bench/strategies.sh ...   another emulated link
#   BENCH_TINY=1 bench/strategies.sh 12 6 sync-none diloco-int4 streaming-int4   (tiny mode, bench/common.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/common.sh
steps="${1:-300}"
h="${2:-50}"
shift 2 || true
bandwidth="${WAN_BANDWIDTH:-20Mbit}"
rtt="${WAN_RTT:-100ms}"
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
for name in "${order[@]}"; do
  [ -n "${runs[$name]+x}" ] || { echo "unknown run '$name'; the names: ${!runs[*]}" >&2; exit 2; }
done
bench_out keep
tokenizer=""
run() {  # name, wan (emulated|unlimited)
  local name="$1" wan="$2" dir="$out/$1-$2" sets=()
  for kv in ${runs[$1]}; do sets+=(--set "$kv"); done
  if [ "$wan" = unlimited ]; then sets+=(--set 'wan.bandwidth="0bit"' --set 'wan.rtt="0s"'); fi
  [ -n "$tokenizer" ] && sets+=(--set "data.tokenizer=\"$tokenizer\"")
  "$nebula" run examples/mlm.toml --set job.steps="$steps" --set job.log_every=10 --set strategy.heterogeneous=false \
    --set "wan.bandwidth=\"$bandwidth\"" --set "wan.rtt=\"$rtt\"" "${sets[@]}" \
    --set metrics.progress='"off"' --set job.run_dir="\"$dir\"" "${tiny[@]}" > "$dir.log" 2>&1 \
    || { echo "$name ($wan) failed: see $dir.log"; exit 1; }
  [ -z "$tokenizer" ] && tokenizer="$dir/tokenizer.model"
  return 0
}
for name in "${order[@]}"; do
  run "$name" emulated
  run "$name" unlimited
done
python3 - "$out" "$bandwidth" "$rtt" "$h" "${order[@]}" <<'PY'
import sys
sys.path.insert(0, "bench")
from rundir import summary, seconds_per_1k_tokens, step_seconds
out, bandwidth, rtt, h, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
run = lambda name, wan: f"{out}/{name}-{wan}"
base = summary(run("sync-none", "emulated")) if "sync-none" in names else None
print(f"{'run':<15} {'WAN bytes':>12} {'vs sync':>9} {'wall s':>7} {'s/1k tok':>9} {'util':>6} {'val loss':>9} {'vs sync':>8}")
for n in names:
    e = summary(run(n, "emulated"))
    per_tok_e, per_tok_u = seconds_per_1k_tokens(run(n, "emulated")), seconds_per_1k_tokens(run(n, "unlimited"))
    red = f"{base['wan_bytes'] / e['wan_bytes']:8.0f}x" if base else "-"
    dl = f"{(e['final_val_loss'] / base['final_val_loss'] - 1) * 100:+7.2f}%" if base else "-"
    print(f"{n:<15} {e['wan_bytes']:12.0f} {red:>9} {e['wall_seconds']:7.1f} {per_tok_e:9.3f} "
          f"{per_tok_u / per_tok_e * 100:5.1f}% {e['final_val_loss']:9.4f} {dl:>8}")
# Does a strategy hide the WAN? The same job and steps over the emulated link and over an
# unlimited one: steady-state s/step (site 0's gateway) and their ratio. Streaming overlaps its
# exchanges with training, so its ratio stays near 1; blocking diloco pays one exchange per H
# steps and sync one per step.
print(f"\nWAN hiding: s/step over {bandwidth}, {rtt} vs an unlimited link (H = {h} where it applies)")
print(f"{'run':<15} {'s/step WAN':>11} {'s/step free':>12} {'WAN/free':>9}")
for n in names:
    e, u = step_seconds(run(n, "emulated")), step_seconds(run(n, "unlimited"))
    print(f"{n:<15} {e:11.4f} {u:12.4f} {e / u:8.2f}x")
print(f"(steps {len(names) and summary(run(names[0], 'emulated'))['steps']}, runs in {out})")
PY
