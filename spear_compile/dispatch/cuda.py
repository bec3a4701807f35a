"""CUDA implementations of the spear ops: ask ``route()`` what runs, then launch it.

Nothing here chooses a kernel: every choice is ``route.route`` (or, for a caller that names the
config, ``route.gemm_route`` / ``route.ec_overlapped_route`` with that choice). What is left is
launch plumbing: reshaping x, making the derived operands (padded B, the concatenations' layouts,
row parameters) before the launches that must follow each other, and the side streams of the
prefill EC structures (stream waits only, so a whole step is capturable in a CUDA graph).

Registered for the ops' CUDA dispatch key by ``register_cuda_kernels`` (``quant/ops.py`` calls it
once the ops are defined). Anything the Triton kernels do not cover (fp32 activations, the
tinygemm / unpacked layouts, no Triton) runs the PyTorch reference: results never depend on what
is installed, only speed does.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ..lowering import dequant_cublas as _dc
from ..lowering import device as capability
from ..lowering import ec_cat as _ec_cat
from ..lowering import ec_decode_triton as _ed
from ..lowering import ec_gemm_self as _egs  # noqa: F401  (the in-launch structure's kernels)
from ..lowering import ec_shrink_splitk as _sk
from ..lowering import ec_triton as _ect
from ..lowering import w4a16_cat as _cat
from ..lowering import w4a16_gemm_wgmma as _wg
from ..lowering import w4a16_gemm_wgmma_ra as _ra
from ..lowering import w4a16_gemv_tma as _gt
from ..lowering import w4a16_gemv_tma_ec as _gte
from ..lowering import w4a16_gemv_tma_rows as _gtr
from ..lowering import w4a16_triton as _t
from ..lowering.layout_cache import derived_cached
from ..ops import refs as _refs
from ..ops import schemas as _ops
from . import route as _r
from .route import OVERLAP_STRUCTURES, Route, W4_GEMV_MAX_M, problem_of, route, use_fused  # noqa: F401
from ..config import DEFAULT_CROSSOVER_M

_TRACE: Optional[list] = None  # routes the op implementations took, while ``trace_routes`` is active


@contextlib.contextmanager
def trace_routes():
    """Collect the ``Route`` every spear op on CUDA takes while the context is active (a list, in call order):
    what the GPU tests compare the inspection report against."""
    global _TRACE
    prev, _TRACE = _TRACE, []
    try:
        yield _TRACE
    finally:
        _TRACE = prev


def _took(rt: Route) -> Route:
    if _TRACE is not None:
        _TRACE.append(rt)
    return rt


HIGH_PRIORITY = capability.HIGH_PRIORITY
side_stream = capability.side_stream
_PADDED_B: dict = {}


def _dense(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The kernels read the bias as N consecutive values; a bias folded in from a residual
    (``passes/fold_residual_add.py``) is a view of an activation and may have any stride."""
    return bias.contiguous() if bias is not None else None


# ---------------------------------------------------------------- launches of single linears


def launch_w4(rt: Route, x2, qweight, scales, zeros, G: int, bias, out=None) -> torch.Tensor:
    """Y = x2 W^T through the W4 kernel of route ``rt``."""
    k, cfg = rt.kernel, rt.config
    if k == "gemv1_tma":
        return _gt.w4a16_gemv_tma(x2, qweight, scales, zeros, G, bias, config=cfg, out=out)
    if k == "gemv1":
        return _t.w4a16_gemv1(x2, qweight, scales, zeros, G, bias, config=cfg, out=out)
    if k == "gemv":
        return _t.w4a16_gemv_small(x2, qweight, scales, zeros, G, bias, config=cfg, out=out)
    if k == "gemm":
        return _t.w4a16_gemm_triton(x2, qweight, scales, zeros, G, bias, config=cfg, out=out)
    if k == "dequant_cublas":
        return _dc.dequant_cublas(x2, qweight, scales, zeros, G, bias, out=out, chunks=cfg[0])
    if k == "gemm_wgmma":
        return _wg.w4a16_gemm_wgmma(x2, qweight, scales, zeros, G, bias, config=cfg, out=out)
    if k == "gemm_wgmma_ra":
        return _ra.w4a16_gemm_wgmma_ra(x2, qweight, scales, zeros, G, bias, config=cfg, out=out)
    if k == _gtr.TABLE_KERNEL:
        return _gtr.w4a16_gemv_tma_rows(x2, qweight, scales, zeros, G, bias, config=cfg, out=out)
    raise ValueError(f"launch_w4: route {rt.describe()} is not a W4 kernel")


