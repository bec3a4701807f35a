"""Frozen, validated configuration objects.

Every knob of the library lives in one of these dataclasses. They validate in
``__post_init__`` (so a bad value fails where it is written, not deep inside a
kernel), serialise to plain dicts (``to_dict`` / ``from_dict``) for artifacts and
for Inductor's cache key, and are hashable.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import numbers
from typing import Any, Optional

GROUP_SIZES = (32, 64, 128, 256)  # input channels per scale the kernels and the packed format support
_GROUP_SIZES = (None, *GROUP_SIZES)
_QUANT_METHODS = ("rtn", "gptq", "awq")  # all three produce the same packed "spear" format
_GATE_ACTS = ("silu", "relu", "gelu")


_KINDS = {"int": ((int,), "an integer"), "float": ((int, float), "a finite number"),
          "bool": ((bool,), "True or False"), "str": ((str,), "a string")}
GATE_BIAS_RANGE = (-10.0, 30.0)  # the EC's alpha is 1 / sigmoid(bias): 2.2e4 at -10, inf far below


def check_types(obj: Any) -> None:
    """Raise ``ValueError`` naming the field when a dataclass field annotated int / float / bool /
    str (or ``Optional`` of one) holds another type: ``"1e-3"`` for a learning rate, ``100.0`` for a
    step count or ``"no"`` for a switch would otherwise fail (or silently mean something else) deep
    in a run. Bools are not integers here, and floats must be finite."""
    for f in dataclasses.fields(obj):
        ann = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        optional = ann.startswith("Optional[")
        base = ann[len("Optional["):-1] if optional else ann
        if base not in _KINDS:
            continue
        v = getattr(obj, f.name)
        if v is None and optional:
            continue
        kinds, what = _KINDS[base]
        if base in ("int", "float") and not isinstance(v, (bool, int, float)):  # numpy / torch scalars
            abstract = numbers.Integral if base == "int" else numbers.Real
            if isinstance(v, abstract) and not isinstance(v, bool):
                v = int(v) if base == "int" else float(v)
                object.__setattr__(obj, f.name, v)
        ok = isinstance(v, kinds) and (base == "bool" or not isinstance(v, bool))
        if ok and base == "float":
            ok = math.isfinite(v)
        if not ok:
            raise ValueError(f"{type(obj).__name__}.{f.name}={v!r}: expected {what}"
                             + (" or None" if optional else ""))


def check_group_size(group_size: Any, owner: str, in_features: Optional[int] = None) -> None:
    """The one group-size rule, shared by ``QuantConfig`` and ``QuantLinear``: ``None`` (one scale per
    output channel) or one of ``GROUP_SIZES``; a layer (``in_features`` given) also accepts
    ``group_size == in_features``, the per-channel case spelled out, and needs K divisible by it.
    Raises ``ValueError`` (``QuantFormatError`` for layers, a subclass) naming ``owner``."""
    if group_size is None:
        return
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral):
        raise ValueError(f"{owner}: group_size={group_size!r} must be an integer or None (per-channel)")
    if group_size in GROUP_SIZES or (in_features is not None and group_size == in_features and group_size > 0):
        if in_features is not None and in_features % group_size:
            raise ValueError(f"{owner}: in_features K={in_features} is not divisible by group_size={group_size}")
        return
    also = f" or in_features={in_features} (per-channel)" if in_features is not None else ""
    raise ValueError(f"{owner}: group_size={group_size!r} is not supported; expected None (per-channel), "
                     f"one of {GROUP_SIZES}{also}")


def check_gate_bias(owner: str, v: float) -> None:
    lo, hi = GATE_BIAS_RANGE
    if v < lo:
        raise ValueError(f"{owner}.gate_init_bias={v}: expected >= {lo} (alpha = 1 / sigmoid(bias) grows as "
                         f"e^-bias: {v} would make it overflow or swamp the correction)")
    if v > hi:
        raise ValueError(f"{owner}.gate_init_bias={v}: expected <= {hi} (a gate that saturated cannot move: "
                         f"sigmoid's slope there is below 1e-13)")


class _Serialisable:
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown keys {sorted(unknown)}; expected a subset of {sorted(names)}")
        return cls(**d)

    def fingerprint(self) -> str:
        """Stable short hash of the config, used in Inductor cache keys."""
        blob = json.dumps(self.to_dict(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class QuantConfig(_Serialisable):
    """How weights are quantized.

    bits: weight bits; only 4 is supported by the packed format.
    group_size: ``None`` (or 0) = one scale per output channel; else 32/64/128/256
        input channels share a scale and zero point.
    symmetric: if True the zero point is fixed at 8 (signed range [-8, 7] stored
        offset by 8); else asymmetric min/max with an integer zero point.
    method: "rtn", "gptq" or "awq"; gptq and awq need calibration inputs (see
        ``quantize_``), and awq a Llama-style model (see ``quant/awq.py``).
    damp, act_order, block_size: GPTQ's Hessian damping (fraction of mean diag), column
        order by decreasing Hessian diagonal (with group parameters fixed up front), and
        lazy-update block width. act_order is on by default: on a development play (Lear,
        SmolLM2-135M per-channel, self-sampled statistics; fp 37.16, RTN 63.23) GPTQ gave 56.16
        without it and 48.94 with it (damp 0.1: 61.66 / 50.21;
        ``benchmarks/results/quality/2026-11-29_cpu_gptq_context/lear_knobs.json``).
    awq_grid: AWQ scale search: alpha in ``{i / awq_grid : i = 0..awq_grid}`` (alpha = 0
        is plain RTN, so the search never does worse than RTN on the calibration data).
    awq_clip_grid: AWQ clipping search: candidate range ratios
        ``1 - awq_max_shrink * i / awq_clip_grid`` for ``i = 0..awq_clip_grid``; 0 turns
        clipping off.
    awq_max_shrink: the smallest ratio tried is ``1 - awq_max_shrink``.
    """

    bits: int = 4
    group_size: Optional[int] = None
    symmetric: bool = False
    method: str = "rtn"
    damp: float = 0.01
    act_order: bool = True
    block_size: int = 128
    awq_grid: int = 20
    awq_clip_grid: int = 10
    awq_max_shrink: float = 0.5

    def __post_init__(self) -> None:
        if self.group_size == 0 and type(self.group_size) is int:  # not 0.0 or False: those fail the type check
            object.__setattr__(self, "group_size", None)
        check_types(self)
        if self.bits != 4:
            raise ValueError(f"QuantConfig.bits={self.bits}: only 4-bit weights are supported")
        check_group_size(self.group_size, "QuantConfig")
        if self.method not in _QUANT_METHODS:
            raise ValueError(f"QuantConfig.method={self.method!r}: expected one of {_QUANT_METHODS}")
        if not 0.0 <= self.damp < 1.0:
            raise ValueError(f"QuantConfig.damp={self.damp}: expected 0 <= damp < 1")
        if self.block_size < 1:
            raise ValueError(f"QuantConfig.block_size={self.block_size}: must be >= 1")
        if self.awq_grid < 1:
            raise ValueError(f"QuantConfig.awq_grid={self.awq_grid}: must be >= 1")
        if self.awq_clip_grid < 0:
            raise ValueError(f"QuantConfig.awq_clip_grid={self.awq_clip_grid}: must be >= 0 (0 = no clipping)")
        if not 0.0 < self.awq_max_shrink < 1.0:
            raise ValueError(f"QuantConfig.awq_max_shrink={self.awq_max_shrink}: expected 0 < awq_max_shrink < 1")


@dataclasses.dataclass(frozen=True)
class ECConfig(_Serialisable):
    """Shape of one error compensator: rank r, gate bottleneck d, gate activation."""

    rank: int = 8
    gate_hidden: int = 8
    act: str = "silu"
    gate_init_bias: float = 6.0

    def __post_init__(self) -> None:
        check_types(self)
        check_gate_bias("ECConfig", self.gate_init_bias)
        if self.rank < 1:
            raise ValueError(f"ECConfig.rank={self.rank}: must be >= 1")
        if self.gate_hidden < 1:
            raise ValueError(f"ECConfig.gate_hidden={self.gate_hidden}: must be >= 1")
        if self.act not in _GATE_ACTS:
            raise ValueError(f"ECConfig.act={self.act!r}: expected one of {_GATE_ACTS}")


# The fused / overlapped EC crossover for shapes without a measured one (CompileConfig.default_crossover_m, and the
# ops' own default when called outside the backend): the fused EC at M = 1 only (the evidence: CompileConfig).
DEFAULT_CROSSOVER_M = 2


@dataclasses.dataclass(frozen=True)
class CompileConfig(_Serialisable):
    """Options of the ``spear`` torch.compile backend.

    crossover_m: rows M at which the overlapped (prefill) lowering beats the
        fused-epilogue (decode) one. ``None`` (default) = measured: the per-GPU,
        per-shape table ``dispatch/tuned/crossover_<GPU>.json`` (or the user cache's) written by
        ``benchmarks/kernels.py``; shapes or devices without a measurement use
        ``default_crossover_m``: 2, the fused EC at M = 1 only. Every crossover measured on
        the H200 is 2 or 4 (the five benchmark shapes: 2, 4, 2, 2, 2), and since the small-M
        GEMMs (``benchmarks/results/small_m_gemm/``) the fused M > 1 GEMV with an EC ran 2.5-5.2x
        the W4 GEMM at M = 2 and 4 (H100, nine shapes), where the overlapped EC beside the GEMM
        ran 1.07-1.42x it at M = 8.
    enable_dequant_match / enable_int4pack_match: turn source-form matchers off.
    fuse_shared_input: at decode (M == 1), run linears without an EC that read the same
        activation (q/k/v, gate/up) as one GEMV over their concatenated weights
        (``passes/fuse_shared_input.py``). On by default: Llama-2-7B-shaped decode on one H200,
        batch 1, 2.82 -> 2.60 ms/token (``benchmarks/results/e2e_decode/2026-11-30_h200_concat_q_k_v.json``).
    fuse_shared_input_gemm: also fuse linears without an EC that read the same activation where M is a static
        2..256 (batched decode, or a prefill that short): one W4 GEMM over the concatenated weights, on a GPU
        where the route runs it so. On by default: on one H200 it took Llama-2-7B's q/k/v to 0.43-0.66x and
        gate/up to 0.63-0.95x the separate GEMMs' time (one untuned Qwen2.5-7B cell 1.76x until ``spear tune``;
        ``benchmarks/results/concat_gemm/2026-12-07_h200/``). It keeps a concatenated copy of those weights
        (about 2 GB for Llama-2-7B W4) while they live.
    fuse_shared_input_ec: also fuse linears *with* ECs that read the same activation into one
        ``spear::ec_linear_cat``: at decode one GEMV with one block-diagonal EC, at a static M of 2-256 (with
        ``fuse_shared_input_gemm``) one GEMM with each EC beside it as the side structure runs it (route
        ``ec_cat_gemm``; not yet timed). On by default: at decode the same model with ECs on 25 % of linears,
        2.731 -> 2.691 ms/token (1.11x -> 1.09x our W4; one H200, 2026-11-30; docs/kernels.md, the decode fusions).
    fuse_shared_input_mixed: with ``fuse_shared_input_ec``, also fuse linears with and without ECs that
        read the same activation into one ``spear::ec_linear_cat`` (the parts without an EC get None: no A rows,
        zero B rows). SPEAR's placements leave such groups in most layers (a v_proj's EC beside plain q / k, an
        up_proj's beside a plain gate); apart, each costs one more launch and loses the GLU and RMSNorm fusions.
        On by default; predicted, not yet measured: HF Llama-2-7B with ECs on an even 25 % of linears, batch 1,
        2.51 ms today against 2.13 for W4 (an EC in nearly every q/k/v and gate/up group), to about 2.3.
    fuse_glu: at decode, ``silu(gate(h)) * up(h)`` over the concatenated gate / up GEMV becomes one
        ``spear::w4a16_linear_glu`` whose epilogue applies the gate (``passes/fuse_glu.py``; on a GPU
        only where that kernel runs).
    fuse_rmsnorm: at decode, an RMSNorm whose only reader is a concatenated / GLU GEMV is computed by
        that GEMV as it stages x (``passes/fuse_rmsnorm.py``; on a GPU only where that kernel runs).
    fold_residual_add: at decode, fold ``x + linear(h)`` into the linear as its bias, so the GEMV's
        epilogue adds the residual and the add kernel disappears (``passes/fold_residual_add.py``).
    fold_gqa_attention: grouped-query attention whose K and V are repeated per query head (HF's
        ``repeat_kv``, taken whenever a mask is given) reads each KV head once instead: the query heads of
        a group become rows of one head (``passes/fold_gqa_attention.py``, on Dynamo's graph); a batch-1
        single-token query is left as it is (measured slower folded).
    on_unmatched_ec: what to do when an EC registered for a foreign module's weight (``attach_`` /
        ``register_ec``) reaches the compiler but no pass rewrites that weight's linear, so the
        compiled model would silently differ from eager + EC: ``"error"`` (default) raises
        ``errors.UnmatchedECError`` naming the module; ``"warn"`` compiles without the EC and warns.
    """

    crossover_m: Optional[int] = None
    default_crossover_m: int = DEFAULT_CROSSOVER_M
    enable_dequant_match: bool = True
    enable_int4pack_match: bool = True
    enable_phase_dispatch: bool = True
    fuse_shared_input: bool = True
    fuse_shared_input_ec: bool = True
    fuse_shared_input_gemm: bool = True
    fuse_shared_input_mixed: bool = True
    fuse_glu: bool = True
    fuse_rmsnorm: bool = True
    fold_residual_add: bool = True
    fold_gqa_attention: bool = True
    on_unmatched_ec: str = "error"

    def __post_init__(self) -> None:
        check_types(self)
        if self.on_unmatched_ec not in ("error", "warn"):
            raise ValueError(f"CompileConfig.on_unmatched_ec={self.on_unmatched_ec!r}: expected 'error' or 'warn'")
        for name in ("crossover_m", "default_crossover_m"):
            v = getattr(self, name)
            if v is not None and v < 2:
                raise ValueError(f"CompileConfig.{name}={v}: must be >= 2 (M == 1 is always decode)")


def default_device(device: Any = None) -> Any:
    """``device`` as a ``torch.device``, or CUDA when present, else the CPU: the one rule every
    entry point (eval, presets, the CLI, the benchmarks) uses to pick where work runs."""
    import torch

    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
