#!/usr/bin/env python3
"""Loads the module nebula trained (TorchScript) in PyTorch and runs it on held-out examples.

  python3 examples/torchscript/check.py RUN_DIR/model.pt PROBE.safetensors [OUT.safetensors]

Prints the accuracy on the probe examples; with OUT, also writes the logits ("logits") there
so that another program (the C++ test) can compare them with its own.
"""
import json
import struct
import sys

import torch


def load_safetensors(path):
    dtypes = {"I64": torch.int64, "F32": torch.float32, "I32": torch.int32, "U8": torch.uint8}
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, v in header.items():
        if name == "__metadata__":
            continue
        begin, end = v["data_offsets"]
        t = torch.frombuffer(bytearray(data[begin:end]), dtype=dtypes[v["dtype"]])
        out[name] = t.reshape(v["shape"])
    return out


def main():
    model = torch.jit.load(sys.argv[1])
    model.eval()
    probe = load_safetensors(sys.argv[2])
    with torch.no_grad():
        logits = model.predict(probe["inputs"])
    accuracy = (logits.argmax(dim=1) == probe["targets"]).float().mean().item()
    print(f"{sys.argv[1]}: accuracy {accuracy:.3f} on {len(probe['targets'])} probe examples")
    if len(sys.argv) > 3:
        sys.path.insert(0, __file__.rsplit("/", 1)[0])
        from export import save_safetensors
        save_safetensors(sys.argv[3], {"logits": logits.contiguous()})


if __name__ == "__main__":
    main()
