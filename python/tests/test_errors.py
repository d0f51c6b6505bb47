"""nebula's errors are Python exceptions carrying nebula's message: a config error names the
file, line and key; a lost site raises nebula.PeerLost within twice the deadline, not a hang."""

import os
import re

import pytest

import jobs
import nebula


def test_a_config_error_names_the_file_line_and_key(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[job]\nname = "x"\nstepz = 3\n\n[[sites]]\nname = "a"\nworkers = 1\n')
    with pytest.raises(nebula.ConfigError) as e:
        nebula.Session(str(path), "a", 0)
    msg = str(e.value)
    assert str(path) in msg and "stepz" in msg and re.search(r":3\b", msg), msg
    assert isinstance(e.value, nebula.Error) and isinstance(e.value, RuntimeError)
    ok = jobs.write_config(str(tmp_path / "ok.toml"), [("a", 1)])
    with pytest.raises(nebula.ConfigError, match="no-such-site"):
        nebula.Session(ok, "no-such-site", 0)


def test_a_lost_site_raises_peer_lost_within_twice_the_deadline(tmp_path):
    layout = [("alpha", 1), ("beta", 1)]
    deadline = 6
    config = jobs.write_config(str(tmp_path / "job.toml"), layout, timeout=f"{deadline}s",
                               extra='[wan]\nreconnect_timeout = "3s"')
    results = jobs.run_workers(config, layout, [jobs.PYTHON, os.path.join(jobs.HERE, "errors_worker.py"), "lost"],
                               timeout=120)
    text = results[("alpha", 0)][1]
    m = re.search(r"raised (PeerLost) after ([0-9.]+) s", text)
    assert m, text[-2000:]
    assert float(m.group(2)) <= 2 * deadline, text[-2000:]


def test_the_sync_codec_is_not_applied_to_the_backend_and_says_so(tmp_path):
    """The backend's collectives are exact whatever strategy.codec says (test_ddp): a codec the
    backend once refused (topk) now starts, with a warning naming the key and the file."""
    layout = [("a", 1)]
    config = jobs.write_config(str(tmp_path / "job.toml"), layout, strategy='kind = "sync"\ncodec = "topk"')
    script = ("import nebula, torch, torch.distributed as dist\nnebula.init_process_group()\n"
              "t = torch.tensor([0.006, -19.5])\ndist.all_reduce(t)\nprint('sums', t.tolist())\n")
    results = jobs.run_workers(config, layout, [jobs.PYTHON, "-c", script])
    code, text = results[("a", 0)]
    assert code == 0, text[-2000:]
    assert "strategy.codec = \"topk\" is not applied" in text and "job.toml" in text, text[-2000:]
    assert "sums [0.006000000052154064, -19.5]" in text, text[-2000:]


@pytest.mark.parametrize("job, words", [('command = [""]', "the first word is the program"),
                                        ('command = ["/usr/bin/python3", "x.py"]\nelastic = true', "job.elastic")])
def test_a_bad_job_command_is_a_config_error(tmp_path, job, words):
    path = tmp_path / "job.toml"
    path.write_text(f'[job]\nname = "x"\n{job}\n\n[[sites]]\nname = "a"\nworkers = 1\n')
    with pytest.raises(nebula.ConfigError, match="command") as e:
        nebula.check_config(str(path))
    assert words in str(e.value) and str(path) in str(e.value), str(e.value)
