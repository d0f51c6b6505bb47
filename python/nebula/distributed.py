"""torch.distributed backend "nebula" (python/process_group.h): DDP and torch.distributed calls
across every worker of every site, inside a site through c10d Gloo, between sites through the
gateways' mutual-TLS WAN links.

    nebula.init_process_group()     # instead of dist.init_process_group("gloo")

It rendezvouses through nebula's own Session (the config's sites and certificates): no TCPStore
that every worker of every site must reach. dist.init_process_group("nebula") with torch's
env:// rendezvous works too where such a store exists, if its RANK and WORLD_SIZE are the job's
(global rank, every worker of every site).
"""

from datetime import timedelta

import torch
import torch.distributed as dist

from . import _nebula
from .session import session


def _create(store, rank, world_size, timeout):
    s = session()
    if (rank, world_size) != (s.rank, s.world_size):
        raise _nebula.ConfigError(
            f"backend 'nebula': the rendezvous gave rank {rank} of {world_size}, but this worker is rank "
            f"{s.rank} of {s.world_size} in the job (site {s.site!r}, local rank {s.local_rank}); use "
            f"nebula.init_process_group(), or a rendezvous whose RANK and WORLD_SIZE are the job's "
            f"(sub-groups from dist.new_group are not supported)")
    return _nebula.process_group(s)


dist.Backend.register_backend("nebula", _create)


class _JobStore(dist.Store):
    """The store torch.distributed's init bookkeeping uses, kept by the Session: add() is a
    collective (every worker calls it in the same order, as init_process_group's barrier does)
    whose result is the job-wide total; set/get stay in this process (the backend keeps no
    state in the store)."""

    def __init__(self, s):
        super().__init__()
        self._session = s
        self._values = {}
        self._counts = {}

    def add(self, key, value):
        t = torch.tensor([int(value)], dtype=torch.int64)
        self._session.all_reduce_sum(t)
        self._counts[key] = self._counts.get(key, 0) + int(t.item())
        return self._counts[key]

    def set(self, key, value):
        self._values[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key):
        if key not in self._values:
            raise _nebula.Error(f"nebula's init store holds no key {key!r} (it keeps only this process's keys)")
        return self._values[key]

    def wait(self, keys, timeout=None):
        missing = [k for k in keys if k not in self._values]
        if missing:
            raise _nebula.Error(f"nebula's init store: wait for {missing}: it keeps only this process's keys")


def init_process_group(timeout=None):
    """dist.init_process_group("nebula") for this worker's Session (created from the environment
    on first use). Returns the Session."""
    s = session()
    if timeout is None:
        timeout = timedelta(minutes=30)
    dist.init_process_group("nebula", store=_JobStore(s), rank=s.rank, world_size=s.world_size, timeout=timeout)
    return s
