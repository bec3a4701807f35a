"""The large-M warpgroup-MMA W4A16 GEMM (``lowering/w4a16_gemm_wgmma.py``).

Gluon kernels do not run in Triton's interpreter: on CPU the inline-asm dequantization is replayed bit for
bit (``dequant_emulated``) against ``dequantize_ref``, the kernel is compiled for sm_90 (no spills, no
layout conversion, 4 warpgroup MMAs per K step, left asynchronous by ptxas) and the wrapper's input checks are exercised. On a GPU
the kernel runs against an fp64 product of the reference's dequantized weight.
"""

import pytest
import torch

from spear_compile.ops.w4a16_ref import dequantize_ref
from spear_compile.quant.format import pack_int4
from spear_compile.dispatch import cuda as DC
from spear_compile.dispatch import route as RT

wg = pytest.importorskip("spear_compile.lowering.w4a16_gemm_wgmma")
pytestmark = pytest.mark.skipif(not wg.HAS_WGMMA, reason="needs Triton with Gluon's Hopper ops (>= 3.5)")
CUDA = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def _case(N, K, G, M=1, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=gen)
    ng = 1 if G >= K else K // G
    s = (torch.rand(N, ng, generator=gen) * 0.02 + 0.005).to(torch.bfloat16)
    z = (torch.rand(N, ng, generator=gen) * 15).to(torch.bfloat16)  # fractional zero points too
    b = torch.randn(N, generator=gen).to(torch.bfloat16)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    return [t.to(device) for t in (x, pack_int4(q), s, z, b)]


@pytest.mark.parametrize("G", [128, 640])  # groups and per-channel (G >= K)
@pytest.mark.parametrize("zeros", [True, False])
def test_asm_dequantization_is_the_reference_bit_for_bit(G, zeros):
    _, qw, s, z, _ = _case(45, 640, G)
    z = z if zeros else None
    got = wg.dequant_emulated(qw, s, z, G)
    ref = dequantize_ref(qw, s, z, min(G, 640), "spear", torch.bfloat16)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


def test_emulation_catches_a_wrong_byte_permute(monkeypatch):
    """The replay reads the selectors the kernel uses: a pair taken from the wrong byte must show."""
    _, qw, s, z, _ = _case(8, 128, 128)
    monkeypatch.setattr(wg, "_SELS", ("0x4400", "0x6622", "0x5511", "0x7733"))
    assert not torch.equal(wg.dequant_emulated(qw, s, z, 128), dequantize_ref(qw, s, z, 128, "spear", torch.bfloat16))


