"""fuse_peer_reduce: ec_linear_partial -> all_reduce -> wait_tensor -> ec_reduced_apply becomes one
spear::ec_linear_peer_reduce; other tensor-parallel graphs compile as Inductor would.

The graphs come from a one-rank gloo group in this process (the collective is in the graph as it is at
any world size); the multi-process numerics are in tests/parallel/."""
import datetime
import os

import pytest
import torch

import spear_compile as spear
from spear_compile.errors import QuantFormatError
from spear_compile.parallel import shard_row
from tests.helpers import assert_compiled_matches_eager, capture, random_ec, snapshot


@pytest.fixture
def group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp_path, 'store')}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def _row_layer(group_name: str, ec: bool = True, bias: bool = False, K: int = 128, N: int = 64):
    lin = torch.nn.Linear(K, N, bias=bias)
    torch.nn.init.normal_(lin.weight, std=0.05)
    q = spear.QuantLinear.from_linear(lin, spear.QuantConfig(group_size=32))
    if ec:
        q.ec = random_ec(K, N, 8, 3)
    return shard_row(q, 0, 1, group_name, "o_proj"), q


def test_row_parallel_ec_chain_becomes_one_op(group):
    layer, whole = _row_layer(group, bias=True)
    x = torch.randn(1, 1, 128)
    rep = capture(layer, (x,))
    snap = snapshot(rep, "fuse_peer_reduce")
    assert snap.matched_count == 1
    for op in ("spear.ec_linear_partial.default", "_c10d_functional.all_reduce.default",
               "_c10d_functional.wait_tensor.default", "spear.ec_reduced_apply.default"):
        assert snap.ops_before.get(op) == 1 and op not in snap.ops_after, op
    assert snap.ops_after.get("spear.ec_linear_peer_reduce.default") == 1
    assert f"silu, spear, {group}, 300.0)" in snap.after  # the fused op reads the all-reduce's group
    (rec,) = rep.linears  # the inspection report lists it
    assert rec["source_form"] == "row_parallel" and rec["ec_rank"] == 8 and rec["tp_group"] == group, rec
    assert_compiled_matches_eager(layer, x)
    with torch.no_grad():  # and the whole single-process layer (one rank holds all of K)
        torch.testing.assert_close(torch.compile(layer, backend="spear")(x), whole(x), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_without_a_group_the_partial_and_apply_fuse_with_no_collective():
    layer, whole = _row_layer("")
    x = torch.randn(3, 128)
    snap = snapshot(capture(layer, (x,)), "fuse_peer_reduce")
    assert snap.matched_count == 1 and "all_reduce" not in snap.before
    assert "silu, spear, , 300.0)" in snap.after  # group "": no reduction
    assert_compiled_matches_eager(layer, x)


class _PartialUsedTwice(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        import torch.distributed._functional_collectives as funcol

        loc, ec = self.layer.local, self.layer.ec
        yh = torch.ops.spear.ec_linear_partial(x, loc.qweight, loc.scales, loc.zeros, loc.group_size, ec.A)
        red = funcol.all_reduce(yh, "sum", self.layer.group_name)
        out = torch.ops.spear.ec_reduced_apply(red, None, ec.B, ec.W1, ec.b1, ec.W2, ec.b2, ec.alpha, ec.act, x.dtype)
        return out, yh.sum()  # the partial has a second user: fusing would drop it


def test_unmatched_tensor_parallel_graphs_compile_as_inductor_would(group):
    plain, _ = _row_layer(group, ec=False, bias=True)  # W4 row-parallel, no EC: linear + all-reduce stay
    x = torch.randn(1, 1, 128)
    snap = snapshot(capture(plain, (x,)), "fuse_peer_reduce")
    assert snap.matched_count == 0 and snap.before == snap.after
    assert "_c10d_functional.all_reduce.default" in snap.after
    assert_compiled_matches_eager(plain, x)
    twice = _PartialUsedTwice(_row_layer(group)[0])
    snap = snapshot(capture(twice, (x,)), "fuse_peer_reduce")
    assert snap.matched_count == 0 and "spear.ec_linear_peer_reduce" not in snap.after
    with torch.no_grad():
        ref = twice(x)
        torch._dynamo.reset()
        out = torch.compile(twice, backend="spear")(x)
    torch._dynamo.reset()
    torch.testing.assert_close(out, ref)


def test_the_ops_name_what_is_wrong():
    layer, _ = _row_layer("")
    loc, ec = layer.local, layer.ec
    x = torch.randn(2, 128)
    with pytest.raises(QuantFormatError, match="yh must be fp32"):
        torch.ops.spear.ec_reduced_apply(torch.zeros(2, 72, dtype=torch.bfloat16), None, ec.B, ec.W1, ec.b1, ec.W2,
                                         ec.b2, ec.alpha, ec.act, torch.float32)
    with pytest.raises(QuantFormatError, match="expected N \\+ rank = 64 \\+ 8"):
        torch.ops.spear.ec_reduced_apply(torch.zeros(2, 70), None, ec.B, ec.W1, ec.b1, ec.W2, ec.b2, ec.alpha,
                                         ec.act, torch.float32)
    with pytest.raises(QuantFormatError, match="A has shape \\(8, 64\\), expected \\(rank, 128\\)"):
        torch.ops.spear.ec_linear_partial(x, loc.qweight, loc.scales, loc.zeros, loc.group_size, ec.A[:, :64])
    with pytest.raises(RuntimeError, match="group 'nope' named, but torch.distributed is not initialised"):
        torch.ops.spear.ec_linear_peer_reduce(x, loc.qweight, loc.scales, loc.zeros, loc.group_size, None, ec.A,
                                              ec.B, ec.W1, ec.b1, ec.W2, ec.b2, ec.alpha, ec.act, "spear", "nope")


def test_the_tensor_parallel_ops_fake_and_real_agree():
    """torch.library.opcheck: schema, fake implementation and eager implementation consistent (no group)."""
    layer, _ = _row_layer("", bias=True)
    loc, ec = layer.local, layer.ec
    x = torch.randn(2, 3, 128)
    gate = (ec.B, ec.W1, ec.b1, ec.W2, ec.b2, ec.alpha)
    yh = torch.ops.spear.ec_linear_partial(x, loc.qweight, loc.scales, loc.zeros, loc.group_size, ec.A)
    cases = [(torch.ops.spear.ec_linear_partial, (x, loc.qweight, loc.scales, loc.zeros, loc.group_size, ec.A)),
             (torch.ops.spear.ec_reduced_apply, (yh, layer.bias, *gate, ec.act, torch.float32)),
             (torch.ops.spear.ec_linear_peer_reduce, (x, loc.qweight, loc.scales, loc.zeros, loc.group_size,
                                                      layer.bias, ec.A, *gate, ec.act, "spear", ""))]
    for op, args in cases:
        torch.library.opcheck(op, args)
