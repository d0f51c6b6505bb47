"""Every torch.distributed collective of backend "nebula" against its definition; run as each
worker of a job by test_collectives.py. Rank r's input is a function of r, so every worker can
compute the expected result itself."""

import sys

import torch
import torch.distributed as dist

import nebula


def values(rank, n, dtype):
    t = torch.arange(n, dtype=torch.float64) * 0.37 + rank * 1.5 - 2.0
    return t.to(dtype) if dtype.is_floating_point else (t * 10).to(dtype)


def main():
    s = nebula.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    assert (rank, world) == (s.rank, s.world_size), (rank, world, s.rank, s.world_size)
    assert dist.get_backend() == "nebula"
    for n in (0, 1, 7, 1001):
        for dtype in (torch.float32, torch.int64, torch.float64, torch.int32):
            # all_reduce SUM: the definition, summed in float64 (float32 sums are added in another order)
            t = values(rank, n, dtype)
            dist.all_reduce(t)
            want = sum(values(r, n, torch.float64) if dtype.is_floating_point else values(r, n, dtype)
                       for r in range(world)) if world else None
            if dtype.is_floating_point:
                assert torch.allclose(t.double(), want.double(), rtol=1e-6, atol=1e-5), (n, dtype, t, want)
            else:
                assert torch.equal(t, want.to(dtype)), (n, dtype, t, want)
            # broadcast from every rank: exact
            for root in range(world):
                t = values(rank, n, dtype)
                dist.broadcast(t, src=root)
                assert torch.equal(t, values(root, n, dtype)), ("broadcast", root, n, dtype)
            # all_gather: exact, in rank order
            out = [torch.empty(n, dtype=dtype) for _ in range(world)]
            dist.all_gather(out, values(rank, n, dtype))
            for r in range(world):
                assert torch.equal(out[r], values(r, n, dtype)), ("all_gather", r, n, dtype)
            flat = torch.empty(n * world, dtype=dtype)
            dist.all_gather_into_tensor(flat, values(rank, n, dtype))
            assert torch.equal(flat, torch.cat([values(r, n, dtype) for r in range(world)])), ("all_gather_base", n)
        # AVG (float32) and reduce_scatter (SUM): against float64 definitions
        t = values(rank, n, torch.float32)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        want = sum(values(r, n, torch.float64) for r in range(world)) / world
        assert torch.allclose(t.double(), want, rtol=1e-6, atol=1e-5), ("avg", n)
        inputs = [values(rank * world + j, n, torch.float32) for j in range(world)]
        out = torch.empty(n, dtype=torch.float32)
        dist.reduce_scatter(out, inputs)
        want = sum(values(r * world + rank, n, torch.float64) for r in range(world))
        assert torch.allclose(out.double(), want, rtol=1e-6, atol=1e-5), ("reduce_scatter", n)
    dist.barrier()
    # What the backend cannot do is an error naming the operation, not a hang.
    for call, name in ((lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.MAX), "MAX"),
                       (lambda: dist.reduce(torch.ones(3), dst=0), "reduce"),
                       (lambda: dist.all_reduce(torch.ones(4)[::2]), "contiguous")):
        try:
            call()
        except RuntimeError as e:
            assert name in str(e), (name, str(e))
        else:
            raise AssertionError(f"{name}: no error")
    dist.barrier()
    print("collectives ok", rank, world)


if __name__ == "__main__":
    sys.exit(main())
