"""The MoE MegaKernel (docs/megakernel.md): dispatch, both expert GEMMs and the combine in one
persistent launch per rank.

- ``launch``: the forward at world 1 and across a group (``moe_forward_local``,
  ``moe_forward_ep``), the group's fused runtime, the error words and the CPU plan;
- ``forward``: the autograd-facing forward that ``uniep.moe_forward`` calls;
- ``backward``: the backward as one launch (local and across a group).
"""

from . import backward, forward, launch  # noqa: F401
