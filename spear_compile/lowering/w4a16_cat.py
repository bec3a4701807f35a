"""CUDA implementation of ``spear::w4a16_linear_cat``: linears sharing one input as one GEMV.

At decode (M = 1) a Llama layer's q/k/v and gate/up projections are separate GEMVs over the same
activation. Small GEMVs waste the GPU: a 4096 x 4096 W4 GEMV on the H200 moves 8.4 MB in 6 us
(1.4 TB/s, one wave of programs: load, then compute, nothing to overlap), an 11008 x 4096 one 23 MB
in 12.5 us (1.9 TB/s). One GEMV over the concatenated weights runs more programs per launch and
pays one launch instead of three.

The concatenation (GEMV words, scales, zero points, biases) is made on first use and cached while
every part's storage lives and its version is unchanged, like ``w4a16_triton.gemv_words``; the
parts' own GEMV layouts are then never built. At 2 <= M <= 256 the op runs one GEMM over the concatenated
packed weights (``concatenated_weight``; ``route.CAT_GEMM_MAX_M`` has the measurement: faster than the parts
except on one untuned shape, 1.76x). Anything else (larger M, shapes the kernels do not take, other layouts or
dtypes) runs each part through ``w4a16_linear``'s CUDA path and concatenates, so there the op is never slower
than its parts by more than that copy.
"""
from __future__ import annotations

from typing import Optional

import torch

from .layout_cache import derived_cached, derived_peek  # noqa: F401
from .w4a16_triton import repack_gemv
from .w4a16_gemv_tma import OPS_SMEM, _descriptor, repack_scale_tiles, repack_tiles, tile_geometry
from .w4a16_gemv_tma import glu_interleave, tile_geometry

_CAT: dict = {}  # the concatenations, cached by w4a16_triton.derived_cached
_CAT_W: dict = {}  # the concatenated packed weights (the M > 1 GEMM's operand)
_CAT_TMA: dict = {}  # per TMA config: the TMA kernel's tiles of the concatenations
_CAT_GLU: dict = {}  # per TMA config: gate / up concatenations interleaved for the GLU epilogue


def concatenated(qweights, scales, zeros, biases) -> tuple:
    """(words [sum N, K/8], scales [sum N, NG], zeros or None, bias or None) of the parts, cached.

    Biases: a part without one contributes zeros when another part has one. Zero points: all
    parts have them or none does (``gemv1_cat_ok`` checks).
    """

    return derived_cached(_CAT, [*qweights, *scales, *zeros, *biases],
                          lambda: (torch.cat([repack_gemv(q) for q in qweights]),
                                   *_cat_params(qweights, scales, zeros, biases)))


def concatenated_weight(qweights, scales, zeros, biases) -> tuple:
    """(packed weight [sum N, K/2], scales, zeros or None, bias or None) of the parts, cached like
    ``concatenated``: the operands of one M > 1 GEMM over the parts (``route.CAT_GEMM_MAX_M``). It holds a copy
    of the parts' packed weights for as long as they live (the GEMM's own layout of it is derived from it)."""
    return derived_cached(_CAT_W, [*qweights, *scales, *zeros, *biases],
                          lambda: (torch.cat(list(qweights)), *_cat_params(qweights, scales, zeros, biases)))


def _cat_params(qweights, scales, zeros, biases) -> tuple:
    """(scales, zeros or None, bias or None) of the parts, concatenated (a part without a bias
    contributes zeros when another part has one)."""
    z = torch.cat(list(zeros)) if zeros[0] is not None else None
    b = None
    if any(x is not None for x in biases):
        ref = next(x for x in biases if x is not None)
        b = torch.cat([x if x is not None else ref.new_zeros(q.shape[0]) for x, q in zip(biases, qweights)])
    return torch.cat(list(scales)), z, b


def concatenated_tma(qweights, scales, zeros, biases, group_size: int, config: tuple) -> tuple:
    """((weight descriptor, scale descriptor or None), the tiles they point into, scales, zeros or None,
    bias or None) of the parts for the TMA kernel, cached like ``concatenated`` (the concatenated
    packed weight itself is not kept)."""
    def make() -> tuple:
        s, z, b = _cat_params(qweights, scales, zeros, biases)
        return (*_tma_operands(torch.cat(list(qweights)), s, z, group_size, config), s, z, b)

    return derived_cached(_CAT_TMA.setdefault(tuple(config), {}), [*qweights, *scales, *zeros, *biases], make)


def _tma_operands(qweight, scales, zeros, group_size: int, config: tuple) -> tuple:
    """((weight descriptor, scale descriptor or None), (tiles, scale tiles or None)) of one packed weight
    [N, K/2] and its scales / zeros for the TMA kernel in ``config`` (scale tiles only where the config
    brings them by TMA: OPS_SMEM, group-wise)."""

    K = qweight.shape[1] * 2
    bn, step, tr = tile_geometry(config)
    t = repack_tiles(qweight, config)
    st = repack_scale_tiles(scales, zeros, group_size, K, config) if config[4] == OPS_SMEM and group_size < K else None
    sd = _descriptor(st, [1, step // 128 * bn]) if st is not None else None
    return (_descriptor(t, [tr, 256]), sd), (t, st)


def concatenated_glu_tma(qweights, scales, zeros, group_size: int, config: tuple) -> tuple:
    """((weight descriptor, scale descriptor or None), tiles, scales, zeros or None) of a gate / up pair
    for the TMA kernel's GLU epilogue: like ``concatenated_tma`` with the rows interleaved in blocks of
    BN / 2 (``glu_interleave``), so each CTA holds a block of gate rows and the matching up rows."""
    def make() -> tuple:
        F, half = qweights[0].shape[0], tile_geometry(config)[0] // 2
        s, z, _ = _cat_params(qweights, scales, zeros, [None, None])
        s = glu_interleave(s, F, half)
        z = glu_interleave(z, F, half) if z is not None else None
        q = glu_interleave(torch.cat(list(qweights)), F, half)
        return (*_tma_operands(q, s, z, group_size, config), s, z)

    return derived_cached(_CAT_GLU.setdefault(tuple(config), {}), [*qweights, *scales, *zeros], make)
