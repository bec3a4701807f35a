"""SERQ baseline: static activation flattening + ONE saliency-aware correction matrix (W4A16/W4A8/W4A4).

Paper: Park, Kim, Choi, "SERQ: Saliency-Aware Low-Rank Error Reconstruction for LLM
Quantization", ICLR 2026 (arXiv:2603.08185); code github.com/acalabys/SERQ (read at 23da465).
A baseline for the static compensators and SPEAR: it does not use the EC op.

For a linear ``y = W x`` (W: N x K), everything below happens offline except one extra
small GEMM ``R x'_S``:

1. Static activation flattening (SmoothQuant-style). Per input channel
       s_k = max|x_k|^a / max_n |W_nk|^(1-a)            (a = ``smooth_alpha``)
   and ``x' = x / s``, ``W' = W diag(s)``, so ``W' x' = W x`` exactly. Linears that read the
   same tensor (q/k/v, gate/up) share one ``s`` (max over their weights), so ``1/s`` folds
   into the producer: the RMSNorm weight (q/k/v, gate/up), the rows of ``up_proj``
   (down_proj) and the rows of ``v_proj`` (o_proj; with grouped-query attention the
   o_proj channels that read the same v row get one tied scale). Folding is checked
   numerically; where no producer can absorb ``1/s`` the layer multiplies its input by a
   stored ``[K]`` vector at run time (reported as ``extra_bytes``). See ``flatten.py``.
2. ``W'`` is quantized again (RTN with the q-model's settings, or GPTQ with the smoothed
   Hessian ``E[x' x'^T]``): error ``E = W' - Q(W')``.
3. Saliency-aware error reconstruction with a single matrix ``R`` (N x k) on k salient
   input channels S:   ``y = Q(W') x' + R x'_S``.   The output error is ``(E - R P_S) x'``
   (P_S picks the rows S). With ``Σ = E[x' x'^T]`` from the calibration inputs,
       J(R) = E||E x' - R x'_S||^2 = tr(E Σ E^T) - 2 tr(R Σ_{S,:} E^T) + tr(R Σ_SS R^T),
   a convex quadratic whose normal equations ``R Σ_SS = E Σ_{:,S}`` give
       R* = E Σ[:, S] Σ[S, S]^{-1}                    (``solve="lsq"``, default)
   (``Σ_SS`` gets a ``damp * mean diag`` ridge for conditioning). R* also cancels the part
   of the other channels' error that is correlated with x_S; with k = K it is E itself and
   the weight error vanishes. Channel choice (``saliency``):
     "greedy" (default): forward stepwise selection on J itself: add the channel whose
        conditional gain ||E Σ_{:,j|S}||^2 / Σ_{jj|S} is largest (exact J decrease, O(N K) a step);
     "error": diagonal score Σ_kk ||E[:, k]||^2;   "act": largest max|x_k| (the released code).
4. Offline permutation: with S moved to the front of K (weight columns and producer
   outputs), ``x'_S`` is the contiguous slice ``x'[..., :k]``; the other channels keep
   their order (``permute="salient"``) or follow by decreasing flattened magnitude
   ("sorted", like the release). Eagerly we keep ``idx`` / ``perm`` and gather, which is
   numerically identical; a permuting deployment stores no index, so none is counted.
   The order only changes numbers when activations are quantized in channel groups, and
   there it cost accuracy (NOTE below), so the default (``permute=None``) keeps the
   original order and gathers the k salient channels.
5. Activations (``act_bits`` 8 or 4): ``x'`` is fake-quantized, symmetric, per token or per
   ``act_group_size`` channels of the permuted order (``quant/actquant.py``), before the
   4-bit GEMM. The correction path reads the same quantized ``x'`` (``correction_act="same"``,
   as the released code does), or the salient channels at higher precision: ``"int8"``
   (their own per-token int8) or ``"fp"``.

What the paper's released code does differently (and what we do instead):
  * flattening there is ``s = max|x|`` (weight-independent: our formula with a = 1) applied
    at run time (``x / s`` then ``x[..., order]`` in a pre-hook); we fold where possible.
  * salient channels there are the 128 with the largest ``max|x|``, a fixed count; we fit
    k to a byte budget and default to the greedy J-optimal choice ("act" reproduces theirs).
  * their R is not a least-squares fit: R = 4-bit per-row quantization of ``W'[:, S]`` and the
    residual ``W'[:, S] - R`` is written back into the main weight before it is quantized
    (a two-level quantization of the salient columns). ``solve="paper"`` does exactly that
    (R on a per-row int4 grid, counted as N*k/2 + 2N bytes); "lsq" is the default here.
  * activations there are per-group(128) int or MXFP4 (group 32) over the permuted order;
    ours are per-token int by default, per-group with ``act_group_size``.
  * R is stored in fp16 here (``r_dtype``), counted as 2*N*k bytes.
The LS objective only sees the weight error: the activation-quantization error
``Q(W')(x' - x'_q)`` is reduced by flattening, not by R.

NOTE (SmolLM2-135M on CPU, per-channel RTN W4, 1 % budget -> k = 8 on every linear;
statistics from 4096 tokens of The Tempest, perplexity on 4096 tokens of Hamlet in
512-token windows; fp 42.6, W4A16 71.8). W4A16: greedy-lsq without flattening 52.4
(QERA-exact at the same budget, r = 4: 52.7),
"act" saliency 58.0, "columns" 60.2, with smooth_alpha=0.5 60.6, alpha=0.5 + "error"
saliency 65.9, the release's recipe (alpha=1, "act", "paper", k=30) 84.3 (worse than
plain). W4A8 per token: plain 74.4, alpha=0.5 61.2, no flattening 54.5. W4A4 per token:
plain 7230, flattening alone 1312, SERQ 1060 (per-token int4 breaks this model).
W4A4 per group of 32: plain 130.6, flattening alone 118.1, SERQ alpha=0.5 86.6 with
permute=None vs 92.3 "salient" and 93.7 "sorted"; no flattening 87.8, alpha=1 "paper" 135.8.
Single runs on 4096 tokens: a few points either way is within noise. So flattening helped
only with per-token 4-bit activations (a wash at group 32, a loss at A16/A8), and permuting
before group-wise activation quantization hurt; ``smooth_alpha=0.5`` stays the default (it
is SERQ's stage 1), pass ``None`` for W4A16/W4A8 comparisons.

Statistics: ``collect_input_stats(ref, batches, names, module_type=nn.Linear, full=True)`` gives
Σ (as ``rxx``) on the *unsmoothed* fp inputs; smoothing maps it to ``Σ / (s s^T)``.
``collect_serq_stats`` is the same pass plus per-channel ``max|x|`` (``max_abs``); without
``max_abs``, flattening uses ``sqrt(E[x^2])`` as the channel magnitude.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Optional, Union

import torch
from torch import nn

from ..config import QuantConfig
from ..quant.actquant import check_act_bits, check_act_group, fake_quant_activation
from ..quant.format import QuantFormatError, QuantizedWeight
from ..quant.gptq import quantize_gptq
from ..quant.linear import QuantLinear
from ..quant.rtn import quantize_rtn
from .flatten import (  # noqa: F401  (re-exported: the flattening half of SERQ)
    SmoothGroup, SmoothPlan, _act_magnitude, fold_smoothing_, smooth_plan, smoothing_scales, transformed_weight,
)
from ..quant.stats import InputStats, collect_input_stats

SALIENCY = ("greedy", "error", "act")
SOLVES = ("lsq", "columns", "paper")
CORRECTION_ACTS = ("same", "int8", "fp")
PERMUTES = ("salient", "sorted", None)


# ----------------------------------------------------------------------------- statistics
@dataclasses.dataclass
class SERQStats(InputStats):
    """``InputStats`` (always full) plus the per-channel running ``max|x|``."""

    max_abs: Optional[torch.Tensor] = None

    def update(self, x: torch.Tensor, full: bool = True) -> None:
        super().update(x, full)
        m = x.detach().reshape(-1, x.shape[-1]).abs().amax(0).to(torch.float32)
        self.max_abs = m if self.max_abs is None else torch.maximum(self.max_abs, m)


@torch.no_grad()
def collect_serq_stats(model: nn.Module, batches: Iterable[torch.Tensor], names: Optional[list[str]] = None,
                       module_type: type = nn.Linear) -> dict[str, SERQStats]:
    """Like ``collect_input_stats(..., full=True)`` plus ``max_abs``; run it on the fp model."""
    return collect_input_stats(model, batches, names, full=True, module_type=module_type, stats_type=SERQStats)


# ----------------------------------------------------------------------------- the correction
def serq_output_error(err: torch.Tensor, R: torch.Tensor, idx: torch.Tensor, rxx: torch.Tensor,
                      err_rxx: Optional[torch.Tensor] = None) -> float:
    """J = E||(err - R P_S) x||^2 = tr(D Σ D^T), D = err minus R on the columns idx.

    ``err_rxx`` (= err @ rxx, if already computed) makes it O(N K) instead of O(N K^2):
    J = <err Σ, err> - 2 <R, (err Σ)[:, S]> + <R Σ_SS, R>.
    """
    E, S, R = err.to(torch.float64), rxx.to(torch.float64), R.to(torch.float64)
    if err_rxx is None:
        D = E.clone()
        if idx.numel():
            D[:, idx] -= R
        return float(((D @ S) * D).sum())
    C = err_rxx.to(torch.float64)
    J = (C * E).sum()
    if idx.numel():
        J = J - 2 * (R * C[:, idx]).sum() + ((R @ S[idx][:, idx]) * R).sum()
    return float(J)


def _check_problem(err_shape, rxx: torch.Tensor, k: int, name: str) -> None:
    N, K = err_shape
    if tuple(rxx.shape) != (K, K):
        raise ValueError(f"{name}: input autocorrelation rxx has shape {tuple(rxx.shape)}, expected ({K}, {K}) "
                         f"for a weight of shape ({N}, {K})")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"{name}: k must be a non-negative int, got {k!r}")
    if k > K:
        raise ValueError(f"{name}: k={k} salient channels exceeds in_features K={K}")


def select_salient(err: torch.Tensor, rxx: torch.Tensor, k: int, saliency: str = "greedy",
                   act_mag: Optional[torch.Tensor] = None, name: str = "serq",
                   err_rxx: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Indices (LongTensor [k]) of the k salient input channels, most salient first.

    ``err_rxx`` = err @ rxx if the caller has it (saves the O(N K^2) product)."""
    _check_problem(tuple(err.shape), rxx, k, name)
    if saliency not in SALIENCY:
        raise ValueError(f"{name}: saliency {saliency!r}; expected one of {SALIENCY}")
    K = err.shape[1]
    if k == 0:
        return torch.zeros(0, dtype=torch.long)
    E = err.to(torch.float64)
    S = rxx.to(torch.float64)
    if saliency == "act":
        if act_mag is None or tuple(act_mag.shape) != (K,):
            raise ValueError(f"{name}: saliency='act' needs act_mag of shape ({K},)")
        return torch.argsort(act_mag.to(torch.float64), descending=True)[:k]
    if saliency == "error":
        return torch.argsort(torch.diagonal(S) * (E * E).sum(0), descending=True)[:k]
    # greedy forward selection on J: keep the error-input covariance and the input variances
    # conditioned on the chosen channels (Gram-Schmidt in the Σ inner product).
    cov = (E @ S if err_rxx is None else err_rxx.to(torch.float64).clone())  # N x K: Cov(E x, x_j | S)
    var = torch.diagonal(S).clone()               # Var(x_j | S)
    tiny = 1e-12 * float(var.max().clamp_min(1e-300))
    basis = torch.zeros(K, k, dtype=torch.float64)  # normalised conditional covariance columns
    chosen = torch.zeros(K, dtype=torch.bool)
    out: list[int] = []
    for t in range(k):
        gain = (cov * cov).sum(0) / var.clamp_min(tiny)
        gain[chosen | (var <= tiny)] = -1.0
        j = int(torch.argmax(gain))
        if gain[j] < 0:  # the remaining channels are (numerically) linear in the chosen ones
            rest = torch.nonzero(~chosen).flatten()
            out.extend(rest[torch.argsort(torch.diagonal(S)[rest], descending=True)][:k - len(out)].tolist())
            break
        v = S[:, j] - basis[:, :t] @ basis[j, :t]    # Cov(x, x_j | S)
        root = v[j].clamp_min(tiny).sqrt()
        b = v / root
        cov -= (cov[:, j] / root)[:, None] * b[None, :]
        var -= b * b
        basis[:, t] = b
        chosen[j] = True
        out.append(j)
    return torch.tensor(out, dtype=torch.long)


