"""Selection: entropy decides concentrate vs spread, the budget is respected, real damage ranks the worst module first."""
import copy

import pytest
import torch

import spear_compile as spear
from spear_compile.compensators.selection import Plan, ec_bytes, module_damage, plan, shapes_of
from tests.helpers import LlamaLike

SHAPES = {f"m{i}": (256, 256) for i in range(20)}


def test_low_entropy_concentrates_high_entropy_spreads():
    budget = 20 * ec_bytes(256, 256, 8)
    peaked = {n: (1.0 if n == "m3" else 1e-4) for n in SHAPES}
    flat = {n: 1.0 for n in SHAPES}
    p1, p2 = plan(peaked, SHAPES, budget), plan(flat, SHAPES, budget)
    assert [m.name for m in p1.modules] == ["m3"] and p1.modules[0].rank > 100
    assert len(p2.modules) == 20 and p2.modules[0].rank == 8
    assert p1.entropy < p2.entropy
    for p in (p1, p2):
        assert p.ec_bytes <= budget


def test_cost_aware_score_prefers_cheaper_modules_at_equal_damage():
    shapes = {"small": (128, 128), "big": (4096, 4096)}
    p = plan({"small": 1.0, "big": 1.0}, shapes, budget_bytes=ec_bytes(128, 128, 4), max_rank=4)
    assert [m.name for m in p.modules] == ["small"]


def test_tiny_budget_and_json_round_trip():
    p = plan({"m0": 1.0, "m1": 0.5}, SHAPES, budget_bytes=10)
    assert p.modules == []
    p = plan({"m0": 1.0, "m1": 0.5}, SHAPES, budget_bytes=ec_bytes(256, 256, 16) * 2)
    assert Plan.from_json(p.to_json()) == p


def test_real_damage_finds_the_broken_module():
    torch.manual_seed(0)
    fp = LlamaLike(layers=2)
    q = spear.quantize_(copy.deepcopy(fp), spear.QuantConfig(), progress=False)
    bad = q.layers[1].up_proj
    with torch.no_grad():
        bad.zeros.add_(3.0)  # a badly quantized module: its outputs shift a lot
    batches = [torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    dmg = module_damage(fp, q, batches, progress=False)
    assert len(dmg) == 14 and max(dmg, key=dmg.get) == "layers.1.up_proj"
    assert all(0.0 <= v <= 1.0 for v in dmg.values())
    # the fp model was restored after every swap
    assert isinstance(fp.layers[1].up_proj, torch.nn.Linear)
    p = plan(dmg, shapes_of(q, dmg), budget_bytes=4 * ec_bytes(128, 64, 4))
    assert p.modules[0].name == "layers.1.up_proj"


@pytest.mark.parametrize("kind", ["llamalike", "hf_llama"])
def test_replayed_damage_equals_whole_forwards(kind):
    """Replaying from the module's layer (recorded outputs for the layers before it, stop at
    the head's input) gives the same damage as running the whole quantized-one-module model."""
    torch.manual_seed(0)
    if kind == "llamalike":
        fp = _WithHead()
        batches = [torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    else:
        from spear_compile.models.tiny import tiny_llama

        fp = tiny_llama(layers=3)
        batches = [torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    q = spear.quantize_(copy.deepcopy(fp), spear.QuantConfig(), progress=False)
    fast = module_damage(fp, q, batches, progress=False)
    slow = module_damage(fp, q, batches, progress=False, replay=False)
    assert fast.keys() == slow.keys() and len(fast) == 21
    for n in fast:
        assert fast[n] == pytest.approx(slow[n], rel=1e-6, abs=1e-12), n
    assert len({round(v, 12) for v in fast.values()}) > 10  # real, distinct damages
    stack = fp.model.layers if kind == "hf_llama" else fp.body.layers
    assert all(type(layer) is type(stack[0]) and type(layer).__name__ != "_Cached" for layer in stack)


class _WithHead(torch.nn.Module):
    """LlamaLike under a prefix ("body.layers.i...") with an output head, like a causal LM."""

    def __init__(self):
        super().__init__()
        self.body, self.lm_head = LlamaLike(layers=3), torch.nn.Linear(64, 32)

    def forward(self, x):
        return self.lm_head(self.body(x))


def test_spectra_allocate_ranks_by_damage_removed_per_byte():
    shapes = {f"m{i}": (256, 256) for i in range(4)}
    damage = {"m0": 1.0, "m1": 1.0, "m2": 0.5, "m3": 0.5}
    flat = 0.9 ** torch.arange(256.0)                        # error spread over many directions
    steep = torch.tensor([100.0] + [0.01] * 255)             # one direction holds it all
    spectra = {"m0": flat, "m1": steep, "m2": steep, "m3": flat}
    budget = ec_bytes(256, 256, 40)
    p = plan(damage, shapes, budget, spectra=spectra)
    r = p.ranks()
    assert p.ec_bytes <= budget
    assert r["m1"] == 1 and r["m2"] == 1          # one direction removes nearly all their damage
    assert r["m0"] > r["m3"] > 1                  # flat spectra share the rest by damage
    assert sum(r.values()) >= 38                   # the budget is (nearly) spent
    # a shared-rank plan over the same modules cannot be better by this measure
    shared = plan(damage, shapes, budget)
    removed = lambda ranks: sum(damage[n] * float(spectra[n][:k].sum() / spectra[n].sum())  # noqa: E731
                                for n, k in ranks.items())
    assert removed(r) > removed(shared.ranks())


def _flat_spectra(shapes, n=64):
    return {k: 0.9 ** torch.arange(float(n)) for k in shapes}


def test_select_all_offers_every_module_and_entropy_fewer():
    shapes = {f"m{i}": (256, 256) for i in range(10)}
    damage = {f"m{i}": 2.0 ** -i for i in range(10)}            # peaked: n_eff is about 3
    budget = 10 * ec_bytes(256, 256, 2)
    spectra = {k: 0.5 ** torch.arange(64.0) for k in shapes}    # the first directions hold most error
    ent = plan(damage, shapes, budget, spectra=spectra)
    every = plan(damage, shapes, budget, spectra=spectra, select="all")
    assert {m.name for m in ent.modules} <= {f"m{i}" for i in range(round(ent.n_eff))} and round(ent.n_eff) == 4
    assert len(every.modules) > round(ent.n_eff)
    assert every.ec_bytes <= budget and "all 10 damaged modules" in every.modules[0].reason
    with pytest.raises(ValueError, match="select"):
        plan(damage, shapes, budget, select="some")


def test_min_rank_is_a_floor_and_max_rank_a_cap():
    shapes = {f"m{i}": (256, 256) for i in range(6)}
    damage = {"m0": 1.0, **{f"m{i}": 1e-3 for i in range(1, 6)}}
    spectra = _flat_spectra(shapes)
    budget = ec_bytes(256, 256, 30)
    free = plan(damage, shapes, budget, spectra=spectra, select="all").ranks()
    floor = plan(damage, shapes, budget, spectra=spectra, select="all", min_rank=2).ranks()
    capped = plan(damage, shapes, budget, spectra=spectra, select="all", max_rank=8).ranks()
    assert free["m0"] > 8 and min(floor.values()) >= 2 and len(floor) == 6
    assert floor["m0"] < free["m0"]                              # the floor's bytes came from m0
    assert max(capped.values()) == 8 and sum(capped.values()) > 8
    with pytest.raises(ValueError, match="min_rank=40"):
        plan(damage, shapes, budget, spectra=spectra, select="all", min_rank=40)
    with pytest.raises(ValueError, match="needs spectra"):
        plan(damage, shapes, budget, min_rank=1)
