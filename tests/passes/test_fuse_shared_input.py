"""fuse_shared_input: decode linears sharing an activation -> one w4a16_linear_cat + slices."""
import pytest
import torch

import spear_compile as spear
from spear_compile import CompileConfig
from tests.helpers import assert_compiled_matches_eager, capture, quantized_llama, spear_ops_after
from tests.helpers import random_ec as _ec, llama_with_ecs as _llama_with_ecs  # noqa: F401

FUSE = CompileConfig(fuse_shared_input=True, fuse_glu=False)  # (fuse_glu would turn gate/up into a GLU op)


def test_decode_qkv_and_gate_up_become_two_concatenated_linears():
    m = quantized_llama(d=64, layers=1, heads=2, ff=128)
    rep = capture(m, (torch.randn(1, 1, 64),), config=FUSE)
    ops = spear_ops_after(rep)
    # q, k, v -> one; gate, up -> one; o and down stay (quantize_ leaves lm_head in full precision)
    assert ops["spear.w4a16_linear_cat.default"] == 2, ops
    assert ops["spear.w4a16_linear.default"] == 2, ops
    snap = next(s for s in rep.graphs[0].snapshots if s.pass_name == "fuse_shared_input")
    assert snap.matched_count == 5
    assert "aten.slice.Tensor" in snap.after and "w4a16_linear_cat" not in snap.before
    # the report still lists all 7 linears; the fused ones say where they went
    fused = {r["weight"].split(".")[2]: r for r in rep.linears if r.get("fused_into")}
    assert len(rep.linears) == 7 and set(fused) == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    assert fused["q_proj"]["fused_into"] == fused["v_proj"]["fused_into"] != fused["up_proj"]["fused_into"]
    # each names the route of the concatenated op (on CPU tensors: the reference)
    assert all(r["lowering"] == "fused" and r["kernel"] == "reference" for r in fused.values())


def test_on_by_default_can_be_turned_off_and_not_at_prefill():
    m = quantized_llama(d=64, layers=1, heads=2, ff=128)
    assert CompileConfig().fuse_shared_input
    ops = spear_ops_after(capture(m, (torch.randn(1, 1, 64),)))  # gate/up's concatenation goes on into fuse_glu
    assert ops["spear.w4a16_linear_cat.default"] == 1 and ops["spear.w4a16_linear_glu.default"] == 1, ops
    assert ops["spear.w4a16_linear.default"] == 2, ops
    ops = spear_ops_after(capture(m, (torch.randn(1, 1, 64),), config=CompileConfig(fuse_shared_input=False)))
    assert "spear.w4a16_linear_cat.default" not in ops and ops["spear.w4a16_linear.default"] == 7
    ops = spear_ops_after(capture(m, (torch.randn(1, 300, 64),), config=FUSE))  # M = 300: prefill, left alone
    assert "spear.w4a16_linear_cat.default" not in ops and ops["spear.w4a16_linear.default"] == 7


@pytest.mark.parametrize("M", [2, 8, 256])
def test_batched_decode_concatenates_into_one_gemm_and_equals_eager(M):
    """At a static 2 <= M <= 256 q/k/v and gate/up become one concatenated op each (one GEMM on a GPU); the
    decode-only fusions after it (GLU epilogue, RMSNorm prologue, residual bias) leave it alone; off with
    fuse_shared_input_gemm=False; compiled equals eager."""
    m = quantized_llama(d=64, layers=2, heads=2, ff=128, group_size=32)
    x = torch.randn(1, M, 64)
    rep = capture(m, (x,))
    ops = spear_ops_after(rep)
    assert ops["spear.w4a16_linear_cat.default"] == 4 and ops["spear.w4a16_linear.default"] == 4, ops
    assert "spear.w4a16_linear_glu.default" not in ops
    by = {s.pass_name: s.matched_count for s in rep.graphs[0].snapshots}
    assert by["fuse_shared_input"] == 10 and by["fuse_glu"] == 0 and by["fuse_rmsnorm"] == 0, by
    assert not any(r.get("rms_norm") or r.get("residual") for r in rep.linears)
    off = spear_ops_after(capture(m, (x,), config=CompileConfig(fuse_shared_input_gemm=False)))
    assert "spear.w4a16_linear_cat.default" not in off and off["spear.w4a16_linear.default"] == 14
    assert_compiled_matches_eager(m, x, tol=1e-5)


