"""test_diloco.py's checkpoint check: `straight` trains 2K steps; `first` trains K steps and saves
the model's and nebula.DiLoCo's state_dict; `second` loads them and trains the other K steps.
Prints the parameters' CRC-32."""

import sys
import zlib

import torch
import torch.nn as nn

import nebula


def main(mode, path, k=10):
    torch.set_num_threads(1)
    s = nebula.session()
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = nebula.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    if mode == "second":
        state = torch.load(path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["diloco"])
    g = torch.Generator().manual_seed(50 + s.rank)
    for _ in range(opt.steps_done):  # the data already seen
        torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
    steps = 2 * k if mode == "straight" else k
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if mode == "first":
        torch.save({"model": model.state_dict(), "diloco": opt.state_dict()}, f"{path}.{s.site}")
    opt.finish()
    crc = 0
    for p in model.parameters():
        crc = zlib.crc32(p.detach().numpy().tobytes(), crc)
    print(f"{mode} crc32 {crc:08x} after {opt.steps_done} steps; outer steps {opt.metrics().get('outer_steps')}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if sys.argv[1] != "second" else f"{sys.argv[2]}.{nebula.session().site}")
