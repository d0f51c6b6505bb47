#!/usr/bin/env bash
# WAN bytes against quality (issue [4/7]'s benchmark): the demo's pre-training job
# (examples/demo.toml: two sites, 2 + 1 workers, MLM + TLM + contrastive, 2,000 steps) run by
# synchronous data parallel in float32 with a learning-rate sweep (its best run is the baseline) and by a
# grid of strategies (tuned too, below), side by side in one run: the same seed, corpus, tokenizer and steps, so
# equal tokens (printed). For each: WAN bytes, the ratio to the baseline's, the final validation
# loss and its penalty against the baseline's, retrieval accuracy (mean over the languages);
# then the Pareto frontier (no other run has both more reduction and less loss), the best
# point within 2 % run again at a second seed beside the baseline's (SEED2=0 skips it), and
# last: `best within 2%: <ratio>x (+<penalty>%) <run>`.
#
# Every run trains over an unlimited link (bytes do not depend on it), but the controller's
# runs over the demo's emulated WAN (50 Mbit/s, 80 ms), as the demo does (watching quality, its
# choices rest on the losses alone).
#   bench/frontier.sh [steps, default 2000] [runs...]   (default: all 25, about two hours here)
#   BENCH_OUT=DIR REUSE=1 bench/frontier.sh ...   keeps the runs DIR already holds (a summary.json)
#   EXTRA="job.log_every=1 ..." bench/frontier.sh ...   more --set options for every run (last: they win)
# With job.log_every = 1 the table also has, for diloco at a fixed H, the mean merge gap and the
# share of each round's local progress the merge kept ("kept"), over the second half of the
# rounds (bench/rundir.py round_progress): the quality signals a controller could watch.
#   BENCH_TINY=1 bench/frontier.sh 12 sync-lr2e-3 diloco-h50-int4 controller   (tiny mode, bench/common.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/common.sh
steps="${1:-2000}"
shift || true
# The strategies' own tuning (docs/strategies.md, "Tuning the strategies"): their inner steps at
# the demo's learning rate, 2e-3 (INNER_LR=x sets another; 2e-3 beat the sync sweep's best, 4e-3,
# for diloco at fp16 H = 50 and int4 H = 100), diloco's outer Nesterov momentum 0.8
# (OUTER_MOMENTUM; at 0.9, the default, fp16 H = 50 ended 7.6 % above the best sync here, at 0.8
# 2.0 %), and sparseloco's error feedback in place of outer momentum (momentum 0, outer lr 1,
# decay 0.95 as SparseLoCo's).
momentum="${OUTER_MOMENTUM:-0.8}"
sparse="strategy.codec=sparseloco strategy.codec_block=4096 strategy.codec_indices=\"rice\" strategy.outer_momentum=0 strategy.outer_lr=1 strategy.codec_error_decay=0.95"
declare -A runs=(
  [sync-lr1e-3]="strategy.kind=sync strategy.codec=none model.lr=1e-3"
  [sync-lr2e-3]="strategy.kind=sync strategy.codec=none model.lr=2e-3"
  [sync-lr4e-3]="strategy.kind=sync strategy.codec=none model.lr=4e-3"
  [sync-lr8e-3]="strategy.kind=sync strategy.codec=none model.lr=8e-3"
  [streaming-h100-int4]="strategy.kind=streaming strategy.codec=int4 strategy.inner_steps=100 strategy.fragments=4 strategy.delay=5 strategy.outer_momentum=$momentum"
  [controller]="strategy.kind=diloco strategy.codec=auto strategy.inner_steps=0 strategy.max_loss_penalty=0.02 strategy.outer_momentum=$momentum"
  # The controller at outer momentum 0, lr 1 (averaging; before stop 57 named controller-sparse:
  # watching quality it no longer chooses sparseloco, whose cost the merge gap does not see).
  [controller-m0]="strategy.kind=diloco strategy.codec=auto strategy.inner_steps=0 strategy.max_loss_penalty=0.02 strategy.outer_momentum=0 strategy.outer_lr=1"
)
order=(sync-lr1e-3 sync-lr2e-3 sync-lr4e-3 sync-lr8e-3)
for h in 50 100 250 500; do
  runs[diloco-h$h-fp16]="strategy.kind=diloco strategy.codec=fp16 strategy.inner_steps=$h strategy.outer_momentum=$momentum"
  runs[diloco-h$h-int4]="strategy.kind=diloco strategy.codec=int4 strategy.inner_steps=$h strategy.outer_momentum=$momentum"
  runs[diloco-h$h-sparse1]="strategy.kind=diloco $sparse strategy.codec_density=0.01 strategy.inner_steps=$h"
  runs[diloco-h$h-sparse3]="strategy.kind=diloco $sparse strategy.codec_density=0.03 strategy.inner_steps=$h"
  order+=(diloco-h$h-fp16 diloco-h$h-int4 diloco-h$h-sparse1 diloco-h$h-sparse3)
