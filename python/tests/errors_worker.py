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
    # beta leaves only once alpha's first all-reduce has returned: leaving the moment its own
    # returned could cut alpha's short (the loss would then surface in the first one).
    first_done = os.path.join(os.path.dirname(os.environ["NEBULA_CONFIG"]), "alpha-first-all-reduce-done")
    if s.site == "beta":
        deadline = time.monotonic() + 60
        while not os.path.exists(first_done) and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)  # gone: no goodbye, no more collectives
    open(first_done, "w").close()
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
