"""torch.distributed backend "nebula": every collective against its definition, on 1 to 3 sites
of different sizes, with sizes 0, 1, odd and large, for float and integer dtypes."""

import os

import pytest

import jobs


@pytest.mark.parametrize("layout", [[("solo", 2)], [("alpha", 2), ("beta", 1)], [("a", 1), ("b", 2), ("c", 1)]],
                         ids=["1site", "2sites", "3sites"])
def test_every_collective_matches_its_definition(tmp_path, layout):
    config = jobs.write_config(str(tmp_path / "job.toml"), layout)
    results = jobs.run_workers(config, layout, [jobs.PYTHON, os.path.join(jobs.HERE, "collectives_worker.py")])
    world = sum(w for _, w in layout)
    for (name, r), (_, text) in results.items():
        assert "collectives ok" in text and f" {world}" in text, text[-2000:]
