"""Unmodified DDP across 2 sites x 2 workers over backend "nebula" ends with the same weights as
DDP over plain Gloo on the same 4 ranks (exact float32 WAN leg; tolerance 1e-6 relative)."""

import os
import subprocess

import torch

import jobs


def _run(tmp_path, mode):
    layout = [("alpha", 2), ("beta", 2)]
    config = jobs.write_config(str(tmp_path / f"{mode}.toml"), layout)
    worker = os.path.join(jobs.HERE, "ddp_worker.py")
    procs = []
    port = jobs.free_port()
    for rank, (site, local) in enumerate([("alpha", 0), ("alpha", 1), ("beta", 0), ("beta", 1)]):
        out = str(tmp_path / f"{mode}-{rank}.pt")
        env = dict(os.environ, NEBULA_CONFIG=config, NEBULA_SITE=site, NEBULA_RANK=str(local),
                   GLOO_INIT=f"tcp://127.0.0.1:{port}", GLOBAL_RANK=str(rank), GLOBAL_WORLD="4",
                   OMP_NUM_THREADS="1", PYTHONPATH=os.path.join(jobs.BUILD, "python"))
        procs.append((site, local, subprocess.Popen([jobs.PYTHON, worker, mode, out], env=env, text=True,
                                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
    for (site, local), (code, text) in jobs.wait_all(procs).items():
        assert code == 0, f"{mode} worker {site}/{local} exited {code}:\n{text[-3000:]}"
    return [torch.load(str(tmp_path / f"{mode}-{rank}.pt")) for rank in range(4)]


def test_ddp_over_nebula_equals_ddp_over_gloo(tmp_path):
    nebula = _run(tmp_path, "nebula")
    gloo = _run(tmp_path, "gloo")
    for rank in range(4):
        for a, b, g in zip(nebula[rank], nebula[0], gloo[0]):
            assert torch.equal(a, b), f"rank {rank}'s weights differ from rank 0's under nebula"
            rel = ((a - g).norm() / g.norm()).item()
            assert rel <= 1e-6, f"nebula vs gloo: relative difference {rel}"
