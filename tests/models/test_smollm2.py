"""The real SmolLM2-135M: 210 quantized linears, compiled logits == eager, all matched."""
import pytest
import torch

import spear_compile as spear
from spear_compile.inspect import capture
from spear_compile.models import load


@pytest.fixture(scope="module")
def smollm2_w4():
    model, tok = load("smollm2-135m")
    ids = tok("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer",
              return_tensors="pt").input_ids
    spear.quantize_(model, spear.QuantConfig(group_size=None), progress=False)
    return model, ids


@pytest.mark.slow
def test_smollm2_compiled_logits_match_eager_and_all_linears_matched(smollm2_w4):
    model, ids = smollm2_w4
    assert len(spear.quantized_linears(model)) == 210
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model, backend="spear")(ids).logits
    # fp32 logits of magnitude ~15: Inductor's fusions reassociate sums, so the bound is relative
    # (a wrong kernel is off by 1e-2 and more). An absolute 1e-4 held on one CPU and not on another
    # (1.01e-4 here, at this commit and the previous one).
    assert (compiled - eager).abs().max().item() < 2e-5 * eager.abs().max().item()
    torch._dynamo.reset()
    rep = capture(model, (ids[:, :1],), model_name="smollm2-135m")  # decode-shaped input
    s = rep.summary()
    assert s["matched_linears"] == 210 and s["by_source_form"] == {"spear_op": 210}
    assert s["lowering"] == {"fused": 210}
    assert all(r.get("lowering") and r.get("reason") for r in rep.linears)
    # the decode fusions find their forms in the real Hugging Face graph: per layer one q/k/v and one
    # gate/up concatenation, silu(gate) * up into the latter, both RMSNorms, both residual adds
    matched = {}
    for g in rep.graphs:
        for snap in g.snapshots:
            matched[snap.pass_name] = matched.get(snap.pass_name, 0) + snap.matched_count
    assert (matched["fuse_shared_input"], matched["fuse_glu"], matched["fuse_rmsnorm"],
            matched["fold_residual_add"]) == (150, 30, 60, 60), matched