def lsq_correction(err: torch.Tensor, rxx: torch.Tensor, idx: torch.Tensor, damp: float = 1e-6) -> torch.Tensor:
    """R* = err Σ[:, idx] (Σ[idx, idx] + λ I)^{-1}, λ = damp * mean diag: the minimiser of J over R."""
    E, S = err.to(torch.float64), rxx.to(torch.float64)
    k = idx.numel()
    if k == 0:
        return torch.zeros(E.shape[0], 0, dtype=torch.float64)
    Sss = S[idx][:, idx]
    Sss = 0.5 * (Sss + Sss.t())
    lam = damp * float(torch.diagonal(Sss).mean().clamp_min(1e-30))
    Sss = Sss + lam * torch.eye(k, dtype=torch.float64)
    rhs = (E @ S[:, idx]).t()                     # k x N
    L, info = torch.linalg.cholesky_ex(Sss)
    if int(info) == 0:
        return torch.cholesky_solve(rhs, L).t()
    return torch.linalg.lstsq(Sss, rhs).solution.t()


def int4_rows(w: torch.Tensor) -> torch.Tensor:
    """Per-row symmetric 4-bit fake quantization (grid [-7, 7] * max|row| / 7), the released code's R."""
    w = w.to(torch.float64)
    s = (w.abs().amax(1, keepdim=True) / 7.0).clamp_min(1e-12)
    return torch.clamp(torch.round(w / s), -7, 7) * s


