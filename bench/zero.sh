#!/usr/bin/env bash
# ZeRO-1, -2 and -3 inside a site against the whole optimizer, side by side, on one job
# (examples/mlm.toml: two sites of WORKERS and WORKERS1 workers, the same steps, data and seed)
# with [parallel] shard = "none", "optimizer" and (not with sync) "gradients", "full" and "full"
# with recompute. Per row: AdamW values per worker; each phase's peak memory (summary.json's
# peak_rss_bytes_by_phase: init, step, outer_sync, eval; the kernel's high-water mark reset at
# each phase's start) of the largest gateway and of the largest other worker; the sum over the job's
# workers of their peaks (what the whole job needs at most); worker 1's bytes to its site's other
# workers per step, step time and validation loss.
#   bench/zero.sh [steps, default 150] [strategy, default diloco]
#   EXTRA="--set model.dim=512 ..." bench/zero.sh ...   other options for every run (a bigger model)
#   WORKERS=4 bench/zero.sh ...   the first site's workers (default 2; 1 runs shard = "none" only:
#                                 sharding over one worker changes nothing)
#   WORKERS1=4 bench/zero.sh ...  the second site's workers (default 1)
#   WAN_MODE=every_worker bench/zero.sh ...   every worker on the WAN (default: the gateways)
#   SHARDS="none full" bench/zero.sh ...      only these rows ("full+recompute" is a row too; a
#                                   row ending "@glibc" runs under glibc's malloc instead of the
#                                   binary's jemalloc, through bench/glibc_malloc.c preloaded)
#   TINY_BASE=1 bench/zero.sh ...   each row again without EXTRA (the default tiny model), and a
#                                   second table: each phase's model-related peak (the row's minus
#                                   its tiny twin's) against the first row's, beside 1/N + 10 %
#   MEMORY_LIMIT_MB=N bench/zero.sh ...   the whole job of each row inside a memory cgroup (v1,
#                                   /sys/fs/cgroup/memory) of N MiB, no swap: a row the kernel
#                                   kills for memory is printed as such and the others go on;
#                                   so is a job that has not ended after MEMORY_LIMIT_SECONDS
#                                   (default 1800): without swap, a job far over the limit can
#                                   thrash on its libraries' pages instead of being killed (an
#                                   unsharded 14 GiB job in 8 GiB did, for minutes)
#   BENCH_TINY=1 bench/zero.sh 6 diloco   (tiny mode, bench/common.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/common.sh
steps="${1:-150}"
kind="${2:-diloco}"
bench_out drop
read -r -a extra <<< "${EXTRA:-}"
workers="${WORKERS:-2}"
[[ "$workers" =~ ^[1-9][0-9]*$ ]] || { echo "WORKERS=$workers: want a positive number of workers" >&2; exit 2; }
workers1="${WORKERS1:-1}"
[[ "$workers1" =~ ^[1-9][0-9]*$ ]] || { echo "WORKERS1=$workers1: want a positive number of workers" >&2; exit 2; }
limit_mb="${MEMORY_LIMIT_MB:-}"
[[ "${MEMORY_LIMIT_SECONDS:-1800}" =~ ^[1-9][0-9]*$ ]] || { echo "MEMORY_LIMIT_SECONDS=$MEMORY_LIMIT_SECONDS: want a positive number of seconds" >&2; exit 2; }
cgroups=/sys/fs/cgroup/memory
if [ -n "$limit_mb" ]; then
  [[ "$limit_mb" =~ ^[1-9][0-9]*$ ]] || { echo "MEMORY_LIMIT_MB=$limit_mb: want a positive number of MiB" >&2; exit 2; }
  [ -w "$cgroups" ] || { echo "MEMORY_LIMIT_MB: $cgroups is not a writable cgroup v1 memory controller" >&2; exit 2; }
fi
tiny_base="${TINY_BASE:-0}"
wan_mode="${WAN_MODE:-gateway}"
[[ "$wan_mode" == gateway || "$wan_mode" == every_worker ]] || { echo "WAN_MODE=$wan_mode: gateway or every_worker" >&2; exit 2; }
if [ -n "${SHARDS:-}" ]; then
  read -r -a shards <<< "$SHARDS"
