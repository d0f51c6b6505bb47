#!/usr/bin/env bash
# The planner's layout for the 70B case against a run of it, scaled down, on this machine.
# `nebula plan examples/plan_8x512_70b.toml` recommends pipeline stages with recompute (the
# strategy, codec, H, F, delay, shard and WAN mode its table names). This script
#   1. reads that recommendation (--json);
#   2. runs the same layout scaled down: 2 sites × 2 workers, each site pipeline 2 × data 1 with
#      the recommendation's recompute, shard, strategy, codec and WAN mode, H scaled to H_RUN
#      (default 8), F to at most H_RUN, the delay in proportion; an MLM encoder of LAYERS
#      (default 4) layers DIM wide (default 512, heads DIM/64, ffn 4·DIM) over sequences of
#      max_len 16, 16 per step, one per micro-batch (as the planner cuts them; a batch is as
#      long as its longest sequence, so a step's peak is at max_len);
#   3. writes a topology of that run (its parameter count from summary.json, tokens per
#      worker-step = 16 · max_len / 2, the shape, 2 sites × 2 workers) with that one candidate, asks
#      `nebula plan --json` for it, and prints predicted against measured:
#      - WAN bytes per step: every worker's wan_bytes_sent over the steady-state window
#        (rundir.window) over its steps, against the plan's wan_bytes_per_step;
#      - memory per worker: the largest worker's peak resident memory in the steps or outer
#        syncs (summary.json peak_rss_bytes_by_phase) less its peak before the set-up ("start":
#        LibTorch loaded, nothing built), against the plan's device + host need (on CPU both are
#        the same RAM).
#   heterogeneous = false: sites whose speeds differ would run different inner steps, and the
#   window compares every worker at the same steps.
#   The issue's bar: within 20 %. What the planner leaves out shows up here: the data and the
#   tokenizer, the allocator's slack, the embedding's rows on the first stage and the tied
#   copy on the last (the planner spreads parameters evenly over the layers).
#   bench/plan_layout.sh [steps, default 48]
#   BENCH_TINY=1 bench/plan_layout.sh 8   (tiny mode, bench/common.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/common.sh
steps="${1:-48}"
bench_out drop
h_run="${H_RUN:-8}"
dim="${DIM:-512}"
layers="${LAYERS:-4}"
[ "${#tiny[@]}" -gt 0 ] && h_run="${H_RUN:-2}" && layers="${LAYERS:-2}"
"$nebula" plan examples/plan_8x512_70b.toml --json > "$out/plan70b.json"
# The recommendation, scaled: KEY=VALUE lines for the run's --set options.
python3 - "$out/plan70b.json" "$h_run" > "$out/layout.env" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["recommended"]
if r is None:
    sys.exit("nebula plan examples/plan_8x512_70b.toml recommends nothing: no layout to run")
if r["pipeline"] < 2 or r["tensor"] != 1:
    sys.exit(f"the recommended layout (pipeline {r['pipeline']}, tensor {r['tensor']}) is not the stages this script runs")
h = int(sys.argv[2])
f = min(r["fragments"], h) if r["strategy"] == "streaming" else 1
delay = min(h - 1, round(r["delay"] * h / r["inner_steps"])) if r["strategy"] == "streaming" else 0
print(f"strategy={r['strategy']} codec={r['codec']} h={h if r['strategy'] != 'sync' else 1} f={f} delay={delay} "
      f"shard={r['shard']} mode={r['wan_mode']} recompute={'true' if r['recompute'] else 'false'} "
      f"pipeline_70b={r['pipeline']} h_70b={r['inner_steps']}")
PY
read -r -a layout < "$out/layout.env"
declare strategy codec h f delay shard mode recompute pipeline_70b h_70b
for kv in "${layout[@]}"; do declare "$kv"; done
echo "70B recommendation: $strategy/$codec H=$h_70b, pipeline $pipeline_70b with recompute=$recompute, shard $shard, $mode"
echo "run here: 2 sites x 2 workers, pipeline 2 (recompute=$recompute), $strategy/$codec H=$h F=$f delay=$delay, shard $shard, $mode"
strategy_sets=(--set strategy.kind="\"$strategy\"" --set strategy.codec="\"$codec\"")
[ "$strategy" != sync ] && strategy_sets+=(--set strategy.inner_steps="$h")
[ "$strategy" = streaming ] && strategy_sets+=(--set strategy.fragments="$f" --set strategy.delay="$delay")
batch=16
[ "${#tiny[@]}" -gt 0 ] && batch=4
heads=$(( dim >= 128 ? dim / 64 : 2 ))
# The model and data first, tiny mode's after them (so they win), then what the layout needs:
# enough layers for 2 stages, one sequence per micro-batch.
"$nebula" run examples/mixed_layouts.toml --set job.steps="$steps" --set job.log_every="$h" \
  --set metrics.progress='"off"' --set job.timeout='"600s"' --set job.run_dir="\"$out/run\"" \
  --set sites.0.workers=2 --set sites.1.workers=2 --set parallel.pipeline=2 \
  --set parallel.recompute="$recompute" --set parallel.shard="\"$shard\"" --set wan.mode="\"$mode\"" \
  --set strategy.heterogeneous=false \
  "${strategy_sets[@]}" --set model.dim="$dim" --set model.heads="$heads" --set model.ffn=$((4 * dim)) \
  --set model.max_len=16 --set data.vocab_size="${VOCAB:-1000}" --set data.max_pairs_per_language=3000 \
  "${tiny[@]}" --set model.layers="$layers" --set data.batch_size="$batch" --set parallel.micro_batches="$batch" \
  > "$out/run.log" 2>&1 || { echo "the run failed: see $out/run.log" >&2; exit 1; }