def test_batched_linears_with_ecs_concatenate_unless_ec_fusion_is_off():
    """At M = 8 q/k/v and gate/up with ECs become one ec_linear_cat each (one GEMM, each EC beside it on a GPU);
    compiled equals eager; with fuse_shared_input_ec off they keep their own ops."""
    m = _llama_with_ecs()  # ECs on every linear but down_proj
    x = torch.randn(1, 8, 64)
    ops = spear_ops_after(capture(m, (x,)))
    assert ops["spear.ec_linear_cat.default"] == 2 and ops["spear.ec_linear.default"] == 1, ops  # o alone
    assert_compiled_matches_eager(m, x)
    ops = spear_ops_after(capture(m, (x,), config=CompileConfig(fuse_shared_input_ec=False)))
    assert "spear.ec_linear_cat.default" not in ops and "spear.w4a16_linear_cat.default" not in ops, ops
    assert ops["spear.ec_linear.default"] == 6, ops


def test_a_linear_with_an_ec_fuses_with_its_plain_neighbours_unless_mixed_fusion_is_off():
    """k with an EC beside plain q and v: one ec_linear_cat whose q and v parts have no EC (the default); with
    fuse_shared_input_mixed off, k keeps its own kernel and q, v fuse apart. Either way compiled equals eager."""
    m = quantized_llama(d=64, layers=1, heads=2, ff=128)
    spear.attach_(m, {"layers.0.k_proj": _ec(64, 64, 4, 4)})
    x = torch.randn(1, 1, 64)
    assert CompileConfig().fuse_shared_input_mixed  # the default
    rep = capture(m, (x,), config=FUSE)
    ops = spear_ops_after(rep)
    assert ops["spear.ec_linear_cat.default"] == 1 and ops["spear.w4a16_linear_cat.default"] == 1, ops  # qkv; gate/up
    assert "spear.ec_linear.default" not in ops and ops["spear.w4a16_linear.default"] == 2, ops  # o, down
    fused = {r["weight"].split(".")[2]: r for r in rep.linears if r.get("fused_into")}
    assert fused["q_proj"]["fused_into"] == fused["k_proj"]["fused_into"] == fused["v_proj"]["fused_into"]
    assert_compiled_matches_eager(m, x, config=FUSE)
    off = CompileConfig(fuse_shared_input=True, fuse_glu=False, fuse_shared_input_mixed=False)
    ops = spear_ops_after(capture(m, (x,), config=off))
    # q, v fuse (k has an EC); gate, up fuse
    assert ops["spear.w4a16_linear_cat.default"] == 2 and ops["spear.ec_linear.default"] == 1, ops
    assert ops["spear.w4a16_linear.default"] == 2 and "spear.ec_linear_cat.default" not in ops, ops  # o, down
    assert_compiled_matches_eager(m, x, config=off)


def test_mixed_groups_go_on_into_the_glu_and_rmsnorm_fusions_and_equal_eager():
    """SPEAR-like placement (ECs on v and up only, two layers): at the defaults q/k/v become one ec_linear_cat
    and gate/up one ec_linear_glu (a plain gate beside up's EC), each reading its RMSNorm; compiled equals
    eager. Batched (M = 4) the same groups concatenate (ec_linear_cat: one GEMM, each EC beside it) and equal eager."""
    m = quantized_llama(d=64, layers=2, heads=2, ff=128)
    spear.attach_(m, {f"layers.{i}.{name}": _ec(64, n, 4, 10 * i + j)
                      for i in range(2) for j, (name, n) in enumerate((("v_proj", 64), ("up_proj", 128)))})
    x = torch.randn(1, 1, 64)
    rep = capture(m, (x,))
    ops = spear_ops_after(rep)
    assert ops["spear.ec_linear_cat.default"] == 2 and ops["spear.ec_linear_glu.default"] == 2, ops
    assert "spear.ec_linear.default" not in ops and "spear.w4a16_linear_cat.default" not in ops, ops
    by = {s.pass_name: s.matched_count for s in rep.graphs[0].snapshots}
    assert by["fuse_glu"] == 2 and by["fuse_rmsnorm"] == 4, by
    assert_compiled_matches_eager(m, x)
    x = torch.randn(1, 4, 64)
    ops = spear_ops_after(capture(m, (x,)))
    assert ops["spear.ec_linear_cat.default"] == 4 and "spear.ec_linear.default" not in ops, ops
    assert ops["spear.w4a16_linear.default"] == 4, ops  # o, down
    assert_compiled_matches_eager(m, x)


