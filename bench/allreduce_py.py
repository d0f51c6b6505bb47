"""bench/python.sh's all-reduce timing: N all_reduce calls of SIZE bytes of float32 through
torch.distributed, backend "nebula" (placement from the environment) or "gloo" (GLOO_INIT,
GLOBAL_RANK, GLOBAL_WORLD). Prints the algorithm bandwidth (bytes / seconds per call)."""

import os
import sys
import time

import torch
import torch.distributed as dist


def main(backend, size_bytes, iters):
    torch.set_num_threads(1)
    if backend == "nebula":
        import nebula
        nebula.init_process_group()
    else:
        dist.init_process_group("gloo", init_method=os.environ["GLOO_INIT"], rank=int(os.environ["GLOBAL_RANK"]),
                                world_size=int(os.environ["GLOBAL_WORLD"]))
    t = torch.ones(size_bytes // 4)
    for _ in range(3):
        dist.all_reduce(t)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    seconds = (time.perf_counter() - start) / iters
    if dist.get_rank() == 0:
        print(f"allreduce {backend} {size_bytes} bytes: {seconds * 1e3:.2f} ms, {size_bytes / seconds / 2**20:.1f} MiB/s")
    # Both ranks done before either tears down: a Gloo pair closed by its peer while the
    # process exits can end it in std::terminate (PyTorch 1.13).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
