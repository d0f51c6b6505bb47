#!/usr/bin/env bash
# Checks `nebula plan` against runs measured here over the emulated WAN.
#   bench/plan_validate.sh [STRATEGY ...]          (default: sync)
#   STEPS=40 CODECS="none int8" bench/plan_validate.sh sync diloco
#
# 1. Calibrates compute speed: runs examples/mlm.toml with an unlimited WAN
#    (wan.bandwidth=0, wan.rtt=0) and takes the steady-state step time, tokens per
#    worker-step and the parameter count (floats sent per step) from its metrics.jsonl.
# 2. For each STRATEGY and CODEC: runs the demo over its emulated WAN (50 Mbit/s, 80 ms),
#    writes a topology with the calibrated tokens_per_second_per_worker and the run's own
#    [wan] and [strategy] settings, asks `build/nebula plan --json` for that one candidate, and
#    prints predicted vs measured step time and WAN bytes per step with the relative error.
# Steady state = between the first and last metrics lines of site 0's gateway (the first
# window holds start-up and the initial broadcast of the weights). For diloco/streaming use
# STEPS of several H (and job.log_every dividing H) so that the window holds whole rounds:
# EXTRA="--set strategy.inner_steps=10" passes more --set options to every run.
#   BENCH_TINY=1 STEPS=6 CODECS=int8 EXTRA="--set strategy.inner_steps=2 --set strategy.heterogeneous=false" \
#     bench/plan_validate.sh sync diloco
#   (heterogeneous = false: sites whose measured speeds differ would run different inner steps,
#   and the window compares the sites at the same steps)
#   (tiny mode, bench/common.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/common.sh
steps="${STEPS:-40}"
codecs="${CODECS:-none int8}"
strategies=("$@")
[ ${#strategies[@]} -gt 0 ] || strategies=(sync)
read -r -a extra <<< "${EXTRA:-}"
bench_out drop

run() {  # run NAME --set ...: one demo run into $out/NAME
  local name="$1"
  shift
  "$nebula" run examples/mlm.toml --set job.steps="$steps" --set metrics.progress='"off"' \
    --set job.run_dir="\"$out/$name\"" "${extra[@]}" "$@" "${tiny[@]}" > "$out/$name.log" 2>&1 \
    || { echo "$name failed: see $out/$name.log"; exit 1; }
}

# What a run measured, as JSON: steady-state s/step, WAN bytes/step (all gateways), tokens per
# worker-step, floats exchanged per step, and the run's resolved [wan], [strategy] and sites.
measure() {
  python3 - "$out/$1" <<'PY'
import json, sys
sys.path.insert(0, "bench")
from rundir import job, training_lines, window
run = sys.argv[1]
job = job(run)
lines = training_lines(run)
first, last = window(run, lines=lines)
span = last["step"] - first["step"]
gateways = [l for l in lines if l["rank"] == 0]
wan = 0.0
for s in job["sites"]:
    mine = [l for l in gateways if l["site"] == s["name"]]
    a = next(l for l in mine if l["step"] == first["step"])
    b = next(l for l in mine if l["step"] == last["step"])
    wan += b["wan_bytes_sent"] - a["wan_bytes_sent"]
workers = sum(s["workers"] for s in job["sites"])
tok = {l["step"]: 0 for l in lines}
for l in lines:
    tok[l["step"]] += l["tokens"]
print(json.dumps({
    "step_s": (last["elapsed"] - first["elapsed"]) / span,
    "wan_bytes_per_step": wan / span,
    "tokens_per_worker_step": (tok[last["step"]] - tok[first["step"]]) / span / workers,
    "floats_per_step": (last["codec_bytes_in"] - first["codec_bytes_in"]) / span / 4,
    "wan": job["wan"], "strategy": job["strategy"],
    "sites": [{"name": s["name"], "workers": s["workers"]} for s in job["sites"]],
}))
PY
}

echo "calibrating compute with an unlimited WAN ($steps steps of examples/mlm.toml) ..."
run free --set wan.bandwidth=0 --set wan.rtt=0
measure free > "$out/free.json"
python3 - "$out/free.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
print(f"  {c['step_s']:.4f} s/step, {c['tokens_per_worker_step']:.0f} tokens per worker-step, "
      f"{c['floats_per_step']:.0f} parameters -> {c['tokens_per_worker_step'] / c['step_s']:.0f} tokens/s per worker")
PY
echo
printf "%-10s %-6s %9s %9s %7s %12s %12s %7s\n" strategy codec "s/step" measured error "WAN B/step" measured error
for kind in "${strategies[@]}"; do
  for codec in $codecs; do
    if [ "$kind" = sync ] && [ "$codec" = sparseloco ]; then continue; fi
    name="$kind-$codec"
    run "$name" --set strategy.kind="\"$kind\"" --set strategy.codec="\"$codec\""
    measure "$name" > "$out/$name.json"
    # The topology the planner sees: calibrated compute, the run's WAN and strategy settings.
    python3 - "$out/free.json" "$out/$name.json" > "$out/$name.plan.toml" <<'PY'
import json, sys
free, m = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
tps = free["tokens_per_worker_step"] / free["step_s"]
st, wan = m["strategy"], m["wan"]
n = free["floats_per_step"]
# Sync sends one bucket per strategy.bucket bytes; with a single bucket nothing overlaps.
overlap = 0 if 4 * n <= int(st["bucket"].rstrip("B")) else 2 / 3
print(f'[model]\nparameters = {n:.0f}\ntokens_per_step_per_worker = {free["tokens_per_worker_step"]:.3f}\n')
for s in m["sites"]:
    print(f'[[sites]]\nname = "{s["name"]}"\nworkers = {s["workers"]}\n'
          f'tokens_per_second_per_worker = {tps:.3f}\nlan_bandwidth = "0"\n')
print(f'[wan]\nbandwidth = "{wan["bandwidth"]}"\nrtt = "{wan["rtt"]}"\nshared_uplink = false\n')
print(f'[candidates]\nstrategies = ["{st["kind"]}"]\ncodecs = ["{st["codec"]}"]\n'
      f'inner_steps = [{st["inner_steps"]}]\nfragments = [{st["fragments"]}]\ndelay = [{st["delay"]}]\n'
      f'codec_block = {st["codec_block"]}\ncodec_density = {st["codec_density"]}\n')
print(f'[planner]\noverlap = {overlap}\ntolerance = 0.0')
PY
    "$nebula" plan "$out/$name.plan.toml" --json > "$out/$name.plan.json"
    python3 - "$out/$name.json" "$out/$name.plan.json" "$kind" "$codec" <<'PY'
import json, sys
m, p = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))["recommended"]
err = lambda pred, meas: f"{100 * (pred - meas) / meas:+.1f}%"
print(f"{sys.argv[3]:<10} {sys.argv[4]:<6} {p['step_seconds']:9.4f} {m['step_s']:9.4f} "
      f"{err(p['step_seconds'], m['step_s']):>7} {p['wan_bytes_per_step']:12.0f} "
      f"{m['wan_bytes_per_step']:12.0f} {err(p['wan_bytes_per_step'], m['wan_bytes_per_step']):>7}")
PY
  done
done