else
  shards=(none)
  if ((workers > 1)); then
    shards+=(optimizer)
    [[ "$kind" != sync ]] && shards+=(gradients full full+recompute)
  fi
fi
# run NAME ARGS...: one job (inside a fresh memory cgroup of MEMORY_LIMIT_MB when set; under
# glibc's malloc when NAME ends "-glibc"); returns 0, or 3 when the kernel killed a process of it
# for memory.
run() {
  local name="$1"
  shift
  local preload=""
  if [[ "$name" == *-glibc || "$name" == *-glibc-tiny ]]; then
    [ -e "$out/glibc_malloc.so" ] || cc -O2 -shared -fPIC -o "$out/glibc_malloc.so" bench/glibc_malloc.c
    preload="$out/glibc_malloc.so"
  fi
  local nebula=(env ${preload:+LD_PRELOAD="$preload"} "$nebula")
  if [ -z "$limit_mb" ]; then
    "${nebula[@]}" "$@" > "$out/$name.log" 2>&1 || { echo "$name failed: see $out/$name.log" >&2; exit 1; }
    return 0
  fi
  local cg="$cgroups/nebula-zero-$$-$name" rc=0
  mkdir "$cg"
  echo $((limit_mb * 1048576)) > "$cg/memory.limit_in_bytes"
  [ -e "$cg/memory.memsw.limit_in_bytes" ] && echo $((limit_mb * 1048576)) > "$cg/memory.memsw.limit_in_bytes"
  timeout -k 30 "${MEMORY_LIMIT_SECONDS:-1800}" bash -c 'echo $$ > "$0/cgroup.procs" && exec "$@"' "$cg" \
    "${nebula[@]}" "$@" > "$out/$name.log" 2>&1 || rc=$?
  if ((rc == 124 || rc == 137)); then  # stalled: stop what is left of the job (only its cgroup's processes)
    xargs -r kill -9 < "$cg/cgroup.procs" 2>/dev/null || true
    for _ in 1 2 3 4 5 6 7 8 9 10; do rmdir "$cg" 2>/dev/null && break; sleep 1; done
    return 4
  fi
  local killed
  killed=$(awk '$1 == "oom_kill" { print $2 }' "$cg/memory.oom_control")
  [ -n "$killed" ] || killed=$(cat "$cg/memory.failcnt")  # kernels before 4.13: the limit was hit
  rmdir "$cg" 2>/dev/null || true
  if ((rc != 0)); then
    ((killed > 0)) && return 3
    echo "$name failed (not for memory): see $out/$name.log" >&2
    exit 1
  fi
  return 0
}

printf "%-15s %12s %8s | %36s | %36s | %8s | %12s %8s %10s %9s\n" "" "AdamW" "" "largest gateway peak MiB" \
  "largest other worker MiB" "job GiB" "site MB/step" "" "" ""
printf "%-15s %12s %8s | %8s %8s %9s %8s | %8s %8s %9s %8s | %8s | %12s %8s %10s %9s\n" shard "values/wkr" "vs none" init \
  step outer eval init step outer eval "sum" "worker 1" "s/step" "vs first" "val loss"
first=""
rows=()
for shard in "${shards[@]}"; do
  row="${shard%@glibc}"
  mode="${row%%+*}"
  recompute=false
  [ "$row" = full+recompute ] && recompute=true
  [ "$mode" = "$row" ] || [ "$row" = full+recompute ] || { echo "SHARDS: unknown row '$shard'" >&2; exit 2; }
  [[ "$mode" =~ ^(none|optimizer|gradients|full)$ ]] || { echo "SHARDS: unknown row '$shard'" >&2; exit 2; }
  name="${shard/+/-}"
  name="${name/@/-}"
  job=(run examples/mlm.toml --set job.steps="$steps" --set strategy.kind="\"$kind\"" --set strategy.inner_steps=10
       --set strategy.heterogeneous=false --set parallel.shard="\"$mode\"" --set parallel.recompute="$recompute"
       --set wan.mode="\"$wan_mode\"" --set sites.0.workers="$workers" --set sites.1.workers="$workers1"
       --set metrics.progress='"off"' --set job.timeout='"600s"')  # without ZeRO-3 a large model's evaluation
                                                                    # on the gateway alone can outlast 120 s
  killed=0
  run "$name" "${job[@]}" --set job.run_dir="\"$out/$name\"" "${extra[@]}" "${tiny[@]}" || killed=$?
  if ((killed == 0)) && [ "$tiny_base" = 1 ]; then
    run "$name-tiny" "${job[@]}" --set job.run_dir="\"$out/$name-tiny\"" "${tiny[@]}" || killed=$?
  fi
  if ((killed == 4)); then
    printf "%-15s not ended after %s s inside the job's cgroup of %s MiB (not killed; without swap it can thrash): stopped\n" "$name" \
      "${MEMORY_LIMIT_SECONDS:-1800}" "$limit_mb"
    continue
  elif ((killed != 0)); then
    printf "%-15s killed for memory inside the job's cgroup of %s MiB; the launcher says: %s\n" "$name" "$limit_mb" \
      "$(grep -m1 'error:' "$out/$name.log" || grep -v '^\s*$' "$out/$name.log" | tail -1)"
    continue
  fi
  rows+=("$name")
  first="${first:-$name}"
  python3 - "$out" "$name" "$first" "$workers" <<'PY'
