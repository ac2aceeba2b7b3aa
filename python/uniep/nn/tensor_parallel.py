"""Megatron-style tensor-parallel linear layers on the P2P-decomposed collectives.

With sequence parallelism (the default) activations between TP blocks are split along the
sequence (dim 0) across the group: ``ColumnParallelLinear`` all-gathers its input inside the GEMM
(``all_gather_matmul``) and ``RowParallelLinear`` reduce-scatters its output out of the GEMM
(``matmul_reduce_scatter``), so a column -> row pair maps ``[S/W, ..., in]`` to ``[S/W, ..., out]``
with no exposed communication. Without sequence parallelism the input of a column layer is
replicated and the output of a row layer is all-reduced, as in Megatron-LM.

Weights keep ``nn.Linear``'s ``[out, in]`` layout, split along ``out`` (column) or ``in`` (row).
Under the same ``torch.manual_seed`` on every rank, the layers hold their slice of exactly the
weight (and bias) a single-rank ``nn.Linear(in_features, out_features, bias, dtype=dtype)`` would
draw: the full tensors are drawn in ``nn.Linear``'s order and sliced, so the RNG also stays in step
across ranks. ``from_full`` / ``load_full_`` load a full weight instead.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

# collectives registers the fake kernels and autograd of the ops the layers call.
from .. import _C, collectives, distributed  # noqa: F401

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class _CopyToGroup(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient: a replicated input feeding sharded weights."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.group is None:
            return grad, None
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce forward, identity backward: partial sums of a row-sharded GEMM."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        if group is None:
            return x
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None


class _ParallelLinear(nn.Module):
    """Shared set-up: the group, the checks, and nn.Linear-consistent initialisation.

    The constructor's arguments are documented on ``ColumnParallelLinear``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = True,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        chunks: int = 1,
        order: str = "direct",
    ) -> None:
        super().__init__()
        self.in_features = _positive_int("in_features", in_features)
        self.out_features = _positive_int("out_features", out_features)
        self.chunks = _positive_int("chunks", chunks)
        if order not in ("direct", "ring"):
            raise ValueError(f'order must be "direct" or "ring", got {order!r}')
        self.order = order
        self.sequence_parallel = bool(sequence_parallel)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if dtype not in (torch.float32, torch.bfloat16, torch.float64):
            raise ValueError(f"dtype must be float32, bfloat16 or float64, got {dtype}")
        self._group = distributed.resolve_group(group)
        self.group_name = distributed.group_name(group)
        self.world_size = distributed.world_size(group)
        self.rank = distributed.rank(group)
        self._factory = {"dtype": dtype, "device": device}
        self._make_parameters(bias)
        self.reset_parameters()

    def _make_parameters(self, bias: bool) -> None:
        """Create this rank's ``weight`` and ``bias`` (or register ``bias`` as None)."""
        raise NotImplementedError

    def _per_rank(self, features: int, name: str) -> int:
        """This rank's share of ``features`` split evenly over the group (errors name ``name``)."""
        if features % self.world_size != 0:
            raise ValueError(
                f"{name} ({features}) must be divisible by the group's world size "
                f"({self.world_size})"
            )
        return features // self.world_size

    def _full_init(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias nn.Linear(in, out, bias, dtype) would draw now, same RNG calls."""
        w = torch.empty(
            self.out_features, self.in_features, dtype=self.weight.dtype, device=self.weight.device
        )
        nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        b = None
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features)
            b = torch.empty(self.out_features, dtype=self.weight.dtype, device=self.weight.device)
            nn.init.uniform_(b, -bound, bound)
        return w, b

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-draw as a single-rank ``nn.Linear`` would, keeping this rank's slice."""
        if self.weight.device.type == "meta":
            return
        self.load_full_(*self._full_init())

    @torch.no_grad()
    def load_full_(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's slice of a full ``[out, in]`` weight (and ``[out]`` bias) in place."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight must be [out_features, in_features] = "
                f"[{self.out_features}, {self.in_features}], got {tuple(weight.shape)}"
            )
        if (bias is None) != (self.bias is None):
            raise ValueError(
                "bias must be given exactly when the layer has one "
                f"(bias={self.bias is not None}), got {'None' if bias is None else 'a tensor'}"
            )
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(
                f"bias must be [out_features] = [{self.out_features}], got {tuple(bias.shape)}"
            )
        self._load_slices(weight, bias)

    def _load_slices(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        raise NotImplementedError

    @classmethod
    def from_full(
        cls,
        weight: torch.Tensor | nn.Linear,
        bias: torch.Tensor | None = None,
        group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = True,
        chunks: int = 1,
        order: str = "direct",
    ) -> _ParallelLinear:
        """The layer holding this rank's slice of a full weight ``[out, in]`` (or nn.Linear).

        Draws no random numbers. The layer takes ``weight``'s dtype and device.
        """
        if isinstance(weight, nn.Linear):
            bias = weight.bias
            weight = weight.weight
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
        out_features, in_features = weight.shape
        layer = cls(
            in_features,
            out_features,
            group=group,
            sequence_parallel=sequence_parallel,
            bias=bias is not None,
            dtype=weight.dtype,
            device="meta",
            chunks=chunks,
            order=order,
        )
        layer = layer.to_empty(device=weight.device)
        layer.load_full_(weight.detach(), None if bias is None else bias.detach())
        return layer

    def _check_input(self, x: object, features: int, what: str, op: str) -> None:
        if not isinstance(x, torch.Tensor):
            self._refuse(f"x must be a torch.Tensor, got {type(x).__name__}", op, "cpu")
        if x.dim() < 2 and self.sequence_parallel:
            error = f"x must be at least 2-D [S, ..., {what}], got shape {tuple(x.shape)}"
            self._refuse(error, op, x.device.type)
        if x.dim() < 1 or x.shape[-1] != features:
            error = f"x must be [..., {what} = {features}], got shape {tuple(x.shape)}"
            self._refuse(error, op, x.device.type)
        if x.dtype != self.weight.dtype:
            error = f"x must have the layer's dtype {self.weight.dtype}, got {x.dtype}"
            self._refuse(error, op, x.device.type)

    def _refuse(self, error: str, op: str, device: str) -> NoReturn:
        """Raise ``ValueError(error)``; with sequence parallelism on CPU, first join the peers'
        agreement in ``op`` (the collective they are in) as failed, so they raise at once naming
        this rank instead of waiting for it. (Without sequence parallelism the peers are in no
        agreement, and CUDA collectives agree on nothing on the host: they time out naming this
        rank.)"""
        if self.sequence_parallel and device == "cpu" and self.world_size > 1:
            _C.coll_fail_call(self.group_name, op, error)
        raise ValueError(error)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}, "
            f"world_size={self.world_size}, rank={self.rank}, chunks={self.chunks}, "
            f"order={self.order!r}"
        )


