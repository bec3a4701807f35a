"""Where ECs go and at which rank: CKA damage, its entropy, and a byte budget.

Damage of module m: ``d_m = 1 - CKA(f_fp, f_m)``, where ``f`` are the features that feed
the output head, ``f_fp`` from the full-precision model and ``f_m`` from the same model
with *only* m quantized (linear CKA, fp64, streamed; ``compensators/cka.py``).

Entropy decides concentrate-vs-spread. With ``p_m = d_m / sum d``, ``H = -sum p ln p``
and ``n_eff = exp(H)`` (the effective number of damaged modules): a few dominant modules
(low entropy) get few, high-rank ECs; damage spread evenly (high entropy) gets many,
low-rank ECs. We take the ``round(n_eff)`` modules with the best cost-aware score
``d_m / (bytes per rank of m / mean)^gamma`` (so a cheap module with the same damage wins)
and give them one shared rank, the largest that fits the byte budget.

With ``spectra`` (per module, the squared singular values of the activation-whitened weight
error, ``static.output_error_spectrum``), ranks are no longer shared: bytes go greedily to
the next singular direction with the most damage removed per byte, ``d_m * sigma_{m,r}^2 /
sum_i sigma_{m,i}^2 / bytes_per_rank(m)``, i.e. module m's damage is assumed proportional to
its expected output error and a rank-r correction removes its top r directions. Modules
whose first direction is never worth its bytes get no EC.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import math
import re
from typing import Iterable, Optional

import torch
from torch import nn

from ..quant.linear import QuantLinear

from .cka import StreamingCKA


@dataclasses.dataclass
class ModuleChoice:
    name: str
    damage: float
    rank: int
    bytes: int
    reason: str


@dataclasses.dataclass
class Plan:
    modules: list[ModuleChoice]
    budget_bytes: int
    entropy: float
    n_eff: float
    damage: dict[str, float]

    @property
    def ec_bytes(self) -> int:
        return sum(m.bytes for m in self.modules)

    def ranks(self) -> dict[str, int]:
        return {m.name: m.rank for m in self.modules}

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, s: str) -> "Plan":
        d = json.loads(s)
        d["modules"] = [ModuleChoice(**m) for m in d["modules"]]
        return cls(**d)


def ec_bytes(N: int, K: int, rank: int, gate_hidden: int = 8, dtype_bytes: int = 2) -> int:
    """Stored bytes of one EC: A, B, the gate MLP (W1, b1, W2, b2) and alpha."""
    return dtype_bytes * (rank * (N + K) + 2 * rank * gate_hidden + gate_hidden + rank + 1)


def _allocate(chosen: list[str], damage: dict[str, float], shapes: dict[str, tuple[int, int]],
              spectra: dict[str, torch.Tensor], budget_bytes: int, gate_hidden: int, dtype_bytes: int,
              max_rank: int, min_rank: int = 0) -> dict[str, int]:
    """Greedy water-filling of ranks: the most damage removed per byte first (see module doc).
    ``min_rank``: every chosen module starts at that rank (a floor the KL training can use
    where the spectra see little error); the greedy spends what is left."""
    import heapq

    missing = [n for n in chosen if n not in spectra]
    if missing:
        raise KeyError(f"plan: no error spectrum for modules {missing[:5]}")
    frac = {n: (spectra[n].double() / spectra[n].double().sum().clamp_min(1e-30)).tolist() for n in chosen}
    cost = lambda n, r: ec_bytes(*shapes[n], r, gate_hidden, dtype_bytes) if r else 0  # noqa: E731
    cap = {n: min(max_rank, len(frac[n]), *shapes[n]) for n in chosen}
    rank = {n: min(min_rank, cap[n]) for n in chosen}
    spent = sum(cost(n, r) for n, r in rank.items())
    if spent > budget_bytes:
        raise ValueError(f"plan: min_rank={min_rank} on {len(chosen)} modules needs {spent} bytes, "
                         f"over the budget of {budget_bytes}")
    heap = [(-damage[n] * frac[n][rank[n]] / (cost(n, rank[n] + 1) - cost(n, rank[n])), n)
            for n in chosen if rank[n] < cap[n]]
    heapq.heapify(heap)
    while heap:
        _, n = heapq.heappop(heap)
        r = rank[n]
        step = cost(n, r + 1) - cost(n, r)
        if spent + step > budget_bytes:
            continue  # this module's next direction does not fit; cheaper ones may
        rank[n], spent = r + 1, spent + step
        if r + 1 < cap[n]:
            heapq.heappush(heap, (-damage[n] * frac[n][r + 1] / (cost(n, r + 2) - cost(n, r + 1)), n))
    return {n: r for n, r in rank.items() if r > 0}


_SELECT = ("entropy", "all")


def plan(damage: dict[str, float], shapes: dict[str, tuple[int, int]], budget_bytes: int, gate_hidden: int = 8,
         dtype_bytes: int = 2, max_rank: int = 256, gamma: float = 0.5,
         spectra: Optional[dict[str, torch.Tensor]] = None, select: str = "entropy", min_rank: int = 0) -> Plan:
    """Choose modules and ranks under ``budget_bytes`` from per-module damage and [N, K] shapes
    (shared rank, or greedy per-module ranks when ``spectra`` are given).

    ``select="entropy"`` takes the ``round(n_eff)`` best-scoring modules (module doc);
    ``select="all"`` offers every damaged module to the allocation (with ``spectra`` the greedy
    still leaves out modules whose first direction never earns its bytes). ``min_rank`` (greedy
    only): the rank every selected module gets before the greedy spends the rest."""
    if select not in _SELECT:
        raise ValueError(f"plan: select={select!r}; expected one of {_SELECT}")
    if max_rank < 1:
        raise ValueError(f"plan: max_rank={max_rank} must be >= 1")
    if min_rank and spectra is None:
        raise ValueError("plan: min_rank needs spectra (it is a floor for the greedy allocation)")
    names = [n for n in damage if damage[n] > 0]
    if not names:
        return Plan([], budget_bytes, 0.0, 0.0, dict(damage))
    missing = [n for n in names if n not in shapes]
    if missing:
        raise KeyError(f"plan: no shape for modules {missing[:5]}")
    total = sum(damage[n] for n in names)
    p = {n: damage[n] / total for n in names}
    H = -sum(v * math.log(v) for v in p.values() if v > 0)
    n_eff = math.exp(H)
    per_rank = {n: ec_bytes(*shapes[n], 1, gate_hidden, dtype_bytes) for n in names}
    mean_cost = sum(per_rank.values()) / len(per_rank)
    score = {n: damage[n] / (per_rank[n] / mean_cost) ** gamma for n in names}
    order = sorted(names, key=lambda n: -score[n])
    k = len(order) if select == "all" else max(1, min(len(order), round(n_eff)))
    while k >= 1:
        chosen = order[:k]
        rank = max_rank
        while rank >= 1 and sum(ec_bytes(*shapes[n], rank, gate_hidden, dtype_bytes) for n in chosen) > budget_bytes:
            rank -= 1
        if rank >= 1:
            break
        k -= 1  # the budget cannot give every chosen module rank 1: drop the weakest
    if k < 1:
        return Plan([], budget_bytes, H, n_eff, dict(damage))
    if spectra is not None:
        ranks = _allocate(order[:k], damage, shapes, spectra, budget_bytes, gate_hidden, dtype_bytes, max_rank,
                          min_rank)
        mods = [ModuleChoice(n, damage[n], ranks[n], ec_bytes(*shapes[n], ranks[n], gate_hidden, dtype_bytes),
                             f"{_which(k, len(names), gamma, select)} (n_eff = exp(H) = {n_eff:.1f}); "
                             f"rank {ranks[n]} by greedy damage-weighted output-error "
                             f"reduction per byte") for n in order[:k] if n in ranks]
        return Plan(mods, budget_bytes, H, n_eff, dict(damage))
    mods = [ModuleChoice(n, damage[n], rank, ec_bytes(*shapes[n], rank, gate_hidden, dtype_bytes),
                         f"{_which(k, len(names), gamma, select)} (n_eff = exp(H) = {n_eff:.1f}); "
                         f"rank {rank} is the largest shared rank within the budget")
            for n in order[:k]]
    return Plan(mods, budget_bytes, H, n_eff, dict(damage))


def _which(k: int, n: int, gamma: float, select: str) -> str:
    if select == "all" and k == n:
        return f"one of all {n} damaged modules"
    return f"one of the top {k} of {n} by damage/cost^{gamma}"


class _Stop(Exception):
    """Raised by the feature hook: nothing after the output head's input is needed."""


