"""AWQ: activation-aware weight quantization, folded into a Llama-style model.

Why scaling helps. A linear ``y = W x`` (``W``: N x K) is quantized group-wise with RTN:
each group's step is set by its largest weights, so every weight carries a rounding error
of the same size, about ``step / 2``, whatever the input channel. But the output error
``(Q(W) - W) x`` weighs column ``k``'s error by ``|x_k|``, and LLM activations have a few
*salient* channels whose magnitude is 10-100x the rest. AWQ multiplies column ``k`` by
``s_k > 1`` before quantizing and divides the input by ``s_k``:

    y = (W diag(s)) (diag(s)^-1 x)        exact in full precision
    y_q = Q(W diag(s)) diag(s)^-1 x        what runs after quantization

Column ``k``'s rounding error is still ~``step / 2`` on the scaled weight, so after the
``1 / s_k`` it shrinks by ``s_k`` in the output; as long as the scaled column does not set
the group's max (which would widen the step for everyone), salient channels get relatively
finer steps for free. The scale is tied to the activation statistics:

    s_k = mean|x_k| ^ alpha,    normalised by sqrt(max(s) * min(s)),    alpha in [0, 1]

``alpha`` is found by a grid search (``QuantConfig.awq_grid`` steps) minimising the layer
output error on calibration inputs. With ``R = E[x x^T]`` (collected once, exact over all
calibration tokens) the error of one linear is

    err(s) = E ||W x - Q(W diag(s)) diag(s)^-1 x||^2 = tr(E R E^T),   E = Q(W diag(s)) diag(s)^-1 - W

summed over the linears that share the input (they must share ``s``: see folding below).
``alpha = 0`` gives ``s = 1``, plain RTN, so the searched scale is never worse than RTN on
the calibration data. (llm-awq measures the error at the attention / MLP block output
instead; the per-linear objective is cheaper, exact through ``R``, and is what we test.)

Clipping. After scaling, each group's range ``[min, max]`` is shrunk by a ratio ``r`` from
``1 - awq_max_shrink * i / awq_clip_grid`` (``i = 0..awq_clip_grid``): rare outlier weights
saturate, everything else gets a finer step. ``r`` is chosen per output channel and group to
minimise the same output error ``e_n^T R' e_n`` (``R'`` the scaled inputs' second moment).
Groups of one row interact through ``R'``, so we do one exact coordinate-descent sweep:
starting from ``r = 1`` everywhere, each group in turn takes the ratio that minimises the
row's *full* error given the others (``2 d^T (R' e)_g + d^T R'_gg d`` for a change ``d``),
which can never increase it. (llm-awq picks each group independently, ignoring the cross
terms, and skips q/k; we clip every linear, since our objective is the linear's output.)

Folding. The packed "spear" format has no per-input-channel scale, so ``diag(s)^-1`` must go
into whatever produces ``x``. In a Llama decoder layer (``model.model.layers[i]``):

* q/k/v share ``input_layernorm``'s output: one ``s``; the RMSNorm weight is divided by ``s``.
* gate/up share ``post_attention_layernorm``'s output: likewise.
* down_proj's input is ``act(gate(h)) * up(h)``, linear in up's output per channel: up_proj's
  rows (and bias) are divided by ``s``.
* o_proj's input is the attention output, per head ``softmax(QK^T) V``, linear in v_proj's
  output per channel, so v_proj's rows are divided by ``s``. With grouped-query attention
  (``n_rep = heads / kv_heads > 1``) each v channel (kv head ``j``, dim ``d``) feeds the o_proj
  input channels of the ``n_rep`` query heads ``j * n_rep + r`` (HF's ``repeat_kv`` order), so
  we search one scale per *v* channel, from ``mean|x|`` averaged over those heads, and
  expand it to o_proj's columns. (llm-awq / AutoAWQ skip o_proj under GQA; we handle it.)

Then each linear's weight is multiplied by ``s`` along K and the producer divided by ``s``: the
full-precision function is unchanged (up to the rounding of the rescaled weights to the model
dtype; exact in float64), and the model is quantized with RTN using the searched clipping.
Before touching any weight the folding algebra is checked on the model itself: every norm
must scale its output by its weight, and hooks emulating the v->o and up->down folds with
random scales must leave the logits unchanged; otherwise :class:`AWQModelError` names the
part that does not match. Input statistics of all layers come from one pass of the
calibration batches through the full-precision model (AWQ also uses full-precision inputs:
the folding does not change them); they take ``8 (3 h^2 + f^2)`` bytes per layer.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Collection, Iterable, Optional, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from ..config import QuantConfig
from .format import QuantFormatError, QuantizedWeight
from .stats import collect_input_stats
from .rtn import quantize_rtn, rtn_params, rtn_round, weight_groups


class AWQModelError(ValueError):
    """The model does not have the Llama layout (or algebra) that AWQ's scale folding needs."""


