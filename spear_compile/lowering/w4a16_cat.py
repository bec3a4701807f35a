"""CUDA implementation of ``spear::w4a16_linear_cat``: linears sharing one input as one GEMV.

At decode (M = 1) a Llama layer's q/k/v and gate/up projections are separate GEMVs over the same
activation. Small GEMVs waste the GPU: a 4096 x 4096 W4 GEMV on the H200 moves 8.4 MB in 6 us
(1.4 TB/s, one wave of programs: load, then compute, nothing to overlap), an 11008 x 4096 one 23 MB
in 12.5 us (1.9 TB/s). One GEMV over the concatenated weights runs more programs per launch and
pays one launch instead of three.

The concatenation (GEMV words, scales, zero points, biases) is made on first use and cached while
every part's storage lives and its version is unchanged, like ``w4a16_triton.gemv_words``; the
parts' own GEMV layouts are then never built. Anything else (M > 1, shapes the M = 1 kernel does not
take, other layouts or dtypes) runs each part through ``w4a16_linear``'s CUDA path and
concatenates, so the op is never slower than its parts by more than that copy.
"""
from __future__ import annotations

from typing import Optional

import torch

_CAT: dict = {}  # the concatenations, cached by w4a16_triton.derived_cached
_CAT_TMA: dict = {}  # per TMA config: the TMA kernel's tiles of the concatenations
_CAT_GLU: dict = {}  # per TMA config: gate / up concatenations interleaved for the GLU epilogue
GLU_ACTS = ("silu",)  # gate activations of spear::w4a16_linear_glu (the epilogue computes silu)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama models compute it (and as ``fuse_rmsnorm`` matches it): in fp32, rounded to
    x's dtype, then times the weight (rounded again)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def glu_of(y2: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` of a gate / up concatenation ``y2 [..., 2F]``, rounded as the unfused graph
    rounds (what Inductor computes for ``F.silu(g) * u``): silu in fp32, rounded to y2's dtype, times up."""
    if act not in GLU_ACTS:
        raise ValueError(f"glu_of: unknown gate activation {act!r}; expected one of {GLU_ACTS}")
    g, u = y2.chunk(2, dim=-1)
    return torch.nn.functional.silu(g.float()).to(y2.dtype) * u


def concatenated(qweights, scales, zeros, biases) -> tuple:
    """(words [sum N, K/8], scales [sum N, NG], zeros or None, bias or None) of the parts, cached.

    Biases: a part without one contributes zeros when another part has one. Zero points: all
    parts have them or none does (``gemv1_cat_ok`` checks).
    """
    from .w4a16_triton import derived_cached, repack_gemv

    return derived_cached(_CAT, [*qweights, *scales, *zeros, *biases],
                          lambda: (torch.cat([repack_gemv(q) for q in qweights]),
                                   *_cat_params(qweights, scales, zeros, biases)))


def _cat_params(qweights, scales, zeros, biases) -> tuple:
    """(scales, zeros or None, bias or None) of the parts, concatenated (a part without a bias
    contributes zeros when another part has one)."""
    z = torch.cat(list(zeros)) if zeros[0] is not None else None
    b = None
    if any(x is not None for x in biases):
        ref = next(x for x in biases if x is not None)
        b = torch.cat([x if x is not None else ref.new_zeros(q.shape[0]) for x, q in zip(biases, qweights)])
    return torch.cat(list(scales)), z, b


def gemv1_cat_ok(x2: torch.Tensor, qweights, zeros, group_size: int) -> bool:
    """Whether the M = 1 kernel takes every part (and the zero points concatenate)."""
    from .w4a16_triton import gemv1_ok

    K = x2.shape[1]
    return (all(gemv1_ok(x2.shape[0], K, group_size, q) for q in qweights)
            and len({z is None for z in zeros}) == 1)


