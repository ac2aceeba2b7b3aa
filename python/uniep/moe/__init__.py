"""The MoE layer's engine: ``moe_forward`` (``torch.ops.uniep.moe``'s Python side, ``ops``), the
expert-parallel runtime (``ep``), the MegaKernel (``megakernel``), prepared experts
(``prepared``), tile gates (``tile_gates``) and what training needs around them (``autograd``,
``backward_cuda``, ``expert_shards``, ``kept_weights``).

Importing it registers the fake kernels and autograd of the ops these modules extend.
"""

from . import ep, megakernel, ops, prepared, tile_gates  # noqa: F401
from .ops import moe_forward

__all__ = ["moe_forward"]
