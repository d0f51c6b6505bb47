#!/usr/bin/env bash
# Soak run ([6/7]'s benchmark; minutes, not in CI): two sites pre-training the benchmark MLM
# (examples/mlm.toml) with elastic diloco over an emulated 20 Mbit/s, 100 ms WAN whose link is
# cut every CUT seconds, while the second site's gateway is killed (SIGKILL) every RESTART
# seconds and started again by the launcher (job.restarts; it resumes from its checkpoint and
# rejoins). The same job without faults runs first. Prints steps, synchronizations, hash
# checks, reconnections, restarts and the final validation loss of both, side by side.
#   bench/soak.sh [steps, default 3000] [RESTART s, default 60] [CUT s, default 20]
#   BENCH_TINY=1 bench/soak.sh 16 1000 1000   (tiny mode, bench/common.sh: H = 4; no fault fires in
#                                              so short a run, so it checks the runs and the table only)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/common.sh
steps="${1:-3000}"
restart_every="${2:-60}"
cut_every="${3:-20}"
bench_out keep
# Tiny mode: rounds (and checkpoints) of 4 steps, so a run of a few steps still synchronizes.
[ ${#tiny[@]} -gt 0 ] && tiny+=(--set strategy.inner_steps=4 --set checkpoint.every=4)
common=(--set job.steps="$steps" --set job.elastic=true --set job.restarts=1000 --set checkpoint.every=50
        --set strategy.kind='"diloco"' --set strategy.codec='"int4"' --set strategy.inner_steps=50
        --set strategy.heterogeneous=false --set 'wan.bandwidth="20Mbit"' --set 'wan.rtt="100ms"'
        --set 'wan.reconnect_timeout="5s"' --set metrics.progress='"off"')
second=$(awk '/^\[\[sites\]\]/{n++} n==2 && /^name/{gsub(/"/,"",$3); print $3; exit}' examples/mlm.toml)

echo "clean run ($steps steps) in $out/clean ..."
start=$(date +%s)
"$nebula" run examples/mlm.toml "${common[@]}" --set job.run_dir="\"$out/clean\"" "${tiny[@]}" > "$out/clean.log" 2>&1 \
  || { echo "clean run failed: see $out/clean.log"; exit 1; }
clean_s=$(( $(date +%s) - start ))

printf '%s\n[[wan.faults]]\nkind = "cut"\nevery = "%ss"\n' "$(cat examples/mlm.toml)" "$cut_every" > "$out/soak.toml"
echo "soak run in $out/soak: cuts every ${cut_every}s, site '$second' killed every ${restart_every}s ..."
start=$(date +%s)
"$nebula" run "$out/soak.toml" "${common[@]}" --set job.run_dir="\"$out/soak\"" "${tiny[@]}" > "$out/soak.log" 2>&1 &
job=$!
kills=0
next=$(( $(date +%s) + restart_every ))
while kill -0 "$job" 2>/dev/null; do
  sleep 1
  if [ "$(date +%s)" -ge "$next" ] && [ -f "$out/soak/workers.json" ]; then
    pid=$(python3 -c "import json,sys; print(next((w['pid'] for w in json.load(open(sys.argv[1])) if w['site']==sys.argv[2] and w['rank']==0), ''))" "$out/soak/workers.json" "$second")
    if [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null; then kills=$((kills + 1)); echo "  killed $second's gateway (pid $pid) at $(( $(date +%s) - start )) s"; fi
    next=$(( $(date +%s) + restart_every ))
  fi
done
wait "$job" || { echo "soak run failed: see $out/soak.log"; exit 1; }
soak_s=$(( $(date +%s) - start ))

python3 - "$out" "$clean_s" "$soak_s" "$kills" <<'PY'
import sys
sys.path.insert(0, "bench")
from rundir import audit, summary
out, clean_s, soak_s, kills = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def row(name, wall):
    s = summary(f"{out}/{name}")
    m = s["strategy_metrics"]
    reconnects = sum(1 for a in audit(f"{out}/{name}") if a.get("reason") == "reconnected")
    return s, [name, s["local_steps_site0"], int(m["outer_steps"]), int(m.get("hash_checks", 0)), reconnects,
               len(s.get("sites_rejoined", [])), wall, s["final_val_loss"]]
clean, a = row("clean", clean_s)
soak, b = row("soak", soak_s)
print(f"\n{'run':<6} {'steps':>6} {'syncs':>6} {'hash ok':>8} {'reconn.':>8} {'rejoins':>8} {'wall s':>7} {'val loss':>9}")
for r in (a, b):
    print(f"{r[0]:<6} {r[1]:>6} {r[2]:>6} {r[3]:>8} {r[4]:>8} {r[5]:>8} {r[6]:>7} {r[7]:>9.4f}")
print(f"\nsite kills: {kills}; val loss soak / clean = {b[7] / a[7]:.4f}")
PY
