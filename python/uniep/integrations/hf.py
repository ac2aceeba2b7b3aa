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

``swap_moe_layers`` goes one level up: it replaces each whole sparse MoE block (router, experts
and, for Qwen2-MoE, the gated shared expert) of Mixtral, Qwen2-MoE and Qwen3-MoE by
``HFMoELayer``, a ``uniep.nn.MoELayer`` with the block's forward (``[B, S, H] -> [B, S, H]``)
that routes with UniEP's router. Its router module (``HFRouter``) is made an instance of the
block's HF router class, so HF's output recording (the ``OutputRecorder(<router class>)`` of the
model's ``_can_record_outputs``) records its logits as it recorded HF's: ``output_router_logits``
and HF's load-balancing loss work unchanged. Its state dict uses the block's HF names and layout
(``gate.weight``, ``experts.gate_up_proj``, ``experts.down_proj``, ``shared_expert.*``,
``shared_expert_gate.weight``), with ``hf_state_dict`` gathering the experts as for ``HFExperts``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import _C
from ..nn import Experts, MoELayer, router_logits
from ._layout_hooks import register_layout_hooks

__all__ = [
    "HFExperts",
    "HFMoELayer",
    "HFRouter",
    "hf_state_dict",
    "layer_unsupported_reason",
    "swap_moe_blocks",
    "swap_moe_layers",
    "unsupported_reason",
]

_PARAMS = ("gate_up_proj", "down_proj")


def is_silu(act: object) -> bool:
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
    if not is_silu(getattr(module, "act_fn", None)):
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


def _experts_to_local(module: nn.Module, t: torch.Tensor, name: str) -> torch.Tensor:
    """An HF-layout experts tensor (``name``: ``gate_up_proj`` or ``down_proj``) of all ``E`` or
    this rank's ``E_local`` experts -> this rank's in UniEP's layout (``w1`` / ``w2``).
    ``module``: an ``HFExperts`` or ``HFMoELayer``."""
    local = module.num_local_experts
    if t.dim() == 3 and t.shape[0] == module.num_experts:
        t = t[module.expert_offset : module.expert_offset + local]
    inner = (module.hidden, 2 * module.ffn_hidden)
    if name == "down_proj":
        inner = (module.ffn_hidden, module.hidden)
    hf_inner = inner if module.hf_transposed else inner[::-1]
    if t.dim() != 3 or tuple(t.shape) != (local, *hf_inner):
        raise ValueError(
            f"{name} must be [E={module.num_experts} or E_local={local}, "
            f"{hf_inner[0]}, {hf_inner[1]}] (HF layout of {module.hf_class or 'the experts'}), "
            f"got {tuple(t.shape)}"
        )
    return t if module.hf_transposed else t.transpose(1, 2)


def _experts_to_hf(module: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """``w1`` / ``w2`` (or their gradients) of ``module`` -> HF's layout."""
    return t if module.hf_transposed else t.transpose(1, 2).contiguous()


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
        register_layout_hooks(self, _save_hf_layout, _load_hf_layout)

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
        return _experts_to_local(self, t, name)

    def _local_to_hf(self, t: torch.Tensor) -> torch.Tensor:
        return _experts_to_hf(self, t)

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


def _save_hf_layout(module: HFExperts, state_dict: dict, prefix: str) -> None:
    for ours, theirs in (("w1", "gate_up_proj"), ("w2", "down_proj")):
        if prefix + ours in state_dict:
            state_dict[prefix + theirs] = module._local_to_hf(state_dict.pop(prefix + ours))


def _load_hf_layout(module: HFExperts, state_dict: dict, prefix: str, error_msgs: list) -> None:
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
    return replace_found(
        model, found, unsupported_reason, lambda m: HFExperts.from_hf(m, group, tuning), strict
    )


def replace_found(
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


# Sparse MoE blocks whose routing ``MoELayer`` reproduces: softmax over all experts, the top-k
# kept and renormalised unless the router says ``norm_topk_prob=False`` (Mixtral's always does).
_SOFTMAX_BLOCKS = ("MixtralSparseMoeBlock", "Qwen2MoeSparseMoeBlock", "Qwen3MoeSparseMoeBlock")

# HFMoELayer's parameters (relative names) -> the HF block's state-dict keys; shared_w1 is two of
# them, _SHARED_GATE_UP.
_LAYER_TO_HF = {
    "router.weight": "gate.weight",
    "w1": "experts.gate_up_proj",
    "w2": "experts.down_proj",
    "shared_w2": "shared_expert.down_proj.weight",
    "shared_gate.weight": "shared_expert_gate.weight",
}
_SHARED_GATE_UP = ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight")


def _is_hf_experts(module: object) -> bool:
    return isinstance(module, HFExperts) or (
        isinstance(module, nn.Module)
        and hasattr(module, "gate_up_proj")
        and hasattr(module, "down_proj")
    )


def _shared_unsupported_reason(mlp: nn.Module, gate: nn.Module | None, hidden: int) -> str | None:
    projs = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, nn.Linear) and p.bias is None for p in projs):
        return "it is not gate_proj, up_proj and down_proj linear layers without biases"
    if len(list(mlp.parameters())) != 3:
        return "it has parameters besides gate_proj, up_proj and down_proj"
    if not is_silu(getattr(mlp, "act_fn", None)):
        return "its activation (act_fn) is not SiLU"
    inner = projs[0].out_features
    shapes = [tuple(p.weight.shape) for p in projs]
    if shapes != [(inner, hidden), (inner, hidden), (hidden, inner)]:
        return f"its projections are {shapes}, not [I, H={hidden}], [I, H], [H, I]"
    if gate is not None and not (
        isinstance(gate, nn.Linear) and gate.bias is None and gate.out_features == 1
    ):
        return "its gate (shared_expert_gate) is not a bias-free Linear(H, 1)"
    return None


def layer_unsupported_reason(block: nn.Module) -> str | None:
    """Why ``block`` (an HF sparse MoE block) cannot become ``HFMoELayer``; None if it can."""
    kind = type(block).__name__
    if kind not in _SOFTMAX_BLOCKS:
        return (
            f"swap_moe_layers knows the routing of {', '.join(_SOFTMAX_BLOCKS)} only (a router's "
            "scores, choice and normalisation are in its code, not in its parameters); "
            "swap_moe_blocks swaps the experts alone and keeps the model's router"
        )
    experts, gate = block.experts, block.gate
    if isinstance(experts, HFExperts):
        return "its experts are already UniEP's (swap_moe_blocks ran): swap an unswapped model"
    reason = unsupported_reason(experts)
    if reason is not None:
        return f"its experts: {reason}"
    num_experts = experts.gate_up_proj.shape[0]
    hidden = experts.gate_up_proj.shape[1 if getattr(experts, "is_transposed", False) else 2]
    held = [n for n, _ in gate.named_parameters()] + [n for n, _ in gate.named_buffers()]
    if held != ["weight"]:
        return f"its router (gate) holds {held}, not a single weight [E, H]"
    if tuple(gate.weight.shape) != (num_experts, hidden):
        return f"its router weight is {tuple(gate.weight.shape)}, not [E={num_experts}, H={hidden}]"
    top_k = getattr(gate, "top_k", None)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        return f"its router's top_k ({top_k!r}) is not an int in [1, {num_experts}]"
    if getattr(block, "jitter_noise", 0):
        return (
            f"router_jitter_noise={block.jitter_noise}: in training it scales the inputs by "
            "random noise, which MoELayer does not (set the block's jitter_noise to 0 to swap it "
            "without)"
        )
    shared = getattr(block, "shared_expert", None)
    if shared is not None:
        reason = _shared_unsupported_reason(
            shared, getattr(block, "shared_expert_gate", None), hidden
        )
        if reason is not None:
            return f"its shared expert: {reason}"
    return None


class HFRouter(nn.Module):
    """The router of an ``HFMoELayer``: ``weight [E, H]``; ``forward(hidden_states [..., H])``
    gives the logits ``[T, E]`` (float32, float64 for float64 layers: ``uniep.nn.router_logits``).

    ``HFMoELayer.from_hf`` makes it an instance of the replaced block's router class too (a
    subclass of both, one per HF class), because HF's output recording hooks every module of the
    class its model names in ``_can_record_outputs`` (``OutputRecorder(MixtralTopKRouter,
    index=0)``): it hooks this router as it hooked HF's, with no change to transformers'
    registries, and HF's weight init finds ``weight`` where it looks for it. HF's router returns
    ``(logits, top_k_weights, top_k_index)``; this one the logits alone, which recorders take
    whole.
    """

    def __init__(self, weight: nn.Parameter) -> None:
        # Not the HF router's __init__, which builds its weight from a config.
        nn.Module.__init__(self)
        self.weight = weight
        self.num_experts, self.hidden_dim = weight.shape

    def reset_parameters(self) -> None:
        """``nn.Linear``'s draw (uniform in ``±1/sqrt(H)``), as ``MoELayer``'s router."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(
        self, hidden_states: torch.Tensor, logits: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``hidden_states [..., H]`` -> ``logits [T, E]``. Logits already computed from
        ``hidden_states`` (by ``HFMoELayer.forward``) are returned as they are: that call is for
        the hooks on this module, which record them without a second matmul."""
        if logits is None:
            logits = router_logits(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        return logits

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}"


_ROUTER_CLASSES: dict[type, type] = {}


def _hf_router_class(hf_router: type[nn.Module]) -> type[HFRouter]:
    """The ``HFRouter`` that is also an ``hf_router`` (one class per HF router class)."""
    cls = _ROUTER_CLASSES.get(hf_router)
    if cls is None:
        cls = type(f"UniEP{hf_router.__name__}", (HFRouter, hf_router), {"__module__": __name__})
        _ROUTER_CLASSES[hf_router] = cls
    return cls


def _copy_forward_hooks(src: nn.Module, dst: nn.Module) -> None:
    # HF installs its recording hooks once per model, on the modules present then (at the first
    # forward that records anything): a router replaced later must carry the replaced one's.
    for hook_id, hook in src._forward_hooks.items():
        dst.register_forward_hook(
            hook,
            with_kwargs=hook_id in src._forward_hooks_with_kwargs,
            always_call=hook_id in src._forward_hooks_always_called,
        )


class HFMoELayer(MoELayer):
    """``uniep.nn.MoELayer`` that replaces a whole HF sparse MoE block, with HF's interface.

    Same forward as the block: ``hidden_states [B, S, H]`` (any ``[..., H]``) -> same shape;
    routing, experts and shared expert are ``MoELayer``'s. ``router`` is an ``HFRouter``
    (``weight [E, H]``, float32 as ``MoELayer``'s router, also for bfloat16 models: the logits
    are float32 where HF's are in the model's dtype) that is an instance of the block's router
    class; every forward passes it the logits ``[T, E]`` the layer routed with, so HF's output
    recording records them: ``output_router_logits=True`` gives one per layer, and HF's
    load-balancing loss differentiates through them to ``router.weight`` and the inputs.

    ``state_dict`` / ``load_state_dict`` use the block's names and layout: ``gate.weight``,
    ``experts.gate_up_proj`` / ``experts.down_proj`` (loading: all ``E`` experts or this rank's
    ``E_local``; saving: this rank's, as ``HFExperts``), ``shared_expert.gate_proj.weight``,
    ``shared_expert.up_proj.weight``, ``shared_expert.down_proj.weight`` and
    ``shared_expert_gate.weight``. ``to_hf`` maps this layer's tensors (e.g. gradients) the same
    way.

    Args:
        hidden, ffn_hidden, num_experts, top_k, group, tuning, dtype, device, options:
            ``MoELayer``'s (``options``: its keyword arguments, e.g. ``renormalize``,
            ``shared_ffn_hidden``, ``shared_gate``).
        hf_router: the HF router class ``router`` is an instance of too (None: none).
        hf_transposed: the HF experts store ``is_transposed`` tensors.
        hf_class: the replaced block's class name.
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        top_k: int,
        group: dist.ProcessGroup | None = None,
        tuning: str | _C.TuningParams = "",
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        *,
        hf_router: type[nn.Module] | None = None,
        hf_transposed: bool = False,
        hf_class: str = "",
        **options: object,
    ) -> None:
        super().__init__(
            hidden, ffn_hidden, num_experts, top_k, group, tuning, dtype, device, **options
        )
        router_class = HFRouter if hf_router is None else _hf_router_class(hf_router)
        self.router = router_class(self.router.weight)
        self.hf_transposed = hf_transposed
        self.hf_class = hf_class
        register_layout_hooks(self, _save_layer_hf_layout, _load_layer_hf_layout)

    @classmethod
    def from_hf(
        cls,
        block: nn.Module,
        group: dist.ProcessGroup | None = None,
        tuning: str | _C.TuningParams = "",
    ) -> HFMoELayer:
        """This rank's share of the HF sparse MoE ``block`` (which is left unchanged). Forward
        hooks on the block's router (HF's recording hooks, once the model has recorded an
        output) are registered on the new router too.

        Raises:
            ValueError: ``block`` is not supported (the reason is named).
        """
        reason = layer_unsupported_reason(block)
        if reason is not None:
            raise ValueError(f"cannot swap {type(block).__name__}: {reason}")
        experts, gate = block.experts, block.gate
        gate_up = experts.gate_up_proj
        transposed = bool(getattr(experts, "is_transposed", False))
        if transposed:
            num_experts, hidden, two_i = gate_up.shape
        else:
            num_experts, two_i, hidden = gate_up.shape
        options: dict[str, object] = {"renormalize": bool(getattr(gate, "norm_topk_prob", True))}
        shared = getattr(block, "shared_expert", None)
        if shared is not None:
            options["shared_ffn_hidden"] = shared.gate_proj.out_features
            options["shared_gate"] = getattr(block, "shared_expert_gate", None) is not None
        new = cls(
            hidden,
            two_i // 2,
            num_experts,
            gate.top_k,
            group,
            tuning,
            dtype=gate_up.dtype,
            device="meta",
            hf_router=type(gate),
            hf_transposed=transposed,
            hf_class=type(block).__name__,
            **options,
        )
        new.to_empty(device=gate_up.device)
        new.load_state_dict(block.state_dict())
        new.train(block.training)
        _copy_forward_hooks(gate, new.router)
        return new

    def forward(
        self, hidden_states: torch.Tensor, return_router_logits: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``hidden_states [..., H]`` -> ``[..., H]`` (see ``MoELayer.forward``); the router logits
        ``[T, E]`` go through ``router``'s hooks (HF's output recording)."""
        y, logits = super().forward(hidden_states, return_router_logits=True)
        self.router(hidden_states, logits)
        return (y, logits) if return_router_logits else y

    def to_hf(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This layer's tensors under its names (``router.weight``, ``w1``, ``shared_w1``, ...;
        parameters or their gradients) -> under the HF block's names and in its layout
        (``gate.weight``, ``experts.gate_up_proj [E_local, 2I, H]``,
        ``shared_expert.gate_proj.weight [I_s, H]`` and ``shared_expert.up_proj.weight``, ...).
        Other keys pass unchanged."""
        out = {}
        for key, t in tensors.items():
            if key in ("w1", "w2"):
                out[_LAYER_TO_HF[key]] = _experts_to_hf(self, t)
            elif key == "shared_w1":
                for hf_key, part in zip(_SHARED_GATE_UP, t.chunk(2, dim=1), strict=True):
                    out[hf_key] = part.t().contiguous()
            elif key == "shared_w2":
                out[_LAYER_TO_HF[key]] = t.t().contiguous()
            else:
                out[_LAYER_TO_HF.get(key, key)] = t
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, hf_class={self.hf_class}"


def _save_layer_hf_layout(module: HFMoELayer, state_dict: dict, prefix: str) -> None:
    names = (*_LAYER_TO_HF, "shared_w1")
    ours = {k: state_dict.pop(prefix + k) for k in names if prefix + k in state_dict}
    state_dict.update({prefix + k: t for k, t in module.to_hf(ours).items()})


def _load_layer_hf_layout(
    module: HFMoELayer, state_dict: dict, prefix: str, error_msgs: list
) -> None:
    for ours, theirs in _LAYER_TO_HF.items():
        if prefix + theirs not in state_dict:
            continue
        t = state_dict.pop(prefix + theirs)
        if ours in ("w1", "w2"):
            try:
                t = _experts_to_local(module, t, theirs.split(".")[-1])
            except ValueError as e:
                error_msgs.append(f"{prefix}{theirs}: {e}")
                continue
        elif ours == "shared_w2":
            t = t.t()
        state_dict[prefix + ours] = t
    gate_up = [prefix + k for k in _SHARED_GATE_UP]
    if all(k in state_dict for k in gate_up):
        parts = [state_dict.pop(k).t() for k in gate_up]
        state_dict[prefix + "shared_w1"] = torch.cat(parts, dim=1)


def swap_moe_layers(
    model: nn.Module,
    group: dist.ProcessGroup | None = None,
    tuning: str | _C.TuningParams = "",
    strict: bool = True,
) -> list[str]:
    """Replace every HF sparse MoE block of ``model`` (router, experts, shared expert) by
    ``HFMoELayer``, in place.

    Candidates are the submodules with a router child ``gate`` and an experts child ``experts``
    (HF's, or ``HFExperts``, which is refused). Supported: Mixtral, Qwen2-MoE (with its gated
    shared expert) and Qwen3-MoE (``layer_unsupported_reason`` names why a block is not).
    ``output_router_logits=True`` keeps working, before or after the model's first forward,
    and gives UniEP's router logits (see ``HFMoELayer``). As for ``swap_moe_blocks``, every rank
    must hold the whole model and call this with the same ``group``; each keeps its share of
    every layer's experts; for training with DDP, wrap afterwards with
    ``uniep.nn.data_parallel(model)``.

    Args:
        model: an HF model (any ``nn.Module``).
        group: the process group the experts are split over (see ``uniep.moe_forward``).
        tuning: ``TuningParams`` for every swapped layer.
        strict: raise if a candidate cannot be swapped (else leave it as it is).

    Returns:
        The qualified names of the swapped blocks.

    Raises:
        ValueError: ``strict`` and a candidate is unsupported (named, with the reason), or no
            candidate was found.
    """
    found = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(getattr(module, "gate", None), nn.Module)
        and _is_hf_experts(getattr(module, "experts", None))
    ]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no HF sparse MoE block (a module with a router 'gate' "
            "and an experts module 'experts' holding gate_up_proj and down_proj)"
        )
    return replace_found(
        model,
        found,
        layer_unsupported_reason,
        lambda m: HFMoELayer.from_hf(m, group, tuning),
        strict,
    )


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with the experts of every ``HFExperts`` and ``HFMoELayer`` gathered
    from all their ranks.

    The result has the unswapped HF model's keys and shapes (``gate_up_proj`` of all ``E``
    experts), so ``save_pretrained(path, state_dict=hf_state_dict(model))`` writes a checkpoint
    plain transformers loads. Collective: every rank of every swapped module's group must call
    it; each gets the whole dict.
    """
    state = model.state_dict()
    for name, module in model.named_modules():
        if not isinstance(module, (HFExperts, HFMoELayer)) or module.world_size == 1:
            continue
        group = dist.distributed_c10d._resolve_process_group(module.group_name)
        prefix = f"{name}." if name else ""
        if isinstance(module, HFMoELayer):
            prefix += "experts."
        for key in ("gate_up_proj", "down_proj"):
            local = state[prefix + key].contiguous()
            parts = [torch.empty_like(local) for _ in range(module.world_size)]
            dist.all_gather(parts, local, group=group)
            state[prefix + key] = torch.cat(parts)
    return state
