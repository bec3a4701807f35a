"""The TMA-ring M = 1 GEMV (``lowering/w4a16_gemv_tma.py``).

Gluon kernels do not run in Triton's interpreter: on CPU the re-tiling is checked by undoing it and
running the Gluon kernel's emulation against fp64 (odd N and K that need padding included), and the
kernel is compiled for sm_90 (every layout conversion in it is asserted free). On a GPU the kernel
runs against fp64 and the reference.
"""

import pytest
import torch

from spear_compile.dispatch import keys as TK
from spear_compile.ops import refs

from spear_compile.dispatch import route as R

from spear_compile.lowering import device as capability

from tests.helpers import use_tuned_table

from spear_compile.ops.w4a16_ref import w4a16_linear_ref

from tests.helpers import exact_gemv as _exact, gemv_case as _case, run_compiled

gt = pytest.importorskip("spear_compile.lowering.w4a16_gemv_tma")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not gt.HAS_TMA, reason="needs Triton with Gluon and its Hopper TMA ops (>= 3.5)")


@pytest.mark.parametrize("config", [(8, 2, 1, 4, 1), (4, 1, 1, 8, 0)])
def test_tiles_round_trip_through_the_emulation(config):
    """N = 45 and K = 640 are not whole tiles: the padding must not move a word or add a product."""
    N, K, G = 45, 640, 128
    x, q, qw, s, z, b = _case(N, K, G)
    tiles = gt.repack_tiles(qw, config)
    bn, step, tr = gt.tile_geometry(config)
    assert tiles.shape == (-(-N // bn) * -(-K // step) * tr, gt.ROW)
    y = gt.tiles_emulated(x, tiles, s, z, G, b, N, config)
    ex = _exact(x, q, s, z, G, b)
    assert ((y.double() - ex).abs() <= ex.abs() * 2 ** -7 + 1e-6).all()


@pytest.mark.parametrize("G", [128, 256])
def test_scale_tiles_hold_each_slices_group(G):
    """Tile (b, t), slice j, row n holds (scale, zero) of row b BN + n at column t STEP + 128 j."""
    config = (8, 1, 1, 4, 2)
    N, K = 45, 1280
    _, _, _, s, z, _ = _case(N, K, G)
    bn, step, _ = gt.tile_geometry(config)
    nb, kt = step // 128, -(-K // step)
    tiles = gt.repack_scale_tiles(s, z, G, K, config).view(-1, kt, nb, bn)
    sv, zv = s.view(torch.int16).to(torch.int32) & 0xFFFF, z.view(torch.int16).to(torch.int32) & 0xFFFF
    for b in range(tiles.shape[0]):
        for t in range(kt):
            for j in range(nb):
                col = t * step + 128 * j
                rows = torch.arange(b * bn, min(b * bn + bn, N))
                if col >= K:
                    continue
                got = tiles[b, t, j, : len(rows)]
                assert torch.equal(got & 0xFFFF, sv[rows, col // G]) and torch.equal((got >> 16) & 0xFFFF, zv[rows, col // G])
    assert torch.equal(gt.repack_scale_tiles(s, None, G, K, config) >> 16, torch.zeros_like(tiles.view(-1, nb * bn)))


def test_tile_layout_is_contiguous_per_warp():
    """A warp's 32 lanes x 4 words cover 128 consecutive words of the tile (no bank conflicts)."""
    reg, lane, warp = gt.tile_layout_bases(8, 2, 1)
    flat = [r * gt.ROW + c for r, c in lane]
    assert sorted(flat) == [4, 8, 16, 32, 64]
    assert [r * gt.ROW + c for r, c in reg[:2]] == [1, 2]


def test_config_unpacking_and_host_errors():
    """Configs are validated, and shapes that do not fit raise before any launch (on CPU too)."""
    assert gt.unpack_config((4, 2, 2, 2, 2)) == (4, 2, 2, 2, 2, 1)
    assert gt.unpack_config((4, 2, 2, 2, 2, 2)) == (4, 2, 2, 2, 2, 2)
    for bad in ((4, 2, 2, 2), (4, 2, 3, 2, 2), (4, 2, 2, 0, 2), (4, 2, 2, 2, 3), (4, 2, 2, 2, 2, 3),
                (4, 2, 2, 2, 2, 1, 4), (4, 2, 2, 2, 2, 1, 1, 1)):  # (a seventh value, the removed persistence)
        with pytest.raises(ValueError, match="expected|powers of two"):
            gt.unpack_config(bad)
    x, q, qw, s, z, b = _case(64, 2560, 128)  # 2560 columns = 3 steps of 1024 (padded): SPLIT 2 cannot share them
    with pytest.raises(ValueError, match="splits K into 2 runs"):
        gt.w4a16_gemv_tma(x, qw, s, z, 128, None, config=(4, 2, 2, 2, 2, 2))
    with pytest.raises(ValueError, match="packed weight"):
        gt.w4a16_gemv_tma(x, qw[:, :640], s, z, 128, None, config=(4, 2, 2, 2, 2))
    with pytest.raises(ValueError, match="scales"):
        gt.w4a16_gemv_tma(x, qw, s[:, :10], z, 128, None, config=(4, 2, 2, 2, 2))
    with pytest.raises(ValueError, match="bias"):
        gt.w4a16_gemv_tma(x, qw, s, z, 128, b[:10], config=(4, 2, 2, 2, 2))
    if not gt._tma_capable(torch.device(DEV)):
        with pytest.raises(ValueError, match="sm_90"):
            gt.w4a16_gemv_tma(x, qw, s, z, 128, None, config=(4, 2, 2, 2, 2))


def test_scale_tiles_need_bf16():
    _, _, _, s, z, _ = _case(32, 1024, 128)
    for ss, zz in ((s.half(), z), (s, z.float())):
        with pytest.raises(ValueError, match="bf16"):
            gt.repack_scale_tiles(ss, zz, 128, 1024, (4, 2, 2, 2, 2))


@pytest.mark.parametrize("G", [128, 512, None])
def test_concatenated_tiles_equal_the_parts(G):
    """``w4a16_cat.concatenated_tma``: one set of tiles over the parts (a part without a bias adds
    zeros) computes, through the emulation, what the parts' references compute."""
    from spear_compile.lowering import w4a16_cat as C

    K = 1024
    Gs = G or K
    parts = [_case(n, K, Gs, seed=n) for n in (40, 24, 59)]
    x = parts[0][0]
    qs, ss, zs = [p[2] for p in parts], [p[3] for p in parts], [p[4] for p in parts]
    bs = [parts[0][5], None, parts[2][5]]
    cfg = (4, 2, 2, 2, 2)
    _, (tiles, stiles), s, z, b = C.concatenated_tma(qs, ss, zs, bs, Gs, cfg)
    assert (stiles is None) == (G is None)
    y = gt.tiles_emulated(x, tiles, s, z, Gs, b, 123, cfg)
    ref = torch.cat([w4a16_linear_ref(x, q, sc, zp, Gs, bb) for q, sc, zp, bb in zip(qs, ss, zs, bs)], -1)
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 8e-3
    assert C.concatenated_tma(qs, ss, zs, bs, Gs, cfg)[1][0] is tiles  # cached


def test_repack_errors():
    with pytest.raises(ValueError, match="K=200"):
        gt.repack_tiles(torch.zeros(4, 100, dtype=torch.uint8), (8, 1, 1, 4, 1))


def test_kernel_compiles_for_sm90_with_free_layout_conversions():
    """Compiling is the check (``assert_trivial`` on both conversions); TMA loads and mma.sync must be
    in the PTX."""
    code = ("from spear_compile.lowering.w4a16_gemv_tma import TMA_CONFIGS, compile_sm90\n"
            "for cfg in TMA_CONFIGS:\n"
            "    for pc in (False, True):\n"
            "        ptx = compile_sm90(cfg, per_channel=pc)['ptx']\n"
            "        assert 'cp.async.bulk.tensor.2d' in ptx and 'mma.sync.aligned.m16n8k16' in ptx, cfg\n"
            "        # one MMA per 16 rows x 16 columns of the step; OPS = 2 takes D_ones from x's staged sums\n"
            "        # (no all-ones MMA), the other modes compute it by a second MMA per tile\n"
            "        n_mma = cfg[1] * cfg[2] * 8 * (1 if cfg[4] == 2 else 2)\n"
            "        assert ptx.count('mma.sync.aligned.m16n8k16') == n_mma, (cfg, ptx.count('mma.sync'))\n"
            "    if len(cfg) == 5:  # the GLU epilogue (not the K-split configs)\n"
            "        assert 'ex2' in compile_sm90(cfg, glu=True)['ptx'], cfg\n"
            "        if cfg[4] == 2:  # the RMSNorm prologue (x staged in shared memory)\n"
            "            assert 'rsqrt' in compile_sm90(cfg, norm=True, glu=True)['ptx'], cfg\n"
            "    if len(cfg) == 5:  # the decode EC's epilogue (PDL wait), with the norm and GLU where they run\n"
            "        ptx = compile_sm90(cfg, ec=True, norm=cfg[4] == 2, glu=cfg[4] == 2)['ptx']\n"
            "        assert 'griddepcontrol.wait' in ptx, cfg\n"
            "print('ok')\n")
    run_compiled(code)


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                    reason="runs the kernel: TMA needs CUDA sm_90+")
@pytest.mark.parametrize("G", [128, 256, None])
@pytest.mark.parametrize("config", gt.TMA_CONFIGS)
def test_kernel_matches_reference_on_gpu(G, config):
    """Three launches per config: a K-split config must leave its workspace zeroed for the next one."""
    N, K = 200, 3840  # neither a whole number of row blocks nor of K steps; every config's SPLIT divides them
    Gs = G or K
    x, q, qw, s, z, b = _case(N, K, Gs)
    x, qw, s, z, b = (t.cuda() for t in (x, qw, s, z, b))
    for zz, bb in ((z, b), (None, None), (z, b)):
        y = gt.w4a16_gemv_tma(x, qw, s, zz, Gs, bb, config=config)
        ex = _exact(x.cpu(), q, s.cpu(), zz.cpu() if zz is not None else None, Gs, bb.cpu() if bb is not None else None)
        assert ((y.cpu().double() - ex).abs() <= ex.abs() * 2 ** -7 + 1e-5).all()
        ref = w4a16_linear_ref(x, qw, s, zz, Gs, bb)
        assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 8e-3


def test_tma_route_takes_only_measured_shapes_that_can_run_here(monkeypatch):
    """The route takes the TMA kernel only from a tuned-table entry, and never where it cannot run
    (no sm_90+ GPU, fp16 activations, non-bf16 scales, K or G not multiples of 128, M > 1)."""
    from spear_compile.dispatch import route as R
    from tests.helpers import use_tuned_table

    use_tuned_table(monkeypatch, {TK.tma_key(256, 1024, 128): [4, 2, 2, 2, 2]})
    bf = torch.bfloat16
    p = R.Problem(op="w4a16", M=1, N=256, K=1024, G=128, dtype=bf, param_dtypes=(bf, bf), device=torch.device("cuda"))
    kernel = lambda **kw: R.route(p.replace(**kw)).kernel  # noqa: E731
    monkeypatch.setattr(gt, "_tma_capable", lambda device: False)
    if not R._triton.HAS_TRITON:
        pytest.skip("needs Triton")
    assert kernel() == "gemv1"
    monkeypatch.setattr(gt, "_tma_capable", lambda device: True)  # the rest as on a Hopper GPU
    assert kernel() == ("gemv1_tma" if gt.HAS_TMA else "gemv1")
    if not gt.HAS_TMA:
        return
    assert R.route(p).config == (4, 2, 2, 2, 2)
    assert kernel(K=2048) == "gemv1"  # no entry for this shape
    assert kernel(G=64) == "gemv1"
    assert kernel(dtype=torch.float16) == "gemv1"
    assert kernel(M=2) in ("gemm", "dequant_cublas")  # a GEMM (256 rows: dequantize + cuBLAS off the interpreter)
    assert kernel(param_dtypes=(torch.float16,)) == "gemv1"
    assert kernel(param_dtypes=(bf, torch.float32)) == "gemv1"
    monkeypatch.setenv("SPEAR_NO_TMA_GEMV", "1")
    assert kernel() == "gemv1"


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                    reason="runs the kernel: TMA needs CUDA sm_90+")
@pytest.mark.parametrize("G", [128, None])
def test_dispatch_routes_m1_through_the_tma_kernel_when_the_table_says_so(G, monkeypatch):
    """w4a16_gemv and the concatenated GEMV (q/k/v-style parts, one without a bias) take the TMA
    kernel for a shape with a table entry and match the reference; without the entry they do not."""
    from spear_compile.lowering import w4a16_cat as C
    from spear_compile.dispatch import cuda as D

    K = 1280
    Gs = G or K
    parts = [_case(n, K, Gs, seed=n) for n in (96, 40, 120)]
    x = parts[0][0].cuda()
    qs = [p[2].cuda() for p in parts]
    ss = [p[3].cuda() for p in parts]
    zs = [p[4].cuda() for p in parts]
    bs = [parts[0][5].cuda(), None, parts[2][5].cuda()]
    calls = []
    real = gt.w4a16_gemv_tma
    monkeypatch.setattr(gt, "w4a16_gemv_tma", lambda *a, **k: calls.append(k["config"]) or real(*a, **k))
    table = dict(TK.tuned_table())
    table[TK.tma_key(96, K, Gs)] = [4, 2, 2, 2, 2]
    table[TK.tma_key(256, K, Gs)] = [8, 2, 1, 2, 2]
    table = use_tuned_table(monkeypatch, table)
    y = D.w4a16_gemv(x, qs[0], ss[0], zs[0], Gs, bs[0])
    ref = w4a16_linear_ref(x, qs[0], ss[0], zs[0], Gs, bs[0])
    assert calls == [(4, 2, 2, 2, 2)]
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 8e-3
    y = D.w4a16_cat_gemv1(x, qs, ss, zs, Gs, bs)
    ref = torch.cat([w4a16_linear_ref(x, q, s, z, Gs, b) for q, s, z, b in zip(qs, ss, zs, bs)], -1)
    assert calls[-1] == (8, 2, 1, 2, 2) and len(calls) == 2
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 8e-3
    D.w4a16_gemv(x, qs[1], ss[1], zs[1], Gs, None)  # 40 rows: no entry, the CUDA-core kernel
    assert len(calls) == 2


def _glu_pair(F, K, G, seed=0):
    parts = [_case(F, K, G, seed=seed + i) for i in range(2)]
    return parts[0][0], [p[2] for p in parts], [p[3] for p in parts], [p[4] for p in parts]


def _glu_ref(x, qs, ss, zs, G):
    from spear_compile.ops.refs import glu_of

    return glu_of(torch.cat([w4a16_linear_ref(x, q, s, z, G, None) for q, s, z in zip(qs, ss, zs)], -1))


@pytest.mark.parametrize("config", [(4, 2, 2, 2, 2), (8, 1, 1, 4, 1)])
def test_glu_interleaved_tiles_pair_gate_and_up_rows_per_cta(config):
    """The GLU tiles (``concatenated_glu_tma``): through the emulation, CTA b's rows are gate rows
    b H .. b H + H - 1 then the same up rows (H = BN / 2), which is what the kernel's epilogue pairs."""
    from spear_compile.lowering import w4a16_cat as C

    bn, _, _ = gt.tile_geometry(config)
    F, K, G = 3 * bn, 1024, 128  # six CTAs of BN / 2 outputs each
    x, qs, ss, zs = _glu_pair(F, K, G)
    _, (tiles, _), s, z = C.concatenated_glu_tma(qs, ss, zs, G, config)
    y2 = gt.tiles_emulated(x, tiles, s, z, G, None, 2 * F, config).view(-1, 2, bn // 2)  # [CTA, gate|up, H]
    g, u = y2[:, 0].reshape(1, F), y2[:, 1].reshape(1, F)
    ref = [w4a16_linear_ref(x, q, sc, zp, G, None) for q, sc, zp in zip(qs, ss, zs)]
    for got, want in ((g, ref[0]), (u, ref[1])):
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 8e-3
    with pytest.raises(ValueError, match="blocks of"):
        gt.glu_interleave(torch.zeros(2 * F + 2, 4), F + 1, bn // 2)


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                    reason="runs the kernel: TMA needs CUDA sm_90+")
@pytest.mark.parametrize("G", [128, None])
@pytest.mark.parametrize("config", [(4, 2, 2, 2, 2), (4, 2, 4, 2, 2), (2, 2, 2, 2, 2), (8, 1, 1, 4, 1)])
def test_glu_kernel_matches_the_reference_on_gpu(G, config):
    """silu(gate) * up from the GLU epilogue against glu_of(the parts' references); F = 688 x 16 rows
    would be the MLP's, here F = 3 x 48 (a multiple of BN / 2 for every config above)."""
    from spear_compile.lowering import w4a16_cat as C

    F, K = 144, 1280
    Gs = G or K
    x, qs, ss, zs = _glu_pair(F, K, Gs)
    x, qs, ss, zs = x.cuda(), [q.cuda() for q in qs], [s.cuda() for s in ss], [z.cuda() for z in zs]
    descs, _, s, z = C.concatenated_glu_tma(qs, ss, zs, Gs, config)
    y = gt.w4a16_gemv_tma(x, None, s, z, Gs, None, config=config, descs=descs, glu=True)
    ref = _glu_ref(x, qs, ss, zs, Gs)
    assert y.shape == (1, F)
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
    with pytest.raises(ValueError, match="GLU epilogue"):
        gt.w4a16_gemv_tma(x, None, s, z, Gs, torch.zeros(2 * F, dtype=x.dtype, device=x.device), config=config,
                          descs=descs, glu=True)


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                    reason="runs the kernel: TMA needs CUDA sm_90+")
def test_glu_op_takes_the_epilogue_only_where_the_table_says_so(monkeypatch):
    """spear::w4a16_linear_glu on CUDA: the GLU-epilogue kernel for a shape with a (non-split) table
    entry, the concatenated GEMV + glu_of without one; both equal the reference."""
    from spear_compile.lowering import w4a16_cat as C

    F, K, G = 144, 1280, 128
    x, qs, ss, zs = _glu_pair(F, K, G, seed=3)
    x, qs, ss, zs = x.cuda(), [q.cuda() for q in qs], [s.cuda() for s in ss], [z.cuda() for z in zs]
    calls = []
    real = gt.w4a16_gemv_tma
    monkeypatch.setattr(gt, "w4a16_gemv_tma", lambda *a, **k: calls.append(k.get("glu")) or real(*a, **k))
    ref = _glu_ref(x, qs, ss, zs, G)
    table = dict(TK.tuned_table())
    table.pop(TK.tma_key(2 * F, K, G), None)
    table = use_tuned_table(monkeypatch, table)
    y0 = torch.ops.spear.w4a16_linear_glu(x, qs, ss, zs, G)
    assert calls == []
    table[TK.tma_key(2 * F, K, G)] = [4, 2, 2, 2, 2]
    y1 = torch.ops.spear.w4a16_linear_glu(x, qs, ss, zs, G)
    assert calls == [True]
    assert R.glu_config(R.cat_problem_of("w4a16_glu", x, qs, ss, zs, G))[0] == (4, 2, 2, 2, 2)
    for y in (y0, y1):
        assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                    reason="runs the kernel: TMA needs CUDA sm_90+")
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("config", [(4, 2, 2, 2, 2), (2, 2, 2, 2, 2), (4, 2, 4, 2, 2)])
def test_rmsnorm_prologue_matches_norm_then_gemv_on_gpu(config, glu):
    """x RMS-normalised as the kernel stages it (K = 1280: not whole steps, the padding must not count
    in the sum of squares) against rms_norm_ref then the reference; a non-OPS-2 config refuses."""
    from spear_compile.lowering import w4a16_cat as C

    F, K, G = 144, 1280, 128
    x, qs, ss, zs = _glu_pair(F, K, G, seed=5)
    x = x * 3.0
    w = (torch.rand(K) + 0.5).to(torch.bfloat16)
    x, w, qs, ss, zs = x.cuda(), w.cuda(), [q.cuda() for q in qs], [s.cuda() for s in ss], [z.cuda() for z in zs]
    xn = refs.rms_norm_ref(x, w, 1e-5)
    if glu:
        descs, _, s, z = C.concatenated_glu_tma(qs, ss, zs, G, config)
        ref = _glu_ref(xn, qs, ss, zs, G)
    else:
        descs, _, s, z, _ = C.concatenated_tma(qs, ss, zs, [None, None], G, config)
        ref = torch.cat([w4a16_linear_ref(xn, q, sc, zp, G, None) for q, sc, zp in zip(qs, ss, zs)], -1)
    y = gt.w4a16_gemv_tma(x, None, s, z, G, None, config=config, descs=descs, glu=glu, norm=(w, 1e-5))
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
    with pytest.raises(ValueError, match="RMSNorm prologue"):
        gt.w4a16_gemv_tma(x, qs[0], ss[0], zs[0], G, None, config=(8, 1, 1, 4, 1), norm=(w, 1e-5))