# The run's topology, with the one candidate it ran: its parameters, shape and batch from the
# run directory (tokens per worker-step: a replica's max_len-long sequences over its 2 workers).
python3 - "$out" "$strategy" "$codec" "$h" "$f" "$delay" "$shard" "$mode" "$recompute" > "$out/run_topology.toml" <<'PY'
import sys
sys.path.insert(0, "bench")
from rundir import summary, job
out, strategy, codec, h, f, delay, shard, mode, recompute = sys.argv[1:]
s, j = summary(f"{out}/run"), job(f"{out}/run")
m, batch = j["model"], j["data"]["batch_size"]
sites = "".join(f'[[sites]]\nname = "{x["name"]}"\nworkers = {x["workers"]}\ntokens_per_second_per_worker = 1000\n'
                for x in j["sites"])
print(f"""[model]
parameters = {s['parameters']}
trainable = {s['trainable_parameters']}
tokens_per_step_per_worker = {batch * m['max_len'] // 2}
layers = {m['layers']}
hidden = {m['dim']}
heads = {m['heads']}
sequence = {m['max_len']}
{sites}
[candidates]
strategies = ["{strategy}"]
codecs = ["{codec}"]
inner_steps = [{h}]
fragments = [{f}]
delay = [{delay}]
shard = ["{shard}"]
wan_modes = ["{mode}"]
pipeline = [2]
recompute = [{recompute}]
codec_block = {j['strategy'].get('codec_block', 256)}
""")
PY
"$nebula" plan "$out/run_topology.toml" --json > "$out/run_plan.json"
python3 - "$out" <<'PY'
import json, sys
sys.path.insert(0, "bench")
from rundir import summary, training_lines, window
out = sys.argv[1]
run = f"{out}/run"
plan = json.load(open(f"{out}/run_plan.json"))
p = plan["recommended"] or plan["candidates"][0]
s = summary(run)
lines = training_lines(run)
a, b = window(run, lines=lines)
wan = 0.0
for site in {l["site"] for l in lines}:
    for rank in {l["rank"] for l in lines if l["site"] == site}:
        mine = {l["step"]: l for l in lines if l["site"] == site and l["rank"] == rank}
        wan += mine[b["step"]]["wan_bytes_sent"] - mine[a["step"]]["wan_bytes_sent"]
wan /= b["step"] - a["step"]
peaks = s["peak_rss_bytes_by_phase"]
workers = len(peaks["start"])
held = [max(peaks["step"][w], peaks["outer_sync"][w]) - peaks["start"][w] for w in range(workers)]
m = p["memory_bytes_per_worker"]
predicted = m["device"] + m["host"]
mib = 2 ** 20
print(f"{'':<26} {'predicted':>12} {'measured':>12} {'error':>8}")
print(f"{'WAN bytes per step':<26} {p['wan_bytes_per_step']:12.0f} {wan:12.0f} {wan / p['wan_bytes_per_step'] - 1:+8.1%}")
print(f"{'memory per worker (MiB)':<26} {predicted / mib:12.1f} {max(held) / mib:12.1f} {max(held) / predicted - 1:+8.1%}")
print(f"  predicted: params {m['parameters'] / mib:.1f}, grads {m['gradients'] / mib:.1f}, AdamW {m['optimizer'] / mib:.1f}, "
      f"activations {m['activations'] / mib:.1f}, buffers {m['buffers'] / mib:.1f}, outer {m['outer'] / mib:.1f}, "
      f"codec {m['codec_state'] / mib:.1f}, exchange {m['exchange'] / mib:.1f} MiB")
print(f"  measured per worker (step or outer-sync peak - start): " + ", ".join(f"{x / mib:.1f}" for x in held) +
      f" MiB; start {max(peaks['start']) / mib:.0f} MiB; {s['parameters']} parameters, {s['steps']} steps, final val loss {s['final_val_loss']:.4f}")
PY
