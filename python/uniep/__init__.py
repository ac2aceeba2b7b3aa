"""UniEP: expert-parallel MoE whose communication hides behind computation.

Users reach it through ``torch.ops.uniep.*`` (custom ops with fake kernels and autograd), this
package (``uniep.init``, ``uniep.moe_forward``, ``uniep.nn.MoELayer``) and the ``uniep`` command.
"""

import os

# torch first: _C links against libtorch and registers torch.ops.uniep when it loads.
import torch  # noqa: F401

# _C is listed first so it loads before the modules that extend the ops it registers.
from . import _C, collectives, distributed, gemm, integrations, moe, nn, parm, reference, tuning
from ._C import TuningParams, build_info
from .distributed import Runtime, init
from .moe import moe_forward
from .tuning.tuner import tune

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
    "gemm",
    "init",
    "integrations",
    "moe",
    "moe_forward",
    "nn",
    "parm",
    "reference",
    "tune",
    "tuning",
]
