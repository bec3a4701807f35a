"""The one-launch decode EC (``lowering/ec_self.py``) against ``ec_linear_ref``.

On CPU under ``TRITON_INTERPRET=1`` the programs run one after another with ``SPIN = 0``: program 0
finds no piece of h published and computes them all itself (the fallback), the later ones find them
tagged - so both paths run. On a GPU the same tests run the compiled kernel, where the pieces come from
their owners unless a test leaves them out.
"""
import pytest
import torch

from spear_compile.lowering._triton import HAS_TRITON
from spear_compile.ops.ec_ref import ec_linear_ref

from tests.helpers import DEV, close_to as _close, ec_operands as _ec, packed_weight as _weight

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is a test dependency; install .[test]")


def _setup(N, K, R, D, dtype, G=64, seed=0):
    qweight, scales, zeros, bias, Gs = _weight(N, K, G, dtype, seed)
    return (qweight, scales, zeros, bias, Gs), _ec(N, K, R, D, dtype, seed + 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N,K,R,D,config", [(123, 320, 5, 3, (16, 64, 4, 1)), (123, 320, 8, 4, (32, 32, 2, 0)),
                                              (64, 1536, 16, 8, (8, 64, 4, 0))])
def test_one_launch_ec_matches_reference_over_launches(dtype, N, K, R, D, config):
    from spear_compile.lowering.ec_self import self_plan, self_workspace
    from spear_compile.lowering.w4a16_triton import w4a16_gemv1

    from spear_compile.lowering.ec_self import sm_count

    (q, s, z, b, G), ec = _setup(N, K, R, D, dtype)
    grid = -(-N // config[0])
    plan = self_plan(R, K, grid, 32 * config[2], sm_count(torch.device(DEV)))
    assert plan is not None
    outs = []
    for rep in range(3):  # every launch tags its pieces anew: stale slots of the last launch are not read
        x = torch.randn(1, K, generator=torch.Generator().manual_seed(rep % 2)).to(DEV, dtype)
        y = w4a16_gemv1(x, q, s, z, G, b, ec=ec, config=config)
        _close(y, ec_linear_ref(x, q, s, z, G, b, *ec, "silu"), dtype)
        outs.append(y)
    assert torch.equal(outs[0], outs[2])  # the same x gives the same bits (fixed summation order)
    tick, slots = self_workspace(ec[0], grid, plan)
    assert tick.item() == 3 * grid  # every program took one ticket per launch
    assert ((slots >> 32) == 3).all()  # and every piece carries the last launch's tag


def test_one_launch_ec_ignores_stale_and_foreign_slots():
    """Slots holding garbage under the previous tag (or any other) are recomputed, never summed."""
    from spear_compile.lowering.ec_self import self_plan, self_workspace, sm_count
    from spear_compile.lowering.w4a16_triton import w4a16_gemv1

    dtype, config = torch.bfloat16, (16, 64, 4, 1)
    (q, s, z, b, G), ec = _setup(123, 320, 5, 3, dtype)
    x = torch.randn(1, 320, generator=torch.Generator().manual_seed(3)).to(DEV, dtype)
    ref = ec_linear_ref(x, q, s, z, G, b, *ec, "silu")
    y0 = w4a16_gemv1(x, q, s, z, G, b, ec=ec, config=config)
    tick, slots = self_workspace(ec[0], 8, self_plan(5, 320, 8, 128, sm_count(torch.device(DEV))))
    garbage = torch.tensor(1e6, dtype=torch.float32).view(torch.int32).item()
    slots.copy_(((tick[0] // 8) << 32) | garbage)  # this (finished) launch's tag, wrong values
    y1 = w4a16_gemv1(x, q, s, z, G, b, ec=ec, config=config)
    _close(y1, ref, dtype)
    assert torch.equal(y0, y1)


def test_one_launch_ec_without_owners_computes_the_pieces_itself():
    """No program publishes its own pieces (``publish=False``): every reader gives up waiting
    after SPIN re-reads and computes the missing pieces - the path that keeps a launch whose programs
    are not all resident from deadlocking. Same bits as with the owners."""
    from spear_compile.lowering.ec_self import self_plan, self_workspace, sm_count
    from spear_compile.lowering.w4a16_triton import w4a16_gemv1

    dtype, config = torch.float16, (32, 32, 2, 0)
    (q, s, z, b, G), ec = _setup(123, 320, 8, 4, dtype, seed=5)
    x = torch.randn(1, 320, generator=torch.Generator().manual_seed(4)).to(DEV, dtype)
    y_own = w4a16_gemv1(x, q, s, z, G, b, ec=ec, config=config)
    _, slots = self_workspace(ec[0], 4, self_plan(8, 320, 4, 64, sm_count(torch.device(DEV))))
    own_bits = (slots & 0xFFFFFFFF).clone()
    y_fallback = w4a16_gemv1(x, q, s, z, G, b, ec=ec, config=config, publish=False)
    _close(y_fallback, ec_linear_ref(x, q, s, z, G, b, *ec, "silu"), dtype)
    assert torch.equal(y_own, y_fallback)
    # the pieces themselves (fp32, before any rounding to fp16) have the same bits, now under the new tag
    assert torch.equal(slots & 0xFFFFFFFF, own_bits) and ((slots >> 32) == 2).all()


def test_self_plan_picks_fewest_slots_within_the_register_budget():
    from spear_compile.lowering.ec_self import MAX_SLOTS, PIECE_WIDTHS, self_plan

    for R, K, grid, threads in [(64, 4096, 512, 128), (64, 8192, 256, 128), (16, 11008, 128, 256), (5, 320, 8, 64)]:
        plan = self_plan(R, K, grid, threads)
        assert plan is not None
        assert plan.np == R * plan.nc and plan.nc == -(-K // plan.pw) and plan.np <= MAX_SLOTS
        assert plan.ppc_p * grid >= plan.np and plan.ppc_p * plan.pw <= 32 * threads
        assert plan.nc_p >= plan.nc and plan.owners == grid
    # a grid of several waves: only as many owners as SMs, each with more pieces
    plan = self_plan(64, 4096, 512, 128, sms=132)
    assert plan.owners == 132 and plan.ppc_p * 132 >= plan.np
    # 64 rows of A over 8192 columns cannot be spread over 16 programs of 32 threads
    assert self_plan(64, 8192, 16, 32) is None
    assert min(PIECE_WIDTHS) >= 128


def test_self_plan_is_the_fewest_slots_that_fit(monkeypatch):
    """Against a brute force over the piece widths (on a GPU; the interpreter takes the narrowest that fits)."""
    from spear_compile.lowering import ec_self

    monkeypatch.setattr(ec_self, "INTERPRET", False)
    for R, K, grid, threads, sms in [(64, 4096, 344, 128, 132), (64, 11008, 128, 256, 132), (16, 4096, 512, 128, 132),
                                     (64, 8192, 256, 128, 132), (32, 2048, 8, 64, None)]:
        plan = ec_self.self_plan(R, K, grid, threads, sms)
        owners = min(grid, sms or grid)
        fits = [R * -(-K // pw) for pw in ec_self.PIECE_WIDTHS
                if R * -(-K // pw) <= ec_self.MAX_SLOTS
                and ec_self.next_pow2(-(-R * -(-K // pw) // owners)) * pw <= 32 * threads]
        assert (plan is None) == (not fits) and (plan is None or plan.np == min(fits)), (R, K, grid, plan)


def test_one_launch_ec_refuses_bad_operands():
    from spear_compile.lowering.ec_self import check_self_operands

    A = torch.zeros(8, 64)
    check_self_operands(A, 64, torch.zeros(1, 64))
    with pytest.raises(ValueError, match="A"):
        check_self_operands(A.t().contiguous().t(), 64, torch.zeros(1, 64))
    with pytest.raises(ValueError, match="A"):
        check_self_operands(A, 32, torch.zeros(1, 32))
    with pytest.raises(ValueError, match="x"):
        check_self_operands(A, 64, torch.zeros(2, 64))


def test_one_launch_ec_with_fewer_owners_than_programs(monkeypatch):
    """A grid larger than the GPU's SM count: only the first SM-count programs own pieces (the others
    only read them), each owning more."""
    from spear_compile.lowering import ec_self
    from spear_compile.lowering.w4a16_triton import w4a16_gemv1

    dtype, config = torch.bfloat16, (16, 64, 4, 1)  # 8 programs, 3 of them owners
    monkeypatch.setattr(ec_self, "sm_count", lambda dev: 3)
    (q, s, z, b, G), ec = _setup(123, 320, 8, 4, dtype, seed=7)
    x = torch.randn(1, 320, generator=torch.Generator().manual_seed(5)).to(DEV, dtype)
    plan = ec_self.self_plan(8, 320, 8, 128, 3)
    assert plan.owners == 3 and plan.ppc_p * 3 >= plan.np and plan.ppc_p > -(-plan.np // 8)
    y = w4a16_gemv1(x, q, s, z, G, b, ec=ec, config=config)
    _close(y, ec_linear_ref(x, q, s, z, G, b, *ec, "silu"), dtype)
    tick, slots = ec_self.self_workspace(ec[0], 8, plan)
    assert ((slots >> 32) == 1).all()


def test_slot_read_holds_no_replicated_copies_on_sm90():
    """The slots are read (compiled for sm_90, offline) in a layout whose coverage fits the tensor in every
    dimension: each thread loads distinct slots, so the missing count sees every loaded word. With the old
    [R_P, NC_P] read, 8 warps and R_P = 16, NC_P = 2 gave coverage [128, 2] over a [16, 2] tensor: eight
    threads per slot, counted once (the race of docs/kernels.md)."""
    from tests.helpers import run_compiled

    code = ("import re\n"
            "from spear_compile.lowering.w4a16_triton import compile_gemv1_self_sm90\n"
            "for warps, r_p, nc_p in ((8, 16, 2), (4, 64, 2), (4, 64, 16), (8, 64, 4), (2, 8, 1), (8, 16, 32),\n"
            "                         (4, 16, 64), (1, 16, 8)):\n"
            "    ttg = compile_gemv1_self_sm90(warps, r_p, nc_p).asm['ttgir']\n"
            "    loads = re.findall(r'tt.load .*isVolatile = true.*tensor<(\\d+)x(\\d+)x!tt.ptr<i64>, #(\\w+)>', ttg)\n"
            "    assert loads, (warps, r_p, nc_p)\n"
            "    for rows, cols, name in loads:\n"
            "        lay = re.search('#' + name + r' = #ttg.blocked<\\{sizePerThread = \\[(\\d+), (\\d+)\\], '\n"
            "                        r'threadsPerWarp = \\[(\\d+), (\\d+)\\], warpsPerCTA = \\[(\\d+), (\\d+)\\]', ttg)\n"
            "        s0, s1, t0, t1, w0, w1 = map(int, lay.groups())\n"
            "        assert s0 * t0 * w0 <= int(rows) and s1 * t1 * w1 <= int(cols), (warps, r_p, nc_p, lay.group(0))\n"
            "print('ok')\n")
    run_compiled(code)
