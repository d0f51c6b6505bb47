"""examples/library/my_training_loop.cc in Python: the same model, data, optimizer and loop,
with nebula.DiLoCo (or any [strategy] of the config) doing the communication across sites.
On the same config it ends with bit-identical weights to the C++ program (python/tests/test_diloco.py).

    my_training_loop.py CONFIG [--site NAME --rank N] [--steps N] [--hidden N]

Without --site/--rank it reads $NEBULA_SITE/$NEBULA_RANK (what `nebula run` sets), or torchrun's,
Open MPI's or Slurm's variables. Start one process per worker of every site in CONFIG.
"""

import argparse
import time
import zlib

import torch
import torch.nn as nn

import nebula

INPUTS = 16


def target(x, _w=[]):
    """The function to learn: the same on every worker (its own generator, seeded alike)."""
    if not _w:
        _w.append(torch.randn(INPUTS, 4, generator=torch.Generator().manual_seed(1234)) * 0.25)
    return torch.sin(x @ _w[0]).sum(1, keepdim=True)


def site_inputs(rows, site, g):
    """A batch of this site's data: inputs centred on the site's own point."""
    return torch.randn(rows, INPUTS, generator=g) * 0.7 + (site - 0.5)


def crc_of(params):
    crc = 0
    for p in params:
        crc = zlib.crc32(p.detach().contiguous().numpy().tobytes(), crc)
    return crc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--site", default="")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--hidden", type=int, default=64, help="the MLP's width")
    args = ap.parse_args()
    overrides = [f"job.steps={args.steps}"] if args.steps is not None else []
    torch.set_num_threads(1)  # several workers per machine in the local run
    session = nebula.session(args.config, args.site, args.rank, overrides)

    torch.manual_seed(session.seed)  # only global rank 0's initial weights matter: DiLoCo spreads them
    model = nn.Sequential(nn.Linear(INPUTS, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    optimizer = nebula.DiLoCo(model, optimizer)  # [strategy]: every replica starts from global rank 0's weights

    data = torch.Generator().manual_seed(1000 + session.rank)
    held_out = torch.Generator().manual_seed(99)  # the same test inputs everywhere: all sites' regions
    test_x = torch.cat([site_inputs(256, 0, held_out), site_inputs(256, len(session.sites) - 1, held_out)])

    def test_loss():  # averaged over every worker of every site
        with torch.no_grad():
            loss = nn.functional.mse_loss(model(test_x), target(test_x)).reshape(1)
        return session.all_reduce(loss, op="mean").item()

    initial = test_loss()
    batch, step, start = 32, 0, time.perf_counter()
    while optimizer.keep_training(step):
        x = site_inputs(batch, session.site_index, data)
        loss = nn.functional.mse_loss(model(x), target(x))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step(weight=batch, loss=loss)  # the outer step every H inner steps; the loss for max_loss_penalty
        step += 1
    optimizer.finish()
    seconds = time.perf_counter() - start
    final = test_loss()
    print(f"{session.site}/{session.local_rank}: {optimizer.name}, {step} local steps, parameters crc32 "
          f"{crc_of(model.parameters()):08x}, WAN bytes sent {session.wan_bytes_sent}")
    print(f"{session.site}/{session.local_rank}: {step * batch / seconds:.0f} examples/s in the loop")
    if session.rank == 0:
        print(f"test loss, mean over {session.world_size} workers on {len(session.sites)} sites: "
              f"{initial:.4f} -> {final:.4f}")


if __name__ == "__main__":
    main()
