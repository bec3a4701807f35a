"""CUDA implementation of ``spear::ec_linear_cat`` / ``spear::ec_linear_glu``: EC-compensated linears sharing
one input as one GEMV with one EC.

Reference: the ops' bodies in ``quant/ops.py`` (``ec_linear_ref`` per part, concatenated; ``glu_of`` for
the GLU). Made at decode by ``passes/fuse_shared_input.py`` (``fuse_shared_input_ec``) and
``passes/fuse_glu.py``, with the RMSNorm in front moved in by ``passes/fuse_rmsnorm.py``.

The parts' ECs become one block-diagonal EC (``concatenated_ecs``) for the fused-EC kernels (the
producer grid + PDL-launched CUDA-core GEMV of ``ec_decode_triton``). Where the tuned table runs the
concatenated shape on the TMA kernel, that kernel adds each row's EC in its epilogue instead
(``w4a16_gemv_tma_ec``), reading only the row's own block of the block-diagonal B (``ec_rows``);
``ec_epilogue_ok`` says where (also asked by the passes). The plain concatenations (weights, scales,
TMA tiles, the GLU interleave) are ``w4a16_cat``'s.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import envs
from .w4a16_cat import (concatenated, concatenated_glu_tma, concatenated_tma, gemv1_cat_ok, glu_config, glu_of,
                        rms_norm_ref)

_CAT_EC: dict = {}  # block-diagonal concatenations of ECs sharing an input
_EC_ROWS: dict = {}  # per-row EC columns of concatenated ECs (the TMA kernel's EC epilogue)
_EC_GLU_ROWS: dict = {}  # per GLU half-block: those rows interleaved like the gate / up weights
EC_RC_MAX = 64  # the most EC columns per row the TMA epilogue takes (its [BN, RC] operands live in registers
# through the K loop; compiled and measured at 64)


def ec_parts(qweights, scales, zeros, group_size, biases, As, Bs, W1s, b1s, W2s, b2s, alphas) -> list:
    """Per part of an ``ec_linear_cat``: the ``(qweight, scales, zeros, group_size, bias, A, B, W1, b1,
    W2, b2, alpha)`` arguments of its ``ec_linear`` (the op's checks, reference and fallback)."""
    return [(q, s, z, group_size, b, A, B, W1, b1, W2, b2, al)
            for q, s, z, b, A, B, W1, b1, W2, b2, al in zip(qweights, scales, zeros, biases, As, Bs, W1s, b1s,
                                                               W2s, b2s, alphas)]


def concatenated_ecs(As, Bs, W1s, b1s, W2s, b2s, alphas) -> tuple:
    """One EC equal to several ECs that share an input, for one GEMV over their concatenated weights:
    ``(A, B, W1, b1, W2, b2, alpha)`` with A stacked ([sum R, K]), the gate block-diagonal (W1 [sum D,
    sum R], W2 [sum R, sum D], biases stacked: each part's gate sees only its own h), B block-diagonal
    ([sum N, sum R]: part i's rows read only part i's g * h) with each part's alpha folded into its
    rows (in fp32, then B's dtype), and alpha = 1. Through ``ec_linear_ref`` or the fused EC kernels
    it computes what the parts compute separately (up to the rounding of alpha * B). Cached while
    every part lives and is unchanged, like ``concatenated``.

    Used by ``spear::ec_linear_cat`` (``fuse_shared_input`` with ``CompileConfig.fuse_shared_input_ec``:
    q/k/v or gate/up with ECs as one GEMV + one EC; on by default since it measured 2.731 -> 2.691 ms
    per E2E step, docs/kernels.md session 12)."""
    from .w4a16_triton import derived_cached

    def make() -> tuple:
        A = torch.cat(list(As))
        R = [a.shape[0] for a in As]
        N = [b.shape[0] for b in Bs]
        B = Bs[0].new_zeros(sum(N), sum(R))
        r0 = n0 = 0
        for b, al, r, n in zip(Bs, alphas, R, N):
            B[n0:n0 + n, r0:r0 + r] = (al.float() * b.float()).to(B.dtype)
            r0, n0 = r0 + r, n0 + n
        W1 = torch.block_diag(*W1s)
        W2 = torch.block_diag(*W2s)
        alpha = torch.ones((), dtype=alphas[0].dtype, device=alphas[0].device)
        return A, B, W1, torch.cat(list(b1s)), W2, torch.cat(list(b2s)), alpha

    return derived_cached(_CAT_EC, [*As, *Bs, *W1s, *b1s, *W2s, *b2s, *alphas], make)


def ec_rows(Bs, alphas) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [sum N, RC], offsets [sum N] int32) of ECs sharing an input, for the TMA kernel's EC epilogue
    (``w4a16_gemv_tma_ec._ec_rows``): row n of part i holds ``alpha_i * B_i[n]`` (in fp32, then B's dtype,
    as ``concatenated_ecs`` rounds it) padded to RC = max rank with zeros, and its offset is part i's
    first column of the stacked g * h. ``sum_j rows[n, j] gh[off[n] + j]`` is then row n of the
    block-diagonal ``B gh`` of ``concatenated_ecs``, reading RC instead of sum R columns per row (a
    third of the bytes for q/k/v). Cached like ``concatenated``."""
    from .w4a16_triton import derived_cached

    def make() -> tuple:
        rc = max(b.shape[1] for b in Bs)
        rows, offs, r0 = [], [], 0
        for b, al in zip(Bs, alphas):
            n, r = b.shape
            rows.append(torch.nn.functional.pad((al.float() * b.float()).to(b.dtype), (0, rc - r)))
            offs.append(torch.full((n,), r0, dtype=torch.int32, device=b.device))
            r0 += r
        return torch.cat(rows).contiguous(), torch.cat(offs)

    return derived_cached(_EC_ROWS, [*Bs, *alphas], make)


def ec_rows_emulated(gh: torch.Tensor, rows: torch.Tensor, offs: torch.Tensor, R: int) -> torch.Tensor:
    """What the TMA kernel's EC epilogue adds per row, in PyTorch (fp32): the CPU check of ``ec_rows``."""
    cols = offs.long()[:, None] + torch.arange(rows.shape[1], device=rows.device)[None, :]
    g = torch.where(cols < R, gh.float()[cols.clamp_max(R - 1)], torch.zeros((), device=gh.device))
    return (rows.float() * g).sum(1)