class ColumnParallelLinear(_ParallelLinear):
    """``y = x @ W^T + b`` with ``W`` split by output features (Megatron's ColumnParallelLinear).

    Parameters: ``weight`` ``[out_features / W, in_features]`` (rows
    ``[rank * out/W, (rank+1) * out/W)`` of the full weight), ``bias`` ``[out_features / W]``.

    Shapes (``S`` sequence, ``...`` any batch dims, ``W`` the group's world size):
      - ``sequence_parallel=True``: ``x`` ``[S/W, ..., in]`` (this rank's sequence slice) ->
        ``[S, ..., out/W]``, the all-gather of ``x`` overlapped with the GEMM
        (``all_gather_matmul``). The gradient of ``x`` is reduce-scattered back out of the GEMM.
      - ``sequence_parallel=False``: ``x`` ``[S, ..., in]`` replicated -> ``[S, ..., out/W]``;
        the gradient of ``x`` is all-reduced over the group.

    Args:
        in_features, out_features: of the full layer; ``out_features`` divisible by ``W``.
        group: the tensor-parallel group (None: ``uniep.init``'s, else WORLD, else one rank).
        sequence_parallel: see above.
        bias: add a (sharded) bias.
        dtype: float32, bfloat16 or float64 (default: torch's default dtype).
        device: parameter device; ``"meta"`` skips initialisation.
        chunks: pieces each rank's rows are split into for the overlap (must divide the rows
            ``x.numel() / in`` of every call).
        order: ``"direct"`` or ``"ring"`` peer order; neither changes the result.
    """

    def _make_parameters(self, bias: bool) -> None:
        self.out_per_rank = self._per_rank(self.out_features, "out_features")
        self.weight = nn.Parameter(
            torch.empty(self.out_per_rank, self.in_features, **self._factory)
        )
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_per_rank, **self._factory))
        else:
            self.register_parameter("bias", None)

    def _load_slices(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        rows = slice(self.rank * self.out_per_rank, (self.rank + 1) * self.out_per_rank)
        self.weight.copy_(weight[rows])
        if bias is not None:
            self.bias.copy_(bias[rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[S/W, ..., in]`` (sequence parallel) or ``[S, ..., in]`` -> ``[S, ..., out/W]``."""
        self._check_input(x, self.in_features, "in_features", "all_gather_matmul")
        rows = x.reshape(-1, self.in_features)
        if self.sequence_parallel:
            # Dim 0 is outermost, so gathering the flattened rows gathers the sequence.
            _, y = torch.ops.uniep.all_gather_matmul(
                rows, self.weight.t(), self.group_name, self.chunks, self.order
            )
            y = y.reshape(self.world_size * x.shape[0], *x.shape[1:-1], self.out_per_rank)
        else:
            y = (_CopyToGroup.apply(rows, self._group) @ self.weight.t()).reshape(
                *x.shape[:-1], self.out_per_rank
            )
        return y if self.bias is None else y + self.bias


class RowParallelLinear(_ParallelLinear):
    """``y = x @ W^T + b`` with ``W`` split by input features (Megatron's RowParallelLinear).

    Parameters: ``weight`` ``[out_features, in_features / W]`` (columns
    ``[rank * in/W, (rank+1) * in/W)`` of the full weight), ``bias`` ``[out_features]``, the same
    on every rank and added after the reduction.

    Shapes:
      - ``sequence_parallel=True``: ``x`` ``[S, ..., in/W]`` (e.g. a ColumnParallelLinear's
        output) -> ``[S/W, ..., out]``, the partial products reduce-scattered out of the GEMM
        (``matmul_reduce_scatter``, fixed summation order). ``bias.grad`` then holds only this
        rank's rows' share: reduce it over the group like Megatron's sequence-parallel parameters
        (``bias.sequence_parallel`` is True).
      - ``sequence_parallel=False``: ``x`` ``[S, ..., in/W]`` -> ``[S, ..., out]`` all-reduced
        over the group.

    Args: as for ``ColumnParallelLinear``; ``in_features`` divisible by ``W``; with sequence
    parallelism ``S`` must be divisible by ``W`` (and the rows per rank by ``chunks``).
    """

    def _make_parameters(self, bias: bool) -> None:
        self.in_per_rank = self._per_rank(self.in_features, "in_features")
        self.weight = nn.Parameter(
            torch.empty(self.out_features, self.in_per_rank, **self._factory)
        )
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features, **self._factory))
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def _load_slices(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        cols = slice(self.rank * self.in_per_rank, (self.rank + 1) * self.in_per_rank)
        self.weight.copy_(weight[:, cols])
        if bias is not None:
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[S, ..., in/W]`` -> ``[S/W, ..., out]`` (sequence parallel) or ``[S, ..., out]``."""
        op = "matmul_reduce_scatter"
        self._check_input(x, self.in_per_rank, "in_features / world size", op)
        rows = x.reshape(-1, self.in_per_rank)
        if self.sequence_parallel:
            if x.shape[0] % self.world_size != 0:
                error = (
                    f"x.size(0) (S = {x.shape[0]}) must be divisible by the group's world size "
                    f"({self.world_size}) with sequence parallelism"
                )
                self._refuse(error, op, x.device.type)
            y = torch.ops.uniep.matmul_reduce_scatter(
                rows, self.weight.t(), self.group_name, self.chunks, self.order
            )
            y = y.reshape(x.shape[0] // self.world_size, *x.shape[1:-1], self.out_features)
        else:
            y = _ReduceFromGroup.apply(rows @ self.weight.t(), self._group).reshape(
                *x.shape[:-1], self.out_features
            )
        return y if self.bias is None else y + self.bias