@pytest.mark.parametrize("group_size", [None, 32])
def test_fused_decode_step_equals_eager(group_size):
    m = quantized_llama(d=64, layers=2, heads=2, ff=128, group_size=group_size)
    assert_compiled_matches_eager(m, torch.randn(1, 1, 64), config=FUSE)


def test_cat_op_checks_its_lists_and_matches_its_parts():
    from spear_compile import QuantConfig
    from spear_compile.quant import quantize_rtn

    parts = [quantize_rtn(torch.randn(n, 64) * 0.05, QuantConfig(group_size=32)) for n in (16, 8)]
    x = torch.randn(3, 64)
    qs, ss, zs = [p.qweight for p in parts], [p.scales for p in parts], [p.zeros for p in parts]
    b = torch.randn(8)
    y = torch.ops.spear.w4a16_linear_cat(x, qs, ss, zs, 32, [None, b])
    parts_y = [torch.ops.spear.w4a16_linear(x, qs[0], ss[0], zs[0], 32, None),
               torch.ops.spear.w4a16_linear(x, qs[1], ss[1], zs[1], 32, b)]
    torch.testing.assert_close(y, torch.cat(parts_y, -1), rtol=0, atol=0)
    with pytest.raises(spear.QuantFormatError, match="one length"):
        torch.ops.spear.w4a16_linear_cat(x, qs, ss[:1], zs, 32, [None, None])
    with pytest.raises(spear.QuantFormatError, match=r"part 1"):
        torch.ops.spear.w4a16_linear_cat(x, qs, [ss[0], ss[0]], zs, 32, [None, None])


FUSE_EC = CompileConfig(fuse_shared_input=True, fuse_shared_input_ec=True, fuse_glu=False)  # gate/up stay a cat


def test_ec_linears_sharing_an_input_fuse_unless_turned_off():
    m = _llama_with_ecs()
    assert CompileConfig().fuse_shared_input_ec  # the default
    ops = spear_ops_after(capture(m, (torch.randn(1, 1, 64),), config=CompileConfig(fuse_shared_input_ec=False)))
    assert "spear.ec_linear_cat.default" not in ops and ops["spear.ec_linear.default"] == 6, ops
    rep = capture(m, (torch.randn(1, 1, 64),), config=FUSE_EC)
    ops = spear_ops_after(rep)
    # q/k/v -> one, gate/up -> one; o (EC, alone on its input) and down (no EC) stay
    assert ops["spear.ec_linear_cat.default"] == 2 and ops["spear.ec_linear.default"] == 1, ops
    assert ops["spear.w4a16_linear.default"] == 1, ops
    fused = [r for r in rep.linears if r.get("fused_into")]
    assert len(fused) == 5 and all(r["kernel"] == "reference" for r in fused)  # (CPU tensors: the reference)
    ops = spear_ops_after(capture(m, (torch.randn(1, 300, 64),), config=FUSE_EC))  # prefill: untouched
    assert "spear.ec_linear_cat.default" not in ops and ops["spear.ec_linear.default"] == 6, ops


def test_fused_ec_decode_step_equals_eager():
    assert_compiled_matches_eager(_llama_with_ecs(), torch.randn(1, 1, 64), config=FUSE_EC)


