"""Swap the experts of Hugging Face transformers MoE models for UniEP's expert-parallel ones.

transformers (5.x) gives each MoE family an experts module with one interface:
``experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]`` and the
weights of all ``E`` experts as ``gate_up_proj [E, 2I, H]`` (gate rows, then up rows) and
``down_proj [E, H, I]`` (``[E, H, 2I]`` / ``[E, I, H]`` where the class is marked
``is_transposed``). ``swap_moe_blocks`` replaces each such module by ``HFExperts``, a
``uniep.nn.Experts`` holding this rank's experts in UniEP's layout (``w1 [E_local, H, 2I]``,
``w2 [E_local, I, H]``). The model's router, shared experts and everything else stay as they
are, so the model computes the same function with its own routing, and
``output_router_logits=True`` still works (the router module is untouched).

Checkpoints: an ``HFExperts`` reads and writes its weights under HF's names and in HF's layout
(``gate_up_proj`` / ``down_proj``), through state-dict hooks. ``load_state_dict`` takes either
all ``E`` experts (an HF checkpoint: this rank keeps its own) or this rank's ``E_local``;
``state_dict`` gives this rank's ``E_local`` experts. ``hf_state_dict(model)`` (collective)
gathers every rank's experts into a state dict that the unswapped HF model loads, e.g. for
``save_pretrained(..., state_dict=...)`` on rank 0.

Families checked by the tests: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-V3; any other
experts module passing the structural checks (SwiGLU with SiLU, fused gate/up, no biases) is
swapped too, and one that does not is named with the reason.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import _C
from ..nn import Experts

__all__ = ["HFExperts", "hf_state_dict", "swap_moe_blocks", "unsupported_reason"]

_PARAMS = ("gate_up_proj", "down_proj")


def _is_silu(act: object) -> bool:
    if not callable(act):
        return False
    probe = torch.linspace(-6.0, 6.0, 25, dtype=torch.float64)
    try:
        with torch.no_grad():
            out = act(probe)
    except Exception:
        return False
    return isinstance(out, torch.Tensor) and torch.allclose(out, F.silu(probe), atol=1e-12)


def unsupported_reason(module: nn.Module) -> str | None:
    """Why ``module`` (an HF experts module) cannot become ``HFExperts``; None if it can."""
    params = dict(module.named_parameters())
    if set(params) != set(_PARAMS):
        return f"its parameters are {sorted(params)}, not exactly {list(_PARAMS)} (biases?)"
    if any(True for _ in module.buffers()):
        return "it has buffers"
    flags = {"has_bias": False, "has_gate": True, "is_concatenated": True}
    for flag, want in flags.items():
        if getattr(module, flag, want) != want:
            return f"{flag}={getattr(module, flag)} (UniEP's experts need {flag}={want})"
    if getattr(module, "has_post_expert_norm", False):
        return "it normalises each expert's output (has_post_expert_norm)"
    if getattr(module, "_is_expert_parallel", False):
        return "it is already split by transformers' own expert parallelism"
    apply_gate = getattr(type(module), "_apply_gate", None)
    if apply_gate is not None:
        from transformers.integrations import moe as hf_moe

        if apply_gate is not getattr(hf_moe, "_default_apply_gate", apply_gate):
            return f"{type(module).__name__} has its own gate activation (_apply_gate)"
    if not _is_silu(getattr(module, "act_fn", None)):
        return "its activation (act_fn) is not SiLU"
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    if gate_up.dim() != 3 or down.dim() != 3:
        return f"gate_up_proj {tuple(gate_up.shape)} / down_proj {tuple(down.shape)} are not 3-D"
    if getattr(module, "is_transposed", False):
        experts, hidden, two_i = gate_up.shape
        want_down = (experts, two_i // 2, hidden)
    else:
        experts, two_i, hidden = gate_up.shape
        want_down = (experts, hidden, two_i // 2)
    if two_i % 2 or tuple(down.shape) != want_down:
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} disagree"
    if gate_up.dtype == torch.float16:
        return (
            "it is float16: UniEP's expert kernels compute in float32, bfloat16 or float64 "
            "(cast the model to bfloat16 first)"
        )
    return None


class HFExperts(Experts):
    """``uniep.nn.Experts`` that replaces an HF experts module, with HF's checkpoint layout.

    Same forward as the module it replaces: ``(hidden_states [T, H], top_k_index [T, K],
    top_k_weights [T, K]) -> [T, H]``. Parameters ``w1 [E_local, H, 2I]``, ``w2 [E_local, I, H]``
    (UniEP's layout: no copy or transpose per call); ``state_dict`` / ``load_state_dict`` use
    HF's names and layout (see the module docstring). ``hf_class`` names the replaced class.
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        group: dist.ProcessGroup | None = None,
        tuning: str | _C.TuningParams = "",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        hf_transposed: bool = False,
        hf_class: str = "",
    ) -> None:
        super().__init__(hidden, ffn_hidden, num_experts, group, tuning, dtype, device)
        self.hf_transposed = hf_transposed
        self.hf_class = hf_class
        self.register_state_dict_post_hook(_save_hf_layout)
        self.register_load_state_dict_pre_hook(_load_hf_layout)

    @classmethod
    def from_hf(
        cls,
        module: nn.Module,
        group: dist.ProcessGroup | None = None,
        tuning: str | _C.TuningParams = "",
    ) -> HFExperts:
        """This rank's share of the HF experts ``module`` (which is left unchanged).

        Raises:
            ValueError: ``module`` is not a supported experts module (the reason is named).
        """
        reason = unsupported_reason(module)
        if reason is not None:
            raise ValueError(f"cannot swap {type(module).__name__}: {reason}")
        gate_up, down = module.gate_up_proj, module.down_proj
        transposed = bool(getattr(module, "is_transposed", False))
        if transposed:
            experts, hidden, two_i = gate_up.shape
        else:
            experts, two_i, hidden = gate_up.shape
        new = cls(
            hidden,
            two_i // 2,
            experts,
            group,
            tuning,
            dtype=gate_up.dtype,
            device="meta",
            hf_transposed=transposed,
            hf_class=type(module).__name__,
        )
        new.to_empty(device=gate_up.device)
        with torch.no_grad():
            new.w1.copy_(new._hf_to_local(gate_up, "gate_up_proj"))
            new.w2.copy_(new._hf_to_local(down, "down_proj"))
        new.train(module.training)
        return new

    def _hf_to_local(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """An HF-layout tensor of all ``E`` or this rank's ``E_local`` experts -> UniEP layout."""
        local = self.num_local_experts
        if t.dim() == 3 and t.shape[0] == self.num_experts:
            t = t[self.expert_offset : self.expert_offset + local]
        inner = (self.hidden, 2 * self.ffn_hidden)
        if name == "down_proj":
            inner = (self.ffn_hidden, self.hidden)
        hf_inner = inner if self.hf_transposed else inner[::-1]
        if t.dim() != 3 or tuple(t.shape) != (local, *hf_inner):
            raise ValueError(
                f"{name} must be [E={self.num_experts} or E_local={local}, "
                f"{hf_inner[0]}, {hf_inner[1]}] (HF layout of {self.hf_class or 'the experts'}), "
                f"got {tuple(t.shape)}"
            )
        return t if self.hf_transposed else t.transpose(1, 2)

    def _local_to_hf(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.hf_transposed else t.transpose(1, 2).contiguous()

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """``hidden_states [T, H]``, ``top_k_index [T, K]``, ``top_k_weights [T, K]`` -> ``[T, H]``
        (see ``uniep.nn.Experts.forward``)."""
        return super().forward(hidden_states, top_k_index, top_k_weights)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, hf_class={self.hf_class}"


def _save_hf_layout(module: HFExperts, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    for ours, theirs in (("w1", "gate_up_proj"), ("w2", "down_proj")):
        if prefix + ours in state_dict:
            state_dict[prefix + theirs] = module._local_to_hf(state_dict.pop(prefix + ours))


def _load_hf_layout(
    module: HFExperts,
    state_dict: dict,
    prefix: str,
    local_metadata: dict,
    strict: bool,
    missing_keys: list,
    unexpected_keys: list,
    error_msgs: list,
) -> None:
    for ours, theirs in (("w1", "gate_up_proj"), ("w2", "down_proj")):
        if prefix + theirs in state_dict:
            t = state_dict.pop(prefix + theirs)
            try:
                state_dict[prefix + ours] = module._hf_to_local(t, theirs)
            except ValueError as e:
                error_msgs.append(f"{prefix}{theirs}: {e}")


def swap_moe_blocks(
    model: nn.Module,
    group: dist.ProcessGroup | None = None,
    tuning: str | _C.TuningParams = "",
    strict: bool = True,
) -> list[str]:
    """Replace every HF experts module of ``model`` by ``HFExperts``, in place.

    Candidates are the submodules named ``experts`` that hold ``gate_up_proj`` and
    ``down_proj``. Every rank must hold the whole model (e.g. from ``from_pretrained``) and call
    this with the same ``group``; each keeps its share of every layer's experts, and the HF
    modules (all ``E`` experts) are dropped. For training with DDP, wrap afterwards with
    ``uniep.nn.data_parallel(model)``.

    Args:
        model: an HF model (any ``nn.Module``).
        group: the process group the experts are split over (see ``uniep.moe_forward``).
        tuning: ``TuningParams`` for every swapped module.
        strict: raise if a candidate cannot be swapped (else leave it as it is).

    Returns:
        The qualified names of the swapped modules.

    Raises:
        ValueError: ``strict`` and a candidate is unsupported (named, with the reason), or no
            candidate was found.
    """
    found = [
        (name, module)
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] == "experts"
        and not isinstance(module, HFExperts)
        and hasattr(module, "gate_up_proj")
        and hasattr(module, "down_proj")
    ]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no HF experts module (a submodule named 'experts' with "
            "gate_up_proj and down_proj)"
        )
    return _replace_found(
        model, found, unsupported_reason, lambda m: HFExperts.from_hf(m, group, tuning), strict
    )


def _replace_found(
    model: nn.Module,
    found: list[tuple[str, nn.Module]],
    unsupported: Callable[[nn.Module], str | None],
    make: Callable[[nn.Module], nn.Module],
    strict: bool,
) -> list[str]:
    """Replace each (qualified name, module) of ``found`` in ``model`` by ``make(module)``, in
    place; a module ``unsupported`` gives a reason for raises (``strict``) or stays. Returns the
    names replaced. Shared by the HF and Megatron swaps."""
    swapped = []
    for name, module in found:
        reason = unsupported(module)
        if reason is not None:
            if strict:
                raise ValueError(f"cannot swap {name} ({type(module).__name__}): {reason}")
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, make(module))
        swapped.append(name)
    return swapped


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every ``HFExperts``' experts gathered from all its ranks.

    The result has the unswapped HF model's keys and shapes (``gate_up_proj`` of all ``E``
    experts), so ``save_pretrained(path, state_dict=hf_state_dict(model))`` writes a checkpoint
    plain transformers loads. Collective: every rank of every swapped module's group must call
    it; each gets the whole dict.
    """
    state = model.state_dict()
    for name, module in model.named_modules():
        if not isinstance(module, HFExperts) or module.world_size == 1:
            continue
        group = dist.distributed_c10d._resolve_process_group(module.group_name)
        prefix = f"{name}." if name else ""
        for key in ("gate_up_proj", "down_proj"):
            local = state[prefix + key].contiguous()
            parts = [torch.empty_like(local) for _ in range(module.world_size)]
            dist.all_gather(parts, local, group=group)
            state[prefix + key] = torch.cat(parts)
    return state
