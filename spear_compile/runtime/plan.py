"""What a compiled model costs is decided by what was compiled: the plan the latency model is measured for.

The spear backend will fill a ``Plan`` when it compiles a model (every matched linear with its shape, EC
rank and the kernel route it takes per M bucket, plus the attention and head shapes); the latency model
is then measured for exactly those routes. Until the backend records it, a plan is written by hand (or
by a benchmark) from the model's config. The plan is also part of the latency cache key through
``model_id`` and ``config_hash`` (``CompileConfig.fingerprint()``, which covers the EC placement).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

HEAD_ROWS = ("last", "all")


def _pos(owner: str, name: str, v, lo: int = 1) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{owner}: {name}={v!r} must be an integer >= {lo}")


@dataclass(frozen=True)
class PlannedLinear:
    """One kind of linear in the compiled model.

    ``count`` is how many linears of exactly this shape, EC rank and routing the model holds (e.g. the
    layer count for ``q_proj``). ``routes`` lists ``(up_to_m, route)`` pairs in increasing ``up_to_m``:
    the kernel route taken for M rows up to that bound; M above the last bound takes the last route.
    Empty ``routes`` means the single route ``"reference"`` (dense ``F.linear`` plus the EC's two
    skinny matmuls when ``ec_rank > 0``)."""

    name: str
    in_features: int
    out_features: int
    ec_rank: int = 0
    count: int = 1
    routes: Tuple[Tuple[int, str], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"PlannedLinear: name={self.name!r} must be a non-empty str")
        who = f"PlannedLinear {self.name!r}"
        _pos(who, "in_features", self.in_features)
        _pos(who, "out_features", self.out_features)
        _pos(who, "ec_rank", self.ec_rank, 0)
        _pos(who, "count", self.count)
        routes = tuple(tuple(r) for r in self.routes)
        object.__setattr__(self, "routes", routes)
        last = 0
        for i, r in enumerate(routes):
            if len(r) != 2 or not isinstance(r[1], str) or not r[1]:
                raise ValueError(f"{who}: routes[{i}]={r!r} must be (up_to_m, route name)")
            _pos(who, f"routes[{i}].up_to_m", r[0])
            if r[0] <= last:
                raise ValueError(f"{who}: routes must have strictly increasing up_to_m, got {list(routes)}")
            last = r[0]

    def route_at(self, m: int) -> str:
        """The route this linear takes for ``m`` rows."""
        for up_to, route in self.routes:
            if m <= up_to:
                return route
        return self.routes[-1][1] if self.routes else "reference"


@dataclass(frozen=True)
class Plan:
    """A compiled model as the latency model sees it.

    Attention: ``n_layers`` layers of ``n_heads`` query heads over ``n_kv_heads`` KV heads of
    ``head_dim``. Head: ``hidden_size -> vocab_size``, applied to the last token of each sequence in the
    step (``head_rows="last"``, what continuous-batching engines do) or to every token (``"all"``)."""

    model_id: str
    config_hash: str
    linears: Tuple[PlannedLinear, ...]
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    dtype: str = "bfloat16"
    head_rows: str = "last"

    def __post_init__(self) -> None:
        for f in ("model_id", "config_hash", "dtype"):
            v = getattr(self, f)
            if not isinstance(v, str) or not v:
                raise ValueError(f"Plan: {f}={v!r} must be a non-empty str")
        object.__setattr__(self, "linears", tuple(self.linears))
        for i, lin in enumerate(self.linears):
            if not isinstance(lin, PlannedLinear):
                raise ValueError(f"Plan: linears[{i}]={lin!r} must be a PlannedLinear")
        names = [lin.name for lin in self.linears]
        if len(set(names)) != len(names):
            raise ValueError(f"Plan: linear names must be unique, got {names}")
        for f in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_size", "vocab_size"):
            _pos("Plan", f, getattr(self, f))
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"Plan: n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_rows not in HEAD_ROWS:
            raise ValueError(f"Plan: head_rows={self.head_rows!r} must be one of {HEAD_ROWS}")

    @property
    def routes(self) -> Tuple[str, ...]:
        """Every route the plan uses, sorted (what must be measured)."""
        out = set()
        for lin in self.linears:
            out.update(r for _, r in lin.routes)
            if not lin.routes:
                out.add("reference")
        return tuple(sorted(out))
