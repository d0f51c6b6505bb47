"""The process's nebula Session: this worker's place in the job and its links to the other sites."""

from . import _nebula

_current = None


class Session(_nebula.Session):
    """One worker of one site (nebula::Session). Every worker of every site must create its
    Session (the constructor returns once all have, bounded by job.timeout) and then make the
    same collective calls in the same order.

    Session()                                  placement and config from the environment
    Session("job.toml", site="alpha", rank=0)  explicitly; overrides=["job.steps=10"] as --set
    """

    def all_reduce(self, tensor, op="sum", weight=1.0):
        """In place over every worker of every site: op "sum" (any dtype) or "mean" (float32,
        each worker counting `weight`)."""
        if op == "sum":
            self.all_reduce_sum(tensor)
        elif op == "mean":
            self.all_reduce_mean(tensor, weight)
        else:
            raise ValueError(f"nebula.Session.all_reduce: op={op!r}; use 'sum' or 'mean'")
        return tensor


def session(config="", site="", rank=None, overrides=()):
    """The process's Session, created on first use (from the environment unless given); later
    calls return that one, whatever their arguments."""
    global _current
    if _current is None:
        _current = Session(config, site, rank, list(overrides))
    return _current


def shard(items):
    """This worker's share of `items`: every world_size-th one from its global rank (a site's
    workers share the site's data; each site should load only its own)."""
    s = session()
    return items[s.rank::s.world_size]
