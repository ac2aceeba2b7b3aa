"""The training path on CPU: empty batches, the MegaKernel's shape rule for forward and backward
alike, and expert shards under data parallelism (``uniep.nn.mark_expert_shards``, the DDP trap
that ``moe_forward`` catches). The GPU side is tests/moe/test_gpu_training.py."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from torch import nn

H, FFN, K, E_LOCAL = 16, 8, 2, 2


def _experts(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All E = E_LOCAL * world experts from one seed; this rank's slice."""
    gen = torch.Generator().manual_seed(5)
    e = E_LOCAL * world
    w1 = torch.randn(e, H, 2 * FFN, generator=gen) / H**0.5
    w2 = torch.randn(e, FFN, H, generator=gen) / FFN**0.5
    lo = rank * E_LOCAL
    return w1[lo : lo + E_LOCAL].clone(), w2[lo : lo + E_LOCAL].clone()


def _tokens(rank: int, world: int, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(t, H, generator=gen)
    idx = torch.randint(0, E_LOCAL * world, (t, K), generator=gen)
    w = torch.rand(t, K, generator=gen)
    return x, idx, w


def _empty_worker(rank: int, world: int, tokens: list[int]) -> dict[str, object]:
    import uniep

    x, idx, w = _tokens(rank, world, tokens[rank])
    x.requires_grad_(True)
    w.requires_grad_(True)
    w1, w2 = (t.requires_grad_(True) for t in _experts(rank, world))
    out: dict[str, object] = {}
    for how in ("op", "wrapper"):
        for t in (x, w, w1, w2):
            t.grad = None
        if how == "op":
            name = uniep.distributed.group_name(None)
            y = torch.ops.uniep.moe_forward(x, idx, w, w1, w2, name, "")
        else:
            y = uniep.moe_forward(x, idx, w, w1, w2)
        out[f"{how} grad_fn"] = y.grad_fn is not None
        (y * 1.5).sum().backward()
        out[f"{how} grads"] = [t.grad.clone() for t in (x, w, w1, w2)]
    return out


def _dense_grads(world: int, tokens: list[int]) -> list[list[torch.Tensor]]:
    """Per rank: float64 autograd's gradients of x, w, w1 and w2 for the same problem."""
    from uniep.reference import moe_reference

    parts = [_tokens(r, world, tokens[r]) for r in range(world)]
    x = torch.cat([p[0] for p in parts]).double().requires_grad_(True)
    idx = torch.cat([p[1] for p in parts])
    w = torch.cat([p[2] for p in parts]).double().requires_grad_(True)
    shards = [_experts(r, world) for r in range(world)]
    w1 = torch.cat([s[0] for s in shards]).double().requires_grad_(True)
    w2 = torch.cat([s[1] for s in shards]).double().requires_grad_(True)
    (moe_reference(x, idx, w, w1, w2) * 1.5).sum().backward()
    grads = []
    for r in range(world):
        t0 = sum(tokens[:r])
        t1 = t0 + tokens[r]
        e0 = r * E_LOCAL
        grads.append(
            [x.grad[t0:t1], w.grad[t0:t1], w1.grad[e0 : e0 + E_LOCAL], w2.grad[e0 : e0 + E_LOCAL]]
        )
    return grads


@pytest.mark.parametrize("tokens", [[0], [0, 0], [0, 9], [7, 0, 0, 5]], ids=str)
def test_empty_batches_keep_their_graph_and_join_the_backward(tokens: list[int]) -> None:
    world = len(tokens)
    if world == 1:
        reports = [_empty_worker(0, 1, tokens)]
    else:
        reports = run_ranks(world, _empty_worker, tokens)
    want = _dense_grads(world, tokens)
    for rank, rep in enumerate(reports):
        for how in ("op", "wrapper"):
            assert rep[f"{how} grad_fn"], (rank, how)
            for name, got, ref in zip(
                ("x", "w", "w1", "w2"), rep[f"{how} grads"], want[rank], strict=True
            ):
                assert got.shape == ref.shape, (rank, how, name)
                torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
        if sum(tokens) == 0:  # nothing anywhere: zero expert gradients, not missing ones
            assert all(g.abs().sum() == 0 for g in rep["wrapper grads"][2:])


def test_megakernel_shape_rule_is_one_for_forward_and_backward() -> None:
    from uniep.moe.megakernel.forward import megakernel_overlap, megakernel_shape_ok

    assert megakernel_overlap("overlap=fused", 1, 256, 128) == "fused"
    assert megakernel_overlap("overlap=chunked", 1, 256, 128) == "streams"
    for hidden, ffn in ((256, 96), (96, 128), (256, 0)):
        assert not megakernel_shape_ok(hidden, ffn)
        # None: the separate launches, for the forward (ops.moe_forward) and the backward
        # (ep.moe_backward's CUDA implementation) alike.
        assert megakernel_overlap("overlap=fused", 1, hidden, ffn) is None
        assert megakernel_overlap("overlap=fused", 2, hidden, ffn) is None


class RawExperts(nn.Module):
    """A user's own module over the raw op, holding this rank's expert shards."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        w1, w2 = _experts(rank, world)
        self.gate_up = nn.Parameter(w1)
        self.down = nn.Parameter(w2)
        self.proj = nn.Linear(H, H)  # a replicated parameter beside the shards

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        import uniep

        name = uniep.distributed.group_name(None)
        y = torch.ops.uniep.moe_forward(self.proj(x), idx, w, self.gate_up, self.down, name, "")
        return y


def _ddp_worker(rank: int, world: int) -> dict[str, object]:
    import uniep

    x, idx, w = _tokens(rank, world, 6)
    out: dict[str, object] = {}

    # 1. Plain DDP around the raw op: the forward raises on every rank, naming the fix.
    torch.manual_seed(0)
    model = RawExperts(rank, world)
    ddp = nn.parallel.DistributedDataParallel(model)
    try:
        ddp(x, idx, w)
        out["plain"] = "no error"
    except RuntimeError as e:
        out["plain"] = str(e)
    # 2. The same module called past the wrapper (ddp.module): its shards are rank 0's copies.
    try:
        ddp.module(x, idx, w)
        out["past the wrapper"] = "no error"
    except RuntimeError as e:
        out["past the wrapper"] = str(e)

    # 3. Marked shards under uniep.nn.data_parallel: kept per rank, gradients scaled by 1 / D.
    torch.manual_seed(0)
    ref = RawExperts(rank, world)
    ref(x, idx, w).sum().backward()
    torch.manual_seed(0)
    model = RawExperts(rank, world)
    names = uniep.nn.mark_expert_shards(model, ["gate_up", model.down])
    wrapped = uniep.nn.data_parallel(model)
    wrapped(x, idx, w).sum().backward()
    out["names"] = names
    out["ignored"] = list(model._ddp_params_and_buffers_to_ignore)
    out["kept"] = torch.equal(model.gate_up.detach(), _experts(rank, world)[0])
    out["scaled"] = all(
        torch.allclose(getattr(model, n).grad, getattr(ref, n).grad / world)
        for n in ("gate_up", "down")
    )

    # 4. Equal shards on purpose, marked: trusted.
    model = RawExperts(0, world)
    uniep.nn.mark_expert_shards(model, ["gate_up", "down"])
    model(x, idx, w).sum().backward()
    out["marked equal"] = "ok"
    # The DDPs (one whose forward raised half-way) go while the group is alive, in step on both
    # ranks, rather than in the interpreter's exit after the harness tore the group down.
    del ddp, wrapped
    gc.collect()
    dist.barrier()
    return out


def test_expert_shards_under_data_parallel() -> None:
    reports = run_ranks(2, _ddp_worker)
    for rank, rep in enumerate(reports):
        assert "running DistributedDataParallel treats as replicas" in rep["plain"], rank
        assert "mark_expert_shards" in rep["plain"] and "data_parallel" in rep["plain"]
        assert "hold exactly the same values on all 2 ranks" in rep["past the wrapper"], rank
        assert rep["names"] == ["gate_up", "down"]
        assert rep["ignored"] == [".down", ".gate_up", "down", "gate_up"]
        assert rep["kept"] and rep["scaled"], rank
        assert rep["marked equal"] == "ok"


class WrappedExperts(RawExperts):
    """The same module over ``uniep.moe_forward``, the Python call torch.compile traces."""

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        import uniep

        return uniep.moe_forward(self.proj(x), idx, w, self.gate_up, self.down)


def _ddp_compiled_and_grad_mode_worker(rank: int, world: int) -> dict[str, str]:
    x, idx, w = _tokens(rank, world, 6)
    out: dict[str, str] = {}
    # A plain DDP under torch.compile: the op's autograd compares no checksums while traced,
    # and uniep.moe_forward still names the trap (its check raised while tracing, the call runs
    # again eagerly and raises).
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(WrappedExperts(rank, world))
    try:
        torch.compile(ddp, backend="eager")(x, idx, w)
        out["compiled"] = "no error"
    except RuntimeError as e:
        out["compiled"] = str(e)
    del ddp
    gc.collect()
    dist.barrier()
    # A layer's first call with grad on one rank and off on the other: the shards' check of the
    # first meets the next call of the second, each naming the other's call (a plain exchange
    # there aborted the process on a size mismatch).
    model = RawExperts(rank, world)
    try:
        for _ in range(2):
            if rank == 0:
                with torch.no_grad():
                    model(x, idx, w)
            else:
                model(x, idx, w)
        out["grad mode"] = "no error"
    except ValueError as e:
        out["grad mode"] = str(e)
    return out


def test_the_ddp_trap_under_compile_and_a_grad_mode_that_differs_raise_on_every_rank() -> None:
    reports = run_ranks(2, _ddp_compiled_and_grad_mode_worker)
    for rank, rep in enumerate(reports):
        assert "running DistributedDataParallel treats as replicas" in rep["compiled"], rank
        other = "moe_forward at the same time" if rank == 1 else "check of the expert shards"
        assert other in rep["grad mode"], (rank, rep["grad mode"])


def test_mark_expert_shards_names_bad_arguments() -> None:
    import uniep

    model = RawExperts(0, 1)
    with pytest.raises(ValueError, match=r"params: 'nope' is not a parameter of RawExperts"):
        uniep.nn.mark_expert_shards(model, ["nope"])
    with pytest.raises(ValueError, match=r"params: RawExperts has no parameter named w1 or w2"):
        uniep.nn.mark_expert_shards(model)
    with pytest.raises(ValueError, match=r"params: every entry must be a name or a parameter"):
        uniep.nn.mark_expert_shards(model, [torch.zeros(2)])


def test_prepared_experts_say_at_the_forward_that_they_have_no_backward() -> None:
    from uniep.moe.prepared import _refuse_autograd

    x, w = torch.zeros(2, H, requires_grad=True), torch.zeros(2, K)
    with pytest.raises(RuntimeError, match="moe_forward_prepared has no backward on CUDA"):
        _refuse_autograd(x, w)
    with torch.no_grad():
        _refuse_autograd(x, w)
    _refuse_autograd(x.detach(), w)


def _expert_data_parallel_worker(rank: int, world: int) -> dict[str, str]:
    import warnings

    import uniep

    # Experts split over {0, 1} and {2, 3}; their replicas, one an expert group, over {0, 2} and
    # {1, 3} (expert data parallelism).
    ep = [dist.new_group(r) for r in ([0, 1], [2, 3])][rank // 2]
    dp = [dist.new_group(r) for r in ([0, 2], [1, 3])][rank % 2]
    x = _tokens(rank, world, 6)[0]
    out: dict[str, str] = {}
    for name, group in (("replicas", dp), ("world", None)):
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(
            uniep.nn.MoELayer(H, FFN, 4, K, group=ep), process_group=group
        )
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                ddp(x).sum().backward()
            out[name] = "ok: " + " | ".join(str(w.message) for w in seen)
        except ValueError as e:
            out[name] = f"ValueError: {e}"
        del ddp
        gc.collect()
        dist.barrier()
    return out


def test_ddp_over_expert_replicas_is_not_the_trap() -> None:
    """A DDP whose peers hold the same experts (its group meets the expert group at this rank
    alone) reduces true replicas: the forward runs and warns about the experts' gradient scale,
    where it raised the trap's false claim; a DDP over every rank still raises."""
    for rank, rep in enumerate(run_ranks(4, _expert_data_parallel_worker)):
        assert rep["replicas"].startswith("ok: "), (rank, rep["replicas"])
        assert "scale them by 1/2" in rep["replicas"], (rank, rep["replicas"])
        assert "treats them as replicated" in rep["world"], (rank, rep["world"])
