"""nebula from Python: one PyTorch training job across several sites joined by slow WAN links.

    import nebula
    nebula.init_process_group()            # torch.distributed backend "nebula": DDP across sites
    ...
    opt = nebula.DiLoCo(model, opt)        # or: DiLoCo / streaming across sites, the C++ strategies

Everything below runs nebula's C++ library (include/nebula/session.h) through the extension
`nebula._nebula`; see docs/python.md. A process is one worker of one site: `nebula run` with
`[job] command = ["python3", "train.py"]` starts them all and sets $NEBULA_CONFIG, $NEBULA_SITE
and $NEBULA_RANK (torchrun, Open MPI and Slurm variables work too, as for `nebula worker`).
"""

import torch  # first: the extension uses torch's libraries and type registrations
import torch.distributed  # noqa: F401  (registers c10d's ProcessGroup type the backend returns)

from ._nebula import (  # noqa: F401
    AuthError,
    ConfigError,
    DataError,
    Error,
    NetworkError,
    PeerLost,
    Session as _Session,
    Timeout,
    check_config,
    set_cpu_threads,
)
from .session import Session, session, shard  # noqa: F401
from .distributed import init_process_group  # noqa: F401
from .diloco import DiLoCo  # noqa: F401
from .metrics import Metrics, log  # noqa: F401
