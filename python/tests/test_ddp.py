"""Unmodified DDP across 2 sites x 2 workers over backend "nebula" ends with the same weights as
DDP over plain Gloo on the same 4 ranks (exact float32 WAN leg; tolerance 1e-6 relative)."""

import os
import re
import subprocess

import torch

import jobs


def _run(tmp_path, mode, strategy='kind = "sync"', tag="", texts=None):
    layout = [("alpha", 2), ("beta", 2)]
    config = jobs.write_config(str(tmp_path / f"{mode}{tag}.toml"), layout, strategy=strategy)
    worker = os.path.join(jobs.HERE, "ddp_worker.py")
    procs = []
    port = jobs.free_port()
    for rank, (site, local) in enumerate([("alpha", 0), ("alpha", 1), ("beta", 0), ("beta", 1)]):
        out = str(tmp_path / f"{mode}{tag}-{rank}.pt")
        env = dict(os.environ, NEBULA_CONFIG=config, NEBULA_SITE=site, NEBULA_RANK=str(local),
                   GLOO_INIT=f"tcp://127.0.0.1:{port}", GLOBAL_RANK=str(rank), GLOBAL_WORLD="4",
                   OMP_NUM_THREADS="1", PYTHONPATH=os.path.join(jobs.BUILD, "python"))
        procs.append((site, local, subprocess.Popen([jobs.PYTHON, worker, mode, out], env=env, text=True,
                                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
    sent = 0
    for (site, local), (code, text) in jobs.wait_all(procs).items():
        assert code == 0, f"{mode} worker {site}/{local} exited {code}:\n{text[-3000:]}"
        sent += int(re.search(r"wan_bytes_sent (\d+)", text).group(1))
        if texts is not None:
            texts[(site, local)] = text
    return [torch.load(str(tmp_path / f"{mode}{tag}-{rank}.pt")) for rank in range(4)], sent


def test_ddp_over_nebula_equals_ddp_over_gloo(tmp_path):
    nebula, _ = _run(tmp_path, "nebula")
    gloo, _ = _run(tmp_path, "gloo")
    for rank in range(4):
        for a, b, g in zip(nebula[rank], nebula[0], gloo[0]):
            assert torch.equal(a, b), f"rank {rank}'s weights differ from rank 0's under nebula"
            rel = ((a - g).norm() / g.norm()).item()
            assert rel <= 1e-6, f"nebula vs gloo: relative difference {rel}"


def test_collectives_are_exact_whatever_the_sync_codec(tmp_path):
    """strategy.kind = "sync" with codec int8 (no error feedback): the backend's collectives stay
    exact (a collective may carry a user's own sums; compression for DDP belongs in a
    communication hook): DDP ends with bit-identical weights to the run without a codec, and a
    user's all_reduce of 420003, 0.006, 740736, -19.5, 6291462 returns them (int8 on the WAN leg
    returned 419412.6, -19.5, 740154.8, -19.5, 6291462)."""
    exact, _ = _run(tmp_path, "nebula")
    texts = {}
    int8, _ = _run(tmp_path, "nebula", 'kind = "sync"\ncodec = "int8"\ncodec_error_feedback = false', "-int8",
                            texts)
    for rank in range(4):
        for a, e in zip(int8[rank], exact[rank]):
            assert torch.equal(a, e), f"rank {rank}: weights differ from the run without a codec"
    want = [420003.0, 0.006, 740736.0, -19.5, 6291462.0]
    for who, text in texts.items():
        got = [float(v) for v in re.search(r"user_sums (.*)", text).group(1).split()]
        for g, w in zip(got, want):
            assert abs(g - w) <= 1e-6 * abs(w), f"{who}: all_reduce returned {got}, exact sums {want}"
