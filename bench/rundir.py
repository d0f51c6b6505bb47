"""What the bench scripts read from a nebula run directory, in one place.

metrics.jsonl holds training lines (src/train/metrics.h: elapsed, site, rank, step, loss, tokens,
wan_bytes_sent, ...) and, since evaluation during training, evaluation lines {site, rank, step,
eval} without those fields. A training line is one with a "loss" (the rule `nebula report`
uses too); the scripts read only those. The test suite runs every script in tiny mode
(BENCH_TINY=1), so a change to these files fails a test rather than the next benchmark.
"""
import json
import sys
import tomllib


def job(run):
    with open(f"{run}/job.toml", "rb") as f:
        return tomllib.load(f)


def summary(run):
    with open(f"{run}/summary.json") as f:
        return json.load(f)


def training_lines(run):
    lines = []
    with open(f"{run}/metrics.jsonl") as f:
        for text in f:
            try:
                line = json.loads(text)
            except json.JSONDecodeError:  # a worker killed mid-write leaves a torn last line
                continue
            if isinstance(line, dict) and "loss" in line:
                lines.append(line)
    return lines


def window(run, site=None, lines=None):
    """The first and last training lines of a site's gateway (default: the job's first site):
    the steady state between them leaves out start-up, the initial broadcast of the weights and
    the final evaluation."""
    site = site or job(run)["sites"][0]["name"]
    lines = training_lines(run) if lines is None else lines
    g = [l for l in lines if l["rank"] == 0 and l["site"] == site]
    if len(g) < 2 or g[-1]["step"] == g[0]["step"]:
        sys.exit(f"{run}/metrics.jsonl: {len(g)} training line(s) of site {site}'s gateway at distinct steps; "
                 "the steady-state window needs two (make job.steps larger than job.log_every)")
    return g[0], g[-1]


def step_seconds(run):
    """Steady-state seconds per step of the first site's gateway."""
    a, b = window(run)
    return (b["elapsed"] - a["elapsed"]) / (b["step"] - a["step"])


def seconds_per_1k_tokens(run):
    """Steady-state training time per 1000 tokens of the first site's gateway."""
    a, b = window(run)
    return (b["elapsed"] - a["elapsed"]) / (b["tokens"] - a["tokens"]) * 1000


def audit(run):
    """The lines of the run's audit.jsonl (connections accepted, dialed, reconnected, refused)."""
    lines = []
    with open(f"{run}/audit.jsonl") as f:
        for text in f:
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:  # a torn last line of a killed gateway
                continue
    return lines


def round_progress(run, h):
    """Diloco at a fixed H = h, from per-step losses (job.log_every = 1) of every site's gateway:
    over the second half of the rounds, (mean merge gap, retention), or None without per-step
    lines or two rounds. The gap as src/strategy/merge_gap.h measures it (the first m losses after
    an outer step against the round's local trend, m = max(1, min(10, h // 4)), relative); the
    retention: how far the first-m mean fell from one round to the next, over how far it fell to
    the round's local trend (1: the merge kept all of the round's local progress)."""
    per = {}
    for line in training_lines(run):
        if line["rank"] == 0:
            per.setdefault(line["site"], {})[line["step"]] = line["loss"]
    m = max(1, min(10, h // 4))
    gaps, drop, kept = [], 0.0, 0.0
    for steps in per.values():
        if not steps or sorted(steps) != list(range(1, len(steps) + 1)):
            return None  # not one line per step from the first
        loss = [steps[k] for k in sorted(steps)]
        rounds = len(loss) // h
        mean = lambda a, b: sum(loss[a:b]) / (b - a)
        for r in range((rounds - 1) // 2, rounds - 1):  # the second half; r + 1 must be whole
            start, end = r * h, (r + 1) * h
            first, last, middle = mean(start, start + m), mean(end - m, end), start + h // 2
            trend = last + (last - mean(middle, middle + m)) / max(1, end - m - middle) * m
            after = mean(end, end + m)
            gaps.append((after - trend) / trend)
            drop += first - trend
            kept += first - after
    if not gaps or drop == 0:
        return None
    return sum(gaps) / len(gaps), kept / drop
