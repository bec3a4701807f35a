"""Static activation flattening (SmoothQuant-style), folded offline into the producing op.

Used by SERQ (``serq.py``). For a linear y = W x, a per-input-channel scale
    s_k = max|x_k|^a / max_n |W_nk|^(1-a)
gives x' = x / s and W' = W diag(s) with W' x' = W x exactly; x' has flatter channels, so
per-token activation quantization loses less, and the outliers move into W' where SERQ's
correction matrix picks them up.

Linears that read one tensor share one s (max over their weights) so that 1/s can be
folded into the op producing that tensor, at no run-time cost. Llama naming
(the Hugging Face Llama layout, as SmolLM2 has it):
  q/k/v_proj  -> ``<layer>.input_layernorm.weight``           (y = norm(x) * weight)
  gate/up_proj -> ``<layer>.post_attention_layernorm.weight``
  down_proj   -> rows of ``up_proj``   (down reads act(gate) * up, linear in up's rows)
  o_proj      -> rows of ``v_proj``    (attention is linear in v per channel; with grouped-query
                 attention the o channels that read one v row get one tied scale)
A norm fold is checked numerically on a probe before it is used (Gemma-style ``1 + weight``
norms fail the check). Anything else is "runtime": the layer multiplies its input by a
stored [K] vector 1/s. Scales and transformed weights are computed in float64 on the CPU
(statistics live there) whatever device the model is on.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import torch
from torch import nn

from ..quant.stats import InputStats


def _act_magnitude(st) -> torch.Tensor:
    m = getattr(st, "max_abs", None)
    return (m if m is not None else st.mean_sq.sqrt()).to("cpu", torch.float64)


@dataclasses.dataclass
class SmoothGroup:
    """Linears reading one tensor, their shared scale ``s`` [K], and where ``1/s`` goes.

    fold: ("norm", module name) | ("rows", producer linear name) | ("runtime", "").
    row_map (for "rows"): producer output row of each input channel (identity, or the GQA map).
    """

    members: list[str]
    scale: torch.Tensor
    fold: tuple[str, str]
    row_map: Optional[torch.Tensor] = None


@dataclasses.dataclass
class SmoothPlan:
    groups: list[SmoothGroup]

    def group_of(self, name: str) -> SmoothGroup:
        for g in self.groups:
            if name in g.members:
                return g
        raise KeyError(f"SmoothPlan: no smoothing group contains {name!r}")

    def col_scale(self, name: str) -> torch.Tensor:
        return self.group_of(name).scale

    def row_scale(self, name: str) -> Optional[torch.Tensor]:
        """1/s for the rows of ``name`` when it is the producer that absorbs a consumer's flattening."""
        for g in self.groups:
            if g.fold == ("rows", name):
                n_rows = int(g.row_map.max()) + 1
                inv = torch.ones(n_rows, dtype=torch.float64)
                inv[g.row_map] = 1.0 / g.scale
                return inv
        return None

    def norm_folds(self) -> dict[str, torch.Tensor]:
        return {g.fold[1]: g.scale for g in self.groups if g.fold[0] == "norm"}


_SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
_NORM_OF = {"qkv": "input_layernorm", "gate_up": "post_attention_layernorm"}
_LEAVES = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


def _input_groups(names: list[str], stats: Mapping[str, InputStats]) -> list[list[str]]:
    """Llama naming: siblings q/k/v and gate/up read one tensor (checked on the stats)."""
    by_key: dict[tuple[str, str], list[str]] = {}
    for n in names:
        parent, _, leaf = n.rpartition(".")
        kind = _SHARED_INPUT.get(leaf)
        by_key.setdefault((parent, kind) if kind else (n, ""), []).append(n)
    groups = []
    for members in by_key.values():
        ref = stats[members[0]].mean_sq
        if all(stats[m].mean_sq.shape == ref.shape and torch.allclose(stats[m].mean_sq, ref, rtol=1e-4, atol=1e-8)
               for m in members[1:]):
            groups.append(members)
        else:  # not actually the same input: smooth separately
            groups.extend([m] for m in members)
    return groups


