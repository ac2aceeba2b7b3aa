"""UniEP: expert-parallel MoE whose communication hides behind computation.

Users reach it through ``torch.ops.uniep.*`` (custom ops with fake kernels and autograd), this
package (``uniep.init``, ``uniep.moe_forward``, ``uniep.nn.MoELayer``) and the ``uniep`` command.
"""

import os

# torch first: _C links against libtorch and registers torch.ops.uniep when it loads.
import torch  # noqa: F401

# _C is listed first so it loads before ops, which extends the ops it registers.
from . import (  # noqa: F401
    _C,
    collectives,
    distributed,
    ep,
    fused_backward,
    gate,
    gemm,
    integrations,
    nn,
    ops,
    parallel,
    parm,
    prepared,
    reference,
    tune,
)
from ._C import TuningParams, build_info
from .distributed import Runtime, init
from .ops import moe_forward

__version__: str = build_info()["version"]


def cmake_prefix_path() -> str:
    """The folder to put on ``CMAKE_PREFIX_PATH`` so that ``find_package(uniep)`` finds the C++
    package installed with this module: headers, ``libuniep_core.a``, ``libuniep_cuda.so`` when
    built with CUDA, and ``lib/cmake/uniep/uniepConfig.cmake`` (see "Using UniEP from C++" in the
    README). It is where ``_C`` was installed, also in an editable install."""
    return os.path.dirname(os.path.abspath(_C.__file__))


__all__ = [
    "__version__",
    "Runtime",
    "TuningParams",
    "build_info",
    "cmake_prefix_path",
    "collectives",
    "distributed",
    "ep",
    "init",
    "integrations",
    "moe_forward",
    "nn",
    "ops",
    "parallel",
    "parm",
    "reference",
    "tune",
]
