"""Tiny stand-ins for Megatron-core's MoE modules (Megatron-core is not a dependency).

They mirror Megatron-core's structure and parameter names (``MoELayer`` with ``config``,
``router.weight`` / ``expert_bias`` / ``local_tokens_per_expert``, ``experts`` as
``SequentialMLP`` (``local_experts.{e}.linear_fc1/linear_fc2``), ``TEGroupedMLP``
(``linear_fc1.weight{e}``) or the legacy ``GroupedMLP`` (``weight1 [H, E*2I]``), and
``shared_experts``) and compute its forward the way it does, written for clarity: a dense
``[T, E]`` routing map and probabilities, tokens permuted by expert, each expert run on its
rows, the outputs weighted and scattered back. In training the router adds Megatron's z-loss and
load-balancing losses (``aux_loss``, ``seq_aux_loss``), attached to the graph through
``AuxLossAutoScaler`` as Megatron's ``MoEAuxLossAutoScaler`` does. They are the reference the
swapped blocks are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

TOL = 1e-5


@dataclass
class Config:
    """The TransformerConfig fields the stand-ins and uniep.integrations.megatron read."""

    hidden_size: int = 16
    num_moe_experts: int = 4
    moe_ffn_hidden_size: int = 8
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_dtype: str | None = None
    moe_router_load_balancing_type: str | list[str] = "none"
    moe_aux_loss_coeff: float | list[float] = 0.0
    moe_z_loss_coeff: float | None = None
    calculate_per_token_loss: bool = False
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    gated_linear_unit: bool = True
    activation_func: Any = F.silu
    add_bias_linear: bool = False


class AuxLossAutoScaler(torch.autograd.Function):
    """Identity on ``x``; backward gives ``loss`` the gradient ``AuxLossAutoScaler.scale``, so
    the loss is minimised along with whatever loss ``x`` flows into. Megatron's training
    schedule sets the scale to ``1 / num_microbatches``."""

    scale = 1.0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return x

    @staticmethod
    def backward(ctx: Any, grad_x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (loss,) = ctx.saved_tensors
        return grad_x, torch.full_like(loss, AuxLossAutoScaler.scale)


def switch_balance_loss(scores: torch.Tensor, chosen: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch Transformer's load-balancing loss of tokens ``scores [T, E]``, ``chosen [T, E]``
    (bool): ``E * sum_e f_e * P_e``, ``f_e`` the fraction of the ``T * top_k`` choices that
    pick expert ``e``, ``P_e`` the mean score of ``e``."""
    tokens, experts = scores.shape
    f = chosen.sum(0) / (tokens * top_k)
    p = scores.mean(0)
    return experts * (f * p).sum()


