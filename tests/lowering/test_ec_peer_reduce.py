"""The peer-write pair of a row-parallel EC layer (``lowering/ec_peer_reduce.py``) against its references.

On CPU the kernels run under ``TRITON_INTERPRET=1`` with emulated peers (``PeerStaging.emulated``: plain
tensors stand in for every rank's symmetric staging buffer and signal pad); the ranks' epilogue launches
run one after another, then their post kernels. Checked: every rank's output equals the single-process TP
reference, all ranks agree bit for bit, every signal pad is back in its initial state after a call (so a
second call, as a CUDA-graph replay, works), and a peer that never writes is named, not waited for forever.
"""
import pytest
import torch

from spear_compile.ops.peer_reduce_ref import ec_linear_tp_ref, ec_partial_ref, peer_sum_ref
from spear_compile import QuantConfig
from spear_compile.quant import quantize_rtn
from tests.helpers import DEV, close_to

PR = pytest.importorskip("spear_compile.lowering.ec_peer_reduce")


def _layer(N, K, world, R, D, G, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) * 0.05
    k = K // world
    shards = []
    for i in range(world):  # each rank's K slice quantized on its own (group G within the slice)
        qw = quantize_rtn(w[:, i * k:(i + 1) * k].contiguous(), QuantConfig(group_size=G), out_dtype=dtype)
        A = (torch.randn(R, k, generator=gen) / K ** 0.5).to(dtype)
        shards.append(tuple(t.to(DEV) for t in (qw.qweight, qw.scales, qw.zeros)) + (qw.group_size, A.to(DEV)))
    B = (torch.randn(N, R, generator=gen) * 0.3).to(DEV, dtype)
    W1 = (torch.randn(D, R, generator=gen) / R ** 0.5).to(DEV, dtype)
    b1 = (torch.randn(D, generator=gen) * 0.1).to(DEV, dtype)
    W2, b2 = (torch.randn(R, D, generator=gen) / D ** 0.5).to(DEV, dtype), torch.randn(R, generator=gen).to(DEV, dtype)
    bias = torch.randn(N, generator=gen).to(DEV, dtype)
    return shards, (bias, B, W1, b1, W2, b2, torch.tensor(1.25, device=DEV))