def _norm_folds_exactly(norm: nn.Module, s: torch.Tensor) -> bool:
    """True when ``norm`` is y = f(x) * weight (RMSNorm-like): scaling weight by 1/s scales y by 1/s."""
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor) or tuple(w.shape) != tuple(s.shape):
        return False
    probe = torch.randn(3, s.numel(), generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
    with torch.no_grad():
        before = norm(probe).double().cpu()
        saved = w.detach().clone()
        w.copy_(saved / s.to(w.device, w.dtype))
        try:
            after = norm(probe).double().cpu()
        finally:
            w.copy_(saved)
    tol = 1e-3 if w.dtype in (torch.float16, torch.bfloat16) else 1e-5
    return bool(torch.allclose(after, before / s.double(), rtol=tol, atol=tol * float(before.abs().max())))


def _gqa_row_map(model: nn.Module, K_o: int, N_v: int) -> Optional[torch.Tensor]:
    cfg = getattr(model, "config", None)
    H = getattr(cfg, "num_attention_heads", None)
    if not H:
        return torch.arange(K_o) if K_o == N_v else None
    Hkv = getattr(cfg, "num_key_value_heads", None) or H
    hd = getattr(cfg, "head_dim", None) or K_o // H
    if K_o != H * hd or N_v != Hkv * hd or H % Hkv:
        return None
    c = torch.arange(K_o)
    return (c // hd) // (H // Hkv) * hd + c % hd


def smoothing_scales(act_mag: torch.Tensor, weights: list[torch.Tensor], alpha: float,
                     row_map: Optional[torch.Tensor] = None) -> torch.Tensor:
    """s_k = max|x_k|^a / max|W_:k|^(1-a) over all ``weights`` sharing the input, float64 [K].

    With ``row_map`` the channels mapped to one producer row share one scale (maxima tied).
    """
    a = act_mag.to("cpu", torch.float64).clamp_min(1e-5)
    w = torch.stack([W.detach().to("cpu", torch.float64).abs().amax(0) for W in weights]).amax(0).clamp_min(1e-5)
    if row_map is not None:
        n = int(row_map.max()) + 1
        a = torch.zeros(n, dtype=torch.float64).scatter_reduce(0, row_map, a, "amax", include_self=False)[row_map]
        w = torch.zeros(n, dtype=torch.float64).scatter_reduce(0, row_map, w, "amax", include_self=False)[row_map]
    return (a.pow(alpha) / w.pow(1.0 - alpha)).clamp_min(1e-5)


def smooth_plan(model: nn.Module, weights: Mapping[str, torch.Tensor], stats: Mapping[str, InputStats],
                alpha: float, fold: bool = True) -> SmoothPlan:
    """Flattening scales for the linears in ``weights`` (fp, by name) and where each ``1/s`` goes.

    ``model`` supplies the structure (norm modules, attention config); it is not changed.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"smooth_plan: smooth_alpha={alpha} must lie in [0, 1]")
    names = list(weights)
    mods = dict(model.named_modules())
    groups = []
    for members in _input_groups(names, stats):
        act = torch.stack([_act_magnitude(stats[m]) for m in members]).amax(0)
        parent, _, leaf = members[0].rpartition(".")
        kind = _SHARED_INPUT.get(leaf)
        target, row_map = ("runtime", ""), None
        if fold and kind is not None:
            layer = parent.rpartition(".")[0]
            norm_name = f"{layer}.{_NORM_OF[kind]}" if layer else _NORM_OF[kind]
            siblings = [f"{parent}.{lf}" for lf in _LEAVES[kind] if f"{parent}.{lf}" in mods]
            if norm_name in mods and set(siblings) == set(members):
                s = smoothing_scales(act, [weights[m] for m in members], alpha)
                if _norm_folds_exactly(mods[norm_name], s):
                    groups.append(SmoothGroup(members, s, ("norm", norm_name)))
                    continue
        elif fold and len(members) == 1 and leaf in ("down_proj", "o_proj"):
            producer = f"{parent}.{'up_proj' if leaf == 'down_proj' else 'v_proj'}"
            if producer in weights:
                K, N_p = weights[members[0]].shape[1], weights[producer].shape[0]
                row_map = torch.arange(K) if leaf == "down_proj" and K == N_p else (
                    _gqa_row_map(model, K, N_p) if leaf == "o_proj" else None)
                if row_map is not None:
                    target = ("rows", producer)
        s = smoothing_scales(act, [weights[m] for m in members], alpha, row_map)
        groups.append(SmoothGroup(members, s, target, row_map if target[0] == "rows" else None))
    return SmoothPlan(groups)


def transformed_weight(plan: Optional[SmoothPlan], name: str, W: torch.Tensor,
                       bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(diag(row) W diag(s), row * bias) in float64 on the CPU: the weight the layer holds after folding."""
    W = W.detach().to("cpu", torch.float64)
    b = None if bias is None else bias.detach().to("cpu", torch.float64)
    if plan is None:
        return W, b
    W = W * plan.col_scale(name)[None, :]
    row = plan.row_scale(name)
    if row is not None:
        W = W * row[:, None]
        b = None if b is None else b * row
    return W, b


@torch.no_grad()
def fold_smoothing_(model: nn.Module, plan: SmoothPlan) -> nn.Module:
    """Apply ``plan`` to a full-precision model in place (nn.Linear weights, norms, producer
    rows; runtime groups are not foldable and raise). The function the model computes is unchanged."""
    for g in plan.groups:
        if g.fold[0] == "runtime":
            raise ValueError(f"fold_smoothing_: {g.members} have no producer to fold 1/s into (runtime scale)")
    mods = dict(model.named_modules())
    new = {n: transformed_weight(plan, n, mods[n].weight, mods[n].bias)
           for g in plan.groups for n in g.members + ([g.fold[1]] if g.fold[0] == "rows" else [])}
    for n, (W, b) in new.items():
        mods[n].weight.copy_(W.to(mods[n].weight.dtype))
        if b is not None:
            mods[n].bias.copy_(b.to(mods[n].bias.dtype))
    for norm, s in plan.norm_folds().items():
        w = mods[norm].weight
        w.copy_((w.double() / s.to(w.device)).to(w.dtype))
    return model


__all__ = ["SmoothGroup", "SmoothPlan", "fold_smoothing_", "smooth_plan", "smoothing_scales", "transformed_weight"]