def ec_epilogue_ok(cfg: Optional[tuple], device: torch.device, norm: bool, rc: Optional[int] = None) -> bool:
    """Whether the TMA kernel in ``cfg`` (the tuned table's for the shape, or None) adds a decode EC in
    its epilogue on ``device``: PDL runs there (Hopper: the GEMV waits for the EC's producer grid only
    before its epilogue), the config allows the EC epilogue (``ec_ok``) and, with ``norm``, the RMSNorm
    prologue (``norm_ok``), and each row reads at most ``EC_RC_MAX`` EC columns (``rc``: the largest
    part's rank; None: not known). ``SPEAR_NO_TMA_EC=1`` in the environment turns it off (the CUDA-core EC pair
    everywhere: for A/B measurements and as an escape hatch). Asked at run time (``ec_tma_config``) and
    by the passes before they rewrite (``fuse_rmsnorm``, ``fuse_glu``) or name the kernel
    (``phase_dispatch``)."""
    from .ec_decode_triton import pdl_ok
    from .w4a16_gemv_tma import ec_ok, norm_ok

    if cfg is None or envs.no_tma_ec() or (rc is not None and rc > EC_RC_MAX):
        return False
    return pdl_ok(device) and ec_ok(cfg) and (not norm or norm_ok(cfg))


def ec_tma_config(x2: torch.Tensor, N: int, group_size: int, params: tuple, norm: Optional[tuple],
                  rc: Optional[int] = None) -> Optional[tuple]:
    """The TMA config whose EC epilogue runs a decode EC GEMV of N rows (with the RMSNorm prologue when
    ``norm``), or None: the tuned table's TMA config for the shape (``tma_config``) where
    ``ec_epilogue_ok``."""
    from .w4a16_gemv_tma import tma_config

    cfg = tma_config(N, x2.shape[1], group_size, x2, params=params)
    return cfg if ec_epilogue_ok(cfg, x2.device, norm is not None, rc) else None


def ec_gemv1_cat(x2, qweights, scales, zeros, group_size: int, biases, As, Bs, W1s, b1s, W2s, b2s, alphas,
                 act: str = "silu", out=None, norm: Optional[tuple] = None) -> torch.Tensor:
    """Y[1, sum N] of several EC-compensated linears sharing x: one M = 1 GEMV over the concatenated
    weights with one block-diagonal EC (``concatenated_ecs``). Where the tuned table runs the
    concatenated shape on the TMA kernel (``ec_tma_config``): the EC's producer grid, then the TMA GEMV
    launched with PDL adding each row's part of the EC in its epilogue (``ec_rows``). Elsewhere the same
    fused-EC kernels as a single ``ec_linear`` (the PDL producer + CUDA-core GEMV pair on Hopper, else
    the single launch). ``norm`` (weight, eps): x is RMS-normalised first - by the producer and the TMA
    GEMV as they read it, or by ``rms_norm_ref`` on the other paths."""
    from .w4a16_triton import gemv1_ec

    N = sum(q.shape[0] for q in qweights)
    ec = concatenated_ecs(As, Bs, W1s, b1s, W2s, b2s, alphas)
    cfg = ec_tma_config(x2, N, group_size, (*scales, *zeros), norm, max(b.shape[1] for b in Bs))
    if cfg is not None:
        from .w4a16_gemv_tma_ec import tma_ec_gemv

        descs, _, s, z, b = concatenated_tma(qweights, scales, zeros, biases, group_size, cfg)
        rows, offs = ec_rows(Bs, alphas)
        return tma_ec_gemv(x2, None, s, z, group_size, b, ec, act, cfg, rows, offs, norm=norm, descs=descs, out=out)
    words, s, z, b = concatenated(qweights, scales, zeros, biases)
    x2 = rms_norm_ref(x2, *norm) if norm is not None else x2
    return gemv1_ec(x2, None, s, z, group_size, b, ec, act, out=out, words=words)