def serq_correction(weight: torch.Tensor, dequantized: torch.Tensor, rxx: torch.Tensor, k: int, *,
                    saliency: str = "greedy", solve: str = "lsq", act_mag: Optional[torch.Tensor] = None,
                    damp: float = 1e-6, name: str = "serq") -> tuple[torch.Tensor, torch.Tensor]:
    """``(R [N, k] float64, idx [k])`` for one linear: ``y = Q(W) x + R x[..., idx]``.

    ``weight`` and ``dequantized`` are W and Q(W) in the domain the layer runs in (after
    smoothing), ``rxx`` = E[x x^T] of that domain's inputs. ``solve``: "lsq" (the J
    minimiser), "columns" (R = E[:, idx], the salient columns' own error only). The
    "paper" split changes Q(W) itself, so it lives in :func:`apply_serq_`.
    """
    if weight.dim() != 2 or tuple(weight.shape) != tuple(dequantized.shape):
        raise ValueError(f"{name}: weight {tuple(weight.shape)} and dequantized weight "
                         f"{tuple(dequantized.shape)} must be the same 2-D shape")
    if solve not in ("lsq", "columns"):
        raise ValueError(f"{name}: solve {solve!r}; expected 'lsq' or 'columns' (the 'paper' split is apply_serq_'s)")
    err = weight.detach().to(torch.float64) - dequantized.detach().to(torch.float64)
    idx = select_salient(err, rxx, k, saliency, act_mag, name)
    R = lsq_correction(err, rxx, idx, damp) if solve == "lsq" else err[:, idx].clone()
    return R, idx