done
order+=(streaming-h100-int4 controller controller-m0)
[ $# -gt 0 ] && order=("$@")
for name in "${order[@]}"; do
  [ -n "${runs[$name]+x}" ] || { echo "unknown run '$name'; the names: ${!runs[*]}" >&2; exit 2; }
done
printf '%s\n' "${order[@]}" | grep -q '^sync-' || { echo "no sync-* run among the runs: nothing to compare with" >&2; exit 2; }
bench_out keep
corpus=()
if [ "${#tiny[@]}" -eq 0 ]; then  # the demo's corpus, built once (tiny mode brings its own)
  "$nebula" corpus build --languages de,es,fr,it --max-pairs-per-language 3000 --out "$out/corpus" > "$out/corpus.log" 2>&1 \
    || { echo "nebula corpus build failed: see $out/corpus.log"; exit 1; }
  corpus=(--set data.source='"corpus"' --set "data.path=\"$out/corpus\"")
fi
tokenizer=""
inner_lr="${INNER_LR:-2e-3}"  # the strategies' (the sync runs sweep their own)
run() {  # name, seed, directory
  local name="$1" seed="$2" dir="$3" sets=()
  if [ "${REUSE:-0}" = 1 ] && [ -f "$dir/summary.json" ]; then
    [ -z "$tokenizer" ] && tokenizer="$dir/tokenizer.model"
    return 0
  fi
  for kv in ${runs[$name]}; do sets+=(--set "$kv"); done
  case "$name" in sync-*) ;; *) sets+=(--set "model.lr=$inner_lr") ;; esac
  # examples/demo.toml's controller watches quality: off where the run pins its setting.
  case "$name" in controller*) ;; *) sets+=(--set 'wan.bandwidth="0bit"' --set 'wan.rtt="0s"' --set strategy.max_loss_penalty=0) ;; esac
  [ -n "$tokenizer" ] && sets+=(--set "data.tokenizer=\"$tokenizer\"")
  local extra=()
  for kv in ${EXTRA:-}; do extra+=(--set "$kv"); done
  "$nebula" run examples/demo.toml --set job.steps="$steps" --set job.seed="$seed" --set eval.every=0 \
    --set strategy.adaptive=true "${corpus[@]}" "${sets[@]}" \
    --set metrics.progress='"off"' --set job.run_dir="\"$dir\"" "${tiny[@]}" "${extra[@]}" > "$dir.log" 2>&1 \
    || { echo "$name (seed $seed) failed: see $dir.log"; exit 1; }
  [ -z "$tokenizer" ] && tokenizer="$dir/tokenizer.model"
  return 0
}
for name in "${order[@]}"; do run "$name" 1 "$out/$name"; done
table() {  # the table, the frontier and the winner (to $out/winner: "name sync-name")
  python3 - "$out" "${order[@]}" <<'PY'
import sys
sys.path.insert(0, "bench")
from rundir import job, round_progress, summary
out, names = sys.argv[1], sys.argv[2:]
s = {n: summary(f"{out}/{n}") for n in names}
loss = lambda n: s[n]["final_val_loss"]
def retrieval(n):
    r = [e["retrieval_accuracy"] for e in s[n].get("eval", {}).values() if "retrieval_accuracy" in e]
    return sum(r) / len(r) if r else float("nan")
syncs = [n for n in names if n.startswith("sync-")]
base = min(syncs, key=loss)
ratio = lambda n: s[base]["wan_bytes"] / max(1.0, s[n]["wan_bytes"])
penalty = lambda n: (loss(n) / loss(base) - 1) * 100
others = [n for n in names if n not in syncs]
frontier = {n for n in others
            if not any(ratio(m) >= ratio(n) and loss(m) <= loss(n) and (ratio(m), loss(m)) != (ratio(n), loss(n)) for m in others)}
print(f"sync baseline: {base} (learning-rate sweep {', '.join(syncs)}; schedule: the demo's, warmup then cosine)")
lr = lambda n: float(n.split("-lr")[1])
if len(syncs) > 1 and lr(base) in (min(map(lr, syncs)), max(map(lr, syncs))):
    print(f"warning: the best sync learning rate ({lr(base):g}) is at the edge of the sweep: widen it")
def progress(n):  # (merge gap, retention) of a fixed-H diloco run with per-step losses, or None
    st = job(f"{out}/{n}").get("strategy", {})
    h = st.get("inner_steps", 0)
    return round_progress(f"{out}/{n}", h) if st.get("kind") == "diloco" and h > 0 else None
print(f"{'run':<22} {'tokens':>9} {'WAN bytes':>12} {'vs sync':>9} {'val loss':>9} {'penalty':>8} {'retrieval':>9}"
      f" {'gap':>7} {'kept':>5}")
for n in names:
    star = " *" if n in frontier else ""
    p = progress(n)
    extra = f" {p[0] * 100:+6.2f}% {p[1]:5.2f}" if p else f" {'-':>7} {'-':>5}"
    print(f"{n:<22} {s[n]['tokens']:9.0f} {s[n]['wan_bytes']:12.0f} {ratio(n):8.0f}x {loss(n):9.4f} "
          f"{penalty(n):+7.2f}% {retrieval(n):9.3f}{extra}{star}")
tokens = [s[n]["tokens"] for n in names]
if max(tokens) > 1.005 * min(tokens):
    print(f"warning: tokens differ by more than 0.5 % ({min(tokens):.0f} to {max(tokens):.0f})")
print("* the Pareto frontier (no other run has more reduction and less loss):")
for n in sorted(frontier, key=ratio):
    print(f"  {ratio(n):8.0f}x {penalty(n):+7.2f}%  {n}")
within = [n for n in others if penalty(n) <= 2.0]
with open(f"{out}/winner", "w") as f:
    f.write(f"{max(within, key=ratio) if within else '-'} {base}\n")
PY
}
table
read -r winner base < "$out/winner"
if [ "$winner" != - ] && [ "${SEED2:-1}" != 0 ]; then
  run "$base" 2 "$out/$base-seed2"
  run "$winner" 2 "$out/$winner-seed2"
  python3 - "$out" "$winner" "$base" <<'PY'
import sys
sys.path.insert(0, "bench")
from rundir import summary
out, w, b = sys.argv[1:]
for seed, suffix in ((1, ""), (2, "-seed2")):
    sw, sb = summary(f"{out}/{w}{suffix}"), summary(f"{out}/{b}{suffix}")
    print(f"seed {seed}: {w} {sb['wan_bytes'] / max(1.0, sw['wan_bytes']):.0f}x fewer WAN bytes than {b}, "
          f"validation loss {(sw['final_val_loss'] / sb['final_val_loss'] - 1) * 100:+.2f}%")
PY
fi
python3 - "$out" "$winner" "$base" "${runs[$winner]:-} model.lr=$inner_lr" <<'PY'
import sys
sys.path.insert(0, "bench")
from rundir import summary
out, w, b, sets = sys.argv[1:5]
if w == "-":
    print("best within 2%: none")
else:
    sw, sb = summary(f"{out}/{w}"), summary(f"{out}/{b}")
    print(f"best within 2%: {sb['wan_bytes'] / max(1.0, sw['wan_bytes']):.0f}x "
          f"({(sw['final_val_loss'] / sb['final_val_loss'] - 1) * 100:+.2f}%) {w} ({sets})")
PY
echo "(runs in $out)" >&2