class _Cached(nn.Module):
    """Stands in for a decoder layer during a replay: returns the layer's recorded output."""

    def __init__(self, outputs: list, batch: list) -> None:
        super().__init__()
        self.outputs, self.batch = outputs, batch

    def forward(self, *args, **kwargs):
        return self.outputs[self.batch[0]]


def _layer_index(names: list[str], model: nn.Module) -> tuple[Optional[nn.ModuleList], dict[str, int]]:
    """The ``nn.ModuleList`` of decoder layers holding the modules, and each module's layer index."""
    stack, index = None, {}
    for n in names:
        m = re.match(r"^(.*?)\.?(\d+)\.(.+)$", n)
        if not m:
            continue
        parent = model.get_submodule(m.group(1)) if m.group(1) else model
        if not isinstance(parent, nn.ModuleList):
            continue
        if stack is not None and parent is not stack:
            return None, {}  # modules in two stacks: replay would be ambiguous, run whole forwards
        stack, index[n] = parent, int(m.group(2))
    return stack, index


@torch.no_grad()
def module_damage(fp_model: nn.Module, q_model: nn.Module, batches: Iterable[torch.Tensor],
                  names: Optional[list[str]] = None, feature_module: str = "lm_head",
                  progress: bool = True, replay: bool = True) -> dict[str, float]:
    """``1 - CKA`` of the inputs of ``feature_module`` with one module quantized at a time.

    ``q_model`` is a quantized copy of ``fp_model`` (same module names); for each name its
    module is swapped into ``fp_model`` for the measurement and swapped back after.

    Cost: one partial forward per module. The full-precision outputs of every decoder layer
    are recorded once; measuring a module in layer i replaces layers 0..i-1 by their
    recorded outputs, so only layers i..L-1 run, and the forward stops at the output head's
    input (the head itself, 49k x 576 on SmolLM2, never runs). Identical numbers to whole
    forwards (tested; ``replay=False`` runs whole forwards), about 2.5x less compute.
    """
    from tqdm.auto import tqdm


    batches = list(batches)
    q_mods = dict(q_model.named_modules())
    names = names or [n for n, m in q_mods.items() if isinstance(m, QuantLinear)]
    stack, layer_of = _layer_index(names, fp_model) if replay else (None, {})
    kwargs = {"use_cache": False} if "use_cache" in inspect.signature(fp_model.forward).parameters else {}
    feats: list[torch.Tensor] = []
    layer_out: list[list] = [[] for _ in (stack or [])]

    def grab(m, args):
        feats.append(args[0].detach())
        raise _Stop

    def run(b):
        feats.clear()
        try:
            fp_model(b, **kwargs)
        except _Stop:
            pass
        return feats[-1]

    handles = [fp_model.get_submodule(feature_module).register_forward_pre_hook(grab)]
    handles += [layer.register_forward_hook(lambda m, a, out, i=i: layer_out[i].append(out))
                for i, layer in enumerate(stack or [])]
    try:
        ref = [run(b) for b in batches]
        for h in handles[1:]:
            h.remove()
        del handles[1:]
        batch_no = [0]
        originals = list(stack or [])
        damage = {}
        for name in tqdm(names, desc="CKA damage", disable=not progress, leave=False):
            parent_name, _, child = name.rpartition(".")
            parent = fp_model.get_submodule(parent_name) if parent_name else fp_model
            orig = getattr(parent, child)
            setattr(parent, child, q_mods[name])
            upto = layer_of.get(name, 0)
            for i in range(upto):
                stack[i] = _Cached(layer_out[i], batch_no)
            try:
                s = StreamingCKA()
                for j, (b, r) in enumerate(zip(batches, ref)):
                    batch_no[0] = j
                    s.update(r, run(b))
                damage[name] = max(0.0, 1.0 - s.value())
            finally:
                setattr(parent, child, orig)
                for i in range(upto):
                    stack[i] = originals[i]
    finally:
        for h in handles:
            h.remove()
    return damage


def shapes_of(model: nn.Module, names: Iterable[str]) -> dict[str, tuple[int, int]]:
    out = {}
    for n in names:
        m = model.get_submodule(n)
        out[n] = (m.out_features, m.in_features)
    return out

