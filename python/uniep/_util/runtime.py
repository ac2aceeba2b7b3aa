"""Whether this build has the UniEP GPU runtime, and the one refusal where it does not."""

from __future__ import annotations

from .. import _C


def require_gpu_runtime(what: str, instead: str) -> None:
    """NotImplementedError naming ``what`` on a build without the GPU runtime (a CPU-only build
    has no ``_C.ep_*`` / ``_C.coll_*`` functions at all), as docs/errors.md promises for requests
    the build cannot serve; ``instead`` says what serves CPU tensors."""
    if not getattr(_C, "has_ep_runtime", False):
        raise NotImplementedError(
            f"{what} needs the UniEP GPU runtime, which this build lacks (it takes a CUDA build "
            f"of torch and of uniep; build_info: {_C.build_info()}); {instead}"
        )
