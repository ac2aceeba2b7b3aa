"""CUDA executor of the P2P collectives against NCCL collectives + torch.mm.

Needs >= 2 CUDA GPUs of one NVLink domain (marker `multigpu`); skipped cleanly elsewhere. Each
test spawns one NCCL process per GPU (up to 4) and batches its cases into that one spawn.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _hardware import is_hopper
from test_gpu_ep import _device

pytestmark = pytest.mark.multigpu


def _world() -> int:
    return min(torch.cuda.device_count(), 4) if torch.cuda.is_available() else 0


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def _gather_all(x: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Every rank's x, through NCCL, or through gloo's CPU all-gather when the ranks share a GPU
    (test_gpu_on_one_gpu), which NCCL refuses."""
    if dist.get_backend() == "nccl":
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return parts
    host = [torch.empty(x.shape, dtype=x.dtype) for _ in range(world)]
    dist.all_gather(host, x.detach().cpu().contiguous())
    return [p.to(x.device) for p in host]


def _reduce_scatter_ref(x: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s rows of the sum of every rank's x: NCCL's reduce-scatter, or the sum of the
    gathered parts where gloo serves the group (an order of its own: compare with a tolerance)."""
    if dist.get_backend() == "nccl":
        out = torch.empty(x.shape[0] // world, *x.shape[1:], device=x.device, dtype=x.dtype)
        dist.reduce_scatter_tensor(out, x.contiguous())
        return out
    return sum(_gather_all(x, world)).tensor_split(world)[rank]


def _fixed_order_sum(parts: list[torch.Tensor], dest: int, dtype: torch.dtype) -> torch.Tensor:
    """reduce_order(W, dest): dest+1, ..., dest-1, then dest, accumulated in fp32 (fp64)."""
    world = len(parts)
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    acc = None
    for k in range(1, world + 1):
        v = parts[(dest + k) % world].to(acc_dtype)
        acc = v if acc is None else acc + v
    assert acc is not None
    return acc.to(dtype)


def _collectives_worker(rank: int, world: int) -> dict[str, object]:
    import uniep
    import uniep.collectives as uc

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = _device(rank)
    # The expert-parallel runtime first: the collectives share its NVSHMEM initialisation.
    uniep.moe.ep.init_runtime(max_tokens=64, hidden=256, top_k=2, num_experts=2 * world)
    uc.init_cuda(max_block_bytes=16 << 20, timeout_s=30.0)
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)
    report: dict[str, object] = {}
    tol = {torch.bfloat16: 1e-2, torch.float32: 1e-5, torch.float64: 1e-12}

    for _round in range(3):  # repeated calls reuse the slots and advance the epochs
        for dtype in (torch.bfloat16, torch.float32, torch.float64):
            m, k, n = 96, 160, 136
            a = torch.randn(m, k, generator=gen, device=dev).to(dtype)
            b = torch.randn(k, n, generator=gen, device=dev).to(dtype)
            ag_ref = torch.cat(_gather_all(a, world))
            for chunks in (1, 2, 4):
                ag, mm = uc.all_gather_matmul(a, b, chunks=chunks)
                assert torch.equal(ag, ag_ref), (dtype, chunks)
                err = _rel(mm, ag_ref @ b)
                assert err <= tol[dtype], ("all_gather_matmul", dtype, chunks, err)

            big = torch.randn(world * m, k, generator=gen, device=dev).to(dtype)
            rs_ref = _reduce_scatter_ref(big @ b, world, rank)
            for chunks in (1, 3):
                out = uc.matmul_reduce_scatter(big, b, chunks=chunks)
                err = _rel(out, rs_ref)
                assert err <= tol[dtype] * 2, ("matmul_reduce_scatter", dtype, chunks, err)

            # Plain collectives: bit-exact, and the same bits for every chunk count.
            x = torch.randn(world * 24, 5, 8, generator=gen, device=dev).to(dtype)
            parts = _gather_all(x, world)
            exact = _fixed_order_sum([p[rank * 24 : (rank + 1) * 24] for p in parts], rank, dtype)
            for chunks in (1, 2, 4, 8):
                got = uc.reduce_scatter(x, chunks=chunks)
                assert torch.equal(got, exact), ("reduce_scatter", dtype, chunks)
                g = uc.all_gather(x[:24], chunks=chunks)
                assert torch.equal(g, torch.cat([p[:24] for p in parts])), ("all_gather", chunks)
    # Back-to-back calls of every push kind, checked each time: slot reuse and signal order.
    for i in range(40):
        x = torch.randn(world * 64, 1024, generator=gen, device=dev)
        parts = _gather_all(x, world)
        exact = _fixed_order_sum([p[rank * 64 : (rank + 1) * 64] for p in parts], rank, x.dtype)
        got = uc.reduce_scatter(x, chunks=(1, 2, 4, 8)[i % 4])
        assert torch.equal(got, exact), ("reduce_scatter stress", i)
        b = torch.randn(1024, 256, generator=gen, device=dev)
        mine = uc.matmul_reduce_scatter(x, b, chunks=(1, 2)[i % 2])
        ref = _reduce_scatter_ref(x @ b, world, rank)
        assert _rel(mine, ref) <= 1e-5, ("matmul_reduce_scatter stress", i, _rel(mine, ref))
    # Calls on alternating streams with nothing in between: a call's pushes (which free the
    # peers to write this rank's other slot set) wait for the previous call's reads of its slots,
    # whatever stream that call came on.
    side = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]
    w = torch.randn(1024, 256, generator=gen, device=dev)
    xs = [torch.randn(world * 64, 1024, generator=gen, device=dev) for _ in range(12)]
    torch.cuda.synchronize(dev)
    outs = []
    for i, xi in enumerate(xs):
        with torch.cuda.stream(side[i % 2]):
            if i % 3 == 0:
                outs.append(uc.all_gather_matmul(xi[:64], w, chunks=1)[1])
            else:
                outs.append(uc.reduce_scatter(xi, chunks=1 + i % 2))
    torch.cuda.synchronize(dev)
    for i, (xi, got) in enumerate(zip(xs, outs, strict=True)):
        if i % 3 == 0:
            ref = torch.cat(_gather_all(xi[:64], world)) @ w
            assert _rel(got, ref) <= 1e-5, ("all_gather_matmul across streams", i)
        else:
            parts = _gather_all(xi, world)
            want = _fixed_order_sum([p[rank * 64 : (rank + 1) * 64] for p in parts], rank, xi.dtype)
            assert torch.equal(got, want), ("reduce_scatter across streams", i)
    # Rows whose bytes are not a multiple of 16: the element-wise reduction path.
    odd = torch.randn(world * 6, 7, generator=gen, device=dev)
    parts = _gather_all(odd, world)
    exact = _fixed_order_sum([p[rank * 6 : (rank + 1) * 6] for p in parts], rank, torch.float32)
    assert torch.equal(uc.reduce_scatter(odd, chunks=2), exact)

    # Ulysses all-to-all: [S/W, H, D] -> [S, H/W, D] and back, against each peer's head slice.
    s_local, heads, d = 32, 4 * world, 24
    q = torch.randn(s_local, heads, d, generator=gen, device=dev, dtype=torch.bfloat16)
    received = [p.tensor_split(world, 1)[rank] for p in _gather_all(q, world)]
    head_sharded = uc.all_to_all_ulysses(q, 1, 0)
    assert torch.equal(head_sharded, torch.cat(received, 0))
    assert torch.equal(uc.all_to_all_ulysses(head_sharded, 0, 1), q)
    # The blocks move by 2-D copies between the caller's tensors and the slots: a leading batch
    # dim makes both sides strided (the own block goes through the own slot), float32 rows of
    # 20 bytes are not 16-byte multiples, and a transposed x is made contiguous first.
    for x, sd, gd in (
        (torch.randn(3, 5, 2 * world, 6, generator=gen, device=dev), 2, 1),
        (torch.randn(3, 2 * world, 5, 6, generator=gen, device=dev), 1, 2),
        (torch.randn(world * 2, 5, generator=gen, device=dev), 0, 1),
        (torch.randn(7, world * 3, generator=gen, device=dev).t(), 0, 1),
        (torch.randn(4, world, 5, generator=gen, device=dev, dtype=torch.float64), 1, 2),
    ):
        got = uc.all_to_all_ulysses(x, sd, gd)
        parts = _gather_all(x.contiguous(), world)
        want = torch.cat([p.tensor_split(world, sd)[rank] for p in parts], gd)
        assert torch.equal(got, want), ("all_to_all_ulysses", tuple(x.shape), sd, gd)
        back = uc.all_to_all_ulysses(got, gd, sd)
        assert torch.equal(back, x), ("all_to_all_ulysses round trip", tuple(x.shape), sd, gd)

    # Autograd through the CUDA ops: AG-GEMM's backward is a GEMM-RS (and the reverse).
    a = torch.randn(32, 48, generator=gen, device=dev, dtype=torch.float64, requires_grad=True)
    b = torch.randn(48, 40, generator=gen, device=dev, dtype=torch.float64, requires_grad=True)
    _, mm = uc.all_gather_matmul(a, b, chunks=2)
    mm.square().sum().backward()
    ga, gb = a.grad.clone(), b.grad.clone()
    a_all = torch.cat(_gather_all(a.detach(), world)).requires_grad_(True)
    b_ref = b.detach().clone().requires_grad_(True)
    (a_all @ b_ref).square().sum().backward()
    g_all = a_all.grad.clone()
    g_all = sum(_gather_all(g_all, world))  # every rank's loss depends on every shard
    assert _rel(ga, g_all[rank * 32 : (rank + 1) * 32]) <= 1e-10
    assert _rel(gb, b_ref.grad) <= 1e-10

    # Errors name the argument; none of them leaves a peer waiting.
    with pytest.raises(ValueError, match="ring"):
        uc.all_gather(x[:24], order="ring")
    with pytest.raises(RuntimeError, match="max_block_bytes"):
        uc.all_gather(torch.empty(5 << 20, device=dev))
    with pytest.raises(ValueError, match="chunks"):
        uc.all_gather(x[:24], chunks=5)
    uc.check()

    # The expert-parallel runtime still works beside the collectives (one NVSHMEM, two heaps).
    xt = torch.randn(16, 256, generator=gen, device=dev).bfloat16()
    idx = torch.randint(0, 2 * world, (16, 2), generator=gen, device=dev)
    w = torch.rand(16, 2, generator=gen, device=dev)
    recv = uniep.moe.ep.dispatch(xt, idx, w)
    out = uniep.moe.ep.combine(recv.recv_x[recv.handle.row_slot], recv.handle)
    err = _rel(out.float(), xt.float() * w.sum(1, keepdim=True))
    assert err <= 2e-2, ("ep dispatch+combine beside the collectives", err)
    dist.barrier()
    torch.cuda.synchronize()
    uc.shutdown_cuda()
    return report


@pytest.mark.skipif(_world() < 2, reason="needs >= 2 CUDA GPUs")
def test_cuda_collectives_against_nccl() -> None:
    from uniep.distributed import run_local_ranks

    reports = run_local_ranks(_collectives_worker, _world(), backend="nccl", timeout_s=600)
    assert len(reports) == _world()


def _end_gemm_worker() -> None:
    """A GEMM worker's end on every rank: the default GEMM back, then the runtime destroyed
    together once every rank's calls are done."""
    import uniep.collectives as uc

    uc.set_gemm("cublas")
    dist.barrier()
    torch.cuda.synchronize()
    uc.shutdown_cuda()


def _gemm_backends_worker(rank: int, world: int) -> dict[str, object]:
    """The GEMM choices of set_gemm: each against NCCL + torch.mm, and the cutlass GEMM's bits
    the same for every chunk count and SM carve-out (its reduce-scatter folds in the epilogue)."""
    import uniep.collectives as uc

    dev = _device(rank)
    uc.init_cuda(max_block_bytes=32 << 20, timeout_s=30.0)
    gen = torch.Generator(device=dev).manual_seed(99 + rank)
    hopper = is_hopper(dev)
    report: dict[str, object] = {"hopper": hopper}
    bf16 = torch.bfloat16
    try:
        # Rows that fill no whole 128-row tile, and more than one cluster of tiles.
        for m, k, n in ((96, 160, 136), (520, 1024, 776)):
            a = torch.randn(m, k, generator=gen, device=dev).to(bf16)
            b = (torch.randn(k, n, generator=gen, device=dev) * k**-0.5).to(bf16)
            big = torch.randn(world * m, k, generator=gen, device=dev).to(bf16)
            ag_ref = torch.cat(_gather_all(a, world))
            mm_ref = (ag_ref.float() @ b.float()).to(bf16)
            rs_ref = _reduce_scatter_ref(big @ b, world, rank)
            bits: dict[str, torch.Tensor] = {}
            choices = [("cublas", 0)]
            if hopper:
                choices += [("cutlass", 0), ("cutlass", 16), ("gated", 0), ("gated", 16)]
                # The gated AG+GEMM's bits: the one GEMM of the whole gathered operand.
                bits["ag_mm_gated"] = torch.ops.uniep.part_gemm(ag_ref, b)
                # The gated GEMM+RS's: every rank's partial summed in the reduce order.
                partials = _gather_all(torch.ops.uniep.part_gemm(big, b), world)
                bits["mm_rs_gated"] = _fixed_order_sum(
                    [p[rank * m : (rank + 1) * m] for p in partials], rank, bf16
                )
            for backend, carveout in choices:
                uc.set_gemm(backend, carveout)
                for chunks in (1, 2, 4):
                    ag, mm = uc.all_gather_matmul(a, b, chunks=chunks)
                    assert torch.equal(ag, ag_ref), (backend, chunks)
                    err = _rel(mm, mm_ref)
                    assert err <= 1e-2, ("all_gather_matmul", backend, carveout, chunks, err)
                    out = uc.matmul_reduce_scatter(big, b, chunks=chunks)
                    err = _rel(out, rs_ref)
                    assert err <= 2e-2, ("matmul_reduce_scatter", backend, carveout, chunks, err)
                    if backend != "cublas":
                        # Each backend's bits are the same for every chunking and carve-out
                        # (gated folds the partials after its GEMM, cutlass in the epilogue).
                        for name, got in ((f"ag_mm_{backend}", mm), (f"mm_rs_{backend}", out)):
                            want = bits.setdefault(name, got)
                            assert torch.equal(got, want), (name, m, carveout, chunks)
            report[f"checked_{m}"] = [f"{b_}@{c}" for b_, c in choices]
        if hopper:
            # Operands the kernel does not take (float32; bf16 output rows of 24 bytes) go to
            # cuBLAS.
            uc.set_gemm("cutlass")
            a32 = torch.randn(64, 32, generator=gen, device=dev)
            b32 = torch.randn(32, 24, generator=gen, device=dev)
            _, mm32 = uc.all_gather_matmul(a32, b32)
            assert _rel(mm32, torch.cat(_gather_all(a32, world)) @ b32) <= 1e-5
            a6, b6 = a32[:, :8].to(bf16), b32[:8, :12].to(bf16)
            _, mm6 = uc.all_gather_matmul(a6, b6)
            assert _rel(mm6, (torch.cat(_gather_all(a6, world)).float() @ b6.float())) <= 1e-2
            uc.set_gemm("cutlass", sm_carveout=10_000)
            with pytest.raises(ValueError, match="sm_carveout=10000"):
                uc.all_gather_matmul(a32.to(bf16), b32.to(bf16))
        uc.check()
    finally:
        _end_gemm_worker()
    return report


def _gated_ag_worker(rank: int, world: int) -> dict[str, object]:
    """set_gemm("gated"): all_gather_matmul as one GEMM whose tiles wait for their chunk, bit for
    bit the GEMM of the gathered operand (part_gemm of it in one part) at every chunk count, on
    chunks of whole tile clusters (256 and 512 rows; 1280 = 5 clusters; 1024 in one), and on
    chunks of a few rows, which run as the chunks' GEMMs (sm90_gemm, the same bits); called twice
    in a row per shape, so both slot sets and a second epoch are read. matmul_reduce_scatter the
    same way: one GEMM whose partials are pushed as their tiles are stored, bit for bit the
    fixed-order sum (reduce_order) of every rank's part GEMM partial, at every chunk count."""
    import uniep.collectives as uc

    dev = _device(rank)
    uc.init_cuda(max_block_bytes=32 << 20, timeout_s=60.0)
    gen = torch.Generator(device=dev).manual_seed(7 + rank)
    bf16 = torch.bfloat16
    checked = []
    try:
        uc.set_gemm("gated")
        shapes = ((8, 64, 32), (96, 160, 136), (512, 256, 136), (1280, 1024, 776))
        for m, k, n in (*shapes, (1024, 2048, 2048)):
            a = torch.randn(m, k, generator=gen, device=dev).to(bf16)
            b = (torch.randn(k, n, generator=gen, device=dev) * k**-0.5).to(bf16)
            ag_ref = torch.cat(_gather_all(a, world))
            want = torch.ops.uniep.part_gemm(ag_ref, b)
            assert _rel(want, ag_ref.double() @ b.double()) <= 8e-3
            for chunks in (1, 2, 4, 8):
                if m % chunks:
                    continue
                for _ in range(2):
                    ag, mm = uc.all_gather_matmul(a, b, chunks=chunks)
                    assert torch.equal(ag, ag_ref), (m, chunks)
                    assert torch.equal(mm, want), (m, k, n, chunks)
                checked.append((m, chunks))
            # GEMM + reduce-scatter of [world * m, k] @ [k, n]: this rank's m rows of the sum.
            big = torch.randn(world * m, k, generator=gen, device=dev).to(bf16)
            partials = _gather_all(torch.ops.uniep.part_gemm(big, b), world)
            mine = [p[rank * m : (rank + 1) * m] for p in partials]
            exact = _fixed_order_sum(mine, rank, bf16)
            for chunks in (1, 2, 4, 8):
                if m % chunks:
                    continue
                for _ in range(2):
                    got = uc.matmul_reduce_scatter(big, b, chunks=chunks)
                    assert torch.equal(got, exact), ("matmul_reduce_scatter", m, k, n, chunks)
        uc.check()
    finally:
        _end_gemm_worker()
    return {"checked": checked}


def _gated_timeout_worker(rank: int, world: int) -> str:
    """A gated AG+GEMM whose peer never calls: its tiles give up and the error names the peer."""
    import uniep.collectives as uc

    uc.init_cuda(max_block_bytes=1 << 20, timeout_s=3.0)
    message = "rank 1 never called"
    try:
        if rank == 0:
            uc.set_gemm("gated")
            a = torch.randn(256, 64, device="cuda").bfloat16()  # one part of whole tiles
            uc.all_gather_matmul(a, a[:64].t().contiguous())
            with pytest.raises(TimeoutError, match="waiting for rank 1") as info:
                uc.check()
            message = str(info.value)
    finally:
        uc.set_gemm("cublas")
    dist.barrier()
    return message


def _subgroup_worker(rank: int, world: int) -> dict[str, object]:
    """Runtimes of sub-groups (init_cuda(group, parent=WORLD)): on 4 ranks the MP-like groups
    {0, 1}, {2, 3} and the EP-like {0, 2}, {1, 3}, each rank's two runtimes created and destroyed
    at once on every rank. Each group's collectives equal the same collective over that group
    (gloo or NCCL): all-gather, all-gather + GEMM (also gated), reduce-scatter bit for bit in the
    group's reduce order, and the block all-to-all Parm runs; repeated, so both slot sets and
    the epochs advance."""
    import uniep.collectives as uc

    assert world == 4, world
    dev = _device(rank)
    layouts = ([0, 1], [2, 3], [0, 2], [1, 3])
    groups = [dist.new_group(r) for r in layouts]
    mine = [g for g, r in zip(groups, layouts, strict=True) if rank in r]
    for g in mine:
        uc.init_cuda(g, max_block_bytes=4 << 20, timeout_s=60.0, parent=dist.group.WORLD)
    gen = torch.Generator(device=dev).manual_seed(31 + rank)
    hopper = is_hopper(dev)
    try:
        for _round in range(3):
            for g in mine:
                size, me = dist.get_world_size(g), dist.get_rank(g)
                x = torch.randn(size * 24, 40, generator=gen, device=dev)
                parts = _gather_in(x, g)
                got = uc.reduce_scatter(x, group=g)
                exact = _fixed_order_sum([p[me * 24 : (me + 1) * 24] for p in parts], me, x.dtype)
                assert torch.equal(got, exact), ("reduce_scatter", layouts, rank)
                gathered = uc.all_gather(x[:24], group=g, chunks=2)
                assert torch.equal(gathered, torch.cat([p[:24] for p in parts])), "all_gather"
                # Parm's EP all-to-all: [G, block] with scatter dim 0 and gather dim 1.
                recv = uc.all_to_all_ulysses(x.reshape(size, -1), 0, 1, group=g)
                want = torch.cat([p.reshape(size, -1)[me] for p in parts])
                assert torch.equal(recv.reshape(-1), want), "all_to_all"
                a = x[:24].bfloat16()
                b = (torch.randn(40, 64, generator=gen, device=dev) * 0.1).bfloat16()
                ag_ref = torch.cat([p[:24].bfloat16() for p in parts])
                for backend in ("cublas", "gated") if hopper else ("cublas",):
                    uc.set_gemm(backend)
                    ag, mm = uc.all_gather_matmul(a, b, group=g, chunks=2)
                    assert torch.equal(ag, ag_ref), ("all_gather_matmul", backend)
                    assert _rel(mm, ag_ref.double() @ b.double()) <= 1e-2, backend
                    if backend == "gated":
                        assert torch.equal(mm, torch.ops.uniep.part_gemm(ag_ref, b))
                uc.set_gemm("cublas")
        for g in mine:
            uc.check(g)
    finally:
        uc.set_gemm("cublas")
        dist.barrier()
        torch.cuda.synchronize()
        for g in mine:
            uc.shutdown_cuda(g)
    return {"groups": [dist.get_process_group_ranks(g) for g in mine]}


def _gather_in(x: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every rank of ``group``'s x, in group rank order (through gloo's CPU all-gather where the
    group is gloo, as when the ranks share a GPU)."""
    size = dist.get_world_size(group)
    if dist.get_backend(group) == "nccl":
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return parts
    host = [torch.empty(x.shape, dtype=x.dtype) for _ in range(size)]
    dist.all_gather(host, x.detach().cpu().contiguous(), group=group)
    return [p.to(x.device) for p in host]


@pytest.mark.skipif(_world() < 4, reason="needs >= 4 CUDA GPUs")
def test_cuda_subgroup_collectives() -> None:
    from uniep.distributed import run_local_ranks

    reports = run_local_ranks(_subgroup_worker, 4, backend="nccl", timeout_s=600)
    assert [len(r["groups"]) for r in reports] == [2, 2, 2, 2]


@pytest.mark.skipif(_world() < 2, reason="needs >= 2 CUDA GPUs")
def test_cuda_collectives_gemm_backends() -> None:
    from uniep.distributed import run_local_ranks

    reports = run_local_ranks(_gemm_backends_worker, _world(), backend="nccl", timeout_s=600)
    assert len(reports) == _world()


def _coll_timeout_worker(rank: int, world: int) -> str:
    import uniep.collectives as uc

    uc.init_cuda(max_block_bytes=1 << 20, timeout_s=3.0)
    message = "rank 1 never called"
    if rank == 0:
        x = torch.randn(2 * 64, 32, device="cuda")
        uc.reduce_scatter(x)  # enqueued; its wait for rank 1's partial gives up
        with pytest.raises(TimeoutError, match="waiting for rank 1") as info:
            uc.check()
        message = str(info.value)
    dist.barrier()
    return message


@pytest.mark.hopper
@pytest.mark.skipif(_world() < 2, reason="needs >= 2 CUDA GPUs")
def test_cuda_gated_all_gather_matmul_bits() -> None:
    from uniep.distributed import run_local_ranks

    reports = run_local_ranks(_gated_ag_worker, _world(), backend="nccl", timeout_s=600)
    assert all(r["checked"] for r in reports)


@pytest.mark.skipif(_world() < 2, reason="needs >= 2 CUDA GPUs")
def test_cuda_collective_timeout_names_the_peer() -> None:
    from uniep.distributed import run_local_ranks

    messages = run_local_ranks(_coll_timeout_worker, 2, backend="nccl", timeout_s=300)
    assert "timed out" in messages[0] and "reduce_scatter" in messages[0]


def test_cuda_collectives_heap_holds_two_slot_sets() -> None:
    """init_cuda allocates 2 * world_size * max_block_bytes of push slots: one set for calls of odd
    epoch and one for even, which is what lets a call skip the barrier with its peers."""
    from uniep import _C

    if not getattr(_C, "has_ep_runtime", False):
        pytest.skip("built without the CUDA runtime")
    mib = 1 << 20
    for world in (1, 2, 4, 8, 16):
        grown = _C.coll_symmetric_heap_bytes(world, 3 * mib) - _C.coll_symmetric_heap_bytes(
            world, mib
        )
        assert grown == 2 * world * 2 * mib, (world, grown)