# ----------------------------------------------------------------------------- bytes and budget
def serq_bytes(N: int, k: int, solve: str = "lsq", r_dtype: Optional[torch.dtype] = torch.float16) -> int:
    """Stored bytes of one correction: N*k*itemsize (fp16: 2*N*k); "paper": int4 R + fp16 row scale."""
    if k <= 0:
        return 0
    if solve == "paper":
        return (N * k + 1) // 2 + 2 * N
    return N * k * (torch.empty(0, dtype=r_dtype or torch.float32).element_size())


def serq_k_for_budget(shapes: Mapping[str, tuple[int, int]], budget_bytes: int, solve: str = "lsq",
                      r_dtype: Optional[torch.dtype] = torch.float16,
                      extra_bytes: Optional[Mapping[str, int]] = None) -> dict[str, int]:
    """Largest uniform k (capped at each module's K) whose total bytes fit ``budget_bytes``.

    ``shapes`` maps name -> (N, K); ``extra_bytes`` (e.g. unfolded smoothing vectors) is
    charged to the budget first. As the static methods do, every module gets the same k.
    """
    extra = sum((extra_bytes or {}).values())

    def total(k: int) -> int:
        return extra + sum(serq_bytes(N, min(k, K), solve, r_dtype) for N, K in shapes.values())

    lo, hi = 0, max((K for _, K in shapes.values()), default=0)
    if total(0) > budget_bytes:
        return {n: 0 for n in shapes}
    while lo < hi:  # largest k with total(k) <= budget
        mid = (lo + hi + 1) // 2
        if total(mid) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return {n: min(lo, K) for n, (_, K) in shapes.items()}