class TopKRouter(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.randn(config.num_moe_experts, config.hidden_size) * 0.3)
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.randn(config.num_moe_experts) * 0.1)
            self.register_buffer("local_tokens_per_expert", torch.zeros(config.num_moe_experts))
        else:
            self.expert_bias = None
        self.aux_losses: dict[str, torch.Tensor] = {}

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states [S, B, H] (or [T, H], one sequence) -> probs [T, E] (zero off the map),
        routing_map [T, E] bool, tokens in [S, B] order."""
        c = self.config
        sequences = hidden_states.shape[1] if hidden_states.dim() == 3 else 1
        x = hidden_states.reshape(-1, c.hidden_size)
        logits = F.linear(x, self.weight)
        self.aux_losses = {}
        losses_on = self.training and torch.is_grad_enabled()
        # Megatron multiplies by the rank's token count for a per-token-summed main loss.
        per_token = x.shape[0] if c.calculate_per_token_loss else 1
        if losses_on and c.moe_z_loss_coeff:
            z_loss = (torch.logsumexp(logits, dim=-1) ** 2).mean()
            self.aux_losses["z_loss"] = z_loss.detach()
            logits = AuxLossAutoScaler.apply(logits, c.moe_z_loss_coeff * z_loss * per_token)
        if c.moe_router_score_function == "sigmoid":
            scores = torch.sigmoid(logits)
            choice = scores + self.expert_bias if self.expert_bias is not None else scores
        elif c.moe_router_pre_softmax:
            scores = choice = torch.softmax(logits, dim=-1)
        else:
            scores, choice = logits, logits
        allowed = torch.ones_like(choice, dtype=torch.bool)
        if c.moe_router_group_topk:
            groups = choice.reshape(choice.shape[0], c.moe_router_num_groups, -1)
            per_group = c.moe_router_topk // c.moe_router_group_topk
            best = groups.sort(dim=-1, descending=True).values[..., :per_group].sum(-1)
            chosen = best.argsort(dim=-1, descending=True)[:, : c.moe_router_group_topk]
            group_ok = torch.zeros_like(best, dtype=torch.bool).scatter(1, chosen, True)
            allowed = group_ok.repeat_interleave(groups.shape[-1], dim=1)
        masked = choice.masked_fill(~allowed, float("-inf"))
        order = masked.argsort(dim=-1, descending=True)[:, : c.moe_router_topk]
        routing_map = torch.zeros_like(choice, dtype=torch.bool).scatter(1, order, True)
        if c.moe_router_score_function == "softmax" and not c.moe_router_pre_softmax:
            probs = torch.softmax(scores.masked_fill(~routing_map, float("-inf")), dim=-1)
        else:
            probs = scores * routing_map
            if c.moe_router_score_function == "sigmoid" and c.moe_router_topk > 1:
                probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        if c.moe_router_topk_scaling_factor:
            probs = probs * c.moe_router_topk_scaling_factor
        if losses_on:
            probs = self._attach_balance_losses(probs, logits, sequences, per_token)
        if self.training and self.expert_bias is not None:
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(0)
        return probs * routing_map, routing_map

    def _attach_balance_losses(
        self, probs: torch.Tensor, logits: torch.Tensor, sequences: int, per_token: int
    ) -> torch.Tensor:
        c = self.config
        kinds, coeffs = c.moe_router_load_balancing_type, c.moe_aux_loss_coeff
        if isinstance(kinds, str):
            kinds, coeffs = [kinds], [coeffs]
        # Scores over all experts and a plain top-k of them, whatever the routing does.
        if c.moe_router_score_function == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)
            scores = scores / scores.sum(dim=-1, keepdim=True)
        top = scores.argsort(dim=-1, descending=True)[:, : c.moe_router_topk]
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top, True)
        for kind, coeff in zip(kinds, coeffs, strict=True):
            if coeff <= 0 or kind == "none":
                continue
            if kind == "aux_loss":
                name, loss = (
                    "load_balancing_loss",
                    switch_balance_loss(scores, chosen, c.moe_router_topk),
                )
            elif kind == "seq_aux_loss":
                seq_len = scores.shape[0] // sequences
                per_seq = [
                    switch_balance_loss(
                        scores.reshape(seq_len, sequences, -1)[:, b],
                        chosen.reshape(seq_len, sequences, -1)[:, b],
                        c.moe_router_topk,
                    )
                    for b in range(sequences)
                ]
                name, loss = "seq_load_balancing_loss", torch.stack(per_seq).mean()
            else:
                raise NotImplementedError(kind)
            self.aux_losses[name] = loss.detach()
            probs = AuxLossAutoScaler.apply(probs, coeff * loss * per_token)
        return probs


def _swiglu(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> torch.Tensor:
    """x [n, H], fc1 [2I, H] (gate rows, then up), fc2 [H, I] -> [n, H], as Megatron's glu."""
    gate, up = torch.chunk(x @ fc1.t(), 2, dim=-1)
    return (F.silu(gate) * up) @ fc2.t()


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, 2 * ffn, bias=False)
        self.linear_fc2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _swiglu(x, self.linear_fc1.weight, self.linear_fc2.weight)


class SequentialMLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        c = config
        self.local_experts = nn.ModuleList(
            MLP(c.hidden_size, c.moe_ffn_hidden_size) for _ in range(c.num_moe_experts)
        )

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        parts = x.split(tokens_per_expert)
        return torch.cat([m(p) for m, p in zip(self.local_experts, parts, strict=True)])


class GroupedLinear(nn.Module):
    """Transformer Engine's GroupedLinear: one ``weight{e} [out, in]`` per GEMM."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int) -> None:
        super().__init__()
        bound = in_features**-0.5
        for e in range(num_gemms):
            w = torch.empty(out_features, in_features).uniform_(-bound, bound)
            self.register_parameter(f"weight{e}", nn.Parameter(w))


class TEGroupedMLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        c = config
        E, H, I = c.num_moe_experts, c.hidden_size, c.moe_ffn_hidden_size  # noqa: E741
        self.linear_fc1 = GroupedLinear(E, H, 2 * I)
        self.linear_fc2 = GroupedLinear(E, I, H)

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        outs = []
        for e, p in enumerate(x.split(tokens_per_expert)):
            w1, w2 = getattr(self.linear_fc1, f"weight{e}"), getattr(self.linear_fc2, f"weight{e}")
            outs.append(_swiglu(p, w1, w2))
        return torch.cat(outs)


class GroupedMLP(nn.Module):
    """Megatron's legacy grouped-GEMM experts: flat weights viewed per expert."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        c = config
        E, H, I = c.num_moe_experts, c.hidden_size, c.moe_ffn_hidden_size  # noqa: E741
        self.num_local_experts = E
        self.weight1 = nn.Parameter(torch.randn(H, E * 2 * I) * H**-0.5)
        self.weight2 = nn.Parameter(torch.randn(E * I, H) * I**-0.5)

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        H = x.shape[-1]
        w1 = self.weight1.view(self.num_local_experts, H, -1)
        w2 = self.weight2.view(self.num_local_experts, -1, H)
        outs = []
        for e, p in enumerate(x.split(tokens_per_expert)):
            gate, up = torch.chunk(p @ w1[e], 2, dim=-1)
            outs.append((F.silu(gate) * up) @ w2[e])
        return torch.cat(outs)