# ----------------------------------------------------------------------------- math on one group of linears


def fake_quantize(weight: torch.Tensor, cfg: QuantConfig, out_dtype: torch.dtype,
                  clip: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RTN quantize-dequantize of ``weight`` [N, K] exactly as :func:`quantize_rtn` stores it (fp32 out)."""
    N, K = weight.shape
    G = cfg.group_size or K
    w = weight.detach().to(torch.float32).reshape(N, K // G, G)
    s, z = rtn_params(w, cfg.symmetric, out_dtype, clip)
    return ((rtn_round(w, s, z) - z.unsqueeze(-1)) * s.unsqueeze(-1)).reshape(N, K)


def output_error(weight: torch.Tensor, approx: torch.Tensor, rxx: torch.Tensor) -> torch.Tensor:
    """Per output channel ``E ||(approx - weight) x||^2 = diag(E R E^T)`` for ``R = E[x x^T]`` (float64)."""
    E = approx.double() - weight.double()
    return ((E @ rxx.double()) * E).sum(-1)


def awq_scale(act_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s = mean|x| ^ alpha``, clamped at 1e-4, normalised so ``max(s) * min(s) = 1`` (float64)."""
    s = act_abs.double().pow(alpha).clamp_min(1e-4)
    return s / (s.max() * s.min()).sqrt()


def _check_stats(K: int, act_abs: torch.Tensor, rxx: torch.Tensor, where: str) -> None:
    if tuple(act_abs.shape) != (K,):
        raise QuantFormatError(f"{where}: activation statistic has shape {tuple(act_abs.shape)}, expected ({K},)")
    if tuple(rxx.shape) != (K, K):
        raise QuantFormatError(f"{where}: E[x x^T] has shape {tuple(rxx.shape)}, expected ({K}, {K})")


@torch.no_grad()
def search_scale(weights: Sequence[torch.Tensor], act_abs: torch.Tensor, rxx: torch.Tensor, cfg: QuantConfig,
                 out_dtype: Optional[torch.dtype] = None,
                 expand: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 where: str = "weight") -> tuple[torch.Tensor, float, list[float]]:
    """Grid-search alpha for linears ``weights`` (each [N_i, K]) that share one input.

    ``act_abs`` is ``E|x_k|`` and ``rxx`` is ``E[x x^T]`` of that input. ``reduce`` maps a
    K-vector to the producer's channels and ``expand`` back (o_proj under GQA); both default
    to the identity. Returns ``(s, alpha, errors)``: ``s`` in the producer's channels (float64),
    the best alpha, and the summed output error for every alpha tried.
    """
    if not weights:
        raise ValueError(f"{where}: search_scale needs at least one weight")
    K = weights[0].shape[1]
    for W in weights:
        if W.dim() != 2 or W.shape[1] != K:
            raise QuantFormatError(f"{where}: weights sharing an input must all be [N, {K}], got {tuple(W.shape)}")
    _check_stats(K, act_abs, rxx, where)
    out_dtype = out_dtype or weights[0].dtype
    a = act_abs.double().cpu()
    a = reduce(a) if reduce is not None else a
    # NOTE: fp32 products: they only rank the alphas, and the N*K^2 product per alpha
    # dominates the search: SmolLM2's down_proj (576x1536 @ 1536x1536) takes 44 ms in fp32
    # vs 95 ms in fp64 (best of 15, 2 threads of the shared dev CPU).
    R = rxx.float().cpu()
    Ws = [W.detach().float().cpu() for W in weights]
    best: Optional[tuple[float, float, torch.Tensor]] = None
    errors = []
    for i in range(cfg.awq_grid + 1):
        alpha = i / cfg.awq_grid
        s_prev = awq_scale(a, alpha)
        s = (expand(s_prev) if expand is not None else s_prev).float()
        err = 0.0
        for W in Ws:
            E = fake_quantize(W * s, cfg, out_dtype) / s - W
            err += float(((E @ R) * E).sum(dtype=torch.float64))
        errors.append(err)
        if best is None or err < best[0]:
            best = (err, alpha, s_prev)
    assert best is not None
    return best[2], best[1], errors


@torch.no_grad()
def search_clip(weight: torch.Tensor, rxx: torch.Tensor, cfg: QuantConfig, out_dtype: Optional[torch.dtype] = None,
                where: str = "weight") -> torch.Tensor:
    """Per (output channel, group) range ratios ``[N, K // G]`` (float32) for :func:`quantize_rtn`'s ``clip``.

    One exact coordinate-descent sweep over the groups (see the module docstring): the
    output error ``tr(E R E^T)`` of the returned clipping is never above that of ``r = 1``.
    """
    N, K, G = weight_groups(weight, cfg, where)
    if tuple(rxx.shape) != (K, K):
        raise QuantFormatError(f"{where}: E[x x^T] has shape {tuple(rxx.shape)}, expected ({K}, {K})")
    ng = K // G
    if cfg.awq_clip_grid == 0:
        return torch.ones(N, ng)
    out_dtype = out_dtype or weight.dtype
    ratios = torch.tensor([1.0 - cfg.awq_max_shrink * i / cfg.awq_clip_grid for i in range(cfg.awq_clip_grid + 1)])
    C = len(ratios)
    W = weight.detach().double().cpu()
    R = rxx.double().cpu()
    R32 = R.float()
    W3 = W.reshape(N, ng, G)
    cur = fake_quantize(W, cfg, out_dtype).double().reshape(N, ng, G)  # r = 1 everywhere
    U = (cur - W3).reshape(N, K) @ R  # (E R) rows: the gradient of each row's error / 2
    choice = torch.zeros(N, ng, dtype=torch.long)
    rows = torch.arange(N)
    for g in range(ng):
        sl = slice(g * G, (g + 1) * G)
        wg = W3[:, g:g + 1, :].expand(N, C, G).float()
        s, z = rtn_params(wg, cfg.symmetric, out_dtype, ratios.expand(N, C))
        cand = (rtn_round(wg, s, z) - z.unsqueeze(-1)) * s.unsqueeze(-1)  # [N, C, G]
        # Rank the candidates in fp32 (the C*N*G*G products dominate; per-channel down_proj of
        # SmolLM2 is C*576*1536^2), then confirm the winner's change in fp64: a rounding slip can
        # at worst keep the current ratio, never increase the error.
        delta = cand - cur[:, g:g + 1, :].float()  # candidate 0 is r = 1, the current value: delta 0
        change = 2 * (delta * U[:, None, sl].float()).sum(-1) + ((delta @ R32[sl, sl]) * delta).sum(-1)  # [N, C]
        best = change.argmin(1)
        d = cand[rows, best].double() - cur[:, g, :]  # [N, G]
        exact = 2 * (d * U[:, sl]).sum(-1) + ((d @ R[sl, sl]) * d).sum(-1)
        keep = exact > 0
        best[keep] = 0
        d[keep] = 0.0
        cur[:, g, :] += d
        if g + 1 < ng:
            U += d @ R[sl, :]
        choice[:, g] = best
    return ratios[choice].float()


@torch.no_grad()
def awq_quantize(weight: torch.Tensor, act_abs: torch.Tensor, rxx: torch.Tensor, cfg: QuantConfig,
                 out_dtype: Optional[torch.dtype] = None,
                 where: str = "weight") -> tuple[QuantizedWeight, torch.Tensor]:
    """AWQ for one linear: returns ``(Q(W diag(s)), s)``; the caller must divide its input by ``s``.

    The effective weight is ``qw.dequantize() / s`` (what :func:`apply_awq_` realises by
    folding ``1 / s`` into the producer of the input).
    """
    out_dtype = out_dtype or weight.dtype
    s, _, _ = search_scale([weight], act_abs, rxx, cfg, out_dtype, where=where)
    Ws = weight.detach().double().cpu() * s
    clip = search_clip(Ws, rxx.double().cpu() / torch.outer(s, s), cfg, out_dtype, where=where)
    return quantize_rtn(Ws.float(), cfg, out_dtype, where=where, clip=clip), s


# ----------------------------------------------------------------------------- Llama-style models


@dataclasses.dataclass
class ScaleGroup:
    """Linears that read one producer's output, so they share one AWQ scale."""

    name: str  # e.g. "model.layers.3.self_attn.qkv"
    prev_name: str
    prev: nn.Module  # an RMSNorm (kind "norm") or a linear whose rows are scaled (kind "linear")
    prev_kind: str
    linears: list[tuple[str, nn.Linear]]
    n_rep: int = 1  # o_proj under GQA: each producer channel feeds n_rep query heads
    head_dim: int = 0

    def expand(self, s: torch.Tensor) -> torch.Tensor:
        """Producer channels -> the linears' input channels (repeat over query heads)."""
        if self.n_rep == 1:
            return s
        kv = s.numel() // self.head_dim
        return s.reshape(kv, 1, self.head_dim).expand(kv, self.n_rep, self.head_dim).reshape(-1)

    def reduce(self, a: torch.Tensor) -> torch.Tensor:
        """Input channels -> producer channels (mean over the heads that share a kv head)."""
        if self.n_rep == 1:
            return a
        return a.reshape(-1, self.n_rep, self.head_dim).mean(1).reshape(-1)

    @torch.no_grad()
    def fold_(self, s: torch.Tensor) -> None:
        """Multiply the linears' columns by ``expand(s)``, divide the producer's output by ``s``."""
        s_in = self.expand(s)
        for _, lin in self.linears:
            w = lin.weight
            w.copy_((w.double() * s_in.to(w.device)).to(w.dtype))
        p = self.prev
        sp = s.to(p.weight.device)
        if self.prev_kind == "norm":
            p.weight.copy_((p.weight.double() / sp).to(p.weight.dtype))
            if getattr(p, "bias", None) is not None:
                p.bias.copy_((p.bias.double() / sp).to(p.bias.dtype))
        else:
            p.weight.copy_((p.weight.double() / sp[:, None]).to(p.weight.dtype))
            if p.bias is not None:
                p.bias.copy_((p.bias.double() / sp).to(p.bias.dtype))


_LAYER_PARTS = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def llama_scale_groups(model: nn.Module) -> list[list[ScaleGroup]]:
    """The four scale groups of every decoder layer of a Llama-style model, outermost checks first.

    Accepts a ``*ForCausalLM`` (``model.model.layers``) or the bare decoder (``model.layers``).
    Raises :class:`AWQModelError` naming the first missing or mismatched part.
    """
    inner = getattr(model, "model", None)
    if isinstance(inner, nn.Module) and isinstance(getattr(inner, "layers", None), nn.ModuleList):
        layers, prefix = inner.layers, "model.layers"
    elif isinstance(getattr(model, "layers", None), nn.ModuleList):
        layers, prefix = model.layers, "layers"
    else:
        raise AWQModelError(
            f"AWQ needs a Llama-style model: {type(model).__name__} has no model.model.layers (nn.ModuleList of "
            f"decoder layers with {', '.join(_LAYER_PARTS)})")
    if len(layers) == 0:
        raise AWQModelError(f"AWQ: {prefix} of {type(model).__name__} is empty")
    out = []
    for i, layer in enumerate(layers):
        lp = f"{prefix}.{i}"
        mods = {}
        for part in _LAYER_PARTS:
            try:
                mods[part] = layer.get_submodule(part)
            except AttributeError:
                raise AWQModelError(f"AWQ needs a Llama-style model: {lp}.{part} is missing "
                                    f"({type(layer).__name__} must have {', '.join(_LAYER_PARTS)})") from None
            m = mods[part]
            if part.endswith("_proj"):
                if type(m) is not nn.Linear:
                    raise AWQModelError(f"AWQ: {lp}.{part} is a {type(m).__name__}, expected nn.Linear "
                                        f"(is the model already quantized?)")
            else:
                w = getattr(m, "weight", None)
                if not isinstance(w, torch.Tensor) or w.dim() != 1:
                    raise AWQModelError(f"AWQ: {lp}.{part} ({type(m).__name__}) has no 1-D weight to fold scales into")
        norm1, norm2 = mods["input_layernorm"], mods["post_attention_layernorm"]
        q, k, v, o = (mods[f"self_attn.{n}_proj"] for n in "qkvo")
        gate, up, down = (mods[f"mlp.{n}_proj"] for n in ("gate", "up", "down"))
        hidden = norm1.weight.numel()
        for part, lin in (("self_attn.q_proj", q), ("self_attn.k_proj", k), ("self_attn.v_proj", v),
                          ("mlp.gate_proj", gate), ("mlp.up_proj", up)):
            norm = norm1 if part.startswith("self_attn") else norm2
            if lin.in_features != norm.weight.numel() or norm.weight.numel() != hidden:
                raise AWQModelError(f"AWQ: {lp}.{part} has in_features={lin.in_features} but its norm has "
                                    f"{norm.weight.numel()} channels")
        if down.in_features != up.out_features:
            raise AWQModelError(f"AWQ: {lp}.mlp.down_proj in_features={down.in_features} != "
                                f"up_proj out_features={up.out_features}")
        attn = layer.get_submodule("self_attn")
        head_dim = getattr(attn, "head_dim", None)
        if head_dim is None:
            cfg = getattr(attn, "config", None)
            heads = getattr(cfg, "num_attention_heads", None)
            head_dim = getattr(cfg, "head_dim", None) or (hidden // heads if heads else None)
        if not head_dim or v.out_features % head_dim or o.in_features % v.out_features:
            raise AWQModelError(f"AWQ: {lp}.self_attn: cannot map o_proj in_features={o.in_features} onto "
                                f"v_proj out_features={v.out_features} with head_dim={head_dim}")
        n_rep = o.in_features // v.out_features
        sa, ml = f"{lp}.self_attn", f"{lp}.mlp"
        out.append([
            ScaleGroup(f"{sa}.qkv", f"{lp}.input_layernorm", norm1, "norm",
                       [(f"{sa}.q_proj", q), (f"{sa}.k_proj", k), (f"{sa}.v_proj", v)]),
            ScaleGroup(f"{sa}.o_proj", f"{sa}.v_proj", v, "linear", [(f"{sa}.o_proj", o)], n_rep, head_dim),
            ScaleGroup(f"{ml}.gate_up", f"{lp}.post_attention_layernorm", norm2, "norm",
                       [(f"{ml}.gate_proj", gate), (f"{ml}.up_proj", up)]),
            ScaleGroup(f"{ml}.down_proj", f"{ml}.up_proj", up, "linear", [(f"{ml}.down_proj", down)]),
        ])
    return out


def _logits(out) -> torch.Tensor:
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2


@torch.no_grad()
def check_foldable(model: nn.Module, groups: list[list[ScaleGroup]], batch: torch.Tensor) -> None:
    """Check, without changing any weight, that folding is exact for this model; raise :class:`AWQModelError`.

    Norms: on a copy, scaling the weight by ``c`` must scale the output by ``c``. Linear
    producers: forward hooks divide v_proj / up_proj outputs by random ``c`` and multiply
    the o_proj / down_proj inputs by ``expand(c)``; the logits must not move.
    """
    gen = torch.Generator().manual_seed(0)
    for layer in groups:
        for g in layer:
            if g.prev_kind != "norm":
                continue
            w = g.prev.weight
            n = copy.deepcopy(g.prev)
            x = torch.randn(3, w.numel(), generator=gen).to(w.device, w.dtype)
            c = torch.exp(0.5 * torch.randn(w.numel(), generator=gen)).to(w.device)
            y0 = n(x)
            n.weight.mul_(c.to(w.dtype))
            if getattr(n, "bias", None) is not None:
                n.bias.mul_(c.to(w.dtype))
            y1 = n(x)
            if _rel_diff(y1, y0 * c) > _tolerance(w.dtype):
                raise AWQModelError(f"AWQ: {g.prev_name} ({type(g.prev).__name__}) does not compute "
                                    f"normalize(x) * weight, so 1/s cannot be folded into it (e.g. Gemma's "
                                    f"(1 + weight) norms are not supported)")
    ref = _logits(model(batch))
    tol = _tolerance(ref.dtype)
    for what, idx in (("v_proj -> o_proj (attention output must be linear in v per channel, GQA heads "
                       "repeated kv-major as in HF repeat_kv)", 1),
                      ("up_proj -> down_proj (down_proj input must be act(gate_proj(h)) * up_proj(h))", 3)):
        handles = []
        try:
            for layer in groups:
                g = layer[idx]
                c = torch.exp(0.5 * torch.randn(g.prev.out_features, generator=gen))
                cp, ci = c.to(g.prev.weight.device), g.expand(c).to(g.prev.weight.device)
                handles.append(g.prev.register_forward_hook(lambda m, a, y, cp=cp: y / cp.to(y.dtype)))
                handles.append(g.linears[0][1].register_forward_pre_hook(
                    lambda m, a, ci=ci: (a[0] * ci.to(a[0].dtype),) + tuple(a[1:])))
            got = _logits(model(batch))
        finally:
            for h in handles:
                h.remove()
        err = _rel_diff(got, ref)
        if not err <= tol:
            raise AWQModelError(f"AWQ: folding {what} changes the output of {type(model).__name__} by {err:.2e} "
                                f"(relative; tolerance {tol:g}); this architecture is not Llama-like there")


@dataclasses.dataclass
class AWQResult:
    """What :func:`apply_awq_` did: per scale group (e.g. ``model.layers.3.mlp.gate_up``) the alpha
    and the scale ``s`` (float64, in the producer's channels), per linear the clip ratios."""

    alphas: dict[str, float]
    scales: dict[str, torch.Tensor]
    clips: dict[str, torch.Tensor]


@torch.no_grad()
def apply_awq_(model: nn.Module, calib: Iterable[torch.Tensor], cfg: QuantConfig,
               targets: Optional[Collection[str]] = None, progress: bool = True) -> AWQResult:
    """Search AWQ scales and clipping for a Llama-style model and fold the scales in, in place.

    ``calib``: input batches for ``model``. ``targets``: fully qualified names of the linears
    that will be quantized (default: all q/k/v/o/gate/up/down); a group with no target is
    left alone, and non-target members of a group are scaled (to keep the function exact)
    but not searched over. The model stays full precision and computes the same function;
    quantize each target afterwards with ``quantize_rtn(weight, cfg, clip=result.clips[fqn])``
    (``quantize_(model, QuantConfig(method="awq"), calib=...)`` does all of this).
    """
    groups = llama_scale_groups(model)
    calib = list(calib)
    if not calib:
        raise ValueError("apply_awq_: calib is empty; AWQ needs input batches for the model")
    was_training = model.training
    model.eval()  # dropout would break the exactness checks and the statistics
    try:
        return _apply_awq(model, groups, calib, cfg, targets, progress)
    finally:
        model.train(was_training)


def _apply_awq(model: nn.Module, groups: list[list[ScaleGroup]], calib: list, cfg: QuantConfig,
               targets: Optional[Collection[str]], progress: bool) -> AWQResult:
    all_names = {n for layer in groups for g in layer for n, _ in g.linears}
    targets = all_names if targets is None else set(targets) & all_names
    G = cfg.group_size
    for layer in groups:
        for g in layer:
            for n, lin in g.linears:
                K = lin.in_features
                if n in targets and (K % (G or K) or K % 2):
                    raise QuantFormatError(f"{n}: in_features K={K} must be even and divisible by group_size={G or K}")
    probe = calib[0][:1] if isinstance(calib[0], torch.Tensor) else calib[0]
    check_foldable(model, groups, probe)
    ref = _logits(model(probe))
    if ref.dtype not in (torch.float32, torch.float64):
        ref = None  # half precision: rounding the rescaled weights moves logits by more than a bug check could tell
    active = [[g for g in layer if any(n in targets for n, _ in g.linears)] for layer in groups]
    reps = [g.linears[0][0] for layer in active for g in layer]
    stats = collect_input_stats(model, calib, names=reps, full=True, module_type=nn.Linear)
    res = AWQResult({}, {}, {})
    for layer in tqdm(active, desc=f"awq search g{cfg.group_size or 'ch'}", disable=not progress, leave=False):
        found = []
        for g in layer:  # search every group on the unfolded weights (folds in one layer do not interact)
            st = stats.pop(g.linears[0][0])
            if st.n == 0:
                raise ValueError(f"apply_awq_: {g.linears[0][0]} saw no calibration input")
            ws = [lin.weight for n, lin in g.linears if n in targets]
            s, alpha, _ = search_scale(ws, st.mean_abs, st.rxx, cfg, ws[0].dtype, g.expand, g.reduce, where=g.name)
            found.append((g, s, st.rxx))
            res.alphas[g.name], res.scales[g.name] = alpha, s
        for g, s, _ in found:
            g.fold_(s)
        for g, s, rxx in found:
            s_in = g.expand(s)
            r_scaled = rxx / torch.outer(s_in, s_in)  # E[x x^T] of the folded input x / s
            for n, lin in g.linears:
                if n in targets:
                    res.clips[n] = search_clip(lin.weight, r_scaled, cfg, lin.weight.dtype, where=n)
    if ref is not None:
        err = _rel_diff(_logits(model(probe)), ref)
        if not err <= _tolerance(ref.dtype):
            raise AWQModelError(f"AWQ: folding changed the full-precision output of {type(model).__name__} by "
                                f"{err:.2e} (relative); this is a bug, the model has been modified")
    return res


@torch.no_grad()
def fold_awq_(model: nn.Module, scales: dict[str, torch.Tensor]) -> nn.Module:
    """Fold scales found by :func:`apply_awq_` (``AWQResult.scales``) into another copy of the fp model.

    Gives the full-precision reference *in the quantized model's coordinates*: same function
    as the original, and each linear's weight and input are the ones its quantized twin
    approximates (``W diag(s)``, ``x / s``). Weight-error based initialisations (LoRC, LQER,
    QERA, SPEAR's EC init) and per-linear input statistics need this model, not the
    unfolded one, when the quantized model came from AWQ. Bitwise the same weights as
    ``quantize_(method="awq")`` produced before quantizing. Returns ``model``.
    """
    groups = {g.name: g for layer in llama_scale_groups(model) for g in layer}
    for name, s in scales.items():
        g = groups.get(name)
        if g is None:
            raise AWQModelError(f"fold_awq_: {name!r} is not a scale group of {type(model).__name__}")
        if s.numel() != g.prev.weight.shape[0]:
            raise AWQModelError(f"fold_awq_: scale for {name} has {s.numel()} entries, {g.prev_name} has "
                                f"{g.prev.weight.shape[0]} output channels")
        g.fold_(s.double())
    return model