# ----------------------------------------------------------------------------- the layer
class SERQLinear(QuantLinear):
    """``y = Q(W') x'_q + R x'_S``: a QuantLinear (4-bit main path, same op) plus SERQ's state.

    Buffers: ``R`` [N, k], ``idx`` [k] (salient channels; a permuted deployment slices
    ``[:k]`` instead), ``in_scale`` [K] or None (1/s when flattening could not be folded),
    ``perm`` [K] or None (the offline channel order: ``idx`` first, then the rest by
    decreasing magnitude; it only changes numbers when activations are quantized in groups).
    ``act_bits``: None (A16), 8 or 4: fake quantization of the main-path input, per token or
    per ``act_group_size`` channels of the permuted order.
    Not reloadable by ``spear.load`` (the artifact format knows QuantLinear and ECs only).
    """

    def __init__(self, in_features: int, out_features: int, group_size: Optional[int] = None, bias: bool = True,
                 dtype: torch.dtype = torch.float32, device=None, name: str = "SERQLinear") -> None:
        super().__init__(in_features, out_features, group_size, bias, dtype, device, name)
        self.register_buffer("R", torch.zeros(out_features, 0, dtype=dtype, device=device))
        self.register_buffer("idx", torch.zeros(0, dtype=torch.long, device=device))
        self.register_buffer("in_scale", None)
        self.register_buffer("perm", None)
        self.register_buffer("inv_perm", None)
        self.act_bits: Optional[int] = None
        self.act_group_size: Optional[int] = None
        self.correction_act = "same"

    @classmethod
    def build(cls, qw: QuantizedWeight, bias: Optional[torch.Tensor], R: torch.Tensor, idx: torch.Tensor,
              in_scale: Optional[torch.Tensor] = None, act_bits: Optional[int] = None,
              correction_act: str = "same", act_group_size: Optional[int] = None,
              perm: Optional[torch.Tensor] = None, name: str = "SERQLinear") -> "SERQLinear":
        check_act_bits(act_bits, name)
        check_act_group(act_group_size, qw.in_features, name)
        if correction_act not in CORRECTION_ACTS:
            raise ValueError(f"{name}: correction_act {correction_act!r}; expected one of {CORRECTION_ACTS}")
        N, K = qw.out_features, qw.in_features
        if R.dim() != 2 or R.shape[0] != N or idx.dim() != 1 or R.shape[1] != idx.numel():
            raise ValueError(f"{name}: R has shape {tuple(R.shape)} and idx {tuple(idx.shape)}; expected R [{N}, k] "
                             f"and idx [k]")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= K or idx.unique().numel() != idx.numel()):
            raise ValueError(f"{name}: idx must hold distinct channels in [0, {K})")
        if in_scale is not None and tuple(in_scale.shape) != (K,):
            raise ValueError(f"{name}: in_scale has shape {tuple(in_scale.shape)}, expected ({K},)")
        if perm is not None and (tuple(perm.shape) != (K,) or not torch.equal(perm.sort().values, torch.arange(K))
                                 or not torch.equal(perm[:idx.numel()], idx)):
            raise ValueError(f"{name}: perm must be a permutation of range({K}) that starts with idx")
        m = cls.from_quantized(qw, bias, name=name)
        dt = m.scales.dtype
        m.R = R.detach().to(dt).contiguous()
        m.idx = idx.detach().to(torch.long).contiguous()
        m.in_scale = None if in_scale is None else in_scale.detach().to(dt)
        m.act_bits, m.correction_act, m.act_group_size = act_bits, correction_act, act_group_size
        if perm is not None:
            m.perm = perm.detach().to(torch.long).contiguous()
            m.inv_perm = torch.argsort(m.perm)
        return m

    @property
    def k(self) -> int:
        return self.idx.numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise QuantFormatError(
                f"{self.name}: input has shape {tuple(x.shape)}, last dim must be in_features={self.in_features}")
        if self.in_scale is not None:
            x = x * self.in_scale.to(x.dtype)
        if self.act_group_size is not None and self.perm is not None and self.act_bits is not None:
            # group-wise scales over the permuted channel order (what the permuted layout sees)
            xq = fake_quant_activation(x[..., self.perm], self.act_bits, self.act_group_size)[..., self.inv_perm]
        else:
            xq = fake_quant_activation(x, self.act_bits, self.act_group_size)
        y = super().forward(xq)
        if self.k:
            if self.correction_act == "same":
                xs = xq[..., self.idx]
            elif self.correction_act == "int8":
                xs = fake_quant_activation(x[..., self.idx], 8)
            else:
                xs = x[..., self.idx]
            y = y + xs @ self.R.to(x.dtype).t()
        return y

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", serq_k={self.k}, act_bits={self.act_bits}, "
                f"act_group_size={self.act_group_size}, correction_act={self.correction_act}, "
                f"runtime_scale={self.in_scale is not None}")


