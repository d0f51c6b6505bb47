"""RUN_DIR/metrics.jsonl lines and summary.json, as `nebula worker` writes them, so a Python
job gets `nebula run`'s progress bars and summary and `nebula report` like a built-in one."""

import json
import os
import time

import torch

from . import _nebula
from .session import session as _default_session


class Metrics:
    """metrics = nebula.Metrics(strategy=opt)     # opt: a nebula.DiLoCo, or None (DDP)
    metrics.step(step, loss.item(), tokens)      # every step; a line every job.log_every steps
    metrics.finish()                              # every worker, at the end: summary.json"""

    def __init__(self, session=None, strategy=None):
        self.session = session or _default_session()
        self.strategy = strategy
        os.makedirs(self.session.run_dir, exist_ok=True)
        self._writer = _nebula.MetricsWriter(os.path.join(self.session.run_dir, "metrics.jsonl"))
        self._start = time.time()
        self._tokens = 0
        self._window = []
        self._last_loss = 0.0

    def _wan(self):
        return self.session.wan_bytes_sent, self.session.wan_bytes_received

    def step(self, step, loss, tokens):
        """This worker's `loss` and `tokens` (processed in this step) at step `step` (0-based)."""
        self._tokens += int(tokens)
        self._window.append(float(loss))
        done = step + 1
        if done % self.session.log_every and done != self.session.steps:
            return
        now = time.time()
        sent, received = self._wan()
        line = {"time": now, "elapsed": now - self._start, "site": self.session.site,
                "rank": self.session.local_rank, "step": done, "steps": self.session.steps,
                "loss": sum(self._window) / len(self._window), "tokens": self._tokens,
                "tokens_per_s": self._tokens / max(now - self._start, 1e-9),
                "wan_bytes_sent": sent, "wan_bytes_received": received,
                "peak_rss_bytes": _nebula.peak_rss_bytes(), "python": True}
        if self.strategy is not None:
            line.update({k: v for k, v in self.strategy.metrics().items() if k not in line})
        self._last_loss = line["loss"]
        self._window = []
        self._writer.write(json.dumps(line))

    def finish(self, **extra):
        """A collective (every worker of every site): the job's totals; global rank 0 writes
        RUN_DIR/summary.json (and `extra`, e.g. a validation loss)."""
        s = self.session
        sent, received = self._wan()
        by_worker = torch.zeros(s.world_size, dtype=torch.float64)
        by_worker[s.rank] = sent
        totals = torch.tensor([self._tokens, sent, received, self._last_loss], dtype=torch.float64)
        s.all_reduce_sum(totals)
        s.all_reduce_sum(by_worker)
        if s.rank != 0:
            return
        summary = {"job": os.path.basename(s.run_dir.rstrip("/")), "program": "python",
                   "strategy": self.strategy.name if self.strategy is not None else "ddp (backend nebula)",
                   "sites": len(s.sites), "workers": s.world_size, "steps": s.steps,
                   "tokens": totals[0].item(), "wall_seconds": time.time() - self._start,
                   "final_train_loss": totals[3].item() / s.world_size,
                   "wan_bytes": totals[1].item(), "wan_bytes_sent": totals[1].item(),
                   "wan_bytes_received": totals[2].item(), "wan_bytes_sent_by_worker": by_worker.tolist()}
        if self.strategy is not None:
            summary["strategy_metrics"] = self.strategy.metrics()
            summary["decisions"] = self.strategy.decisions()
        summary.update(extra)
        _nebula.write_json_atomically(os.path.join(s.run_dir, "summary.json"), json.dumps(summary))


_process_metrics = None
_process_strategy = None  # the last nebula.DiLoCo made in this process: its counters join the lines


def log(step, loss, tokens=0):
    """Records this worker's `loss` and `tokens` at step `step` in RUN_DIR/metrics.jsonl (a line
    every job.log_every steps): `nebula run` draws its progress bars from them and `nebula report`
    reads them. Call nebula.Metrics(...).finish() too for a summary.json."""
    global _process_metrics
    if _process_metrics is None:
        _process_metrics = Metrics(strategy=_process_strategy)
    _process_metrics.step(step, loss, tokens)
