// The one place where the Python extension differs between PyTorch 1.13 (Debian's
// python3-torch, which this machine builds and tests) and PyTorch 2.x (what GPU users run).
// cmake/torch_compat.cmake holds the build's differences; this holds the source's.
//
// 1.13: a torch.distributed backend is a c10d::ProcessGroup subclass, returned to Python as is.
// 2.x:  it is a c10d::Backend subclass; Python's creator function returns it and torch wraps it
//       in a ProcessGroup itself. The collective methods have the same signatures in both.
//       (Not yet built against 2.x here: no PyTorch 2.x on these machines.)
#pragma once

#include <torch/version.h>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
namespace nebula::python {
using BackendBase = c10d::Backend;
}
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
namespace nebula::python {
using BackendBase = c10d::ProcessGroup;
}
#endif