# ----------------------------------------------------------------------------- entry point
def _infer_quant_cfg(m: QuantLinear) -> QuantConfig:
    G = None if m.group_size == m.in_features else m.group_size
    try:
        return QuantConfig(group_size=G, symmetric=bool((m.zeros == 8).all()))
    except ValueError as e:
        raise ValueError(f"apply_serq_: cannot re-quantize {m.name} (group_size={m.group_size}): {e}; "
                         "pass quant_cfg=") from e


def _cpu(qw: QuantizedWeight) -> QuantizedWeight:
    return dataclasses.replace(qw, qweight=qw.qweight.cpu(), scales=qw.scales.cpu(), zeros=qw.zeros.cpu())


def _quantize(W: torch.Tensor, cfg: QuantConfig, rxx: torch.Tensor, dtype: torch.dtype, name: str) -> QuantizedWeight:
    """Re-quantize a flattened weight: RTN, or GPTQ with the flattened Hessian 2 E[x' x'^T]."""
    if cfg.method == "gptq":
        return quantize_gptq(W, 2 * rxx, cfg, cfg.damp, cfg.block_size, cfg.act_order, out_dtype=dtype, where=name)
    if cfg.method != "rtn":
        raise ValueError(f"apply_serq_: {name}: re-quantizing a flattened weight with method={cfg.method!r} is not "
                         "supported (rtn, gptq); use smooth_alpha=None to keep q_model's weights")
    return quantize_rtn(W, cfg, out_dtype=dtype, where=name)