import sys
sys.path.insert(0, "bench")
from rundir import summary, step_seconds, window
from zero_peaks import largest, job_sum
out, name, first, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
run = f"{out}/{name}"
s = summary(run)
want = "glibc" if name.endswith("-glibc") else "jemalloc"
if s.get("allocator", want) != want:
    sys.exit(f"{name}: ran under {s['allocator']}, not {want} (summary.json's allocator)")
state, base = window(run)[1]["adamw_state_values"], window(f"{out}/{first}")[1]["adamw_state_values"]
peaks = s["peak_rss_bytes_by_phase"]
phases = ("init", "step", "outer_sync", "eval")
gw = [largest(peaks, phase, workers, True) / 2**20 for phase in phases]
other = [largest(peaks, phase, workers, False) / 2**20 for phase in phases]
site_bytes = s["site_bytes_sent_by_worker"][1] if workers > 1 else 0.0
seconds = step_seconds(run)
print(f"{name:<15} {state:12d} {state / base:7.2f}x | {gw[0]:8.0f} {gw[1]:8.0f} {gw[2]:9.0f} {gw[3]:8.0f} | "
      f"{other[0]:8.0f} {other[1]:8.0f} {other[2]:9.0f} {other[3]:8.0f} | {job_sum(peaks) / 2**30:8.2f} | "
      f"{site_bytes / s['local_steps_site0'] / 1e6:12.2f} "
      f"{seconds:8.3f} {step_seconds(f'{out}/{first}') / seconds:9.2f}x {s['final_val_loss']:9.4f}"
      + ("" if peaks["exact"] else "  (peaks not per phase: /proc/self/clear_refs refused)"))
PY
done
if [ "$tiny_base" = 1 ] && ((${#rows[@]} > 0)); then
  python3 - "$out" "$workers" "${rows[@]}" <<'PY'
import sys
sys.path.insert(0, "bench")
from rundir import summary
from zero_peaks import largest
out, workers, rows = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
phases = ("init", "step", "outer_sync", "eval")
def related(name, phase, gateway):  # the row's peak minus its tiny twin's, MiB
    big, small = (summary(f"{out}/{r}")["peak_rss_bytes_by_phase"] for r in (name, f"{name}-tiny"))
    return (largest(big, phase, workers, gateway) - largest(small, phase, workers, gateway)) / 2**20
print(f"\nmodel-related peak (row minus the same job with the tiny model) against {rows[0]}'s; "
      f"1/N + 10 % = {1 / workers + 0.1:.2f} for N = {workers}")
print(f"{'shard':<15} | {'largest gateway':>39} | {'largest other worker':>39}")
print(f"{'':<15} | " + " ".join(f"{p:>9}" for p in phases) + " | " + " ".join(f"{p:>9}" for p in phases))
for name in rows:
    cells = []
    for gateway in (True, False):
        # Under 8 MiB of model-related memory (tiny mode) a ratio is noise: n/a.
        cells.append(" ".join(f"{related(name, p, gateway) / related(rows[0], p, gateway):8.2f}x"
                              if related(rows[0], p, gateway) >= 8 else f"{'n/a':>9}" for p in phases))
    print(f"{name:<15} | {cells[0]} | {cells[1]}")
PY
fi
