"""nebula.DiLoCo in Python and the C++ diloco strategy (examples/library/my_training_loop.cc,
nebula::Synchronizer) on the same model, data and seeds end with bit-identical weights; and
DiLoCo's state_dict round-trips."""

import os
import re

import pytest

import jobs

LAYOUT = [("alpha", 2), ("beta", 1)]
CPP = os.path.join(jobs.BUILD, "examples", "library", "my_training_loop")
PY = os.path.join(jobs.ROOT, "examples", "python", "my_training_loop.py")


def crcs(results):
    out = {}
    for (site, rank), (_, text) in results.items():
        m = re.search(r"parameters crc32 ([0-9a-f]{8})", text)
        assert m, text[-2000:]
        out[(site, rank)] = m.group(1)
    return out


# heterogeneous = false: with it each site's inner steps per round follow its measured speed,
# so two runs (in either language) need not take the same steps.
@pytest.mark.parametrize("strategy", [
    'kind = "diloco"\ninner_steps = 7\ncodec = "int8"\nouter_lr = 0.7\nouter_momentum = 0.9\nheterogeneous = false',
    'kind = "streaming"\ninner_steps = 8\nfragments = 2\ncodec = "fp16"\nheterogeneous = false',
], ids=["diloco-int8", "streaming-fp16"])
def test_python_diloco_is_bit_identical_to_the_cpp_strategy(tmp_path, strategy):
    config = jobs.write_config(str(tmp_path / "job.toml"), LAYOUT, strategy=strategy, steps=40,
                               extra='[wan]\nbandwidth = "50Mbit"\nrtt = "10ms"')
    cpp = crcs(jobs.run_workers(config, LAYOUT, [CPP, config]))
    py_results = jobs.run_workers(config, LAYOUT, [jobs.PYTHON, PY, config])
    py = crcs(py_results)
    assert py == cpp, f"python {py} vs C++ {cpp}"  # worker by worker (streaming's sites end apart)
    text = py_results[("alpha", 0)][1]
    m = re.search(r"test loss, mean over 3 workers on 2 sites: ([0-9.]+) -> ([0-9.]+)", text)
    assert m and float(m.group(2)) < float(m.group(1)), text[-2000:]


def test_diloco_state_dict_resumes_where_it_stopped(tmp_path):
    """Train 20 steps straight, or 10, save the model's and DiLoCo's state_dict, and the other 10 in a
    new process: the same weights (the outer momentum, global weights and codec state carried over)."""
    layout = [("a", 1), ("b", 1)]
    strategy = 'kind = "diloco"\ninner_steps = 3\ncodec = "int8"\nouter_momentum = 0.9\nheterogeneous = false'
    config = jobs.write_config(str(tmp_path / "job.toml"), layout, strategy=strategy, steps=20)
    worker = os.path.join(jobs.HERE, "resume_worker.py")
    state = str(tmp_path / "state.pt")
    out = {}
    for mode in ("straight", "first", "second"):
        res = jobs.run_workers(config, layout, [jobs.PYTHON, worker, mode, state])
        out[mode] = {w: re.search(r"crc32 ([0-9a-f]{8})", t).group(1) for w, (_, t) in res.items()}
    assert out["second"] == out["straight"], out  # worker by worker
    assert out["first"] != out["straight"], out


WATCHING = """
import sys, torch, nebula
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = nebula.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05))
s = nebula.session()
g = torch.Generator().manual_seed(1 + s.site_index)
def loss_now():
    x = torch.randn(16, 8, generator=g)
    return torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
loss = loss_now()
loss.backward()
try:
    opt.step()
    print("no error without the loss")
except nebula.Error as e:
    print("refused:", e)
for step in range(s.steps):
    opt.zero_grad()
    loss = loss_now()
    loss.backward()
    opt.step(loss=loss)
opt.finish()
print("decisions:", " | ".join(opt.decisions()))
"""


def test_a_controller_watching_quality_gets_the_loss_from_step_and_refuses_to_go_without_it(tmp_path):
    """With max_loss_penalty the controller reads the training loss: DiLoCo.step() refuses to run
    without it (naming the key and the file), and with it the controller decides on merge gaps."""
    layout = [("a", 1), ("b", 1)]
    strategy = ('kind = "diloco"\ninner_steps = 10\ncodec = "auto"\nmax_loss_penalty = 0.02\n'
                'heterogeneous = false')
    # The controller watching quality decides on the losses alone (no time measurements), at round
    # 3 on the gaps of rounds 0 and 1.
    config = jobs.write_config(str(tmp_path / "job.toml"), layout, strategy=strategy, steps=100)
    results = jobs.run_workers(config, layout, [jobs.PYTHON, "-c", WATCHING])
    for (site, rank), (code, text) in results.items():
        assert code == 0, text[-2000:]
        assert "refused:" in text and "max_loss_penalty" in text and "job.toml" in text, text[-2000:]
        assert re.search(r"decisions: .*merge gap -?[0-9.e-]+% at ", text), text[-3000:]