@torch.no_grad()
def apply_serq_(ref_model: nn.Module, q_model: nn.Module, stats: Mapping[str, InputStats], budget_bytes: int,
                act_bits: Optional[int] = None, smooth_alpha: Optional[float] = 0.5, *,
                k: Union[int, Mapping[str, int], None] = None, saliency: str = "greedy", solve: str = "lsq",
                correction_act: str = "same", act_group_size: Optional[int] = None,
                permute: Optional[str] = None,
                fold: bool = True, quant_cfg: Optional[QuantConfig] = None,
                r_dtype: Optional[torch.dtype] = torch.float16, damp: float = 1e-6,
                names: Optional[list[str]] = None) -> dict[str, dict]:
    """Turn every QuantLinear of ``q_model`` (or ``names``) into a :class:`SERQLinear`, in place.

    ref_model: the full-precision model ``q_model`` was quantized from (same module names;
        not modified). stats: per-name ``InputStats`` with ``rxx`` of the fp inputs
        (``collect_input_stats(ref, ..., module_type=nn.Linear, full=True)`` or
        :func:`collect_serq_stats`, which adds ``max|x|`` for flattening).
    budget_bytes: total stored bytes of all R (plus unfolded flattening vectors); every
        module gets the same k, capped at its K (:func:`serq_k_for_budget`). ``k`` (int or
        {name: k}) overrides the budget; an explicit k > K is an error naming the module.
    act_bits: None (W4A16), 8 (W4A8), 4 (W4A4): per-token activation fake quantization, or
        per ``act_group_size`` channels (e.g. 32/64; must divide every K) of the permuted
        order. ``permute``: None (original order; x'_S is gathered), "salient" (S first, the
        rest in their original order: what a contiguous x'_S slice needs), "sorted" (S first,
        the rest by decreasing flattened magnitude, like the release's full sort). Only
        group-wise activation quantization sees the difference (see the NOTE above).
    smooth_alpha: flattening strength a (0.5 SmoothQuant; 1.0 = the released code's s = max|x|);
        None = no flattening, and then the q_model's own quantized weights are kept as they are
        (RTN or GPTQ); otherwise the smoothed weights are re-quantized with ``quant_cfg``
        (default: RTN with each layer's group size and symmetry; pass the QuantConfig used
        for q_model, e.g. method="gptq", to re-run that quantizer with the smoothed Hessian).
    Works on any device: the offline math runs in float64 on the CPU (where the statistics
    are), each new layer goes to its QuantLinear's device.
    Other options: see the module docstring. Norm weights of ``q_model`` are replaced when
    flattening folds into them. Returns {name: {name, N, K, k, bytes, extra_bytes, smoothing,
    out_err_quant, out_err_serq}}; ``bytes`` is R's storage (2*N*k for fp16),
    ``extra_bytes`` the run-time flattening vector (2*K) where it could not be folded, and
    the two ``out_err`` values are J (expected squared output error per token, weight
    error only, in the flattened domain) without and with the correction.
    """
    if ref_model is q_model:
        raise ValueError("apply_serq_: ref_model and q_model are the same object; pass the fp reference separately")
    check_act_bits(act_bits, "apply_serq_")
    check_act_group(act_group_size, where="apply_serq_")
    if saliency not in SALIENCY:
        raise ValueError(f"apply_serq_: saliency {saliency!r}; expected one of {SALIENCY}")
    if solve not in SOLVES:
        raise ValueError(f"apply_serq_: solve {solve!r}; expected one of {SOLVES}")
    if correction_act not in CORRECTION_ACTS:
        raise ValueError(f"apply_serq_: correction_act {correction_act!r}; expected one of {CORRECTION_ACTS}")
    if permute not in PERMUTES:
        raise ValueError(f"apply_serq_: permute {permute!r}; expected one of {PERMUTES}")
    qls = {n: m for n, m in q_model.named_modules() if isinstance(m, QuantLinear)}
    if names is not None:
        missing = [n for n in names if n not in qls]
        if missing:
            raise KeyError(f"apply_serq_: {missing} are not QuantLinear modules of {type(q_model).__name__}")
        qls = {n: qls[n] for n in names}
    ref_mods = dict(ref_model.named_modules())
    weights, biases = {}, {}
    for n, m in qls.items():
        if isinstance(m, SERQLinear):
            raise ValueError(f"apply_serq_: {n} is already a SERQLinear")
        if m.ec is not None:
            raise ValueError(f"apply_serq_: {n} has an error compensator attached; SERQ is a separate baseline")
        if n not in stats:
            raise KeyError(f"apply_serq_: no input statistics for {n}; collect them for every quantized linear")
        st = stats[n]
        if st.xtx is None:
            raise ValueError(f"apply_serq_: statistics of {n} have no E[x x^T]; collect them with full=True")
        ref = ref_mods.get(n)
        if not isinstance(ref, nn.Linear):
            raise KeyError(f"apply_serq_: ref_model has no nn.Linear named {n}")
        if tuple(ref.weight.shape) != (m.out_features, m.in_features):
            raise ValueError(f"apply_serq_: {n}: ref weight {tuple(ref.weight.shape)} does not match the quantized "
                             f"layer ({m.out_features}, {m.in_features})")
        if tuple(st.xtx.shape) != (m.in_features, m.in_features):
            raise ValueError(f"apply_serq_: {n}: statistics are for K={st.xtx.shape[0]}, the layer has "
                             f"in_features={m.in_features}")
        weights[n], biases[n] = ref.weight, ref.bias
    plan = smooth_plan(q_model, weights, stats, smooth_alpha, fold) if smooth_alpha is not None else None

    extra = {n: (2 * m.in_features if plan is not None and plan.group_of(n).fold[0] == "runtime" else 0)
             for n, m in qls.items()}
    shapes = {n: (m.out_features, m.in_features) for n, m in qls.items()}
    if k is None:
        ks = serq_k_for_budget(shapes, budget_bytes, solve, r_dtype, extra)
    elif isinstance(k, int):
        ks = {n: k for n in qls}
    else:
        ks = {n: k.get(n, 0) for n in qls}

    report: dict[str, dict] = {}
    new_modules: dict[str, SERQLinear] = {}
    for n, m in qls.items():
        kn = ks[n]
        rxx = stats[n].rxx.to("cpu", torch.float64)
        W, b = transformed_weight(plan, n, weights[n], biases[n])
        s = plan.col_scale(n) if plan is not None else None
        if s is not None:
            rxx = rxx / (s[:, None] * s[None, :])
        _check_problem(tuple(W.shape), rxx, kn, n)
        check_act_group(act_group_size, m.in_features, n)
        dt = m.scales.dtype
        cfg = quant_cfg or _infer_quant_cfg(m)
        qw = _cpu(m.quantized_weight()) if plan is None else _quantize(W, cfg, rxx, dt, n)
        err = W - qw.dequantize(torch.float64)
        C = err @ rxx
        before = float((C * err).sum())
        idx = select_salient(err, rxx, kn, saliency, _act_magnitude(stats[n]), n, C)
        if solve == "paper":  # released code: R = int4(W'[:, S]); the main weight holds the residual
            R = int4_rows(W[:, idx])
            W_main = W.clone()
            W_main[:, idx] -= R
            qw = _quantize(W_main, cfg, rxx, dt, n)
            err = W - qw.dequantize(torch.float64)
            C = err @ rxx
        else:
            R = lsq_correction(err, rxx, idx, damp) if solve == "lsq" else err[:, idx].clone()
            if r_dtype is not None:
                R = R.to(r_dtype).to(torch.float64)
        after = serq_output_error(err, R, idx, rxx, C)
        runtime = plan is not None and plan.group_of(n).fold[0] == "runtime"
        perm = None
        if permute is not None:
            rest = torch.ones(m.in_features, dtype=torch.bool)
            rest[idx] = False
            rest = torch.nonzero(rest).flatten()
            if permute == "sorted":
                mag = _act_magnitude(stats[n]) / (s if s is not None else 1.0)
                rest = rest[torch.argsort(mag[rest], descending=True, stable=True)]
            perm = torch.cat([idx, rest])
        new_modules[n] = SERQLinear.build(qw, b, R, idx, (1.0 / s) if runtime else None, act_bits, correction_act,
                                          act_group_size, perm, name=n).to(m.qweight.device)
        smoothing = "none" if plan is None else ":".join(x for x in plan.group_of(n).fold if x)
        report[n] = {"name": n, "N": m.out_features, "K": m.in_features, "k": kn,
                     "bytes": serq_bytes(m.out_features, kn, solve, r_dtype), "extra_bytes": extra[n],
                     "smoothing": smoothing, "out_err_quant": before, "out_err_serq": after}
    # commit: swap modules, then fold 1/s into the norms of q_model (new Parameters: never
    # write through storage the reference might share).
    for n, new in new_modules.items():
        parent_name, _, child = n.rpartition(".")
        setattr(q_model.get_submodule(parent_name) if parent_name else q_model, child, new)
    if plan is not None:
        q_mods = dict(q_model.named_modules())
        for norm, s in plan.norm_folds().items():
            w = q_mods[norm].weight
            q_mods[norm].weight = nn.Parameter((w.detach().double() / s.to(w.device)).to(w.dtype),
                                               requires_grad=w.requires_grad)
    return report


__all__ = [
    "SERQLinear", "SERQStats", "SmoothGroup", "SmoothPlan", "apply_serq_", "collect_serq_stats", "fold_smoothing_",
    "int4_rows", "lsq_correction", "select_salient", "serq_bytes", "serq_correction", "serq_k_for_budget",
    "serq_output_error", "smooth_plan", "smoothing_scales", "transformed_weight",
]