def test_ec_cat_op_checks_its_lists_and_matches_its_parts():
    from spear_compile import QuantConfig
    from spear_compile.quant import quantize_rtn

    parts = [quantize_rtn(torch.randn(n, 64) * 0.05, QuantConfig(group_size=32)) for n in (16, 8)]
    ecs = [_ec(64, n, r, r) for n, r in ((16, 4), (8, 2))]
    x = torch.randn(3, 64)
    qs, ss, zs = [p.qweight for p in parts], [p.scales for p in parts], [p.zeros for p in parts]
    b = torch.randn(8)
    ec_lists = [[getattr(e, k) for e in ecs] for k in ("A", "B", "W1", "b1", "W2", "b2", "alpha")]
    with torch.no_grad():
        y = torch.ops.spear.ec_linear_cat(x, qs, ss, zs, 32, [None, b], *ec_lists)
        parts_y = [torch.ops.spear.ec_linear(x, qs[i], ss[i], zs[i], 32, [None, b][i],
                                             *[lst[i] for lst in ec_lists]) for i in range(2)]
    torch.testing.assert_close(y, torch.cat(parts_y, -1), rtol=0, atol=0)
    with pytest.raises(spear.QuantFormatError, match="one length"):
        torch.ops.spear.ec_linear_cat(x, qs, ss, zs, 32, [None, b], *ec_lists[:-1], ec_lists[-1][:1])
    with pytest.raises(spear.QuantFormatError, match=r"part 1"):
        torch.ops.spear.ec_linear_cat(x, qs, ss, zs, 32, [None, b], ec_lists[0][:1] * 2, *ec_lists[1:])
    # a part without an EC (None in all seven lists): its rows are its plain linear
    mixed = [[lst[0], None] for lst in ec_lists]
    with torch.no_grad():
        y = torch.ops.spear.ec_linear_cat(x, qs, ss, zs, 32, [None, b], *mixed)
        plain = torch.ops.spear.w4a16_linear(x, qs[1], ss[1], zs[1], 32, b)
    torch.testing.assert_close(y, torch.cat([parts_y[0], plain], -1), rtol=0, atol=0)
    half = [list(lst) for lst in mixed]
    half[3][1] = ec_lists[3][1]  # b1 given, the rest of part 1's EC None
    with pytest.raises(spear.QuantFormatError, match=r"part 1.*\['A', 'B', 'W1', 'W2', 'b2', 'alpha'\] are None"):
        torch.ops.spear.ec_linear_cat(x, qs, ss, zs, 32, [None, b], *half)
    with pytest.raises(spear.QuantFormatError, match="no part has an EC"):
        torch.ops.spear.ec_linear_cat(x, qs, ss, zs, 32, [None, b], *[[None, None]] * 7)


def test_a_batched_concatenation_on_a_gpu_is_made_only_where_the_route_runs_one_gemm(monkeypatch):
    """On a GPU the pass asks the route at the graph's M: a batched concatenation the route would run as its
    parts (``parts``) is left alone (it would only add a copy); decode and CPU graphs are rewritten without
    asking."""
    from types import SimpleNamespace

    from spear_compile.dispatch.route import Route
    from spear_compile.passes import fuse_shared_input as FS

    asked = []

    def fake_route(kw, op, norm, M):
        asked.append((op, M, len(kw["qweights"])))
        return Route(answer)
    monkeypatch.setattr(FS, "cat_route", fake_route)
    x = SimpleNamespace(meta={"val": SimpleNamespace(shape=(1, 8, 64), device=torch.device("cuda"))})
    members = [(SimpleNamespace(target=FS.W4A16), {"qweight": None, "scales": None, "zeros": None, "bias": None})] * 3
    for answer, want in (("cat_gemm", True), ("parts", False), ("ec_cat_gemm", False)):
        assert FS.FuseSharedInput._pays(x, 32, members) is want
    assert asked == [("w4a16_cat", 8, 3)] * 3
    ec = {"qweight": None, "scales": None, "zeros": None, "bias": None, "A": None, "B": None, "W1": None, "b1": None,
          "W2": None, "b2": None, "alpha": None, "act": "silu"}
    with_ec = members[:2] + [(SimpleNamespace(target=FS.EC_LINEAR), ec)]  # with an EC: asked as ec_cat
    for answer, want in (("ec_cat_gemm", True), ("parts", False), ("cat_gemm", False)):
        assert FS.FuseSharedInput._pays(x, 32, with_ec) is want
    assert asked[3:] == [("ec_cat", 8, 3)] * 3
    del asked[3:]
    x.meta["val"] = SimpleNamespace(shape=(1, 1, 64), device=torch.device("cuda"))  # decode: the GEMV, no question
    assert FS.FuseSharedInput._pays(x, 32, members) and len(asked) == 3
    x.meta["val"] = SimpleNamespace(shape=(1, 8, 64), device=torch.device("cpu"))
    assert FS.FuseSharedInput._pays(x, 32, members) and len(asked) == 3