def w4a16_gemv(x2, qweight, scales, zeros, G: int, bias, ec: Optional[tuple] = None, act: str = "silu",
               config: Optional[tuple] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Y[M, N] for M <= GEMV_MAX_M, optionally with the EC fused (ec = (A, B, W1, b1, W2, b2, alpha)):
    the route's GEMV, or with ``config`` the M > 1 GEMV kernel in that config."""
    M = x2.shape[0]
    if M > _t.GEMV_MAX_M:
        raise ValueError(f"w4a16_gemv: M={M} > {_t.GEMV_MAX_M}; use the GEMM kernel")
    if config is not None:
        return _t.w4a16_gemv_small(x2, qweight, scales, zeros, G, bias, ec=ec, act=act, config=config, out=out)
    p = problem_of("ec" if ec is not None else "w4a16", x2, qweight, scales, zeros, G, bias, ec, lowering="fused")
    rt = _r._ec_route(p, []) if ec is not None else _r._w4_gemv(p, [])  # (the caller asked for the Triton kernels)
    if ec is not None:
        return launch_ec_decode(rt, x2, qweight, scales, zeros, G, bias, ec, act, out=out)
    return launch_w4(rt, x2, qweight, scales, zeros, G, bias, out=out)


def launch_ec_decode(rt: Route, x2, qweight, scales, zeros, G: int, bias, ec: tuple, act: str = "silu",
                     out=None, words=None) -> torch.Tensor:
    """The decode EC GEMV of route ``rt`` (``words``: the CUDA-core GEMV layout itself, ``qweight`` unused)."""
    k, cfg = rt.kernel, rt.config
    if k == "ec_self":
        return _t.w4a16_gemv1(x2, qweight, scales, zeros, G, bias, ec=ec, act=act, config=cfg, out=out, words=words)
    if k == "ec_self_tma":
        return tma_self_gemv(x2, qweight, scales, zeros, G, bias, ec, act, cfg, out=out)
    if k == "ec_pair_tma":
        return tma_ec_gemv(x2, qweight, scales, zeros, G, bias, ec, act, cfg, ec[1], None, out=out)
    if k == "ec_pair":
        return _ed.w4a16_gemv1_ec_pdl(x2, qweight, scales, zeros, G, bias, ec, act=act, config=cfg, out=out,
                                      words=words)
    if k == "ec_gemv":
        return _t.w4a16_gemv_small(x2, qweight, scales, zeros, G, bias, ec=ec, act=act, config=cfg, out=out)
    raise ValueError(f"launch_ec_decode: route {rt.describe()} is not a decode EC kernel")


def tma_self_gemv(x2, qweight, scales, zeros, G: int, bias, ec: tuple, act: str, config: tuple,
                  out=None, publish: bool = True) -> torch.Tensor:
    """The decode EC in one launch of the TMA kernel (``w4a16_gemv_tma_ec.EcSelf``; ``publish``: see there); the
    other arguments are ``w4a16_gemv_tma``'s."""
    return _gt.w4a16_gemv_tma(x2, qweight, scales, zeros, G, bias, config=config, out=out,
                              ec=_gte.EcSelf(ec, act, publish))


def tma_ec_gemv(x2, qweight, scales, zeros, G: int, bias, ec: tuple, act: str, config: tuple, b, roff,
                norm=None, descs=None, glu: bool = False, out=None) -> torch.Tensor:
    """The decode EC pair on the TMA kernel: the producer grid for ``ec = (A, B, W1, b1, W2, b2, alpha)``
    (x RMS-normalised first with ``norm``), then ``w4a16_gemv_tma`` PDL-launched behind it with the EC
    epilogue reading B's rows ``b`` (and row offsets ``roff``, see ``w4a16_gemv_tma_ec.EcEpilogue``). The other arguments
    are ``w4a16_gemv_tma``'s."""
    gh, pdl = _ed.ec_produce(x2, ec, act, norm)
    epi = _gte.EcEpilogue(b, roff, gh, ec[6], ec[0].shape[0], _t.GH_COPIES, wait=pdl)
    return _gt.w4a16_gemv_tma(x2, qweight, scales, zeros, G, bias, config=config, out=out, descs=descs, glu=glu,
                              norm=norm, ec=epi)


def gemv1_ec(x2, qweight, scales, zeros, G: int, bias, ec: tuple, act: str = "silu",
             out: Optional[torch.Tensor] = None, words: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Y[1, N] = M = 1 W4 GEMV + the EC ``ec``, on the route ``route.ec_decode_route`` gives. ``words``: the
    GEMV layout itself (``qweight`` unused; ``w4a16_cat``'s concatenations)."""
    N = words.shape[0] if words is not None else qweight.shape[0]
    p = problem_of("ec", x2, qweight if words is None else words, scales, zeros, G, bias, ec, N=N,
                   lowering="fused").replace(words=words is not None)
    return launch_ec_decode(_r.ec_decode_route(p), x2, qweight, scales, zeros, G, bias, ec, act, out=out, words=words)


def w4a16_gemm(x2, qweight, scales, zeros, G: int, bias, config: Optional[tuple] = None,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Y[M, N] for any M through the GEMM the tuned table gives the shape, or ``config`` (a table value:
    the Triton GEMM's tuple, ``("dequant_cublas",)``, ``("dequant_cublas_pipe", chunks)``,
    ``("wgmma", ...)``, ``("wgmma_ra", ...)``, ``("gemv_tma_rows", ...)``); where that kernel cannot run here,
    M's default."""
    p = problem_of("w4a16", x2, qweight, scales, zeros, G, bias, out=out)
    return launch_w4(_r.gemm_route(p, choice=config), x2, qweight, scales, zeros, G, bias, out=out)


def w4a16_linear_cuda(x, qweight, scales, zeros, group_size, bias, layout="spear", lowering="auto", crossover=DEFAULT_CROSSOVER_M):
    x2 = x.reshape(-1, x.shape[-1])
    rt = _took(route(problem_of("w4a16", x2, qweight, scales, zeros, group_size, bias, layout=layout)))
    if rt.kernel == "reference":
        return _refs.w4a16_linear_ref(x, qweight, scales, zeros, group_size, bias, layout)
    _check_triton_call("spear::w4a16_linear", x2, qweight, group_size)
    y = launch_w4(rt, x2.contiguous(), qweight, scales, zeros, group_size, _dense(bias))
    return y.reshape(*x.shape[:-1], y.shape[-1])


def ec_linear_cuda(x, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act="silu",
                   layout="spear", lowering="auto", crossover=DEFAULT_CROSSOVER_M):
    x2 = x.reshape(-1, x.shape[-1])
    ec = (A, B, W1, b1, W2, b2, alpha)
    rt = _took(route(problem_of("ec", x2, qweight, scales, zeros, group_size, bias, ec, layout=layout, lowering=lowering,
                          crossover=crossover)))
    if rt.kernel == "reference":
        return _refs.ec_linear_ref(x, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act,
                                   layout)
    _check_triton_call("spear::ec_linear", x2, qweight, group_size)
    x2, bias = x2.contiguous(), _dense(bias)
    if rt.kernel.startswith("ec_") and rt.kernel in _DECODE:
        y = launch_ec_decode(rt, x2, qweight, scales, zeros, group_size, bias, ec, act)
    else:
        y = launch_ec_overlapped(rt, x2, qweight, scales, zeros, group_size, bias, *ec, act)
    return y.reshape(*x.shape[:-1], y.shape[-1])


_DECODE = ("ec_self", "ec_self_tma", "ec_pair_tma", "ec_pair", "ec_gemv")


def _check_triton_call(op: str, x2: torch.Tensor, qweight: torch.Tensor, G: int) -> None:
    """What the Triton launches assume of x, beyond the op's own checks (which do not run on CUDA:
    registering a CUDA kernel replaces the op's body)."""
    if x2.shape[-1] != qweight.shape[1] * 2:
        raise ValueError(f"{op}: x has K={x2.shape[-1]} columns but the packed weight {tuple(qweight.shape)} holds "
                         f"K={qweight.shape[1] * 2}")


# ---------------------------------------------------------------- the prefill EC


def ec_overlapped(x2, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act,
                  side: Optional["torch.cuda.Stream"] = None, structure: str = "auto") -> torch.Tensor:
    """The prefill EC in ``structure`` ("auto": the one the tuned table measured fastest for the shape;
    ``route.ec_overlapped_route`` says what each structure runs). Each structure computes the
    reference's numbers within bf16 rounding; the structure decides speed only."""
    ec = (A, B, W1, b1, W2, b2, alpha)
    p = problem_of("ec", x2, qweight, scales, zeros, group_size, bias, ec, lowering="overlapped")
    rt = _r.ec_overlapped_route(p, structure)
    return launch_ec_overlapped(rt, x2, qweight, scales, zeros, group_size, bias, *ec, act, side=side)


def launch_ec_overlapped(rt: Route, x2, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act,
                         side: Optional["torch.cuda.Stream"] = None) -> torch.Tensor:
    k = rt.kernel
    if k == "ec_c_operand":
        return _dc.ec_dequant_cublas(x2, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act,
                                     side=side, high_priority_ec=bool(rt.option("high_priority")))
    if k in ("ec_in_gemm", "ec_in_gemm_ra", "ec_in_gemm_self"):
        return _ec_in_gemm(rt, x2, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act)
    if k != "ec_side":
        raise ValueError(f"launch_ec_overlapped: route {rt.describe()} is not a prefill EC structure")
    side = side or side_stream(x2.device, HIGH_PRIORITY if rt.option("high_priority") else 0)
    return ecs_beside_gemm(rt.parts[0], x2, qweight, scales, zeros, group_size, bias,
                           [(0, (A, B, W1, b1, W2, b2, alpha))], act, side)


def ecs_beside_gemm(gemm: Route, x2, qweight, scales, zeros, group_size: int, bias, ecs: list, act: str,
                    side: Optional["torch.cuda.Stream"]) -> torch.Tensor:
    """The side structure: Y = x2 W^T on ``gemm`` while each EC's shrink and gate run on ``side``, then each EC's
    expand added into its own columns of Y (``ecs``: ``(first column, (A, B, W1, b1, W2, b2, alpha))`` pairs, B's
    rows the EC's columns). Without CUDA (the Triton interpreter; ``side`` None) the same kernels run one after
    another."""
    cuda = x2.is_cuda
    main = torch.cuda.current_stream(x2.device) if cuda else None
    if cuda:
        side.wait_stream(main)  # x2 is ready on main
    with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
        hgs = [_ect.ec_shrink_gate(x2, A, W1, b1, W2, b2, act) for _, (A, _B, W1, b1, W2, b2, _a) in ecs]
    y = launch_w4(gemm, x2, qweight, scales, zeros, group_size, bias)
    if cuda:
        main.wait_stream(side)
        x2.record_stream(side)
    for hg, (n0, (_, B, *_, alpha)) in zip(hgs, ecs):
        if cuda:
            hg.record_stream(main)
        _ect.ec_expand_add_(y[:, n0:n0 + B.shape[0]], hg, B.contiguous(), alpha)
    return y


def _padded_b(B: torch.Tensor) -> torch.Tensor:
    """bf16 [N, R8]: the TMA copy needs 16-byte rows (columns past R are zeros, as in hg)."""
    N, R = B.shape
    if B.dtype == torch.bfloat16 and R % 8 == 0 and B.is_contiguous():
        return B

    def padded():
        r8 = -(-R // 8) * 8
        out = torch.zeros(N, r8, dtype=torch.bfloat16, device=B.device)
        out[:, :R] = B
        return out

    return derived_cached(_PADDED_B, [B], padded)


def _ec_in_gemm(rt: Route, x2, qweight, scales, zeros, group_size, bias, A, B, W1, b1, W2, b2, alpha, act):
    """The "in_gemm" structures: the EC's expand as one more K step of a wgmma GEMM. On the register-operand
    GEMM it is launched with PDL behind the gate kernel (its K loop runs while the gate finishes);
    "in_gemm_self" computes shrink and gate in the GEMM's own launch (``ec_gemm_self.py``)."""
    x2 = x2.contiguous()  # (here, before the gate: nothing may run between the gate and a PDL launch)
    N, K = qweight.shape[0], x2.shape[1]
    Bp = _padded_b(B)
    if rt.kernel == "ec_in_gemm_self":
        return _ra.w4a16_gemm_wgmma_ra_ec_self(x2, qweight, scales, zeros, group_size, bias, A, Bp, W1, b1, W2, b2,
                                               alpha, act, config=rt.config)
    shrink_gate = _sk.ec_shrink_gate_splitk if rt.option("shrink") == "splitk" else _ect.ec_shrink_gate
    if rt.kernel == "ec_in_gemm_ra":
        pdl = bool(rt.option("pdl"))
        if _ra.ring_params_wanted(rt.config, group_size, K, N):  # (made here, before the gate: see x2 above)
            _ra.ring_row_params(scales, zeros)
        hg = shrink_gate(x2, A, W1, b1, W2, b2, act, alpha=alpha, dtype=x2.dtype, pdl_trigger=pdl)
        return _ra.w4a16_gemm_wgmma_ra(x2, qweight, scales, zeros, group_size, bias, config=rt.config, ec=(hg, Bp),
                                       ec_wait=pdl)
    hg = shrink_gate(x2, A, W1, b1, W2, b2, act, alpha=alpha, dtype=x2.dtype)  # [M, R_P], alpha g h
    return _wg.w4a16_gemm_wgmma(x2, qweight, scales, zeros, group_size, bias, config=rt.config, ec=(hg, Bp))


# ---------------------------------------------------------------- concatenations


def _norm(norm_weight, norm_eps):
    return (norm_weight.contiguous(), norm_eps) if norm_weight is not None else None


def w4a16_cat_gemv1(x2, qweights, scales, zeros, group_size: int, biases, out=None,
                    norm: Optional[tuple] = None, rt: Optional[Route] = None) -> torch.Tensor:
    """Y[1, sum N] through one M = 1 GEMV over the concatenated parts (``route``: "cat_tma" or "cat_gemv1").
    ``norm`` (weight, eps): x is RMS-normalised first - by the TMA kernel as it stages x, or by
    ``rms_norm_ref``."""
    if rt is None:  # (the caller asked for the Triton kernels: no device check)
        rt = _r._cat_route(_r.cat_problem_of("w4a16_cat", x2, qweights, scales, zeros, group_size, biases,
                                             norm=norm is not None), [])
    if rt.kernel == "cat_tma":
        descs, _, s, z, b = _cat.concatenated_tma(qweights, scales, zeros, biases, group_size, rt.config)
        return _gt.w4a16_gemv_tma(x2, None, s, z, group_size, b, config=rt.config, out=out, descs=descs, norm=norm)
    words, s, z, b = _cat.concatenated(qweights, scales, zeros, biases)
    x2 = _refs.rms_norm_ref(x2, *norm) if norm is not None else x2
    return _t.w4a16_gemv1(x2, None, s, z, group_size, b, words=words, out=out, config=rt.config)


def w4a16_linear_cat_cuda(x, qweights, scales, zeros, group_size, biases, layout="spear", norm_weight=None,
                          norm_eps=1e-6):
    _ops.check_norm(x, norm_weight, norm_eps, "spear::w4a16_linear_cat")  # (the op's body does not run on CUDA)
    x2 = x.reshape(-1, x.shape[-1])
    norm = _norm(norm_weight, norm_eps)
    p = _r.cat_problem_of("w4a16_cat", x2, qweights, scales, zeros, group_size, biases, layout=layout,
                          norm=norm is not None)
    if zeros[0] is not None:  # the concatenation's GEMM may be one that takes integral zero points only
        p = p.replace(zeros_probe=lambda: all(_wg.integer_zeros(z) for z in zeros))
    rt = _took(route(p))
    if rt.kernel in ("cat_tma", "cat_gemv1"):
        y = w4a16_cat_gemv1(x2.contiguous(), qweights, scales, zeros, group_size, biases, norm=norm, rt=rt)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    if rt.kernel == "cat_gemm":  # one GEMM over the concatenated weights
        q, s, z, b = _cat.concatenated_weight(qweights, scales, zeros, biases)
        x2 = _refs.rms_norm_ref(x2, *norm) if norm is not None else x2
        y = launch_w4(rt.parts[0], x2.contiguous(), q, s, z, group_size, _dense(b))
        return y.reshape(*x.shape[:-1], y.shape[-1])
    x = _refs.rms_norm_ref(x, *norm) if norm is not None else x
    return torch.cat([w4a16_linear_cuda(x, q, s, z, group_size, b, layout)
                      for q, s, z, b in zip(qweights, scales, zeros, biases)], dim=-1)


def w4a16_linear_glu_cuda(x, qweights, scales, zeros, group_size, act="silu", layout="spear", norm_weight=None,
                          norm_eps=1e-6):
    """``spear::w4a16_linear_glu`` on CUDA: the TMA kernel with the GLU epilogue where the route says
    "glu_tma", else the concatenation's route and ``glu_of``."""
    _ops._check_glu(x, qweights, scales, zeros, group_size, act, layout)
    _ops.check_norm(x, norm_weight, norm_eps, "spear::w4a16_linear_glu")
    x2 = x.reshape(-1, x.shape[-1])
    norm = _norm(norm_weight, norm_eps)
    rt = _took(route(_r.cat_problem_of("w4a16_glu", x2, qweights, scales, zeros, group_size, layout=layout,
                                 norm=norm is not None, act=act)))
    if rt.kernel == "glu_tma":
        descs, _, s, z = _cat.concatenated_glu_tma(qweights, scales, zeros, group_size, rt.config)
        y = _gt.w4a16_gemv_tma(x2.contiguous(), None, s, z, group_size, None, config=rt.config, descs=descs, glu=True,
                               norm=norm)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return _refs.glu_of(w4a16_linear_cat_cuda(x, qweights, scales, zeros, group_size, [None, None], layout,
                                              norm_weight, norm_eps), act)


def ec_gemv1_cat(x2, qweights, scales, zeros, group_size: int, biases, As, Bs, W1s, b1s, W2s, b2s, alphas,
                 act: str = "silu", out=None, norm: Optional[tuple] = None, rt: Optional[Route] = None) -> torch.Tensor:
    """Y[1, sum N] of several EC-compensated linears sharing x: one M = 1 GEMV over the concatenated weights
    with one block-diagonal EC (``ec_cat.concatenated_ecs``): the TMA GEMV adding each row's EC in its
    epilogue ("ec_cat_tma"), else the single-EC decode kernels over the concatenation ("ec_cat_gemv1")."""
    if rt is None:  # (the caller asked for the Triton kernels: no device check)
        rt = _r._ec_cat_route(_r.cat_problem_of("ec_cat", x2, qweights, scales, zeros, group_size, biases, As, Bs,
                                                W1s, norm=norm is not None), [])
    ec = _ec_cat.concatenated_ecs(As, Bs, W1s, b1s, W2s, b2s, alphas, qweights)
    if rt.kernel == "ec_cat_tma":
        descs, _, s, z, b = _cat.concatenated_tma(qweights, scales, zeros, biases, group_size, rt.config)
        rows, offs = _ec_cat.ec_rows(Bs, alphas, qweights)
        return tma_ec_gemv(x2, None, s, z, group_size, b, ec, act, rt.config, rows, offs, norm=norm, descs=descs,
                                out=out)
    words, s, z, b = _cat.concatenated(qweights, scales, zeros, biases)
    x2 = _refs.rms_norm_ref(x2, *norm) if norm is not None else x2
    return launch_ec_decode(rt.parts[0], x2, None, s, z, group_size, b, ec, act, out=out, words=words)


def ec_cat_gemm(rt: Route, x2, qweights, scales, zeros, group_size: int, biases, As, Bs, W1s, b1s, W2s, b2s, alphas,
                act: str = "silu") -> torch.Tensor:
    """Y[M, sum N] of linears sharing x2 [M, K], some with ECs (None entries: none), at 2 <= M <= 256 (route
    "ec_cat_gemm"): one W4 GEMM over the concatenated weights on ``rt.parts[0]``, each EC the side structure's way -
    its shrink and gate on the side stream while the GEMM runs, then its expand added into its own columns of Y
    (``ecs_beside_gemm``)."""
    q, s, z, b = _cat.concatenated_weight(qweights, scales, zeros, biases)
    ecs, n0 = [], 0
    for qw, *ec in zip(qweights, As, Bs, W1s, b1s, W2s, b2s, alphas):
        if ec[0] is not None:
            ecs.append((n0, tuple(ec)))
        n0 += int(qw.shape[0])
    return ecs_beside_gemm(rt.parts[0], x2, q, s, z, group_size, _dense(b), ecs, act,
                           side_stream(x2.device) if x2.is_cuda else None)


def ec_linear_cat_cuda(x, qweights, scales, zeros, group_size, biases, As, Bs, W1s, b1s, W2s, b2s, alphas,
                       act="silu", layout="spear", norm_weight=None, norm_eps=1e-6):
    _ops._check_ec_cat(x, qweights, scales, zeros, group_size, biases, As, Bs, W1s, b1s, W2s, b2s, alphas, act, layout)
    _ops.check_norm(x, norm_weight, norm_eps, "spear::ec_linear_cat")
    x2 = x.reshape(-1, x.shape[-1])
    norm = _norm(norm_weight, norm_eps)
    p = _r.cat_problem_of("ec_cat", x2, qweights, scales, zeros, group_size, biases, As, Bs, W1s, layout=layout,
                          norm=norm is not None, act=act)
    if zeros[0] is not None:  # the concatenation's GEMM may be one that takes integral zero points only
        p = p.replace(zeros_probe=lambda: all(_wg.integer_zeros(z) for z in zeros))
    rt = _took(route(p))
    if rt.kernel == "ec_cat_gemm":
        x2 = _refs.rms_norm_ref(x2, *norm) if norm is not None else x2
        y = ec_cat_gemm(rt, x2.contiguous(), qweights, scales, zeros, group_size, biases, As, Bs, W1s, b1s, W2s, b2s,
                        alphas, act)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    if rt.kernel in ("ec_cat_tma", "ec_cat_gemv1"):
        y = ec_gemv1_cat(x2.contiguous(), qweights, scales, zeros, group_size, biases, As, Bs, W1s, b1s, W2s, b2s,
                         alphas, act, norm=norm, rt=rt)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    x = _refs.rms_norm_ref(x, *norm) if norm is not None else x
    return torch.cat([ec_linear_cuda(x, *part, act, layout) if _refs.has_ec(part)
                      else w4a16_linear_cuda(x, *part[:5], layout) for part in
                      _refs.ec_parts(qweights, scales, zeros, group_size, biases, As, Bs, W1s, b1s, W2s, b2s, alphas)],
                     dim=-1)


def ec_linear_glu_cuda(x, qweights, scales, zeros, group_size, As, Bs, W1s, b1s, W2s, b2s, alphas, act="silu",
                       layout="spear", norm_weight=None, norm_eps=1e-6):
    """``spear::ec_linear_glu`` on CUDA: the TMA kernel with the GLU epilogue and each row's EC added before
    it, PDL-launched behind the ECs' producer grid, where the route says "ec_glu_tma"; else ``glu_of`` of
    the EC concatenation."""
    _ops._check_ec_glu(x, qweights, scales, zeros, group_size, As, Bs, W1s, b1s, W2s, b2s, alphas, act, layout)
    _ops.check_norm(x, norm_weight, norm_eps, "spear::ec_linear_glu")
    x2 = x.reshape(-1, x.shape[-1])
    norm = _norm(norm_weight, norm_eps)
    rt = _took(route(_r.cat_problem_of("ec_glu", x2, qweights, scales, zeros, group_size, (), As, Bs, W1s, layout=layout,
                                 norm=norm is not None, act=act)))
    if rt.kernel == "ec_glu_tma":
        x2 = x2.contiguous()
        descs, _, s, z = _cat.concatenated_glu_tma(qweights, scales, zeros, group_size, rt.config)
        rows, offs = _ec_cat.ec_glu_rows(Bs, alphas, _gt.tile_geometry(rt.config)[0] // 2, qweights)
        ec = _ec_cat.concatenated_ecs(As, Bs, W1s, b1s, W2s, b2s, alphas, qweights)
        y = tma_ec_gemv(x2, None, s, z, group_size, None, ec, act, rt.config, rows, offs, norm=norm, descs=descs,
                             glu=True)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return _refs.glu_of(ec_linear_cat_cuda(x, qweights, scales, zeros, group_size, [None, None], As, Bs, W1s, b1s, W2s,
                                           b2s, alphas, act, layout, norm_weight, norm_eps))


def register_cuda_kernels() -> None:
    """Route the ops' CUDA dispatch key to these implementations (idempotent)."""
    if getattr(register_cuda_kernels, "_done", False):
        return
    for name, fn in (("w4a16_linear", w4a16_linear_cuda), ("ec_linear", ec_linear_cuda),
                     ("w4a16_linear_cat", w4a16_linear_cat_cuda), ("ec_linear_cat", ec_linear_cat_cuda),
                     ("w4a16_linear_glu", w4a16_linear_glu_cuda), ("ec_linear_glu", ec_linear_glu_cuda)):
        torch.library.register_kernel(f"spear::{name}", "cuda", fn)
    register_cuda_kernels._done = True  # type: ignore[attr-defined]
