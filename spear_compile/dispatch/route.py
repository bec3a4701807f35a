"""``route(problem) -> Route``: the one place a kernel is chosen.

A ``Problem`` states what is to be computed (op, M, N, K, group size, dtypes, EC rank, fusion, device,
and the tensor facts the kernels depend on: contiguity, zero points present and integral, bias);
``route`` returns the ``Route`` that runs it: the kernel, its config and the reasons of every choice
made on the way (including each kernel that was considered and why it could not run). The CUDA op
implementations (``dispatch/cuda.py``) launch what ``route`` returns; the passes ask it before they
rewrite (``fuse_glu``, ``fuse_rmsnorm``, ``fuse_shared_input`` for a batched concatenation) and to name
the kernel (``phase_dispatch``); the inspection report shows the route and its reasons. It reads the tuned
table (``dispatch/table.py``) and the kernels' constraints, and launches nothing.

Kernels (``Route.kernel``):

* ``reference``: the PyTorch reference (CPU, fp32 activations, non-spear layouts, no Triton);
* W4 only: ``gemv1`` (CUDA-core M = 1 GEMV), ``gemv1_tma`` (TMA-fed Gluon GEMV), ``gemv`` (M > 1
  GEMV, shapes ``gemv1`` does not take), ``gemm`` (Triton tiled GEMM), ``dequant_cublas`` (dequantize,
  then cuBLAS; config ``(chunks,)``), ``gemm_wgmma`` / ``gemm_wgmma_ra`` (Hopper warpgroup-MMA GEMM
  with the weight as the shared-memory / register operand), ``gemv_tma_rows`` (M <= 16: the TMA GEMV with
  x's rows in the MMA's columns, a GEMM choice of the table; opt-in, ``SPEAR_TMA_ROWS``);
* decode EC (M = 1): ``ec_self`` (the EC in the CUDA-core GEMV's launch), ``ec_self_tma`` (in the TMA
  GEMV's launch), ``ec_pair_tma`` (producer grid + PDL-launched TMA GEMV adding the EC in its
  epilogue), ``ec_pair`` (producer grid + CUDA-core GEMV, PDL-launched where PDL runs); small M:
  ``ec_gemv`` (the M > 1 GEMV with in-kernel producers);
* prefill EC: ``ec_side`` (W4 GEMM ``Route.parts[0]`` beside the shrink + gate on a side stream),
  ``ec_c_operand`` (the EC first, into the C operand of dequantize + cuBLAS), ``ec_in_gemm`` (the
  EC's expand as one more K step of ``gemm_wgmma``), ``ec_in_gemm_ra`` (of ``gemm_wgmma_ra``,
  PDL-launched behind the gate), ``ec_in_gemm_self`` (shrink and gate in the register-operand GEMM's
  own launch). ``Route.options`` carries the variants (``high_priority``, ``splitk``, ``pdl``);
* concatenations (``fuse_shared_input`` / ``fuse_glu``): ``cat_gemv1`` / ``cat_tma``, ``glu_tma``, ``cat_gemm``
  (2 <= M <= ``CAT_GEMM_MAX_M``: one GEMM over the concatenated weights, ``parts[0]`` its route), ``ec_cat_gemm``
  (the same with each part's EC beside the GEMM, the side structure's way),
  ``ec_cat_tma`` / ``ec_cat_gemv1`` (then ``parts[0]`` is the EC GEMV's route), ``ec_glu_tma``,
  ``parts`` (each part on its own route, ``Route.parts``) and ``glu_of`` (the concatenation's route in
  ``parts[0]``, then act(gate) * up).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..lowering import _triton
from ..lowering import device as capability
from ..lowering import ec_gemm_self as _egs
from ..lowering import ec_self as _es
from ..lowering import w4a16_gemm_wgmma as _wg
from ..lowering import w4a16_gemm_wgmma_ra as _ra
from ..lowering import w4a16_gemv_tma as _gt
from ..lowering import w4a16_gemv_tma_ec as _gte
from ..lowering import w4a16_gemv_tma_rows as _gtr
from ..lowering import ec_shrink_splitk as _sk
from ..lowering.problem import OPS, Problem  # noqa: F401  (re-exported: the route's callers build problems here)
from ..lowering import w4a16_triton as _t
from .. import envs
from . import keys as _keys
from . import table as _table

TRITON_DTYPES = _triton.TRITON_DTYPES
W4_GEMV_MAX_M = 1  # without an EC the GEMVs beat the small-M GEMM only at M = 1 (H200, bf16)
EC_RC_MAX = _gte.EC_RC_MAX  # the most EC columns per row the TMA epilogue takes
OVERLAP_STRUCTURES = ("auto",) + _table.STRUCTURES


@dataclass(frozen=True)
class Route:
    """The kernel that runs a problem, its config, why (``reasons``, in the order the choices were made),
    its sub-routes (``parts``) and launch variants (``options``)."""

    kernel: str
    config: tuple = ()
    reasons: tuple = ()
    parts: tuple = ()
    options: tuple = ()  # sorted (name, value) pairs

    def option(self, name: str, default=None):
        return dict(self.options).get(name, default)

    def describe(self) -> str:
        """One line: kernel[config] (options) <- parts."""
        s = self.kernel + (f"{list(self.config)}" if self.config else "")
        if self.options:
            s += " (" + ", ".join(f"{k}={v}" for k, v in self.options) + ")"
        if self.parts:
            s += " <- " + " + ".join(p.describe() for p in self.parts)
        return s

    def all_reasons(self) -> list:
        out = list(self.reasons)
        for p in self.parts:
            out += [f"  {r}" for r in p.all_reasons()]
        return out


def _route(kernel, config=(), reasons=(), parts=(), **options) -> Route:
    return Route(kernel, tuple(config), tuple(reasons), tuple(parts), tuple(sorted(options.items())))


# ---------------------------------------------------------------- shapes the table never measured

# A kind's family is anchored by one entry every tuning run writes for a shape it measured: the CUDA-core
# GEMV's plain tile for the M = 1 kernels, the M > 1 GEMV's plain tile, the GEMM's choice for the M bucket.
_FAMILIES = {
    **{k: (_table.Gemv1Key, ("G",)) for k in (_table.Gemv1Key, _table.Gemv1PdlKey, _table.Gemv1TmaEcKey,
                                              _table.Gemv1TmaKey, _table.Gemv1SelfKey, _table.Gemv1SelfRankKey)},
    _table.GemvKey: (_table.GemvKey, ("G",)),
    **{k: (_table.GemmKey, ("M", "G")) for k in (_table.GemmKey, _table.GemmWgKey, _table.GemmRaKey,
                                                 _table.EcSelfKey, _table.EcStructKey)},
}
NEAREST_MAX_OCTAVES = 2  # how far (log2, in N and in K each) a tuned geometry may be to stand in for a shape


def tuned_key(key: _table.Key) -> _table.Key:
    """The key whose entry answers ``key``: ``key`` itself where its shape was tuned (its family's anchor
    entry, ``_FAMILIES``, is in the table: then an absent entry keeps its meaning, e.g. ``gemv1tma`` absent =
    the TMA GEMV measured no faster), else the same kind at the nearest tuned geometry of the same group
    size (and M bucket): the least |log2 N'/N| + |log2 K'/K|, each within ``NEAREST_MAX_OCTAVES``. A shape
    with nothing tuned near keeps its own key (absent: the kernels' defaults). Why: a model's shapes
    outside the shipped table otherwise ran the first config of each kernel and never the TMA GEMV (an HF
    Llama-family model with GQA decoded at 0.54x bf16 against 0.41x on the tuned benchmark shapes, H200)."""
    fam = _FAMILIES.get(type(key))
    if fam is None:
        return key
    t = _table.configs()
    if _NEAREST[0] is not t or _NEAREST[1] != t.generation:  # another table, or keys added / removed since
        _NEAREST[:] = [t, t.generation, {}]
    got = _NEAREST[2].get(key)
    if got is None:
        got = _NEAREST[2][key] = _nearest(t, key, *fam)
    return got


# [table, its generation, {key: tuned_key(key)}]: the route asks on every op call, and an untuned shape's answer
# is a scan of the table (the table is held, so that its identity cannot pass to a new one)
_NEAREST: list = [None, -1, {}]


def _nearest(t: _table.TunedTable, key: _table.Key, anchor_cls: type, same: tuple) -> _table.Key:
    """``tuned_key``'s answer, computed: a scan of the table's anchors."""
    anchor = anchor_cls(**{f.name: getattr(key, f.name) for f in dataclasses.fields(anchor_cls) if f.name != "ec"})
    if anchor in t:
        return key
    best, dist = None, None
    for k in t.keys_of(anchor_cls):
        if getattr(k, "ec", 0) or any(getattr(k, f) != getattr(key, f) for f in same):
            continue
        dn, dk = abs(math.log2(k.N / key.N)), abs(math.log2(k.K / key.K))
        if max(dn, dk) > NEAREST_MAX_OCTAVES:
            continue
        d = (dn + dk, k.N, k.K)
        if dist is None or d < dist:
            best, dist = k, d
    return key if best is None else dataclasses.replace(key, N=best.N, K=best.K)


def tuned(key: _table.Key, default=None):
    """The table's entry for ``key`` at ``tuned_key(key)``, else ``default``."""
    return _table.configs().get(tuned_key(key), default)


def _src(key: _table.Key) -> str:
    """``key`` for a reason, with the geometry that stood in for it."""
    used = tuned_key(key)
    return str(key) if used == key else f"{key} (untuned: nearest tuned geometry {used.N}x{used.K})"


# ---------------------------------------------------------------- the kernels' constraints, with the choices made here
# Each kernel file's ``can_implement`` returns (ok, reason) for its own hardware / shape / dtype constraints; these
# add what is chosen here: the tuned table, the kill switches, the order.

# (the kernel files' checks under the names the route's callers use)
triton_ok = _triton.can_implement
gemv1_can_implement = _t.can_implement
wgmma_can_implement = _wg.can_implement
wgmma_ra_can_implement = _ra.can_implement


def tma_config(p: Problem, rows: int) -> tuple:
    """(the tuned TMA config for ``rows`` x K, or None; reason): the TMA GEMV runs a shape only where the
    table measured it faster than the CUDA-core GEMV (unless SPEAR_NO_TMA_GEMV), and only where the kernel
    can run (``w4a16_gemv_tma.can_implement``)."""
    if envs.no_tma_gemv():
        return None, "SPEAR_NO_TMA_GEMV is set"
    key = _keys.tma_key(rows, p.K, p.G)
    cfg = tuned(key)
    if cfg is None:
        return None, f"no measured TMA win for {_src(key)}"
    ok, why = _gt.can_implement(p)
    if not ok:
        return None, why
    if not _gt.split_fits(cfg, p.K):  # (a nearest geometry's config: its K-split must divide this K's steps)
        return None, (f"{_src(key)}: config {list(cfg)} splits K into {_gt.unpack_config(cfg)[5]}, which does not "
                      f"divide K = {p.K}")
    return tuple(cfg), f"TMA GEMV measured faster for {_src(key)}: config {list(cfg)}"


def tma_rows_ok(p: Problem, config: Optional[tuple] = None) -> tuple:
    """(ok, reason) of whether the multi-row TMA GEMV runs ``p`` here: opted in (``SPEAR_TMA_ROWS``; not yet
    run on a GPU), not switched off with the other TMA GEMVs (``SPEAR_NO_TMA_GEMV``), and the kernel's own
    constraints (``w4a16_gemv_tma_rows.can_implement``, with ``config`` its shared memory)."""
    if not envs.tma_rows():
        return False, "SPEAR_TMA_ROWS is not set (the kernel is opt-in until timed)"
    if envs.no_tma_gemv():
        return False, "SPEAR_NO_TMA_GEMV is set"
    return _gtr.can_implement(p, config)


def pdl_ok(p: Problem) -> bool:
    return capability.pdl(p.device)


def ec_epilogue_ok(cfg: Optional[tuple], p: Problem, norm: bool, rc: Optional[int]) -> tuple:
    """Whether the TMA GEMV in ``cfg`` adds a decode EC in its epilogue here: a config, SPEAR_NO_TMA_EC unset,
    and the epilogue's own constraints (``w4a16_gemv_tma_ec.can_implement``)."""
    if cfg is None:
        return False, "no TMA config"
    if envs.no_tma_ec():
        return False, "SPEAR_NO_TMA_EC is set"
    return _gte.can_implement(p, cfg, norm, rc)


def self_plan_ok(p: Problem, R: int, grid: int, warps: int) -> bool:
    """Whether the one-launch EC's pieces of A fit ``grid`` programs of ``warps`` warps here."""
    return _es.can_implement(p, R, grid, warps)[0]


# ---------------------------------------------------------------- the routes


def _gemv1_config(p: Problem, N: int, ec: bool) -> tuple:
    return tuple(tuned(_keys.gemv1_key(N, p.K, p.G, ec), _t.GEMV1_CONFIGS[0]))


def _w4_gemv(p: Problem, why: list) -> Route:
    ok, r = _t.can_implement(p)
    if ok:
        cfg, r2 = tma_config(p, p.N)
        if cfg is not None:
            return _route("gemv1_tma", cfg, why + [r2])
        return _route("gemv1", _gemv1_config(p, p.N, False), why + [f"TMA GEMV: {r2}", "CUDA-core M = 1 GEMV"])
    cfg = tuple(tuned(_keys.gemv_key(p.N, p.K, p.G, False), _t.GEMV_CONFIGS[0]))
    return _route("gemv", cfg, why + [f"M = 1 GEMV: {r}", "the M > 1 GEMV"])


# The GEMM for a shape with nothing tuned at or near it (``tuned_key``: e.g. Qwen2.5-7B's 512-row k / v, or any
# shape on a GPU without a table). Derived from what tuning chose on an H100 where it measured (the shipped H100
# table, ``benchmarks/results/small_m_gemm/2026-12-07_h100_serving_ms``; ``untuned_shapes/2026-12-05_h100``, where
# M's fixed Triton default took 1.4-7.4x the tuned time at M = 16-256): outputs of at most 1024 rows took
# dequantize + cuBLAS at every M >= 16 (9.7-14.5 us against 19.9-84.8 for the Triton default); every other shape
# took the register-operand GEMM's small tiles at M <= 64, their K split such that the CTAs fill the SMs (the rule
# below picks the tuned KS on all nine shapes at M <= 16), and its 64 x 128 tile at M = 65-256. Not yet timed as a
# default against the tuned choice (``benchmarks/untuned_shapes.py`` measures it).
DEFAULT_SMALL_N = 1024  # rows up to which dequantize + cuBLAS is the default GEMM at M >= 2
DEFAULT_FILL = 1.5  # CTAs per SM the default small tiles' K split reaches first
DEFAULT_RUN_STEPS = 64  # then the split doubles while each run keeps at least this many 64-column steps


def _ra_default(M: int, N: int, K: int, sms: int) -> tuple:
    """The register-operand GEMM's default table value at M <= 256 rows (``DEFAULT_FILL``, ``DEFAULT_RUN_STEPS``)."""
    if M > 64:
        return (_t.WGMMA_RA, 64, 128, 4, 4, 2)
    bmx = 16 if M <= 16 else 32 if M <= 32 else 64
    tiles, steps = -(-N // 64), K // _ra.BK
    ks = 1
    while ks < 8 and tiles * ks < DEFAULT_FILL * sms:
        ks *= 2
    while ks < 8 and steps // ks >= DEFAULT_RUN_STEPS:
        ks *= 2
    ks = _ra.ra_ksplit((0, 0, 0, 0, 0, ks), K)
    split: dict = {}  # KS -> the first 4-warp tile of BMX rows with that split (the 8-stage ring where it exists)
    for c in _ra.SMALL_CONFIGS:
        if c[1] == bmx and c[0] == 64:
            split.setdefault(c[5] if len(c) > 5 else 1, c)
    return (_t.WGMMA_RA,) + split[max(k for k in split if k <= ks)]


def default_gemm_choice(p: Problem) -> tuple:
    """(table value, reason) of the W4 GEMM where nothing was tuned at or near the shape: dequantize + cuBLAS for
    outputs of at most ``DEFAULT_SMALL_N`` rows, the register-operand GEMM at M <= 256 on a GPU that runs it
    (``_ra_default``), else M's fixed default (``w4a16_triton._default_gemm``)."""
    fixed = tuple(_t._default_gemm(p.M)), f"M = {p.M} default (nothing measured)"
    if _t.INTERPRET or p.device.type != "cuda" or p.M < 2:
        return fixed
    if p.N <= DEFAULT_SMALL_N:
        return _t.DEQUANT_CUBLAS, (f"nothing measured; N = {p.N} <= {DEFAULT_SMALL_N}: dequantize + cuBLAS (a GEMM's "
                                   f"tiles of so few rows leave most SMs idle)")
    if p.M <= 256 and _ra.can_implement(p)[0]:
        cfg = _ra_default(p.M, p.N, p.K, capability.sm_count(p.device))
        return cfg, f"nothing measured; the register-operand GEMM's default for M = {p.M}, {p.N} rows, K = {p.K}"
    return fixed


def gemm_route(p: Problem, why: Optional[list] = None, choice: Optional[tuple] = None) -> Route:
    """The W4 GEMM: the table's choice for (M bucket, N, K, G) (or ``choice``, a table value), else the default
    for a shape nothing was measured near (``default_gemm_choice``); where the chosen kernel cannot run here, that
    default, and where neither can, M's fixed default (the Triton GEMM or dequantize + cuBLAS, which run anywhere)."""
    why = list(why or [])
    key = _keys.gemm_key(p.M, p.N, p.K, p.G)
    cfg = tuned(key) if choice is None else list(choice)
    src = f"tuned table {_src(key)}" if choice is None else f"given {list(choice)}"
    stand_in = tuned_key(key)
    if choice is None and p.N <= DEFAULT_SMALL_N and stand_in != key and stand_in.N > p.N:
        # a wider shape's GEMM tiles would leave most SMs idle here (1024x4096 at M = 16 on an H100: the
        # 4096-row shape's Triton tile in 23.2 us, dequantize + cuBLAS 10.6): the default for so few rows instead
        why.append(f"{_src(key)}: a stand-in with {stand_in.N} rows for {p.N}, not taken")
        cfg = None
    first = cfg is not None
    if cfg is None:
        cfg, src = default_gemm_choice(p)
    rt = _gemm_kernel(p, tuple(cfg), src, why)
    if rt is None and first:
        cfg, src = default_gemm_choice(p)
        rt = _gemm_kernel(p, tuple(cfg), src, why)
    if rt is None:
        rt = _gemm_kernel(p, tuple(_t._default_gemm(p.M)), f"M = {p.M} default", why)
    return rt


def _gemm_kernel(p: Problem, cfg: tuple, src: str, why: list) -> Optional[Route]:
    """The route of GEMM table value ``cfg``, or None (the reason appended to ``why``) where its kernel cannot run."""
    if cfg[0] == _gtr.TABLE_KERNEL:
        ok, r = tma_rows_ok(p, cfg[1:])
        if ok:
            return _route(_gtr.TABLE_KERNEL, cfg[1:], why + [f"{src}: the TMA GEMV over x's rows ({r})"])
        why.append(f"{src}: the TMA GEMV over x's rows, which cannot run here ({r})")
        return None
    if cfg[0] in (_t.WGMMA, _t.WGMMA_RA):
        check = _wg.can_implement if cfg[0] == _t.WGMMA else _ra.can_implement
        ok, r = check(p)
        if ok and p.out_contiguous:
            return _route("gemm_" + cfg[0], cfg[1:], why + [f"{src}: {cfg[0]} ({r})"])
        why.append(f"{src}: {cfg[0]}, which cannot run here ({r if not ok else 'out not contiguous'})")
        return None
    if _t.is_dequant_cublas(cfg):
        chunks = int(cfg[1]) if cfg[0] == _t.DEQUANT_CUBLAS_PIPE[0] else 1
        return _route("dequant_cublas", (chunks,), why + [f"{src}: dequantize + cuBLAS in {chunks} slice(s)"])
    return _route("gemm", cfg, why + [f"{src}: Triton GEMM"])


def _w4_route(p: Problem, why: list) -> Route:
    if p.M <= W4_GEMV_MAX_M:
        return _w4_gemv(p, why + [f"M = {p.M} <= {W4_GEMV_MAX_M}: a GEMV"])
    return gemm_route(p, why + [f"M = {p.M} > {W4_GEMV_MAX_M}: a GEMM"])


def use_fused(lowering: str, M: int, crossover: int) -> bool:
    """Whether the fused (GEMV-epilogue) EC runs for M rows under this lowering decision."""
    if M > _t.GEMV_MAX_M:
        return False
    if lowering == "fused":
        return True
    if lowering == "overlapped":
        return False
    return M < crossover  # "dispatch" / "auto": the runtime branch


def _self_choice(p: Problem, N: int) -> tuple:
    R = p.rank
    rk, gk = _keys.gemv1self_rank_key(N, p.K, p.G, R), _keys.gemv1self_key(N, p.K, p.G)
    choice = tuned(rk, tuned(gk))
    if not choice:
        return None, "no one-launch EC measured fastest for the shape"
    if choice[0] == "pair":
        return None, f"{rk}: a two-launch pair measured faster at this rank"
    return choice, f"{_src(rk) if tuned(rk) is not None else _src(gk)}: the one-launch EC on {choice[0]}"


def ec_decode_route(p: Problem, N: Optional[int] = None, why: Optional[list] = None) -> Route:
    """The M = 1 EC GEMV (``words``: a concatenation's CUDA-core layout, which takes no TMA route here)."""
    N = p.N if N is None else N
    why = list(why or [])
    R = p.rank
    if pdl_ok(p):
        choice, r = _self_choice(p, N)
        why.append(r)
        if choice is not None and p.a_contiguous:
            cfg = tuple(int(v) for v in choice[1:])
            if choice[0] == "cc":
                if self_plan_ok(p, R, -(-N // cfg[0]), cfg[2]):
                    return _route("ec_self", cfg, why)
                why.append("its pieces of A do not fit the grid")
            elif choice[0] == "tma" and not p.words and p.b_contiguous:
                ok = _gt.ec_ok(cfg) and _tma_runs(p)  # (the TMA kernel's own constraints, on this config)
                if ok and self_plan_ok(p, R, -(-N // _gt.tile_geometry(cfg)[0]), cfg[0]):
                    return _route("ec_self_tma", cfg, why)
                why.append("the one-launch TMA form cannot run here")
        elif choice is not None:
            why.append("A is not contiguous")
        if not p.words and p.b_contiguous:
            if tma_ec_measured_ok(N, p.K, p.G):
                cfg, r2 = tma_config(p, N)
                ok, r3 = ec_epilogue_ok(cfg, p, p.norm, R)
                if ok:
                    return _route("ec_pair_tma", cfg, why + [r2, r3], pdl=capability.pdl_launch(p.device))
                why.append(f"TMA EC pair: {r3 if cfg is not None else r2}")
            else:
                why.append("gemv1tmaec: the CUDA-core pair measured faster for the shape")
        cfg = ec_pdl_config(N, p.K, p.G)
        return _route("ec_pair", cfg, why + ["producer grid + CUDA-core GEMV"], pdl=capability.pdl_launch(p.device))
    cfg = _gemv1_config(p, N, True)
    why.append("no PDL here")
    if not self_plan_ok(p, R, -(-N // cfg[0]), cfg[2]) or not p.a_contiguous:
        return _route("ec_pair", cfg, why + ["A does not fit the one launch: the pair in stream order"], pdl=False)
    return _route("ec_self", cfg, why + ["the EC in the CUDA-core GEMV's launch"])


def _tma_runs(p: Problem) -> bool:
    """Whether the TMA kernel runs here (SPEAR_NO_TMA_GEMV unset, ``w4a16_gemv_tma.can_implement``) for a config
    given by the one-launch entry."""
    return not envs.no_tma_gemv() and _gt.can_implement(p)[0]


def ec_overlapped_route(p: Problem, structure: str = "auto", why: Optional[list] = None) -> Route:
    """The prefill EC in the structure measured fastest for the shape (or ``structure``)."""
    why = list(why or [])
    if structure not in OVERLAP_STRUCTURES:
        raise ValueError(f"ec_overlapped: structure={structure!r}; expected one of {OVERLAP_STRUCTURES}")
    gemm = gemm_route(p)
    if structure == "auto":
        key = _keys.ec_structure_key(p.M, p.N, p.K, p.G)
        structure = tuned(key, "side")
        why.append(f"{_src(key)}: {structure}" if tuned(key) is not None else "no structure measured: side")
        raw = tuple(tuned(_keys.gemm_key(p.M, p.N, p.K, p.G), _t._default_gemm(p.M)))
        if structure.startswith("c_operand") and not _t.is_dequant_cublas(raw):
            why.append(f"c_operand needs the table's GEMM to be dequantize + cuBLAS, not {raw[0]}: side")
            structure = "side"
    if structure.startswith("c_operand"):
        return _route("ec_c_operand", (), why, high_priority=structure == "c_operand_hi")
    if structure.startswith("in_gemm"):
        r = _in_gemm(p, gemm, splitk=structure == "in_gemm_sk", self_=structure == "in_gemm_self", why=why)
        if r is not None:
            return r
        if p.device.type != "cuda":
            return _route("ec_c_operand", (), why + ["(CPU) the C-operand structure"], high_priority=False)
        structure = "side"
        why.append("no wgmma GEMM can take it: side")
    return _route("ec_side", (), why, parts=(gemm,), high_priority=structure == "side_hi")


def _in_gemm(p: Problem, gemm: Route, splitk: bool, self_: bool, why: list) -> Optional[Route]:
    ok, r = _wg.can_implement(p, ec=True)
    if not ok:
        why.append(f"in_gemm: {r}")
        return None
    use_ra = gemm.kernel == "gemm_wgmma_ra"
    if self_:
        got = tuned(_keys.ec_self_key(p.M, p.N, p.K, p.G))
        if got is None:
            got = list(gemm.config) if use_ra else tuned(_keys.wgmma_ra_key(p.M, p.N, p.K, p.G))
        ra_ok, r2 = _ra.can_implement(p)
        self_ok, r3 = _egs.can_implement(p)
        if got is not None and ra_ok and self_ok:
            return _route("ec_in_gemm_self", tuple(got), why)
        why.append(f"in_gemm_self: {'no measured config' if got is None else r2 if not ra_ok else r3}")
    shrink = "splitk" if splitk and _sk.can_implement(p)[0] else "cublas"
    if use_ra:
        return _route("ec_in_gemm_ra", gemm.config, why + ["the register-operand GEMM takes the expand"],
                      shrink=shrink, pdl=capability.pdl_launch(p.device))
    cfg = (gemm.config if gemm.kernel == "gemm_wgmma"
           else tuple(tuned(_keys.wgmma_key(p.M, p.N, p.K, p.G), _wg.WGMMA_CONFIGS[0])))
    return _route("ec_in_gemm", cfg, why + ["the shared-memory-operand wgmma GEMM takes the expand"], shrink=shrink)


def _ec_route(p: Problem, why: list) -> Route:
    if use_fused(p.lowering, p.M, p.crossover):
        why = why + [f"lowering {p.lowering!r} at M = {p.M}: the fused decode EC"]
        ok, r = _t.can_implement(p)
        if ok:
            return ec_decode_route(p, why=why)
        cfg = tuple(tuned(_keys.gemv_key(p.N, p.K, p.G, True), _t.GEMV_CONFIGS[0]))
        return _route("ec_gemv", cfg, why + [f"M = 1 GEMV: {r}", "the M > 1 GEMV with in-kernel producers"])
    return ec_overlapped_route(p, why=why + [f"lowering {p.lowering!r} at M = {p.M}: the overlapped EC"])


# Linears sharing an input at 2 <= M <= CAT_GEMM_MAX_M run as one GEMM over their concatenated weights. Measured on
# one H200 (``benchmarks/concat_gemm.py``, ``benchmarks/results/concat_gemm/2026-12-07_h200/``), the concatenation
# on the route's own GEMM against each part on its route and ``torch.cat``: Llama-2-7B's q/k/v 0.43-0.53x at M = 2-128
# and 0.66x at 256, gate/up 0.63-0.67x at M = 2-128 (0.86x at 64) and 0.95x at 256; Qwen2.5-7B's q/k/v 0.11-0.29x
# at M = 2-128 (its 512-row k / v parts run slow routes) and 0.66x at 256, gate/up 0.75-0.89x except M = 128,
# where the untuned 37888-row shape's nearest-geometry config made it 1.76x. Above 256 rows not measured: parts.
CAT_GEMM_MAX_M = 256


def _cat_gemm_route(p: Problem, why: list) -> Optional[Route]:
    """The concatenation as one GEMM (``CAT_GEMM_MAX_M``), or None where it does not apply."""
    if p.op != "w4a16_cat" or not 2 <= p.M <= CAT_GEMM_MAX_M or not p.zeros_consistent:
        return None
    inner = route(p.replace(op="w4a16", parts=(), norm=False))
    if inner.kernel == "reference":
        return None
    return _route("cat_gemm", (), why + [f"M = {p.M} in [2, {CAT_GEMM_MAX_M}]: one GEMM over the concatenated "
                                         f"weights ({p.N} rows)"], parts=(inner,))


def _cat_route(p: Problem, why: list) -> Route:
    gemm = _cat_gemm_route(p, why)
    if gemm is not None:
        return gemm
    ok, r = _t.can_implement(p)
    if ok:
        cfg, r2 = tma_config(p, p.N)
        ok2, r3 = _gt.can_implement(p, cfg, norm=p.norm) if cfg is not None else (False, r2)
        if ok2:
            return _route("cat_tma", cfg, why + [r2])
        why = why + [f"TMA GEMV: {r3}"]
        return _route("cat_gemv1", _gemv1_config(p, p.N, False), why)
    return _parts_route(p, why + [f"one GEMV: {r}"])


def _without_ec(p: Problem, **kw) -> Problem:
    """``p`` with no EC (its plain W4 linears), and ``kw`` replaced."""
    return p.replace(rank=None, rank_total=None, gate_width=None, ec_dtypes=(), plain_parts=(), **kw)


def _parts_route(p: Problem, why: list) -> Route:
    def part(i: int, n: int) -> Route:
        if p.has_ec and i not in p.plain_parts:
            return route(p.replace(op="ec", N=n, parts=(), plain_parts=(), norm=False))
        return route(_without_ec(p, op="w4a16", N=n, parts=(), norm=False))
    parts = tuple(part(i, n) for i, n in enumerate(p.parts or (p.N,)))
    return _route("parts", (), why + ["each part on its own route, concatenated"], parts=parts)


def glu_config(p: Problem) -> tuple:
    """(the TMA config whose GLU epilogue runs a gate / up pair of F = p.N rows each, or None; reason)."""
    if len(p.parts) != 2 or p.parts[1] != p.N:
        return None, "not two halves of F rows"
    ok, r = _t.can_implement(p)
    if not ok:
        return None, r
    cfg, r = tma_config(p, 2 * p.N)
    if cfg is None:
        return None, r
    ok, r2 = _gt.can_implement(p, cfg, glu=True)
    if not ok:
        return None, r2
    return cfg, r


def _glu_route(p: Problem, why: list) -> Route:
    cfg, r = glu_config(p)
    if cfg is not None and p.act == "silu" and (not p.norm or _gt.can_implement(p, cfg, norm=True)[0]):
        return _route("glu_tma", cfg, why + [r, "silu(gate) * up in the TMA GEMV's epilogue"])
    cat = route(p.replace(op="w4a16_cat", N=2 * p.N))
    return _route("glu_of", (), why + [f"GLU epilogue: {r if cfg is None else 'not this act / norm'}"], parts=(cat,))


def _ec_cat_gemm_route(p: Problem, why: list) -> Optional[Route]:
    """At 2 <= M <= ``CAT_GEMM_MAX_M``: the concatenation's W4 as one GEMM (``_cat_gemm_route`` of its weights) and
    each EC beside it as the side structure does it (its shrink and gate on the side stream during the GEMM, its
    expand added into its own rows of the output); None where the concatenated GEMM does not apply or where a
    part's EC alone measured fastest in another structure (the tables tune those at M >= 256 only). Predicted
    from the parts' measurements, not yet timed: the GEMM is what the plain concatenation measured (Llama-2-7B's
    q/k/v 0.43-0.53x the three GEMMs at M = 2-128, H200) and each EC adds what it adds beside its own GEMM."""
    if not 2 <= p.M <= CAT_GEMM_MAX_M:
        return None
    for i, n in enumerate(p.parts or (p.N,)):  # each EC as its part alone would run it: the side structure
        own = tuned(_keys.ec_structure_key(p.M, n, p.K, p.G), "side") if i not in p.plain_parts else "side"
        if not own.startswith("side"):
            why.append(f"one GEMM with the ECs beside it: part {i}'s EC measured fastest as {own!r} at M = {p.M}")
            return None
    gemm = _cat_gemm_route(_without_ec(p, op="w4a16_cat"), [])
    if gemm is None:
        return None
    return _route("ec_cat_gemm", (), why + [f"M = {p.M}: one GEMM over the concatenated weights, each EC beside it "
                                            "(shrink and gate on the side stream, expand into its rows)"],
                  parts=gemm.parts)


def _ec_cat_route(p: Problem, why: list) -> Route:
    gemm = _ec_cat_gemm_route(p, why)
    if gemm is not None:
        return gemm
    ok, r = _t.can_implement(p)
    if ok:
        cfg, r2 = tma_config(p, p.N)
        ok2, r3 = ec_epilogue_ok(cfg, p, p.norm, p.rank)
        if ok2:
            return _route("ec_cat_tma", cfg, why + [r2, r3], pdl=capability.pdl_launch(p.device))
        inner = ec_decode_route(p.replace(rank=p.rank_total or p.rank, words=True, norm=False), why=[])
        return _route("ec_cat_gemv1", (), why + [f"TMA EC epilogue: {r3 if cfg is not None else r2}"],
                      parts=(inner,))
    return _parts_route(p, why + [f"one GEMV: {r}"])


def _ec_glu_route(p: Problem, why: list) -> Route:
    cfg, r = glu_config(p)
    ok, r2 = ec_epilogue_ok(cfg, p, p.norm, p.rank)
    if ok:
        return _route("ec_glu_tma", cfg, why + [r, r2], pdl=capability.pdl_launch(p.device))
    cat = route(p.replace(op="ec_cat", N=2 * p.N))
    return _route("glu_of", (), why + [f"GLU epilogue: {r if cfg is None else r2}"], parts=(cat,))


_OPS: dict[str, Callable] = {"w4a16": _w4_route, "ec": _ec_route, "w4a16_cat": _cat_route, "w4a16_glu": _glu_route,
                             "ec_cat": _ec_cat_route, "ec_glu": _ec_glu_route}


def route(p: Problem) -> Route:
    """The route that runs ``p`` (see the module docstring for the kernels)."""
    ok, r = _triton.can_implement(p)
    if not ok:
        return _route("reference", (), [r])
    return _OPS[p.op](p, [])


# ---------------------------------------------------------------- problems from tensors


def _dtypes(*ts) -> tuple:
    return tuple(t.dtype for t in ts if t is not None)


def problem_of(op: str, x2: torch.Tensor, qweight, scales, zeros, G: int, bias=None, ec: Optional[tuple] = None,
               layout: str = "spear", lowering: str = "auto", crossover: int = 16, out=None,
               N: Optional[int] = None, M: Optional[int] = None) -> Problem:
    """The problem of one linear's call (``ec``: (A, B, W1, b1, W2, b2, alpha)). Whether the zero points
    are small integers is looked at only if a route asks (the register-operand GEMM; cached per tensor)."""
    K = x2.shape[-1]
    if M is None:
        M = x2.shape[0] if x2.dim() == 2 else int(x2.numel() // K)
    probe = (lambda: _wg.integer_zeros(zeros)) if zeros is not None and x2.is_cuda else None
    kw = {}
    if ec is not None:
        A, B, W1 = ec[0], ec[1], ec[2]
        kw = dict(rank=int(A.shape[0]), gate_width=int(W1.shape[0]) if W1 is not None and W1.dim() == 2 else None,
                  ec_dtypes=(A.dtype, B.dtype), a_contiguous=A.is_contiguous(), b_contiguous=B.is_contiguous())
    return Problem(op=op, M=int(M), N=int(N if N is not None else qweight.shape[0]), K=int(K), G=int(G),
                   dtype=x2.dtype, param_dtypes=_dtypes(scales, zeros),
                   bias_dtype=bias.dtype if bias is not None else None, device=x2.device, layout=layout,
                   lowering=lowering, crossover=int(crossover), has_zeros=zeros is not None,
                   weight_contiguous=qweight.is_contiguous() if qweight is not None else True,
                   params_contiguous=scales.is_contiguous() and (zeros is None or zeros.is_contiguous()),
                   zeros_probe=probe, out_contiguous=out is None or out.is_contiguous(), **kw)


def cat_problem_of(op: str, x2: torch.Tensor, qweights, scales, zeros, G: int, biases=(), As=None, Bs=None,
                   W1s=None, layout: str = "spear", norm: bool = False, act: str = "silu",
                   M: Optional[int] = None) -> Problem:
    """The problem of a concatenation (``op``: w4a16_cat / w4a16_glu / ec_cat / ec_glu)."""
    K = int(x2.shape[-1])
    M = int(x2.numel() // K) if M is None else M
    rows = tuple(int(q.shape[0]) for q in qweights)
    kw = {}
    if As is not None:  # (parts without an EC - None entries - add no rank)
        plain = tuple(i for i, a in enumerate(As) if a is None)
        As, Bs = [a for a in As if a is not None], [b for b in Bs if b is not None]
        kw = dict(rank=max(int(b.shape[1]) for b in Bs), rank_total=sum(int(a.shape[0]) for a in As),
                  ec_dtypes=(As[0].dtype, Bs[0].dtype), a_contiguous=True, b_contiguous=True,
                  gate_width=sum(int(w.shape[0]) for w in W1s if w is not None) if W1s is not None else None,
                  plain_parts=plain)
    glu = op.endswith("glu")
    return Problem(op=op, M=M, N=rows[0] if glu else sum(rows), K=K, G=int(G), dtype=x2.dtype,
                   param_dtypes=_dtypes(*scales, *zeros), device=x2.device, layout=layout,
                   has_zeros=zeros[0] is not None, zeros_consistent=len({z is None for z in zeros}) == 1,
                   weight_contiguous=all(q.is_contiguous() for q in qweights), parts=rows,
                   bias_dtype=next((b.dtype for b in biases if b is not None), None), norm=norm, act=act, **kw)


# ---------------------------------------------------------------- the route's answers, for tuners and tests


def ec_pdl_config(N: int, K: int, G: int) -> tuple:
    """The GEMV tile of the decode EC's producer + CUDA-core GEMV pair: its own measured one (``gemv1pdl``),
    else the plain W4 tile of the shape, else the first config."""
    return tuple(tuned(_keys.gemv1pdl_key(N, K, G)) or tuned(_keys.gemv1_key(N, K, G, False)) or _t.GEMV1_CONFIGS[0])


def tma_ec_measured_ok(N: int, K: int, G: int) -> bool:
    """Whether a single decode EC of this shape may take the TMA GEMV's EC pair: unless the table measured
    the CUDA-core pair faster (``gemv1tmaec`` entry 0)."""
    return bool(tuned(_keys.gemv1tmaec_key(N, K, G), 1))


def self_plan_fits(R: int, K: int, grid: int, warps: int, device: torch.device) -> bool:
    """Whether the one-launch EC's pieces of A [R, K] fit ``grid`` programs of ``warps`` warps on ``device``."""
    return _es.self_plan(R, K, grid, 32 * warps, _es.sm_count(device)) is not None


def ec_tma_config(x2: torch.Tensor, N: int, G: int, params: tuple, norm, rc: Optional[int] = None) -> Optional[tuple]:
    """The TMA config whose EC epilogue runs a decode EC GEMV of N rows here (with the RMSNorm prologue when
    ``norm``), or None."""
    p = Problem(op="ec", M=int(x2.shape[0]), N=N, K=int(x2.shape[1]), G=G, dtype=x2.dtype,
                param_dtypes=_dtypes(*params), device=x2.device, rank=rc)
    if p.M != 1:
        return None
    cfg, _ = tma_config(p, N)
    return cfg if ec_epilogue_ok(cfg, p, norm is not None, rc)[0] else None


# ---------------------------------------------------------------- table lookups of the wgmma GEMMs and the prefill EC


def wgmma_config(M: int, N: int, K: int, G: int) -> tuple:
    """(BM, BN, STAGES, WARPS) of the warpgroup-MMA GEMM for this shape: the table's GEMM choice when it is
    that kernel, else its fastest measured config (``gemmwg`` keys), else the first config."""
    cfg = gemm_config(M, N, K, G)
    if cfg[0] == _t.WGMMA:
        return tuple(cfg[1:])
    return tuple(tuned(_keys.wgmma_key(M, N, K, G), _wg.WGMMA_CONFIGS[0]))



def wgmma_choices() -> list:
    """Table values for every config of the warpgroup-MMA GEMM, where this Triton has it (else none)."""
    return [(_t.WGMMA,) + c for c in _wg.WGMMA_CONFIGS] if _wg.HAS_WGMMA and not _t.INTERPRET else []



def wgmma_ra_config(M: int, N: int, K: int, G: int) -> Optional[tuple]:
    """(BNW, BMX, STAGES, WARPS[, PF]) of the register-operand GEMM for this shape, for the EC structures
    built on it ("in_gemm_self"): the table's GEMM choice when it is that kernel, else its fastest measured config
    (``gemmra`` keys, written by ``benchmarks/kernels.py`` at M >= 256), else None (not measured). So a structure
    that needs this GEMM does not depend on which GEMM wins the W4 table by a near tie (11008x4096 M = 1024
    flipped between runs)."""
    cfg = gemm_config(M, N, K, G)
    if cfg[0] == _t.WGMMA_RA:
        return tuple(cfg[1:])
    got = tuned(_keys.wgmma_ra_key(M, N, K, G))
    return tuple(got) if got is not None else None



def ec_self_config(M: int, N: int, K: int, G: int) -> Optional[tuple]:
    """(BNW, BMX, STAGES, WARPS[, PF]) of the "in_gemm_self" EC structure's launch: its own fastest measured config
    (``ecself`` keys, written by ``benchmarks/kernels.py`` at M >= 256), else ``wgmma_ra_config``. Why its own:
    the tile that wins the plain W4 GEMM can be a poor host for the shrink roles - 11008x4096 M = 256 (H200):
    W4 took the 4-warp 64 x 128 tile (46.3 us), on which in_gemm_self took 78.6 us against ~51 on the
    128 x 256 tile of the run before."""
    got = tuned(_keys.ec_self_key(M, N, K, G))
    return tuple(got) if got is not None else wgmma_ra_config(M, N, K, G)



def ra_small_choices(M: int, N: Optional[int] = None, K: Optional[int] = None, G: Optional[int] = None) -> list:
    """Table values for the register-operand wgmma GEMM's small-M tiles (``SMALL_CONFIGS``: x blocks of 16 / 32 /
    64 rows, deep rings) whose x block holds M's rows (BMX >= M, the smallest such; above 64 rows the 64-row blocks),
    where this Triton has it and
    (given N, K, G) the kernel takes the shape: a search would otherwise time the route's fallback under its name."""
    if not _wg.HAS_WGMMA or _t.INTERPRET:
        return []
    if K is not None and not _wg.wgmma_ok(M, N or 8, K, G or K, torch.bfloat16):
        return []
    bmx = min((c[1] for c in _ra.SMALL_CONFIGS if c[1] >= M), default=max(c[1] for c in _ra.SMALL_CONFIGS))
    return [(_t.WGMMA_RA,) + c for c in _ra.SMALL_CONFIGS if c[1] == bmx]


def tma_rows_choices(M: int, N: Optional[int] = None, K: Optional[int] = None, G: Optional[int] = None) -> list:
    """Table values for the multi-row TMA GEMV's configs (``w4a16_gemv_tma_rows.ROWS_CONFIGS``) at M rows: none
    unless it is opted in, this Triton has it, this process's GPU is sm_90+, M <= 16 and (given K, G) the kernel
    takes the shape, and only the configs whose shared memory fits at that K (a search would otherwise time the
    route's fallback under their name)."""
    if not envs.tma_rows() or not _gtr.HAS_TMA or _t.INTERPRET or not 1 <= M <= _gtr.MAX_ROWS:
        return []
    if not (torch.cuda.is_available() and _gt._tma_capable(torch.device("cuda"))):  # the tuners time this GPU
        return []
    if K is not None and not _gtr.gluon_ok(1, K, G or K, torch.bfloat16):
        return []
    return [(_gtr.TABLE_KERNEL,) + c for c in _gtr.ROWS_CONFIGS if K is None or _gtr.rows_fit(c, K, M)]


def gemm_choices(M: int, N: Optional[int] = None, K: Optional[int] = None, G: Optional[int] = None) -> list:
    """Every W4 GEMM table value worth timing at M rows, except the large-tile wgmma GEMMs (``wgmma_choices``,
    ``wgmma_ra_choices``, searched from M = 64): the Triton GEMM's configs, the register-operand GEMM's small-M
    tiles (up to M = 128, where they take the shape), the multi-row TMA GEMV (M <= 16, opted in:
    ``tma_rows_choices``), dequantize + cuBLAS."""
    ra = ra_small_choices(M, N, K, G) if M <= 128 else []
    return (list(_t.GEMM_CONFIGS) + ra + tma_rows_choices(M, N, K, G)
            + [_t.DEQUANT_CUBLAS, _t.DEQUANT_CUBLAS_PIPE])


def wgmma_ra_choices() -> list:
    """Table values for every config of the register-operand warpgroup-MMA GEMM (``w4a16_gemm_wgmma_ra``),
    where this Triton has it (else none)."""
    return [(_t.WGMMA_RA,) + c for c in _ra.RA_CONFIGS] if _wg.HAS_WGMMA and not _t.INTERPRET else []



def gemm_config(M: int, N: int, K: int, G: int) -> tuple:
    """The GEMM config the tuned table (or the default for this M) gives this shape."""
    return tuple(tuned(_keys.gemm_key(M, N, K, G), _t._default_gemm(M)))



def ec_structure(M: int, N: int, K: int, G: int) -> str:
    """The prefill EC structure (``dispatch/cuda.py:ec_overlapped``) measured fastest for this shape on
    this GPU, or "side" where nothing was measured. A "c_operand" choice needs the table's GEMM
    for this shape to be dequantize + cuBLAS; otherwise "side" is returned. ("in_gemm" carries its own
    GEMM, ``wgmma_config``.)"""
    choice = tuned(_keys.ec_structure_key(M, N, K, G), "side")
    if choice.startswith("c_operand") and not _t.is_dequant_cublas(gemm_config(M, N, K, G)):
        return "side"
    return choice
