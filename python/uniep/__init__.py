"""UniEP: expert-parallel MoE whose communication hides behind computation.

Users reach it through ``torch.ops.uniep.*`` (custom ops with fake kernels and autograd), this
package (``uniep.init``, ``uniep.moe_forward``, ``uniep.nn.MoELayer``) and the ``uniep`` command.
"""

# torch first: _C links against libtorch and registers torch.ops.uniep when it loads.
import torch  # noqa: F401

# _C is listed first so it loads before ops, which extends the ops it registers.
from . import _C, collectives, distributed, ep, nn, ops, parallel, reference  # noqa: F401
from ._C import TuningParams, build_info
from .distributed import Runtime, init
from .ops import moe_forward

__version__: str = build_info()["version"]

__all__ = [
    "__version__",
    "Runtime",
    "TuningParams",
    "build_info",
    "collectives",
    "distributed",
    "ep",
    "init",
    "moe_forward",
    "nn",
    "ops",
    "parallel",
    "reference",
]
