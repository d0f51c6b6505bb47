"""A small byte-level language model on the English sentences of this machine's gettext
catalogs (/usr/share/locale/*/LC_MESSAGES/*.mo): the data and model of the Python examples.
Plain PyTorch; nothing here knows about nebula.

Held-out data is held out by sentence: a sentence (deduplicated) goes to validation when its
hash says so, wherever it appears."""

import glob
import struct
import zlib

import torch
import torch.nn as nn

CONTEXT = 48  # bytes of context per training window


def _mo_msgids(path):
    """The original (English) strings of one .mo catalog (GNU gettext's binary format)."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 20:
        return []
    magic = struct.unpack("<I", data[:4])[0]
    order = "<" if magic == 0x950412DE else ">" if magic == 0xDE120495 else None
    if order is None:
        return []
    count, originals = struct.unpack(order + "2I", data[8:16])
    out = []
    for i in range(count):
        length, offset = struct.unpack(order + "2I", data[originals + 8 * i:originals + 8 * i + 8])
        text = data[offset:offset + length].split(b"\0")[0]  # the singular of a plural entry
        if 8 <= len(text) <= 200 and b"%" not in text and b"\n" not in text:
            out.append(text)
    return out


def load_sentences(language="de", catalogs=40, valid_percent=10):
    """(train, valid): English sentences of the first `catalogs` catalogs of `language`,
    deduplicated, split by a hash of the sentence."""
    paths = sorted(glob.glob(f"/usr/share/locale/{language}/LC_MESSAGES/*.mo"))[:catalogs]
    if not paths:
        raise SystemExit(f"no gettext catalogs in /usr/share/locale/{language}/LC_MESSAGES")
    sentences = sorted({s for p in paths for s in _mo_msgids(p)})
    valid = [s for s in sentences if zlib.crc32(s) % 100 < valid_percent]
    train = [s for s in sentences if zlib.crc32(s) % 100 >= valid_percent]
    return train, valid


def as_stream(sentences):
    """The sentences as one byte stream, one per line."""
    return torch.frombuffer(bytearray(b"\n".join(sentences) + b"\n"), dtype=torch.uint8).long()


def batch(stream, size, generator):
    """`size` random windows: inputs and next-byte targets."""
    starts = torch.randint(0, stream.numel() - CONTEXT - 1, (size,), generator=generator)
    idx = starts[:, None] + torch.arange(CONTEXT + 1)
    w = stream[idx]
    return w[:, :-1], w[:, 1:]


class CharLM(nn.Module):
    def __init__(self, dim=64, hidden=128):
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.rnn = nn.GRU(dim, hidden, batch_first=True)
        self.out = nn.Linear(hidden, 256)

    def forward(self, x):
        h, _ = self.rnn(self.embed(x))
        return self.out(h)


def loss_of(model, x, y):
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


@torch.no_grad()
def validation_loss(model, stream, windows=64):
    """Mean next-byte loss (nats) on fixed windows of the held-out stream."""
    x, y = batch(stream, windows, torch.Generator().manual_seed(7))
    return loss_of(model, x, y).item()