def ec_linear_cat_cuda(x, qweights, scales, zeros, group_size, biases, As, Bs, W1s, b1s, W2s, b2s, alphas,
                       act="silu", layout="spear", norm_weight=None, norm_eps=1e-6):
    from ..quant.ops import _check_ec_cat, check_norm
    from .dispatch import _triton_ok, ec_linear_cuda

    # (the op's own checks do not run here: registering a CUDA kernel replaces the op's body)
    _check_ec_cat(x, qweights, scales, zeros, group_size, biases, As, Bs, W1s, b1s, W2s, b2s, alphas, act, layout)
    check_norm(x, norm_weight, norm_eps, "spear::ec_linear_cat")
    x2 = x.reshape(-1, x.shape[-1])
    norm = (norm_weight.contiguous(), norm_eps) if norm_weight is not None else None
    if _triton_ok(x, layout) and x2.shape[0] == 1 and gemv1_cat_ok(x2, qweights, zeros, group_size):
        y = ec_gemv1_cat(x2.contiguous(), qweights, scales, zeros, group_size, biases, As, Bs, W1s, b1s, W2s, b2s,
                         alphas, act, norm=norm)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    x = rms_norm_ref(x, *norm) if norm is not None else x
    return torch.cat([ec_linear_cuda(x, *part, act, layout) for part in
                      ec_parts(qweights, scales, zeros, group_size, biases, As, Bs, W1s, b1s, W2s, b2s, alphas)], dim=-1)


def ec_glu_rows(Bs, alphas, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ec_rows`` of a gate / up pair, rows interleaved in blocks of ``half`` (``glu_interleave``) like
    the weights of ``concatenated_glu_tma``, so each GLU CTA's EC rows are its own. Cached."""
    from .w4a16_gemv_tma import glu_interleave
    from .w4a16_triton import derived_cached

    def make() -> tuple:
        rows, offs = ec_rows(Bs, alphas)
        F = Bs[0].shape[0]
        return glu_interleave(rows, F, half).contiguous(), glu_interleave(offs, F, half).contiguous()

    return derived_cached(_EC_GLU_ROWS.setdefault(half, {}), [*Bs, *alphas], make)


def ec_linear_glu_cuda(x, qweights, scales, zeros, group_size, As, Bs, W1s, b1s, W2s, b2s, alphas, act="silu",
                       layout="spear", norm_weight=None, norm_eps=1e-6):
    """``spear::ec_linear_glu`` on CUDA: the TMA kernel with the GLU epilogue and each row's EC added
    before it, PDL-launched behind the ECs' producer grid (``ec_produce``), where ``glu_config`` finds a
    config and ``ec_epilogue_ok``; else ``glu_of`` of the EC concatenation."""
    from ..quant.ops import _check_ec_glu, check_norm
    from .dispatch import _triton_ok
    from .w4a16_gemv_tma import tile_geometry
    from .w4a16_gemv_tma_ec import tma_ec_gemv

    # (the op's own checks do not run here: registering a CUDA kernel replaces the op's body)
    _check_ec_glu(x, qweights, scales, zeros, group_size, As, Bs, W1s, b1s, W2s, b2s, alphas, act, layout)
    check_norm(x, norm_weight, norm_eps, "spear::ec_linear_glu")
    x2 = x.reshape(-1, x.shape[-1])
    norm = (norm_weight.contiguous(), norm_eps) if norm_weight is not None else None
    cfg = glu_config(x2, qweights, scales, zeros, group_size) if _triton_ok(x, layout) else None
    if ec_epilogue_ok(cfg, x.device, norm is not None, max(b.shape[1] for b in Bs)):
        x2 = x2.contiguous()
        descs, _, s, z = concatenated_glu_tma(qweights, scales, zeros, group_size, cfg)
        rows, offs = ec_glu_rows(Bs, alphas, tile_geometry(cfg)[0] // 2)
        ec = concatenated_ecs(As, Bs, W1s, b1s, W2s, b2s, alphas)
        y = tma_ec_gemv(x2, None, s, z, group_size, None, ec, act, cfg, rows, offs, norm=norm, descs=descs, glu=True)
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return glu_of(ec_linear_cat_cuda(x, qweights, scales, zeros, group_size, [None, None], As, Bs, W1s, b1s, W2s, b2s,
                                     alphas, act, layout, norm_weight, norm_eps))