def _compile_in_fresh_process(config, kw, module="w4a16_gemm_wgmma", fn="compile_sm90") -> dict:
    """``module.fn(config, **kw)`` (an offline sm_90 compile: ``compile_sm90``, ``compile_ra_sm90``) in a new
    Python process: Triton 3.6's interpreter patches ``triton.language`` for a
    nested ``@triton.jit`` call and never restores it (``interpreter.py``, ``InterpretedFunction.__call__``),
    so after the interpreted kernels of earlier tests a Gluon compile in this process fails on the first
    arithmetic with a runtime argument (seen in a clean CI run: 'block_argument' has no 'dtype')."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        code = (f"import json, sys; from spear_compile.lowering import {module} as wg; "
                f"a = wg.{fn}({tuple(config)!r}, **{kw!r}); "
                f"json.dump({{'ptx': a['ptx'], 'ttgir': a['ttgir']}}, open({os.path.join(d, 'a.json')!r}, 'w'))")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        return json.load(open(os.path.join(d, "a.json")))


@pytest.mark.parametrize("config,kw", [((128, 128, 5, 8), {}), ((64, 128, 4, 4), dict(per_channel=True, has_z=False)),
                                       ((256, 128, 4, 8), dict(zint=True)), ((256, 128, 4, 16), dict(zint=True))])
def test_compiles_for_sm90_without_spills_or_layout_conversions(config, kw):
    import re

    from .sass_wgmma import compile_sass

    asm = _compile_in_fresh_process(config, kw)
    # one m64nBNk16 per 16 columns of the step and per 64 rows of x a warpgroup holds
    assert asm["ptx"].count("wgmma.mma_async") == wg.BK // 16 * config[0] // (16 * config[3])
    assert asm["ptx"].count("prmt.b32") == 4 * (config[1] * wg.BK // 8) // (32 * config[3])  # 4 per word
    assert "convert_layout" not in asm["ttgir"]
    log, _ = compile_sass(asm["ptx"])
    assert re.search(r" 0 bytes spill stores", log), log
    assert "C7515" not in log, log  # ptxas did not serialise the asynchronous MMAs


def test_integer_zero_points_are_detected_once_per_tensor():
    z = torch.tensor([[3.0, 15.0], [0.0, 7.0]], dtype=torch.bfloat16)
    assert wg.integer_zeros(z)
    assert not wg.integer_zeros(z + 0.5)
    z[0, 0] = 2.5  # an in-place update is seen (the cached answer is keyed on the tensor's version)
    assert not wg.integer_zeros(z)


def test_configs_and_inputs_are_checked_with_clear_errors():
    with pytest.raises(ValueError, match="BM = 16 or 32 WARPS"):
        wg.check_config((96, 128, 4, 4))
    with pytest.raises(ValueError, match="expected"):
        wg.check_config((128, 128, 4))
    assert wg.smem_bytes((128, 128, 5, 8)) < 227 * 1024
    for c in wg.WGMMA_CONFIGS:
        assert wg.smem_bytes(c) <= 227 * 1024, c  # every shipped config fits one H100 / H200 SM
    x, qw, s, z, b = _case(64, 640, 128, M=4)
    with pytest.raises(ValueError, match="K % 64"):
        wg.w4a16_gemm_wgmma(x[:, :600], qw[:, :300], s, z, 128, b)
    with pytest.raises(ValueError, match="scales"):
        wg.w4a16_gemm_wgmma(x, qw, s[:, :2], z, 128, b)
    with pytest.raises(ValueError, match="K % G == 0"):  # K = 640 is not whole groups of 256
        wg.w4a16_gemm_wgmma(x, qw, s[:, :2], z[:, :2], 256, b)
    with pytest.raises(ValueError, match="contiguous"):  # the kernels index [N, NG] storage
        wg.w4a16_gemm_wgmma(x, qw, s.t().contiguous().t(), z, 128, b)
    with pytest.raises(ValueError, match="packed weight"):
        wg.w4a16_gemm_wgmma(x, qw[:32], s, z, 128, b)
    with pytest.raises(ValueError, match="bf16"):
        wg.w4a16_gemm_wgmma(x.half(), qw, s, z, 128, b)
    with pytest.raises(ValueError, match="sm_90"):
        wg.w4a16_gemm_wgmma(x, qw, s, z, 128, b)


def test_register_operand_configs_and_inputs_are_checked_with_clear_errors():
    from spear_compile.lowering import w4a16_gemm_wgmma_ra as ra

    assert ra.check_ra_config((128, 256, 3, 8)) == (128, 256, 3, 8, 0)
    with pytest.raises(ValueError, match="expected"):
        ra.check_ra_config((128, 256, 3, 8, 0, 1, 1))
    with pytest.raises(ValueError, match="KS"):
        ra.check_ra_config((128, 256, 3, 8, 0, 3))  # the K split: a power of two up to 8
    assert ra.ra_ksplit((64, 16, 8, 4, 2, 8), 4096) == 8 and ra.ra_ksplit((64, 16, 8, 4, 2, 8), 3584) == 8
    assert ra.ra_ksplit((64, 16, 8, 4, 2, 8), 640) == 2  # 10 steps of 64: halved until it divides them
    with pytest.raises(ValueError, match="BNW = 16 WARPS"):
        ra.check_ra_config((128, 256, 3, 4))
    assert ra.check_ra_config((128, 256, 3, 8, 2)) == (128, 256, 3, 8, 2)  # row parameters through the ring
    with pytest.raises(ValueError, match="PF in"):
        ra.check_ra_config((128, 256, 3, 8, 3))
    with pytest.raises(ValueError, match="expected"):
        ra.check_ra_config((128, 256))
    assert ra.check_ra_config((64, 16, 12, 4, 2)) == (64, 16, 12, 4, 2)  # the small-M tiles
    with pytest.raises(ValueError, match="BMX in"):
        ra.check_ra_config((64, 24, 8, 4))
    x, qw, s, z, b = _case(64, 640, 128, M=4)
    with pytest.raises(ValueError, match="w4a16_gemm_wgmma_ra: .*K % 64"):
        ra.w4a16_gemm_wgmma_ra(x[:, :600], qw[:, :300], s, z, 128, b)
    with pytest.raises(ValueError, match="w4a16_gemm_wgmma_ra: packed weight"):
        ra.w4a16_gemm_wgmma_ra(x, qw[:32], s, z, 128, b)
    with pytest.raises(ValueError, match="w4a16_gemm_wgmma_ra: a CUDA sm_90"):
        ra.w4a16_gemm_wgmma_ra(x, qw, s, z.round(), 128, b)
    assert not ra.takes(x, 64, 128, s, z.round(), b)  # (no sm_90 here)


def test_table_value_for_the_register_operand_kernel_falls_back_where_it_cannot_run():
    """A tuned-table entry ("wgmma_ra", ...) on a device or input it cannot take (on CPU: the device; on a
    GPU: fractional zero points) runs this M's default GEMM and still gives the reference result."""
    from spear_compile.dispatch import cuda as D
    from spear_compile.lowering import w4a16_triton as T
    from spear_compile.lowering._triton import INTERPRET

    dev = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
    x, qw, s, z, b = _case(64, 640, 128, M=3, device=dev)
    assert not wg.integer_zeros(z)
    w = dequantize_ref(qw, s, z, 128, "spear", torch.bfloat16).double()
    y = D.w4a16_gemm(x, qw, s, z, 128, b, config=(T.WGMMA_RA, 128, 256, 3, 8))
    ref = x.double() @ w.t() + b.double()
    assert (y.double() - ref).abs().max() <= 2 ** -7 * ref.abs().max() + 1e-2


