"""A byte-level language model on the gettext corpus (charlm.py). train_lm.py is a plain
single-process PyTorch script; train_lm_ddp.py and train_lm_diloco.py are the same script
across sites (`diff train_lm.py train_lm_ddp.py`)."""

import sys

import torch

import nebula
from charlm import CharLM, as_stream, batch, load_sentences, loss_of, validation_loss

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
nebula.init_process_group()
torch.manual_seed(0)
train, valid = load_sentences()
train, valid = as_stream(nebula.shard(train)), as_stream(valid)
model = torch.nn.parallel.DistributedDataParallel(CharLM())
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
g = torch.Generator().manual_seed(1)
print(f"validation loss at the start {validation_loss(model, valid):.3f}")
for step in range(steps):
    x, y = batch(train, 32, g)
    loss = loss_of(model, x, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    nebula.log(step, loss.item(), x.numel())
print(f"validation loss {validation_loss(model, valid):.3f}")