class SharedExpertMLP(MLP):
    def __init__(self, config: Config) -> None:
        super().__init__(config.hidden_size, config.moe_shared_expert_intermediate_size)
        self.gate_weight = None
        if config.moe_shared_expert_gate:
            self.gate_weight = nn.Parameter(torch.randn(1, config.hidden_size) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(x, self.gate_weight))
        return out


EXPERTS = {"sequential": SequentialMLP, "te_grouped": TEGroupedMLP, "grouped": GroupedMLP}


class MoELayer(nn.Module):
    def __init__(self, config: Config, layout: str) -> None:
        super().__init__()
        self.config = config
        self.router = TopKRouter(config)
        self.experts = EXPERTS[layout](config)
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size:
            self.shared_experts = SharedExpertMLP(config)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        probs, routing_map = self.router(hidden_states)
        token_ids = [routing_map[:, e].nonzero().flatten() for e in range(routing_map.shape[1])]
        permuted = torch.cat([x[ids] for ids in token_ids])
        out_perm = self.experts(permuted, [len(ids) for ids in token_ids])
        weights = torch.cat([probs[ids, e] for e, ids in enumerate(token_ids)])
        out = torch.zeros_like(x).index_add(
            0, torch.cat(token_ids), out_perm * weights.unsqueeze(-1)
        )
        out = out.reshape(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out, None


class Layer(nn.Module):
    def __init__(self, config: Config, layout: str) -> None:
        super().__init__()
        self.linear = nn.Linear(config.hidden_size, config.hidden_size)
        self.mlp = MoELayer(config, layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(torch.tanh(self.linear(x)))[0]


class Decoder(nn.Module):
    def __init__(self, config: Config, layout: str, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(config, layout) for _ in range(layers))


class Model(nn.Module):
    """``decoder.layers.{i}.mlp`` are the MoE blocks, as in Megatron's GPTModel."""

    def __init__(self, config: Config, layout: str, layers: int = 2) -> None:
        super().__init__()
        self.decoder = Decoder(config, layout, layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.decoder.layers:
            x = layer(x)
        return x


# name -> (layout, config): each routing variant on one expert layout.
CASES: dict[str, tuple[str, Config]] = {
    "softmax-sequential": ("sequential", Config()),
    "sigmoid-grouped-topk-te_grouped": (
        "te_grouped",
        Config(
            num_moe_experts=8,
            moe_router_topk=2,
            moe_router_score_function="sigmoid",
            moe_router_num_groups=4,
            moe_router_group_topk=2,
            moe_router_topk_scaling_factor=2.5,
            moe_router_enable_expert_bias=True,
            moe_shared_expert_intermediate_size=12,
            moe_shared_expert_gate=True,
        ),
    ),
    "pre_softmax-grouped": (
        "grouped",
        Config(num_moe_experts=6, moe_router_topk=3, moe_router_pre_softmax=True),
    ),
}
# Router losses (with coefficients large enough that their gradients are far above TOL). The
# sigmoid ones route with a group limit and expert_bias, so that the loss's plain top-k differs
# from the routing's choice.
_SIGMOID = dict(
    num_moe_experts=8,
    moe_router_score_function="sigmoid",
    moe_router_num_groups=4,
    moe_router_group_topk=2,
    moe_router_enable_expert_bias=True,
)
LOSS_CASES: dict[str, tuple[str, Config]] = {
    "aux_loss-softmax": (
        "sequential",
        Config(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.5),
    ),
    "aux_loss-sigmoid": (
        "te_grouped",
        Config(**_SIGMOID, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.5),
    ),
    "seq_aux_loss-softmax": (
        "grouped",
        Config(
            num_moe_experts=6,
            moe_router_topk=3,
            moe_router_load_balancing_type="seq_aux_loss",
            moe_aux_loss_coeff=0.5,
        ),
    ),
    "seq_aux_loss-sigmoid": (
        "sequential",
        Config(**_SIGMOID, moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.5),
    ),
    "z_loss-pre_softmax": (
        "te_grouped",
        Config(num_moe_experts=6, moe_router_pre_softmax=True, moe_z_loss_coeff=0.05),
    ),
    "z_loss-sigmoid": (
        "grouped",
        Config(**_SIGMOID, moe_router_topk_scaling_factor=2.5, moe_z_loss_coeff=0.05),
    ),
    "all-softmax-per_token": (
        "sequential",
        Config(
            moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
            moe_aux_loss_coeff=[0.3, 0.6],
            moe_z_loss_coeff=0.05,
            calculate_per_token_loss=True,
        ),
    ),
    "all-sigmoid": (
        "te_grouped",
        Config(
            **_SIGMOID,
            moe_router_load_balancing_type=["seq_aux_loss", "aux_loss"],
            moe_aux_loss_coeff=[0.6, 0.3],
            moe_z_loss_coeff=0.05,
            moe_shared_expert_intermediate_size=12,
        ),
    ),
}
CASES.update(LOSS_CASES)


def make_model(case: str, seed: int = 0) -> Model:
    layout, config = CASES[case]
    torch.manual_seed(seed)
    return Model(config, layout)


def tokens(seed: int, seq: int = 5, batch: int = 3, hidden: int = 16) -> torch.Tensor:
    """Megatron's [S, B, H] activations."""
    return torch.randn(seq, batch, hidden, generator=torch.Generator().manual_seed(seed))


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return (out * torch.linspace(-1, 1, out.shape[-1])).square().mean()


def aux_losses(model: nn.Module) -> dict[str, torch.Tensor]:
    """The router losses of every MoE block's last forward, as ``{block.loss name: value}``:
    the stand-in router's ``aux_losses`` or a swapped block's."""
    from uniep.integrations.megatron import MegatronMoE

    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, MegatronMoE):
            found = module.aux_losses
        elif isinstance(module, MoELayer):
            found = module.router.aux_losses
        else:
            continue
        out.update({f"{name}.{k}": v for k, v in found.items()})
    return out


def megatron_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameter gradients under Megatron's names and layouts (a MegatronExperts' w1 / w2
    gradients in its layout, this rank's experts)."""
    from uniep.integrations.megatron import MegatronExperts

    grads: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, MegatronExperts):
            if module.w1.grad is not None:
                grads.update(module.to_megatron(module.w1.grad, module.w2.grad, f"{name}."))
            continue
        for pname, p in module.named_parameters(recurse=False):
            if p.grad is not None:
                grads[f"{name}.{pname}" if name else pname] = p.grad.clone()
    return grads


def rank_share(state: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """``state`` (all experts) as a Megatron rank of ``expert_model_parallel_size=world`` holds
    it: this rank's experts, numbered from 0."""
    out: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    for k in state:
        prefix, sep, rest = k.partition("experts.")
        if not sep or prefix.endswith("shared_"):
            continue
        for stem in ("local_experts.", "linear_fc1.weight", "linear_fc2.weight"):
            if rest.startswith(stem):
                tail = rest[len(stem) :]
                num = tail.split(".", 1)[0]
                if num.isdigit():
                    key = prefix + sep + stem
                    counts[key] = max(counts.get(key, 0), int(num) + 1)
    for k, v in state.items():
        prefix, sep, rest = k.partition("experts.")
        if sep and not prefix.endswith("shared_") and rest in ("weight1", "weight2"):
            local = v.numel() // world
            flat = v.reshape(-1)[rank * local : (rank + 1) * local]
            out[k] = (
                flat.reshape(v.shape[0] // world, -1)
                if rest == "weight2"
                else flat.reshape(v.shape[0], -1)
            )
            continue
        matched = False
        for key, n in counts.items():
            if k.startswith(key):
                tail = k[len(key) :]
                num, dot, rest2 = tail.partition(".")
                e, local = int(num), n // world
                if rank * local <= e < (rank + 1) * local:
                    out[f"{key}{e - rank * local}{dot}{rest2}"] = v
                matched = True
                break
        if not matched:
            out[k] = v
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item() if b.numel() else 0.0
    return (a - b).abs().max().item() / max(scale, 1e-30) if a.numel() else 0.0


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> list[str]:
    bad = (
        [f"{what}: keys differ: {sorted(set(got) ^ set(want))}"]
        if got.keys() != want.keys()
        else []
    )
    for k in sorted(got.keys() & want.keys()):
        if got[k].shape != want[k].shape:
            bad.append(f"{what} {k}: shape {tuple(got[k].shape)} != {tuple(want[k].shape)}")
        elif (err := rel_err(got[k].double(), want[k].double())) > TOL:
            bad.append(f"{what} {k}: rel err {err:.2e}")
    return bad