@pytest.mark.skipif(not CUDA, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("config", wg.WGMMA_CONFIGS)
@pytest.mark.parametrize("M,N,K,G,zeros,bias", [(200, 264, 640, 128, True, True), (1, 64, 128, 64, False, False),
                                               (1024, 1024, 1024, 1024, True, False), (333, 520, 4096, 128, True, True),
                                               (300, 136, 512, 128, "int", True)])
def test_matches_the_reference_on_gpu(config, M, N, K, G, zeros, bias):
    """Fractional zero points take the three-fma expansion, integer ones ("int") the two-fma one."""
    x, qw, s, z, b = _case(N, K, G, M=M, device="cuda")
    if zeros == "int":
        z = z.round()
        assert wg.integer_zeros(z)
    z, b = (z if zeros else None), (b if bias else None)
    w = dequantize_ref(qw, s, z, min(G, K), "spear", torch.bfloat16).double()
    ref = x.double() @ w.t() + (b.double() if b is not None else 0.0)
    y = wg.w4a16_gemm_wgmma(x, qw, s, z, G, b, config=config)
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    err = (y.double() - ref).abs()
    assert (err <= ref.abs() * 2 ** -7 + 1e-2 * ref.abs().mean()).all(), err.max()


@pytest.mark.skipif(not CUDA, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("config", [(64, 16, 12, 4, 2), (128, 32, 8, 8, 2), (64, 16, 8, 4, 0), (64, 16, 8, 4, 2, 4),
                                    (64, 32, 6, 4, 2, 8), (64, 64, 6, 4, 2, 2)])
@pytest.mark.parametrize("M,N,K,G,bias", [(5, 264, 640, 128, True), (16, 520, 4096, 128, False),
                                         (33, 136, 512, 512, True), (2, 64, 128, 64, False)])
def test_register_operand_small_m_tiles_match_the_reference_on_gpu(config, M, N, K, G, bias):
    """The serving-regime tiles (x blocks of 16 / 32 rows, deep rings): partial x blocks, several of them (M = 33),
    per-channel, a grid of one tile."""
    from spear_compile.lowering import w4a16_gemm_wgmma_ra as ra

    x, qw, s, z, b = _case(N, K, G, M=M, device="cuda")
    z, b = z.round(), (b if bias else None)
    w = dequantize_ref(qw, s, z, min(G, K), "spear", torch.bfloat16).double()
    ref = x.double() @ w.t() + (b.double() if b is not None else 0.0)
    y = ra.w4a16_gemm_wgmma_ra(x, qw, s, z, G, b, config=config)
    err = (y.double() - ref).abs()
    assert (err <= ref.abs() * 2 ** -7 + 1e-2 * ref.abs().mean()).all(), err.max()
    if len(config) > 5:  # the K runs' partials are summed in run order: the same bits again, counters left at zero
        assert torch.equal(ra.w4a16_gemm_wgmma_ra(x, qw, s, z, G, b, config=config), y)
        assert int(ra.ks_workspace(x.device, 1, 1)[1].abs().sum()) == 0


def _ec_case(N, K, R, device):
    gen = torch.Generator().manual_seed(7)
    A = torch.randn(R, K, generator=gen) / K ** 0.5
    B = torch.randn(N, R, generator=gen) * 0.1
    W1, b1 = torch.randn(16, R, generator=gen) / R ** 0.5, torch.randn(16, generator=gen) * 0.1
    W2, b2 = torch.randn(R, 16, generator=gen) / 4, torch.randn(R, generator=gen)
    return tuple(t.to(device, torch.bfloat16) for t in (A, B, W1, b1, W2, b2)) + (torch.tensor(1.25, device=device),)


@pytest.mark.parametrize("structure", ["in_gemm", "in_gemm_sk", "in_gemm_self"])
def test_in_gemm_structure_gives_the_reference_wherever_it_runs(structure):
    """On CPU (Triton's interpreter) "in_gemm" cannot run its kernel and takes a structure that runs there;
    on a GPU it runs the wgmma kernel (sm_90+) or the side-stream structure: the reference's numbers
    either way."""
    from spear_compile.lowering._triton import INTERPRET
    from spear_compile.dispatch.cuda import ec_overlapped
    from spear_compile.ops.ec_ref import ec_linear_ref

    dev = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
    x, qw, s, z, b = _case(24, 128, 64, M=5, device=dev)
    ec = _ec_case(24, 128, 8, dev)
    ref = ec_linear_ref(x, qw, s, z, 64, b, *ec, "silu")
    y = ec_overlapped(x, qw, s, z, 64, b, *ec, "silu", structure=structure)
    assert ((y.float() - ref.float()).abs().max() / ref.float().abs().max()) < 2e-2


@pytest.mark.skipif(not CUDA, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("R", [64, 20])  # 20: B's rows are padded to 16 bytes for the TMA copy
def test_ec_added_as_one_more_k_step_matches_the_reference_on_gpu(R, monkeypatch):
    from spear_compile.dispatch.cuda import ec_overlapped
    from spear_compile.ops.ec_ref import ec_linear_ref

    calls = []
    real = wg.w4a16_gemm_wgmma
    monkeypatch.setattr(wg, "w4a16_gemm_wgmma", lambda *a, **k: calls.append(k.get("ec")) or real(*a, **k))
    x, qw, s, z, b = _case(264, 640, 128, M=300, device="cuda")
    ec = _ec_case(264, 640, R, "cuda")
    ref = ec_linear_ref(x, qw, s, z, 128, b, *ec, "silu").double()
    y = ec_overlapped(x, qw, s, z, 128, b, *ec, "silu", structure="in_gemm")
    assert len(calls) == 1 and calls[0] is not None  # the wgmma kernel ran, with the EC operands
    err = (y.double() - ref).abs()
    assert (err <= ref.abs() * 2 ** -7 + 1e-2 * ref.abs().mean()).all(), err.max()


@pytest.mark.skipif(not CUDA, reason="needs an sm_90 GPU")
def test_register_operand_kernel_refuses_fractional_zero_points_on_gpu():
    from spear_compile.lowering import w4a16_gemm_wgmma_ra as ra

    x, qw, s, z, b = _case(64, 640, 128, M=4, device="cuda")
    assert not wg.integer_zeros(z) and not ra.takes(x, 64, 128, s, z, b) and ra.takes(x, 64, 128, s, z.round(), b)
    with pytest.raises(ValueError, match="zero points must be integers"):
        ra.w4a16_gemm_wgmma_ra(x, qw, s, z, 128, b)


@pytest.mark.skipif(not CUDA, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("R", [64, 20])
@pytest.mark.parametrize("config", [(128, 256, 3, 8), (64, 256, 4, 4), (128, 256, 4, 8, 2)])
@pytest.mark.parametrize("structure", ["in_gemm", "in_gemm_sk"])
def test_register_operand_kernel_takes_the_ec_step_behind_the_gate_on_gpu(R, config, structure, monkeypatch):
    """Where the table runs the shape on the register-operand GEMM, "in_gemm" launches it with PDL behind the
    gate kernel (it waits before reading alpha g h) and it adds the EC as one more K step: the reference's
    numbers, also with PDL off (plain stream order). "in_gemm_sk": behind the split-K shrink + gate."""
    from spear_compile.lowering import w4a16_gemm_wgmma_ra as ra
    from spear_compile.lowering import w4a16_triton as T
    from spear_compile.dispatch.cuda import ec_overlapped
    from spear_compile.ops.ec_ref import ec_linear_ref

    calls = []
    real = ra.w4a16_gemm_wgmma_ra
    monkeypatch.setattr(ra, "w4a16_gemm_wgmma_ra", lambda *a, **k: calls.append((k.get("ec"), k.get("ec_wait")))
                        or real(*a, **k))
    monkeypatch.setattr(RT, "gemm_route", lambda p, why=None, choice=None: RT.Route("gemm_wgmma_ra", tuple(config)))
    x, qw, s, z, b = _case(264, 640, 128, M=300, device="cuda")
    z = z.round()
    ec = _ec_case(264, 640, R, "cuda")
    ref = ec_linear_ref(x, qw, s, z, 128, b, *ec, "silu").double()
    if len(config) > 4 and config[4] == 2:  # its table is made before the gate, never between it and the GEMM
        hg = torch.zeros(300, 64, dtype=torch.bfloat16, device="cuda")
        Bp = torch.zeros(264, 64, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match="row-parameter table"):
            real(x, qw, s.clone(), z, 128, b, config=config, ec=(hg, Bp), ec_wait=True)
    for no_pdl in ("0", "1"):
        monkeypatch.setenv("SPEAR_NO_PDL", no_pdl)
        y = ec_overlapped(x, qw, s, z, 128, b, *ec, "silu", structure=structure)
        assert calls[-1][0] is not None and calls[-1][1] is (no_pdl == "0")  # the EC step ran, PDL as asked
        err = (y.double() - ref).abs()
        assert (err <= ref.abs() * 2 ** -7 + 1e-2 * ref.abs().mean()).all(), (no_pdl, err.max())
    assert len(calls) == 2


def test_register_operand_expansion_takes_each_lanes_byte():
    """The register-operand kernel's prmt selector t | t << 4 | (4 + t) << 8 | (4 + t) << 12 on (word,
    word >> 4) gives lane t the bf16 pair 128 + q of columns 8 w + 2 t and 8 w + 2 t + 1 (its wgmma A
    fragment), replayed on CPU with the same prmt emulation as the plain kernel's."""
    _, qw, _, _, _ = _case(8, 128, 128)
    q = torch.stack((qw & 0xF, qw >> 4), -1).reshape(8, 128).to(torch.int64)
    w = qw.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [8, 16]
    for t in range(4):
        sel = t * 0x11 + (t + 4) * 0x1100
        p = (wg._prmt(w, w >> 4, sel) & 0x000F000F) | 0x43004300
        lo = ((p & 0xFFFF).to(torch.int16).view(torch.bfloat16).float() - 128).to(torch.int64)
        hi = (((p >> 16) & 0xFFFF).to(torch.int16).view(torch.bfloat16).float() - 128).to(torch.int64)
        assert torch.equal(lo, q[:, 2 * t::8]) and torch.equal(hi, q[:, 2 * t + 1::8])


@pytest.mark.parametrize("config,kw", [((128, 256, 4, 8), {}), ((128, 256, 4, 8), dict(per_channel=True, has_z=False,
                                                                                      has_bias=False)),
                                       ((128, 128, 5, 8), {}), ((64, 256, 3, 4), dict(r_p=64)),
                                       ((128, 256, 4, 8), dict(r_p=64, ec_self=True)),
                                       ((64, 256, 4, 4), dict(r_p=32, ec_self=True)),
                                       ((64, 256, 4, 4), dict(r_p=64, ec_self=True, split=4)),
                                       ((128, 256, 3, 8), dict(r_p=64, ec_self=True, split=2)),
                                       ((64, 128, 4, 4), dict(r_p=64, ec_self=True, split=2)),
                                       ((128, 256, 3, 8, 1), dict(has_bias=False)),
                                       ((64, 256, 4, 4), dict(per_channel=True, has_z=False)),
                                       ((128, 256, 3, 8, 2), {}), ((64, 256, 4, 4, 2), dict(has_z=False)),
                                       ((64, 256, 4, 4, 2), dict(r_p=64, ec_self=True, split=4)),
                                       ((64, 16, 12, 4, 2), {}), ((128, 32, 8, 8, 2), dict(has_bias=False)),
                                       ((64, 16, 8, 4, 2, 4), {})])
def test_register_operand_kernel_compiles_with_its_a_registers_kept_until_retired(config, kw):
    """The [rows, words, lanes, 2] expansion reshapes into the wgmma A layout without moving data (the
    convert_layout is asserted trivial at compile time); no spills; MMAs left asynchronous; and no instruction
    of the K loop writes the A registers of an MMA that is still running (the bug of an earlier version)."""
    import re

    from .sass_wgmma import compile_sass, hgmma_loop, inflight_writes, ra_loops

    asm = _compile_in_fresh_process(config, kw, module="w4a16_gemm_wgmma_ra", fn="compile_ra_sm90")
    # per step, 4 k16 MMAs and 2 rows x 8 words per thread; steps in pairs plus a tail for an odd count
    # (+ the EC step; + with ec_self the shrink role's loop: one [64, BMX, BK] MMA per step)
    shrink = wg.BK // 16 if kw.get("ec_self") else 0
    assert asm["ptx"].count("wgmma.mma_async") == 3 * wg.BK // 16 + kw.get("r_p", 0) // 16 + shrink
    assert asm["ptx"].count("griddepcontrol.wait") == (1 if kw.get("r_p") and not kw.get("ec_self") else 0)
    if kw.get("ec_self"):  # the shrink role's release of its flag, the tiles' acquire spin, the ticket, the trap
        ptx = asm["ptx"]
        assert "atom.global.gpu.release.exch.b32" in ptx and "ld.global.gpu.acquire.b32" in ptx
        assert "atom.global.gpu.relaxed.add.u64" in ptx and "trap;" in ptx and "nanosleep.u32" in ptx
        assert ptx.count("fence.proxy.async.shared::cta") >= 1  # alpha g h's generic stores before the EC MMA
    assert asm["ptx"].count("prmt.b32") == 3 * 2 * 8
    log, sass = compile_sass(asm["ptx"])
    assert re.search(r" 0 bytes spill stores", log) and "C7515" not in log, log
    assert sum("HGMMA" in t for t in hgmma_loop(sass)) == 2 * wg.BK // 16
    assert len(ra_loops(sass)) == 1  # (checked below as a cycle)
    assert inflight_writes(sass) == []
    if len(config) > 4 and config[4] == 2:  # row parameters through the ring: no global load left in a K loop
        from .sass_wgmma import instructions

        ins = instructions(sass)
        for first, last in ra_loops(sass):
            assert not [t for _, t in ins[first:last + 1] if re.search(r"\bLDG\b", t)], "a global load in the K loop"


def test_ring_row_parameters_are_what_the_expansion_computes_and_made_once():
    """``ring_row_params``: row 2 g = c = -(128 + z) (without zero points -128 s), row 2 g + 1 = s, of group g, bf16
    and exact (the values the K loop computes from (s, z) itself); one table per weight, remade after an
    in-place update of the scales."""
    from spear_compile.lowering import w4a16_gemm_wgmma_ra as ra

    torch.manual_seed(0)
    N, NG = 24, 5
    s = (torch.rand(N, NG) * 0.02 + 1e-3).to(torch.bfloat16)
    z = torch.randint(0, 16, (N, NG)).to(torch.bfloat16)
    t = ra.ring_row_params(s, z)
    assert t.shape == (2 * NG, N) and t.dtype == torch.bfloat16 and t.is_contiguous()
    for g in range(NG):
        assert torch.equal(t[2 * g], -(z[:, g] + 128.0)) and torch.equal(t[2 * g + 1], s[:, g])
        assert torch.equal(t[2 * g].float(), -(z[:, g].float() + 128))  # exact
    t0 = ra.ring_row_params(s, None)
    assert all(torch.equal(t0[2 * g].float(), s[:, g].float() * -128) for g in range(NG))
    assert ra.ring_row_params(s, z) is t
    s.mul_(2)
    t2 = ra.ring_row_params(s, z)
    assert t2 is not t and torch.equal(t2[1], s[:, 0])


def test_inflight_register_check_flags_an_overwritten_a_operand():
    """The SASS check itself: a write to an HGMMA's A registers before the DEPBAR that retires it is flagged
    (a one-step loop reloading them: an earlier wrong kernel; a two-register write after the loop before
    the final wait); two steps on two register sets, or a write after a full wait, are not."""
    from .sass_wgmma import inflight_writes

    def sass(body, tail=()):
        lines = [f"        /*{16 * i:04x}*/                   {t} ;" for i, t in enumerate(list(body) + ["@P1 BRA 0x0"])]
        lines += [f"        /*{16 * (len(body) + 1 + i):04x}*/                   {t} ;" for i, t in enumerate(tail)]
        return "\n".join(lines)

    def step(r):
        return [f"LDS.128 R{r}, [R20+0x20000]", f"HGMMA.64x256x16.F32.BF16 R24, R{r}, gdesc[UR20], R24, gsb0",
                "WARPGROUP.DEPBAR.LE gsb0, 0x1"]

    assert len(inflight_writes(sass(step(152)))) == 1  # one step per loop: the next load hits the running MMA
    assert inflight_writes(sass(step(152) + step(168))) == []  # steps in pairs on two register sets
    assert len(inflight_writes(sass(step(152) + ["PRMT R154, R13, R16, R12"] + step(168)))) == 1
    assert inflight_writes(sass(step(152) + ["WARPGROUP.DEPBAR.LE gsb0, 0x0", "PRMT R154, R13, R16, R12"])) == []
    tail = ["HGMMA.64x256x16.F32.BF16 R24, R184, gdesc[UR20], R24, gsb0", "IMAD.WIDE R186, R1, 0x4, R2"]
    assert len(inflight_writes(sass(step(152) + step(168), tail + ["WARPGROUP.DEPBAR.LE gsb0, 0x0"]))) == 1
    assert inflight_writes(sass(step(152) + step(168), tail[:1] + ["WARPGROUP.DEPBAR.LE gsb0, 0x0"] + tail[1:])) == []


@pytest.mark.skipif(not CUDA, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("M,N,K,G,zeros,bias", [(200, 264, 640, 128, "int", True), (1024, 1024, 1024, 1024, None, False),
                                               (333, 520, 4096, 128, "int", True),
                                               (77, 136, 576, 64, "int", False)])  # 9 K steps: the odd tail
def test_register_operand_kernel_matches_the_reference_on_gpu(M, N, K, G, zeros, bias, monkeypatch):
    from spear_compile.lowering import w4a16_gemm_wgmma_ra as ra

    tables = []  # PF = 2 launches must really take the ring's row parameters (not fall back to PF = 0)
    real_table = ra.ring_row_params
    monkeypatch.setattr(ra, "ring_row_params", lambda s_, z_: tables.append(1) or real_table(s_, z_))

    x, qw, s, z, b = _case(N, K, G, M=M, device="cuda")
    z = z.round() if zeros else None
    b = b if bias else None
    w = dequantize_ref(qw, s, z, min(G, K), "spear", torch.bfloat16).double()
    ref = x.double() @ w.t() + (b.double() if b is not None else 0.0)
    from spear_compile.lowering import w4a16_triton as T

    runs = [(c, lambda c=c: ra.w4a16_gemm_wgmma_ra(x, qw, s, z, G, b, config=c))
            for c in ra.RA_CONFIGS + [(128, 256, 3, 8, 1), (64, 256, 4, 4, 1)]]
    runs.append(("table", lambda: DC.w4a16_gemm(x, qw, s, z, G, b, config=(T.WGMMA_RA,) + ra.RA_CONFIGS[0])))
    outs = {}
    for config, run in runs:
        n_tables = len(tables)
        y = run()
        c = config if isinstance(config, tuple) else ra.RA_CONFIGS[0]  # ("table": the table value's config)
        grouped = len(c) > 4 and c[4] == 2 and G < K
        assert len(tables) == n_tables + grouped, config
        outs[config] = y
        err = (y.double() - ref).abs()
        assert (err <= ref.abs() * 2 ** -7 + 1e-2 * ref.abs().mean()).all(), (config, err.max())
    for config in [(128, 256, 3, 8, 2), (64, 256, 4, 4, 2)]:  # the same expansion and MMA order: the same bits
        plain = outs.get(config[:4]) if config[:4] in outs else ra.w4a16_gemm_wgmma_ra(x, qw, s, z, G, b,
                                                                                          config=config[:4])
        assert torch.equal(outs[config], plain), config


def test_in_launch_ec_says_which_ecs_it_cannot_take():
    """``ec_gemm_self.self_takes``: bf16 A [R <= 64, K] contiguous, bf16 B, a gate at most 16 wide - or the
    reason, naming the operand (the dispatch then runs "in_gemm")."""
    from spear_compile.lowering.ec_gemm_self import self_takes

    A, B, W1 = torch.zeros(64, 128, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(16, 64)
    assert self_takes(A, B, W1, 128) is None
    assert "A torch.float32" in self_takes(A.float(), B, W1, 128)
    assert "R <= 64" in self_takes(torch.zeros(96, 128, dtype=torch.bfloat16), B, W1, 128)
    assert "K = 256" in self_takes(A, B, W1, 256)
    assert "contiguous" in self_takes(torch.zeros(128, 64, dtype=torch.bfloat16).t(), B, W1, 128)
    assert "hidden units" in self_takes(A, B, torch.zeros(32, 64), 128)
    assert self_takes(A, B, torch.zeros(8, 64), 128) is None  # SPEAR's default gate (GPU-tested)


def test_in_launch_ec_splits_shrink_roles_only_where_they_fit_the_first_wave():
    """``ec_gemm_self.self_split``: the most roles per x block (1, 2, 4; >= 64 tokens each) that fit beside the
    tiles in one wave of one CTA per SM, else 1 (a grid of several waves hides one role per block)."""
    from spear_compile.lowering.ec_gemm_self import self_split, split_ok

    assert split_ok(4, 256) and split_ok(2, 128) and not split_ok(4, 128) and not split_ok(3, 256)
    assert self_split(128, 1, 256, 132) == 4  # 8192^2 M = 256 on the 4-warp tile: 128 tiles + 4 roles
    assert self_split(86, 1, 256, 132) == 4  # 11008x4096 M = 256, 8 warps
    assert self_split(129, 1, 256, 132) == 2 and self_split(130, 1, 256, 132) == 2
    assert self_split(131, 1, 256, 132) == 1 and self_split(132, 1, 256, 132) == 1
    assert self_split(128, 4, 256, 132) == 1  # 4096^2 M = 1024: 128 tiles + 4 roles is exactly a wave
    assert self_split(224, 1, 256, 132) == 1  # 28672x8192 M = 256: two waves
    assert self_split(10, 1, 128, 132) == 2 and self_split(10, 1, 64, 132) == 1  # >= 64 tokens per role


def _self_run(monkeypatch, config):
    """Route "in_gemm_self" to the register-operand GEMM with ``config`` and record the in-launch calls."""
    from spear_compile.lowering import w4a16_gemm_wgmma_ra as ra
    from spear_compile.lowering import w4a16_triton as T

    calls = []
    real = ra.w4a16_gemm_wgmma_ra_ec_self
    monkeypatch.setattr(ra, "w4a16_gemm_wgmma_ra_ec_self", lambda *a, **k: calls.append(k) or real(*a, **k))
    monkeypatch.setattr(RT, "gemm_route", lambda p, why=None, choice=None: RT.Route("gemm_wgmma_ra", tuple(config)))
    return calls


@pytest.mark.skipif(not CUDA, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("R", [64, 20, 16])
@pytest.mark.parametrize("config", [(128, 256, 3, 8), (64, 256, 4, 4), (128, 256, 4, 8, 2), (64, 256, 4, 4, 2)])
@pytest.mark.parametrize("M,act", [(300, "silu"), (1000, "gelu"), (37, "relu")])
def test_in_launch_ec_matches_the_reference_on_gpu(R, config, M, act, monkeypatch):
    """"in_gemm_self": the output tiles plus one shrink role per x block in one launch. The output within bf16
    rounding of the reference, the EC's own part (y minus the W4 GEMM) within 2 % of ``ec_delta_ref`` (plus
    the two bf16 roundings; measured 0.015 on an H200 on alpha g h values up to 4, one bf16 ulp), bit
    for bit the same over repeated launches on changing inputs (tags: a stale block is never read)."""
    from spear_compile.lowering import w4a16_gemm_wgmma_ra as ra
    from spear_compile.dispatch.cuda import ec_overlapped
    from spear_compile.ops.ec_ref import ec_delta_ref, ec_linear_ref

    calls = _self_run(monkeypatch, config)
    N, K = 264, 640
    x, qw, s, z, b = _case(N, K, 128, M=M, device="cuda")
    x1 = _case(N, K, 128, M=M, seed=5, device="cuda")[0]
    z = z.round()
    ec = _ec_case(N, K, R, "cuda")
    ys = [ec_overlapped(xx, qw, s, z, 128, b, *ec, act, structure="in_gemm_self") for xx in (x, x1, x, x1)]
    assert len(calls) == 4
    for xx, y in ((x, ys[0]), (x1, ys[1])):
        ref = ec_linear_ref(xx, qw, s, z, 128, b, *ec, act).double()
        err = (y.double() - ref).abs()
        assert (err <= ref.abs() * 2 ** -7 + 1e-2 * ref.abs().mean()).all(), err.max()
        w4 = ra.w4a16_gemm_wgmma_ra(xx, qw, s, z, 128, b, config=config).double()
        d, dref = y.double() - w4, ec_delta_ref(xx, *ec, act).double()
        # (y and w4 are each rounded to bf16: up to half an ulp of each, up to 2^-8 relative, on top of the EC's error)
        tol = (y.double().abs() + w4.abs()) * 2 ** -8 + 0.02 * dref.abs().max()
        assert ((d - dref).abs() <= tol).all(), ((d - dref).abs() - tol).max()
    assert torch.equal(ys[0], ys[2]) and torch.equal(ys[1], ys[3])


@pytest.mark.skipif(not CUDA, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("D,K", [(5, 640), (8, 640), (16, 128)])  # K = 128: two K steps, fewer than the ring's stages
def test_in_launch_ec_kernel_with_other_gate_widths_and_short_k_on_gpu(D, K):
    """The kernel entry point with gates narrower than 16 (SPEAR's default is 8) and a K loop shorter than the
    ring: the reference's numbers (its first GPU run: passed; the dispatch then admitted every
    width up to 16)."""
    from spear_compile.lowering import w4a16_gemm_wgmma_ra as ra
    from spear_compile.ops.ec_ref import ec_linear_ref

    N, M, R = 264, 300, 20
    x, qw, s, z, b = _case(N, K, 128 if K > 128 else K, M=M, device="cuda")
    z = z.round()
    gen = torch.Generator().manual_seed(11)
    A = torch.randn(R, K, generator=gen) / K ** 0.5
    B = torch.randn(N, R, generator=gen) * 0.1
    W1, b1 = torch.randn(D, R, generator=gen) / R ** 0.5, torch.randn(D, generator=gen) * 0.1
    W2, b2 = torch.randn(R, D, generator=gen) / D ** 0.5, torch.randn(R, generator=gen)
    ec = tuple(t.to("cuda", torch.bfloat16) for t in (A, B, W1, b1, W2, b2)) + (torch.tensor(1.25, device="cuda"),)
    G = 128 if K > 128 else K
    Bp = torch.zeros(N, 24, dtype=torch.bfloat16, device="cuda")
    Bp[:, :R] = ec[1]
    ref = ec_linear_ref(x, qw, s, z, G, b, *ec, "silu").double()
    for config in ((128, 256, 3, 8), (64, 256, 4, 4)):
        y = ra.w4a16_gemm_wgmma_ra_ec_self(x, qw, s, z, G, b, ec[0], Bp, *ec[2:], "silu", config=config)
        err = (y.double() - ref).abs()
        assert (err <= ref.abs() * 2 ** -7 + 1e-2 * ref.abs().mean()).all(), (config, err.max())


@pytest.mark.skipif(not CUDA, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("config", [(128, 256, 3, 8), (64, 256, 4, 4), (64, 128, 4, 4), (64, 128, 4, 4, 2)])
@pytest.mark.parametrize("M", [300, 37])  # 37: three of block 0's four parts lie wholly past M
def test_in_launch_ec_with_split_shrink_roles_on_gpu(config, M):
    """1, 2 and 4 shrink roles per x block (each BMX / split tokens, its own flag), with the roles' ring split
    times deeper where it fits (``role_depth``): the reference's numbers, and the same alpha g h
    within one bf16 ulp whatever the split (each h element is one K-ordered sum)."""
    from spear_compile.lowering import w4a16_gemm_wgmma_ra as ra
    from spear_compile.ops.ec_ref import ec_linear_ref

    N, K, R = 264, 640, 64
    x, qw, s, z, b = _case(N, K, 128, M=M, device="cuda")
    z = z.round()
    ec = _ec_case(N, K, R, "cuda")
    ref = ec_linear_ref(x, qw, s, z, 128, b, *ec, "silu").double()
    hgs = []
    for split in (1, 2, 4) if config[1] == 256 else (1, 2):
        hg = torch.full((M, 64), float("nan"), dtype=torch.bfloat16, device="cuda")
        for _ in range(2):  # a second launch on the same workspace (tags move on)
            y = ra.w4a16_gemm_wgmma_ra_ec_self(x, qw, s, z, 128, b, *ec, "silu", config=config, hg=hg, split=split)
        err = (y.double() - ref).abs()
        assert (err <= ref.abs() * 2 ** -7 + 1e-2 * ref.abs().mean()).all(), (split, err.max())
        hgs.append(hg.double())
    for h in hgs[1:]:
        assert ((h - hgs[0]).abs() <= hgs[0].abs() * 2 ** -7 + 1e-6).all()
    with pytest.raises(ValueError, match="split=3"):
        ra.w4a16_gemm_wgmma_ra_ec_self(x, qw, s, z, 128, b, *ec, "silu", config=config, split=3)


@pytest.mark.skipif(not CUDA, reason="needs an sm_90 GPU")
def test_in_launch_ec_over_several_waves_and_in_a_cuda_graph_on_gpu(monkeypatch):
    """A grid of several waves (8 x 44 tiles + 8 shrink roles on 132 SMs): no deadlock (shrink roles are the
    first CTAs to start), the reference's numbers; captured in a CUDA graph and replayed on new inputs, the
    eager launch's bits."""
    from spear_compile.dispatch.cuda import ec_overlapped
    from spear_compile.ops.ec_ref import ec_linear_ref

    calls = _self_run(monkeypatch, (128, 256, 4, 8))
    N, K, M = 5632, 1024, 2048
    x, qw, s, z, b = _case(N, K, 128, M=M, device="cuda")
    z = z.round()
    ec = _ec_case(N, K, 64, "cuda")
    ref = ec_linear_ref(x, qw, s, z, 128, b, *ec, "silu").double()
    y = ec_overlapped(x, qw, s, z, 128, b, *ec, "silu", structure="in_gemm_self")
    err = (y.double() - ref).abs()
    assert (err <= ref.abs() * 2 ** -7 + 1e-2 * ref.abs().mean()).all(), err.max()
    xs = x.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg = ec_overlapped(xs, qw, s, z, 128, b, *ec, "silu", structure="in_gemm_self")
    x2 = _case(N, K, 128, M=M, seed=9, device="cuda")[0]
    for xx in (x2, x, x2):
        xs.copy_(xx)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(yg, ec_overlapped(xx, qw, s, z, 128, b, *ec, "silu", structure="in_gemm_self"))
    assert len(calls) >= 5


@pytest.mark.skipif(not CUDA, reason="needs an sm_90 GPU")
def test_in_launch_ec_leaves_ecs_it_cannot_take_to_in_gemm_on_gpu(monkeypatch):
    """Rank 96 (> 64, the shrink MMA's rows): "in_gemm_self" runs "in_gemm" instead - the reference's numbers,
    no in-launch call."""
    from spear_compile.dispatch.cuda import ec_overlapped
    from spear_compile.ops.ec_ref import ec_linear_ref

    calls = _self_run(monkeypatch, (128, 256, 3, 8))
    x, qw, s, z, b = _case(264, 640, 128, M=300, device="cuda")
    z = z.round()
    ec = _ec_case(264, 640, 96, "cuda")
    ref = ec_linear_ref(x, qw, s, z, 128, b, *ec, "silu").double()
    y = ec_overlapped(x, qw, s, z, 128, b, *ec, "silu", structure="in_gemm_self")
    assert calls == []
    err = (y.double() - ref).abs()
    assert (err <= ref.abs() * 2 ** -7 + 1e-2 * ref.abs().mean()).all(), err.max()