def concatenated_tma(qweights, scales, zeros, biases, group_size: int, config: tuple) -> tuple:
    """((weight descriptor, scale descriptor or None), the tiles they point into, scales, zeros or None,
    bias or None) of the parts for the TMA kernel, cached like ``concatenated`` (the concatenated
    packed weight itself is not kept)."""
    from .w4a16_triton import derived_cached

    def make() -> tuple:
        s, z, b = _cat_params(qweights, scales, zeros, biases)
        return (*_tma_operands(torch.cat(list(qweights)), s, z, group_size, config), s, z, b)

    return derived_cached(_CAT_TMA.setdefault(tuple(config), {}), [*qweights, *scales, *zeros, *biases], make)


def _tma_operands(qweight, scales, zeros, group_size: int, config: tuple) -> tuple:
    """((weight descriptor, scale descriptor or None), (tiles, scale tiles or None)) of one packed weight
    [N, K/2] and its scales / zeros for the TMA kernel in ``config`` (scale tiles only where the config
    brings them by TMA: OPS_SMEM, group-wise)."""
    from .w4a16_gemv_tma import OPS_SMEM, _descriptor, repack_scale_tiles, repack_tiles, tile_geometry

    K = qweight.shape[1] * 2
    bn, step, tr = tile_geometry(config)
    t = repack_tiles(qweight, config)
    st = repack_scale_tiles(scales, zeros, group_size, K, config) if config[4] == OPS_SMEM and group_size < K else None
    sd = _descriptor(st, [1, step // 128 * bn]) if st is not None else None
    return (_descriptor(t, [tr, 256]), sd), (t, st)


def w4a16_cat_gemv1(x2, qweights, scales, zeros, group_size: int, biases, out=None,
                    norm: Optional[tuple] = None) -> torch.Tensor:
    """Y[1, sum N] through one M = 1 GEMV over the concatenated parts: the TMA kernel where the tuned
    table measured it faster for the concatenated shape, else the CUDA-core kernel. ``norm``
    (weight, eps): x is RMS-normalised first - by the TMA kernel as it stages x where its config
    allows (``norm_ok``), else by ``rms_norm_ref``."""
    from .w4a16_gemv_tma import norm_ok, tma_config, w4a16_gemv_tma
    from .w4a16_triton import w4a16_gemv1

    N, K = sum(q.shape[0] for q in qweights), x2.shape[1]
    cfg = tma_config(N, K, group_size, x2, params=(*scales, *zeros))
    if cfg is not None and (norm is None or norm_ok(cfg)):
        descs, _, s, z, b = concatenated_tma(qweights, scales, zeros, biases, group_size, cfg)
        return w4a16_gemv_tma(x2, None, s, z, group_size, b, config=cfg, out=out, descs=descs, norm=norm)
    words, s, z, b = concatenated(qweights, scales, zeros, biases)
    x2 = rms_norm_ref(x2, *norm) if norm is not None else x2
    return w4a16_gemv1(x2, None, s, z, group_size, b, words=words, out=out)


def w4a16_linear_cat_cuda(x, qweights, scales, zeros, group_size, biases, layout="spear", norm_weight=None,
                          norm_eps=1e-6):
    from ..quant.ops import check_norm
    from .dispatch import _triton_ok, w4a16_linear_cuda

    check_norm(x, norm_weight, norm_eps, "spear::w4a16_linear_cat")  # (the op's body does not run on CUDA)
    x2 = x.reshape(-1, x.shape[-1])
    norm = (norm_weight.contiguous(), norm_eps) if norm_weight is not None else None
    if _triton_ok(x, layout) and x2.shape[0] == 1 and gemv1_cat_ok(x2, qweights, zeros, group_size):
        y = w4a16_cat_gemv1(x2.contiguous(), qweights, scales, zeros, group_size, biases, norm=norm)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    x = rms_norm_ref(x, *norm) if norm is not None else x
    return torch.cat([w4a16_linear_cuda(x, q, s, z, group_size, b, layout)
                      for q, s, z, b in zip(qweights, scales, zeros, biases)], dim=-1)


def concatenated_glu_tma(qweights, scales, zeros, group_size: int, config: tuple) -> tuple:
    """((weight descriptor, scale descriptor or None), tiles, scales, zeros or None) of a gate / up pair
    for the TMA kernel's GLU epilogue: like ``concatenated_tma`` with the rows interleaved in blocks of
    BN / 2 (``glu_interleave``), so each CTA holds a block of gate rows and the matching up rows."""
    from .w4a16_gemv_tma import glu_interleave, tile_geometry
    from .w4a16_triton import derived_cached

    def make() -> tuple:
        F, half = qweights[0].shape[0], tile_geometry(config)[0] // 2
        s, z, _ = _cat_params(qweights, scales, zeros, [None, None])
        s = glu_interleave(s, F, half)
        z = glu_interleave(z, F, half) if z is not None else None
        q = glu_interleave(torch.cat(list(qweights)), F, half)
        return (*_tma_operands(q, s, z, group_size, config), s, z)

    return derived_cached(_CAT_GLU.setdefault(tuple(config), {}), [*qweights, *scales, *zeros], make)


def glu_config_for(F: int, K: int, G: int, dtype: torch.dtype, device: torch.device,
                   param_dtypes: tuple = ()) -> Optional[tuple]:
    """The TMA config whose GLU epilogue runs a gate / up pair of F rows each at M = 1, or None: the
    tuned table's config for the concatenated shape [2F, K] (where it measured the TMA kernel faster
    than the CUDA-core one), without a K-split, F a multiple of half its rows. Also what the
    ``fuse_glu`` pass asks before it rewrites on a GPU."""
    from .w4a16_gemv_tma import tile_geometry, tma_config_for, unpack_config

    cfg = tma_config_for(2 * F, K, G, dtype, device, param_dtypes=param_dtypes)
    if cfg is None or unpack_config(cfg)[5] != 1 or F % (tile_geometry(cfg)[0] // 2):
        return None
    return cfg


def glu_config(x2: torch.Tensor, qweights, scales, zeros, group_size: int) -> Optional[tuple]:
    """``glu_config_for`` of an activation x2 [1, K] and a gate / up pair."""
    F = qweights[0].shape[0]
    if (x2.shape[0] != 1 or len(qweights) != 2 or qweights[1].shape[0] != F
            or not gemv1_cat_ok(x2, qweights, zeros, group_size)):
        return None
    return glu_config_for(F, x2.shape[1], group_size, x2.dtype, x2.device,
                          tuple(p.dtype for p in (*scales, *zeros) if p is not None))


def w4a16_linear_glu_cuda(x, qweights, scales, zeros, group_size, act="silu", layout="spear", norm_weight=None,
                          norm_eps=1e-6):
    """``spear::w4a16_linear_glu`` on CUDA: the TMA kernel with the GLU epilogue where ``glu_config``
    finds one (and the RMSNorm prologue, if any, where ``norm_ok``), else the concatenated GEMV (or
    the parts) and ``glu_of``."""
    from ..quant.ops import _check_glu, check_norm
    from .dispatch import _triton_ok
    from .w4a16_gemv_tma import norm_ok, w4a16_gemv_tma

    # (the op's own checks do not run here: registering a CUDA kernel replaces the op's body)
    _check_glu(x, qweights, scales, zeros, group_size, act, layout)
    check_norm(x, norm_weight, norm_eps, "spear::w4a16_linear_glu")
    x2 = x.reshape(-1, x.shape[-1])
    norm = (norm_weight.contiguous(), norm_eps) if norm_weight is not None else None
    cfg = glu_config(x2, qweights, scales, zeros, group_size) if _triton_ok(x, layout) else None
    if cfg is not None and act == "silu" and (norm is None or norm_ok(cfg)):
        descs, _, s, z = concatenated_glu_tma(qweights, scales, zeros, group_size, cfg)
        y = w4a16_gemv_tma(x2.contiguous(), None, s, z, group_size, None, config=cfg, descs=descs, glu=True,
                           norm=norm)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return glu_of(w4a16_linear_cat_cuda(x, qweights, scales, zeros, group_size, [None, None], layout, norm_weight,
                                        norm_eps), act)
