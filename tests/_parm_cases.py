"""Cases of the Parm CPU-executor tests: the worker that runs them on gloo ranks and the float64
dense reference they are checked against (uniep.parm.reference)."""

from __future__ import annotations

from typing import Any

import torch

SCHEDULES = ("baseline", "s1", "s2")


def case_tensors(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The full layer and every MP group's tokens, from the case's seed (same on every rank)."""
    gen = torch.Generator().manual_seed(case["seed"])
    M, H, E, S = case["M"], case["H"], case["E"], case["S"]
    G = case["world"] // case["N"]

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.rand(*shape, generator=gen, dtype=torch.float64) * 2 - 1) * scale

    t = {
        "gate": rand(M, E, scale=M**-0.5 * case.get("gate_scale", 1.0)),
        "w1": rand(E, M, H, scale=M**-0.5),
        "w2": rand(E, H, M, scale=H**-0.5),
        "x": rand(G, S, M),
        "dy": rand(G, S, M),
        "dl": rand(G),
    }
    if case.get("one_expert"):
        # Every token prefers expert 0 by far: the others stay empty (and overflow is likely).
        t["gate"][:, 0] += 10.0 / M
        t["x"] = t["x"].abs()
    return t


def rank_worker(rank: int, world: int, cases: list[dict[str, Any]]) -> list[Any]:
    """Run every case of this world size under every schedule; return per case per schedule the
    outputs and gradients (or the error message)."""
    from uniep.parm import CapacityError, ParmMoELayer, new_groups

    groups: dict[int, tuple[Any, Any]] = {}
    out = []
    for case in cases:
        N = case["N"]
        if N not in groups:
            groups[N] = new_groups(N)
        mp, ep = groups[N]
        if case.get("errors"):
            out.append(_error_cases(rank, world, mp, ep, case))
            continue
        t = case_tensors(case)
        g = rank // N
        per_schedule = {}
        for schedule in (*SCHEDULES, "auto") if case.get("auto") else SCHEDULES:
            layer = ParmMoELayer(
                mp,
                ep,
                case["M"],
                case["H"],
                case["E"],
                case["k"],
                capacity_factor=case["f"],
                schedule=schedule,
                overflow=case.get("overflow", "error"),
            )
            layer.load_full(t["gate"].float(), t["w1"].float(), t["w2"].float())
            x = t["x"][g].float().requires_grad_()
            try:
                y = layer(x)
            except CapacityError as e:
                per_schedule[schedule] = {"error": str(e)}
                continue
            loss = (y * t["dy"][g].float()).sum() + t["dl"][g].float() * layer.l_aux
            loss.backward()
            per_schedule[schedule] = {
                "y": y.detach(),
                "l_aux": layer.l_aux.detach(),
                "dx": x.grad,
                "dgate": layer.gate.grad,
                "dw1": layer.w1.grad,
                "dw2": layer.w2.grad,
                "dropped": layer.last_stats["dropped"],
                "ran": layer.last_schedule,
            }
        out.append(per_schedule)
    return out


def reference(case: dict[str, Any]) -> dict[str, Any]:
    """float64 outputs and gradients: per MP group (y, l_aux, dx, dgate) and the full expert
    gradients of the sum of every group's loss."""
    from uniep import _C
    from uniep.parm.reference import parm_reference

    t = case_tensors(case)
    G = case["world"] // case["N"]
    shape = _C.parm.ParmShape(
        world_size=case["world"],
        mp_size=case["N"],
        gpus_per_node=case["N"],
        tokens=case["S"],
        hidden=case["M"],
        ffn_hidden=case["H"],
        num_experts=case["E"],
        top_k=case["k"],
        capacity_factor=case["f"],
    )
    w1 = t["w1"].clone().requires_grad_()
    w2 = t["w2"].clone().requires_grad_()
    res: dict[str, Any] = {"y": [], "l_aux": [], "dx": [], "dgate": [], "dropped": 0}
    loss = torch.zeros((), dtype=torch.float64)
    leaves = []
    for g in range(G):
        x = t["x"][g].clone().requires_grad_()
        gate = t["gate"].clone().requires_grad_()
        y, l_aux, dropped = parm_reference(
            x, gate, w1, w2, case["k"], case["N"], shape.slice_capacity
        )
        loss = loss + (y * t["dy"][g]).sum() + t["dl"][g] * l_aux
        res["y"].append(y.detach())
        res["l_aux"].append(l_aux.detach())
        res["dropped"] += dropped
        leaves.append((x, gate))
    loss.backward()
    res["dx"] = [x.grad for x, _ in leaves]
    res["dgate"] = [gate.grad for _, gate in leaves]
    res["dw1"], res["dw2"] = w1.grad, w2.grad
    return res


def _error_cases(rank: int, world: int, mp: Any, ep: Any, case: dict[str, Any]) -> dict[str, str]:
    """Misuse that every rank must report the same way (and then carry on in step)."""
    from uniep.parm import ParmMoELayer

    def message(fn: Any) -> str:
        try:
            fn()
        except ValueError as e:
            return str(e)
        return "no error"

    got = {"swapped-groups": message(lambda: ParmMoELayer(ep, mp, 8, 8, 4, 2))}
    for schedule in SCHEDULES:
        layer = ParmMoELayer(mp, ep, 8, 8, 4, 2, capacity_factor=0.0, schedule=schedule)
        tokens = 6 + rank // case["N"]  # MP groups disagree on the token count
        got[schedule] = message(lambda layer=layer, t=tokens: layer(torch.randn(t, 8)))
    return got
