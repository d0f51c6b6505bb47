"""test_errors.py's workers: `lost` — site beta's worker leaves without a word after the first
all-reduce; alpha's next all-reduce must raise nebula.PeerLost within the bound."""

import os
import sys
import time

import torch

import nebula


def main(mode):
    s = nebula.session()
    t = torch.ones(5)
    s.all_reduce(t)
    assert t[0].item() == s.world_size
    if s.site == "beta":
        os._exit(0)  # gone: no goodbye, no more collectives
    start = time.monotonic()
    try:
        s.all_reduce(torch.ones(5))
    except (nebula.PeerLost, nebula.Timeout) as e:
        print(f"raised {type(e).__name__} after {time.monotonic() - start:.1f} s: {e}")
        return 0
    print("no error: the all-reduce finished without beta")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
