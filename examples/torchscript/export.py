#!/usr/bin/env python3
"""Bring your own model: the Python side of examples/torchscript/langid.toml.

Writes into OUT (default runs/torchscript-data):
  model.pt                    a TorchScript module (torch.jit.script) whose forward(inputs, targets)
                              returns the loss, and whose predict(inputs) returns logits
  data/alpha.safetensors      site alpha's examples: "inputs" [N, 48] int64, "targets" [N] int64
  data/beta.safetensors       site beta's (other text: no example is on both sites)
  probe.safetensors           64 examples of neither site, to compare outputs after training

The task: which language is a sentence in? Real sentences from the gettext catalogs under
/usr/share/locale (de, fr, es, pl), as their first 48 UTF-8 bytes. Needs only Debian's
python3-torch (safetensors files are written by the small function below).

  python3 examples/torchscript/export.py [OUT] [--trace] [--batchnorm]
  nebula run examples/torchscript/langid.toml
  python3 examples/torchscript/check.py runs/torchscript/model.pt runs/torchscript-data/probe.safetensors

--batchnorm exports LangIdBatchNorm instead: a module with buffers (BatchNorm's running
statistics), which nebula keeps equal on every worker like the weights.
"""
import glob
import gettext
import json
import os
import struct
import sys
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

LANGUAGES = ["de", "fr", "es", "pl"]
WIDTH = 48  # bytes per example
PER_LANGUAGE = 3000  # sentences per language and site, at most


class LangId(nn.Module):
    """Byte embedding, a convolution, max over time, a linear layer: logits per language."""

    def __init__(self, classes: int = len(LANGUAGES)):
        super().__init__()
        self.embed = nn.Embedding(256, 32)
        self.conv = nn.Conv1d(32, 64, kernel_size=3, padding=1)
        self.out = nn.Linear(64, classes)

    @torch.jit.export
    def predict(self, inputs: torch.Tensor) -> torch.Tensor:
        h = self.embed(inputs).transpose(1, 2)  # [N, 32, WIDTH]
        h = F.relu(self.conv(h)).max(dim=2).values  # [N, 64]
        return self.out(h)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.predict(inputs), targets)


class LangIdBatchNorm(nn.Module):
    """LangId with batch normalization after the convolution."""

    def __init__(self, classes: int = len(LANGUAGES)):
        super().__init__()
        self.embed = nn.Embedding(256, 32)
        self.conv = nn.Conv1d(32, 64, kernel_size=3, padding=1)
        self.norm = nn.BatchNorm1d(64)
        self.out = nn.Linear(64, classes)

    @torch.jit.export
    def predict(self, inputs: torch.Tensor) -> torch.Tensor:
        h = self.embed(inputs).transpose(1, 2)  # [N, 32, WIDTH]
        h = F.relu(self.norm(self.conv(h))).max(dim=2).values  # [N, 64]
        return self.out(h)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.predict(inputs), targets)


def save_safetensors(path, tensors):
    """The safetensors format: u64 header size, JSON header, raw little-endian tensor bytes."""
    dtypes = {torch.int64: "I64", torch.float32: "F32", torch.int32: "I32", torch.uint8: "U8"}
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        blob = t.numpy().tobytes()
        header[name] = {"dtype": dtypes[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def sentences(lang):
    """(catalog file, translated sentence) of every readable catalog of `lang`."""
    for mo in sorted(glob.glob(f"/usr/share/locale/{lang}/LC_MESSAGES/*.mo")):
        try:
            with open(mo, "rb") as f:
                catalog = gettext.GNUTranslations(f)._catalog
        except Exception:  # a corrupt or odd catalog: skip it
            continue
        for msgid, msgstr in sorted(catalog.items(), key=str):
            if isinstance(msgid, str) and msgid and isinstance(msgstr, str) and len(msgstr) >= 8:
                yield os.path.basename(mo), msgstr


def encode(text):
    b = text.encode("utf-8")[:WIDTH]
    return list(b) + [0] * (WIDTH - len(b))


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = args[0] if args else "runs/torchscript-data"
    os.makedirs(out + "/data", exist_ok=True)
    # Each catalog file goes to one place by a hash of its name: alpha, beta, or the probe set.
    shares = {"alpha": ([], []), "beta": ([], []), "probe": ([], [])}
    for label, lang in enumerate(LANGUAGES):
        counts = {k: 0 for k in shares}
        for name, text in sentences(lang):
            h = zlib.crc32(name.encode()) % 10
            where = "probe" if h == 0 else "alpha" if h % 2 else "beta"
            if counts[where] >= (16 if where == "probe" else PER_LANGUAGE):
                continue
            counts[where] += 1
            shares[where][0].append(encode(text))
            shares[where][1].append(label)
    for site in ("alpha", "beta"):
        x, y = shares[site]
        save_safetensors(f"{out}/data/{site}.safetensors",
                         {"inputs": torch.tensor(x, dtype=torch.int64), "targets": torch.tensor(y, dtype=torch.int64)})
        print(f"{out}/data/{site}.safetensors: {len(y)} examples")
    x, y = shares["probe"]
    save_safetensors(f"{out}/probe.safetensors",
                     {"inputs": torch.tensor(x, dtype=torch.int64), "targets": torch.tensor(y, dtype=torch.int64)})

    torch.manual_seed(0)
    model = LangIdBatchNorm() if "--batchnorm" in sys.argv else LangId()
    if "--trace" in sys.argv:  # torch.jit.trace records forward only; nebula needs nothing else
        example = torch.zeros(2, WIDTH, dtype=torch.int64)
        module = torch.jit.trace(model, (example, torch.zeros(2, dtype=torch.int64)))
    else:
        module = torch.jit.script(model)
    module.save(f"{out}/model.pt")
    print(f"{out}/model.pt: {sum(p.numel() for p in model.parameters())} parameters")


if __name__ == "__main__":
    main()
