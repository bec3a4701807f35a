"""Configs of the TMA-fed GEMV (``w4a16_gemv_tma``): what a config tuple means and which fusions it allows.

A leaf: the kernel, its EC epilogue (``w4a16_gemv_tma_ec``) and the route (``dispatch/route.py``) read the
same rules from here.
"""
from __future__ import annotations

ROW = 256  # int32 words per row of the TMA view (1 KB: the box's inner dimension)

# (WARPS, RB, CH, STAGES, OPS[, SPLIT]): K slices per CTA, row blocks of 16, 128-column chunks per warp
# and step, ring depth, where each step's x and scales come from (OPS_GLOBAL loads them from global
# memory before waiting for the step's tile, OPS_PREFETCH loads the next step's into registers during
# this step, OPS_SMEM stages all of x in shared memory once and brings the scales with the tile by
# TMA), SPLIT, the programs per row block that share its K steps (default 1; 2 doubles the grid where
# the row blocks alone fill half the GPU: measured slower on every benchmark shape on an H200, one config
# kept for its tests). (A persistent variant, a few programs per SM streaming many row blocks, measured
# slower and was removed: docs/kernels.md.)
OPS_GLOBAL, OPS_PREFETCH, OPS_SMEM = 0, 1, 2
TMA_CONFIGS = [(4, 2, 2, 2, 2), (8, 2, 2, 2, 2), (2, 2, 2, 2, 2), (4, 2, 4, 2, 2), (2, 2, 4, 2, 2),
               (4, 2, 1, 2, 2), (8, 2, 1, 3, 0), (4, 2, 2, 2, 2, 2), (4, 2, 2, 3, 2), (4, 4, 2, 2, 2)]


def tile_geometry(config: tuple) -> tuple[int, int, int]:
    """(BN rows, STEP columns, TR rows of ROW words) of one CTA tile for a config."""
    warps, rb, ch = config[:3]
    bn, nb = 16 * rb, warps * ch
    return bn, 128 * nb, nb * bn * 16 // ROW  # BN * 16 = 256 RB words: always whole rows


def unpack_config(config: tuple) -> tuple:
    """(WARPS, RB, CH, STAGES, OPS, SPLIT): SPLIT (K runs per row block) defaults to 1."""
    if len(config) not in (5, 6):
        raise ValueError(f"TMA GEMV config {config}: expected (WARPS, RB, CH, STAGES, OPS[, SPLIT])")
    vals = tuple(int(v) for v in config)
    warps, rb, ch, stages, ops, split = vals + (1,)[len(vals) - 5:]
    pow2 = all(v > 0 and v & (v - 1) == 0 for v in (warps, rb, ch))
    if not pow2 or stages < 1 or ops not in (OPS_GLOBAL, OPS_PREFETCH, OPS_SMEM) or split not in (1, 2):
        raise ValueError(f"TMA GEMV config {config}: WARPS, RB and CH must be powers of two, STAGES >= 1, OPS in "
                         f"{{0, 1, 2}} and SPLIT 1 or 2 (two partials add up the same in either order)")
    return warps, rb, ch, stages, ops, split


def split_fits(config: tuple, K: int) -> bool:
    """Whether the config's K-split divides K's steps (each run takes whole steps): the wrapper refuses
    a config where it does not, the route skips it and the tuner does not time it."""
    return -(-K // tile_geometry(config)[1]) % unpack_config(config)[5] == 0


def ec_ok(config: tuple) -> bool:
    """Whether a config can add the decode EC in its epilogue: no K-split."""
    return unpack_config(config)[5] == 1


def norm_ok(config: tuple) -> bool:
    """Whether a config can normalise x as it stages it: x in shared memory (OPS 2), no K-split."""
    _, _, _, _, ops, split = unpack_config(config)
    return ops == OPS_SMEM and split == 1
