"""A Python job's workers started the way clusters start processes, as for `nebula worker`: site
alpha's two workers by a real torchrun (RANK, WORLD_SIZE, LOCAL_RANK; its agent's store at
MASTER_ADDR:MASTER_PORT is the site's), site beta's by Slurm's variables; none gets a rank from
nebula. Every collective of the backend then runs across the three workers."""

import os
import subprocess

import jobs


def test_torchrun_and_slurm_placed_workers_form_the_job(tmp_path):
    layout = [("alpha", 2), ("beta", 1)]
    config = jobs.write_config(str(tmp_path / "job.toml"), layout)
    worker = os.path.join(jobs.HERE, "collectives_worker.py")
    base = dict(os.environ, NEBULA_CONFIG=config, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                PYTHONPATH=os.path.join(jobs.BUILD, "python"))
    for k in ("NEBULA_SITE", "NEBULA_RANK", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        base.pop(k, None)
    torchrun = subprocess.Popen(
        # -r/-t: Debian 12's torchrun 1.13 fails on Python 3.11 without redirects (torch's Std.from_str)
        [jobs.PYTHON, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
         f"--master_port={jobs.free_port()}", "--log_dir", str(tmp_path / "torchrun"), "-r", "1", "-t", "1", worker],
        env=dict(base, NEBULA_SITE="alpha"), text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    slurm = subprocess.Popen([jobs.PYTHON, worker], env=dict(base, NEBULA_SITE="beta", SLURM_PROCID="0",
                                                             SLURM_NTASKS="1"),
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    results = jobs.wait_all([("alpha", "torchrun", torchrun), ("beta", 0, slurm)], timeout=240)
    for who, (code, text) in results.items():
        assert code == 0, f"{who} exited {code}:\n{text[-3000:]}"
    alpha = results[("alpha", "torchrun")][1]
    # global ranks 0 and 1 (alpha, from torchrun's RANK), 2 (beta, from SLURM_PROCID) of 3
    assert "collectives ok 0 3" in alpha and "collectives ok 1 3" in alpha, alpha[-3000:]
    assert "collectives ok 2 3" in results[("beta", 0)][1]