def _run(staging, xs, shards, ec, act="silu", max_spin=None, ranks=None):
    bias, B, W1, b1, W2, b2, alpha = ec
    ranks = range(len(staging)) if ranks is None else ranks
    for i in ranks:
        qw, s, z, G, A = shards[i]
        PR.ec_partial_store(xs[i], qw, s, z, G, A, staging[i], max_spin=max_spin)
    return [PR.ec_peer_post(xs[0].shape[0], staging[i], bias, B, W1, b1, W2, b2, alpha, act, xs[0].dtype,
                            max_spin=max_spin) for i in ranks]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peer_write_pair_matches_the_reference_and_resets_its_signals(world, dtype):
    N, K, R, D, M = 72, 96 * world, 5, 3, 3  # N not a tile multiple, odd rank and gate width
    shards, ec = _layer(N, K, world, R, D, 32, dtype)
    staging = PR.PeerStaging.emulated(world, N, R, DEV)
    for rep in range(2):  # the second call runs on the flags the first left: what a CUDA-graph replay does
        gen = torch.Generator().manual_seed(10 + rep)
        xs = [torch.randn(M, K // world, generator=gen).to(DEV, dtype) for _ in range(world)]
        outs = _run(staging, xs, shards, ec)
        ref = ec_linear_tp_ref(xs, shards, *ec, act="silu")
        for out in outs:
            close_to(out, ref, dtype)
            assert torch.equal(out, outs[0])  # every rank sums in rank order: identical outputs
        assert all(st.initial_state() for st in staging), [st.flags.tolist() for st in staging]
        for st in staging:
            st.check()


def test_staged_partials_are_the_ranks_partials():
    world, N, K, R = 2, 40, 128, 4
    shards, ec = _layer(N, K, world, R, 2, 64, torch.float32)
    staging = PR.PeerStaging.emulated(world, N, R, DEV)
    xs = [torch.randn(2, K // world).to(DEV) for _ in range(world)]
    _run(staging, xs, shards, ec)
    want = torch.stack([ec_partial_ref(x, *s[:5]) for x, s in zip(xs, shards)])
    for st in staging:  # every rank's buffer holds every rank's partial in its slot
        torch.testing.assert_close(st.buf[:, :2], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(peer_sum_ref(staging[0].buf[:, :2]), want.sum(0), rtol=1e-5, atol=1e-5)


def test_a_peer_that_never_writes_is_named():
    from spear_compile.errors import PeerTimeoutError

    world, N, K, R = 2, 40, 128, 4
    shards, ec = _layer(N, K, world, R, 2, 64, torch.float32)
    staging = PR.PeerStaging.emulated(world, N, R, DEV)
    xs = [torch.randn(1, K // world).to(DEV) for _ in range(world)]
    _run(staging, xs, shards, ec, max_spin=8, ranks=[0])  # rank 1 never launches
    with pytest.raises(PeerTimeoutError, match="rank 0 of 2 gave up waiting for rank 1") as e:
        staging[0].check()
    assert e.value.missing == (1,)


def test_launch_checks_name_the_argument():
    shards, ec = _layer(40, 128, 2, 4, 2, 64, torch.float32)
    st = PR.PeerStaging.emulated(2, 40, 4, DEV)[0]
    qw, s, z, G, A = shards[0]
    with pytest.raises(ValueError, match="1 <= M <= 16"):
        PR.ec_partial_store(torch.randn(17, 64), qw, s, z, G, A, st)
    with pytest.raises(ValueError, match="staging is for N=40, rank=4, the layer has N=40, rank=3"):
        PR.ec_partial_store(torch.randn(1, 64), qw, s, z, G, A[:3].contiguous(), st)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M,N,K,R,D,G", [(1, 4096, 4096, 64, 16, 128), (4, 192, 192, 8, 4, 32),
                                         (4, 192, 384, 8, 4, 32), (16, 4096, 11008, 64, 16, 128)])
def test_world_size_one_runs_the_peer_write_path_on_one_gpu(monkeypatch, M, N, K, R, D, G):
    """The op on one GPU, no process group: the same two kernels with one slot, against the reference;
    twice (the signals reset) and under a CUDA graph. Shapes: a 7B-shaped layer at M = 1 and at the
    staging's largest M, and the tiny TP model's o_proj and down_proj (K = 192 and 384 at G = 32)."""
    monkeypatch.delenv("SPEAR_NO_PEER_WRITE", raising=False)

    dtype = torch.bfloat16
    shards, (bias, B, W1, b1, W2, b2, alpha) = _layer(N, K, 1, R, D, G, dtype)
    qw, s, z, G, A = shards[0]
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    op = torch.ops.spear.ec_linear_peer_reduce
    args = (qw, s, z, G, bias, A, B, W1, b1, W2, b2, alpha, "silu", "spear", "")
    ref = ec_linear_tp_ref([x], shards, bias, B, W1, b1, W2, b2, alpha)
    for _ in range(2):
        close_to(op(x, *args), ref, dtype)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = op(x, *args)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    close_to(out, ref, dtype)
    st = PR.staging_for("", N, R, x.device)
    assert st.initial_state()
    st.check()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_two_layers_of_one_shape_share_the_staging_in_turn(monkeypatch):
    """Two layers of the same N and rank (the tiny TP model's o_proj and down_proj) use one staging, one
    after the other, the second reading the first's output, as in a model step: each equals its reference."""
    monkeypatch.delenv("SPEAR_NO_PEER_WRITE", raising=False)
    dtype = torch.bfloat16
    op = torch.ops.spear.ec_linear_peer_reduce
    layers = [_layer(192, 192, 1, 8, 4, 32, dtype, seed=1), _layer(192, 192, 1, 8, 4, 32, dtype, seed=2)]
    x = torch.randn(4, 192, device="cuda", dtype=dtype)
    h, ref = x, x
    for shards, (bias, B, W1, b1, W2, b2, alpha) in layers:
        qw, s, z, G, A = shards[0]
        h = op(h, qw, s, z, G, bias, A, B, W1, b1, W2, b2, alpha, "silu", "spear", "")
        ref = ec_linear_tp_ref([ref], shards, bias, B, W1, b1, W2, b2, alpha)
    close_to(h, ref, dtype)


def test_both_kernels_compile_for_sm90_with_system_scope_signals():
    """Offline sm_90 compile (no GPU needed): the signals are system-scope acquire / release atomics (peers
    read them over NVLink), and neither kernel spills."""
    from tests.helpers import run_compiled

    code = ("import re\n"
            "from spear_compile.lowering.ec_peer_reduce import compile_sm90\n"
            "from tests.lowering.sass_wgmma import compile_sass\n"
            "for name, k in compile_sm90(world=2).items():\n"
            "    ptx = k.asm['ptx']\n"
            "    assert 'atom.global.acquire.sys.cas.b32' in ptx and 'atom.global.sys.release.exch.b32' in ptx, name\n"
            "    log, _ = compile_sass(ptx)\n"
            "    assert re.search(r'\\b0 bytes spill stores', log), (name, log[-300:])\n"
            "print('ok')\n")
    run_compiled(code)
