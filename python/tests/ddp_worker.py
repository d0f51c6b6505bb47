"""Unmodified DistributedDataParallel training, over backend "nebula" (placement from the
environment) or over plain Gloo on the same ranks; writes the final weights for test_ddp.py."""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def main(mode, out_path, steps=6):
    torch.set_num_threads(1)
    if mode == "nebula":
        import nebula
        nebula.init_process_group()
    else:
        dist.init_process_group("gloo", init_method=os.environ["GLOO_INIT"], rank=int(os.environ["GLOBAL_RANK"]),
                                world_size=int(os.environ["GLOBAL_WORLD"]))
    rank = dist.get_rank()
    torch.manual_seed(rank)  # different initial weights per rank: DDP must make them rank 0's
    model = nn.Sequential(nn.Linear(12, 33), nn.Tanh(), nn.Linear(33, 5))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)  # several buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(16, 12, generator=g)
        y = torch.randn(16, 5, generator=g)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.save([p.detach().clone() for p in model.parameters()], out_path)
    # A user's own sums (metrics, counters): each rank a quarter of 420003, 0.006, 740736, -19.5, 6291462.
    sums = torch.tensor([105000.75, 0.0015, 185184.0, -4.875, 1572865.5])
    dist.all_reduce(sums)
    print("user_sums " + " ".join(repr(v) for v in sums.tolist()))
    dist.barrier()
    sent = nebula.session().wan_bytes_sent if mode == "nebula" else 0
    print(f"ddp done {mode} {rank} wan_bytes_sent {sent}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
