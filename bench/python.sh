#!/usr/bin/env bash
# The Python package's overheads, each measured side by side in one run:
#  1. The training loop: examples/library/my_training_loop (C++) against its Python twin
#     examples/python/my_training_loop.py (nebula.DiLoCo), the same diloco job on 2 sites
#     (2 + 1 workers), at two widths of its MLP (hidden 64: 1.2k parameters, a step of ~2 ms where
#     PyTorch's own per-op Python overhead shows; hidden 4096: 74k): examples per second in the
#     loop, mean over the workers. Both run the same C++ strategy and end with bit-identical
#     weights (checked here: the quality cost is none).
#  2. torch.distributed all_reduce of SIZE bytes on 2 ranks, backend "nebula" against plain
#     Gloo, algorithm bandwidth (bytes / time per call): inside one site of 2 workers (no WAN
#     leg), and across 2 sites of 1 worker (the hierarchical all-reduce over the gateways).
#   bench/python.sh [steps, default 400] [all-reduce calls, default 50]
#   SIZE=4194304 bench/python.sh ...      the all-reduce size in bytes (default 4 MiB)
#   BENCH_TINY=1 bench/python.sh 20 3     (tiny mode, bench/common.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/common.sh
steps="${1:-400}"
calls="${2:-50}"
size="${SIZE:-4194304}"
[[ "$steps" =~ ^[1-9][0-9]*$ && "$calls" =~ ^[1-9][0-9]*$ && "$size" =~ ^[1-9][0-9]*$ ]] ||
  { echo "steps '$steps', calls '$calls', SIZE '$size': want positive numbers" >&2; exit 2; }
[ "${#tiny[@]}" -gt 0 ] && size=65536
bench_out drop
build="$(dirname "$nebula")"
[ -e "$build/python/nebula/_nebula"*.so ] || { echo "$build/python: no nebula Python package; build it (scripts/build.sh)" >&2; exit 1; }
/usr/bin/python3 - "$out" "$steps" "$calls" "$size" "$build" <<'PY'
import os, re, sys
out, steps, calls, size, build = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
os.environ["NEBULA_BINARY_DIR"] = os.path.abspath(build)
sys.path.insert(0, "python/tests")
import jobs

layout = [("alpha", 2), ("beta", 1)]
config = jobs.write_config(f"{out}/loop.toml", layout, steps=steps,
                           strategy='kind = "diloco"\ninner_steps = 20\ncodec = "int8"\nheterogeneous = false',
                           extra='[wan]\nbandwidth = "200Mbit"\nrtt = "10ms"')
print(f"{'loop':<8} {'hidden':>6} {'ms/step':>8} {'examples/s':>11} {'vs C++':>7} {'weights crc32':>14} {'test loss':>10}")
for hidden in ("64", "4096"):
    rows = {}
    for name, argv in (("C++", [f"{build}/examples/library/my_training_loop", config]),
                       ("Python", [jobs.PYTHON, "examples/python/my_training_loop.py", config])):
        res = jobs.run_workers(config, layout, argv + ["--hidden", hidden], timeout=1800)
        text = "".join(t for _, t in res.values())
        rates = [float(x) for x in re.findall(r"([0-9.]+) examples/s in the loop", text)]
        crcs = sorted(set(re.findall(r"parameters crc32 ([0-9a-f]{8})", text)))
        loss = re.search(r"test loss, mean over \d+ workers on \d+ sites: [0-9.]+ -> ([0-9.]+)", text).group(1)
        assert len(rates) == 3 and len(crcs) == 1, text[-3000:]
        rows[name] = (sum(rates) / len(rates), crcs[0], loss)
    for name, (rate, crc, loss) in rows.items():
        print(f"{name:<8} {hidden:>6} {32e3 / rate:8.2f} {rate:11.0f} {rate / rows['C++'][0]:6.2f}x {crc:>14} {loss:>10}")
    print(f"same weights at hidden {hidden}: " + ("yes" if rows["C++"][1] == rows["Python"][1] else "NO"))

# The same ranks twice: one site of 2 workers (c10d inside the site, no WAN leg), then two
# sites of 1 worker (the hierarchical all-reduce: the gateways' exchange over the WAN session
# stack, plaintext, no emulation, identity codec) -- each against Gloo's flat all-reduce.
print(f"\n{'all_reduce ' + str(size) + ' B':<32} {'MiB/s':>8} {'vs Gloo':>8}")
for label, layout in (("1 site x 2 workers", [("site", 2)]), ("2 sites x 1 worker", [("a", 1), ("b", 1)])):
    config = jobs.write_config(f"{out}/allreduce-{len(layout)}.toml", layout)
    gloo_init = f"tcp://127.0.0.1:{jobs.free_port()}"
    bw = {}
    for backend in ("gloo", "nebula"):
        procs, rank = [], 0
        for name, workers in layout:
            for r in range(workers):
                env = {"GLOO_INIT": gloo_init, "GLOBAL_RANK": str(rank), "GLOBAL_WORLD": "2"}
                procs += [(name, r, p) for _, _, p in jobs.start_workers(
                    config, [(name, 1)], [jobs.PYTHON, "bench/allreduce_py.py", backend, str(size), calls],
                    env=dict(env, NEBULA_RANK=str(r)))]
                rank += 1
        res = jobs.wait_all(procs, timeout=600)
        text = "".join(t for _, t in res.values())
        assert all(c == 0 for c, _ in res.values()), text[-3000:]
        bw[backend] = float(re.search(r"([0-9.]+) MiB/s", text).group(1))
    for backend in ("gloo", "nebula"):
        print(f"{backend + ', ' + label:<32} {bw[backend]:8.1f} {bw[backend] / bw['gloo']:7.2f}x")
PY
