"""Helpers for the pytest suite: a job config with free loopback ports, and one process per
worker of every site, each with its placement in the environment (as `nebula run` sets it)."""

import os
import random
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BUILD = os.environ.get("NEBULA_BINARY_DIR", os.path.join(ROOT, "build"))
PYTHON = sys.executable


def free_port():
    """A port below the kernel's ephemeral range (as transport::pick_free_port): no outgoing
    connection of another test can take it between this pick and the worker's bind."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port in 20000-32000")


def write_config(path, sites, strategy="kind = \"sync\"", extra="", timeout="60s", steps=10):
    """sites: [(name, workers), ...]. Plaintext loopback links (these tests check the
    collectives, not TLS; the examples run with mutual TLS)."""
    lines = ["[job]", 'name = "pytest"', f'run_dir = "{os.path.dirname(path)}/run"', f"steps = {steps}",
             f'timeout = "{timeout}"', ""]
    for name, workers in sites:
        lines += ["[[sites]]", f'name = "{name}"', f"workers = {workers}",
                  f'gateway = "127.0.0.1:{free_port()}"', f'store = "127.0.0.1:{free_port()}"', ""]
    lines += ["[strategy]", strategy, "", "[security]", "insecure = true", "", extra]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def start_workers(config, sites, argv, env=None):
    """Starts `argv` once per worker of every site; returns [(site, rank, Popen)]."""
    procs = []
    for name, workers in sites:
        for r in range(workers):
            e = dict(os.environ, NEBULA_CONFIG=config, NEBULA_SITE=name, NEBULA_RANK=str(r),
                     OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            e["PYTHONPATH"] = os.path.join(BUILD, "python") + os.pathsep + HERE
            e.update(env or {})
            procs.append((name, r, subprocess.Popen(argv, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                    text=True)))
    return procs


def wait_all(procs, timeout=240):
    """Waits for every process (bounded); kills the rest if the time runs out. Returns
    {(site, rank): (returncode, output)}."""
    deadline = time.time() + timeout
    out = {}
    for name, r, p in procs:
        try:
            text, _ = p.communicate(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for _, _, q in procs:
                q.kill()
            text, _ = p.communicate()
            text += "\n[killed: the test's time ran out]"
        out[(name, r)] = (p.returncode, text)
    return out


def run_workers(config, sites, argv, timeout=240, env=None):
    results = wait_all(start_workers(config, sites, argv, env), timeout)
    for (name, r), (code, text) in results.items():
        assert code == 0, f"worker {name}/{r} exited {code}:\n{text[-3000:]}"
    return results
