"""What a compiled model costs is decided by what was compiled: the plan the latency model is measured for.

The spear backend records every spear linear it compiled (``passes/record_plan.py``);
``runtime.compiled.plan_of(model)`` turns those records into a ``Plan``: one ``PlannedLinear`` per
kind of linear (same shapes, EC ranks and routes; ``count`` of them), each holding the ``PlannedOp``s
that run it (for a q / k / v group at decode one concatenated op, at prefill three separate ones) with
the kernel route per M bucket, plus the attention and head shapes. The latency model is then measured
by running exactly those ops. A plan can also be written by hand from a model's config (``ops`` empty:
the linear is timed as dense ``F.linear``, route ``"reference"``). The plan is part of the latency
cache key through ``model_id`` and ``config_hash``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple
from ..config import DEFAULT_CROSSOVER_M

HEAD_ROWS = ("last", "all")


def _pos(owner: str, name: str, v, lo: int = 1) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{owner}: {name}={v!r} must be an integer >= {lo}")


OPS = ("w4a16", "ec", "w4a16_cat", "w4a16_glu", "ec_cat", "ec_glu")


def route_at(routes: Tuple[Tuple[int, str], ...], m: int) -> str:
    """The route of ``(up_to_m, route)`` pairs (increasing ``up_to_m``) for ``m`` rows: the first pair with
    ``m <= up_to_m``, else the last; ``"reference"`` when there are none."""
    for up_to, route in routes:
        if m <= up_to:
            return route
    return routes[-1][1] if routes else "reference"


@dataclass(frozen=True)
class PlannedOp:
    """One compiled spear op: ``op`` (a ``dispatch.route.OPS`` name) over ``parts`` (per part: output rows,
    EC rank (0: none), EC gate width), input width ``K``, group ``G``, the ``lowering`` / ``crossover``
    the backend chose, the rows ``[m_lo, m_hi]`` its graph runs it at (``m_hi`` None: unbounded) and
    ``routes``: ``(M, kernel description)`` at the recorded M buckets."""

    op: str
    parts: Tuple[Tuple[int, int, int], ...]
    K: int
    G: int
    m_lo: int = 1
    m_hi: Optional[int] = None
    lowering: str = "auto"
    crossover: int = DEFAULT_CROSSOVER_M
    norm: bool = False
    act: str = "silu"
    layout: str = "spear"
    has_zeros: bool = True
    has_bias: bool = False
    dtype: str = "bfloat16"
    routes: Tuple[Tuple[int, str], ...] = ()

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"PlannedOp: op={self.op!r}; expected one of {OPS}")
        object.__setattr__(self, "parts", tuple(tuple(int(v) for v in p) for p in self.parts))
        object.__setattr__(self, "routes", tuple((int(m), str(r)) for m, r in self.routes))
        if not self.parts or any(len(p) != 3 or p[0] < 1 or p[1] < 0 or p[2] < 0 for p in self.parts):
            raise ValueError(f"PlannedOp {self.op}: parts={self.parts!r} must be (rows >= 1, rank >= 0, gate >= 0)")
        _pos(f"PlannedOp {self.op}", "K", self.K)
        _pos(f"PlannedOp {self.op}", "m_lo", self.m_lo)
        if self.m_hi is not None and self.m_hi < self.m_lo:
            raise ValueError(f"PlannedOp {self.op}: m_hi={self.m_hi} < m_lo={self.m_lo}")

    @classmethod
    def from_record(cls, r: dict) -> "PlannedOp":
        return cls(op=r["op"], parts=tuple(tuple(p) for p in r["parts"]), K=r["K"], G=r["G"], m_lo=r["m_lo"],
                   m_hi=r["m_hi"], lowering=r["lowering"], crossover=r["crossover"], norm=r["norm"], act=r["act"],
                   layout=r["layout"], has_zeros=r["has_zeros"], has_bias=r["has_bias"], dtype=r["dtype"],
                   routes=tuple(tuple(x) for x in r["routes"]))

    @property
    def out_features(self) -> int:
        """Rows of the op's output (the GLU's output is one half)."""
        return self.parts[0][0] if self.op.endswith("glu") else sum(p[0] for p in self.parts)

    def covers(self, m: int) -> bool:
        return self.m_lo <= m and (self.m_hi is None or m <= self.m_hi)

    def distance(self, m: int) -> int:
        """How far ``m`` lies outside the op's rows (0 inside)."""
        if m < self.m_lo:
            return self.m_lo - m
        return 0 if self.m_hi is None or m <= self.m_hi else m - self.m_hi

    def route_at(self, m: int) -> str:
        """The recorded route at the smallest recorded bucket >= ``m`` (else the last)."""
        return route_at(self.routes, m)


def ops_at(ops, m: int) -> tuple:
    """The ops that run ``m`` rows: those whose rows cover ``m``, else the nearest (a graph for ``m``
    would be compiled like it)."""
    got = tuple(o for o in ops if o.covers(m))
    if got or not ops:
        return got
    d = min(o.distance(m) for o in ops)
    return tuple(o for o in ops if o.distance(m) == d)


@dataclass(frozen=True)
class PlannedLinear:
    """One kind of linear in the compiled model.

    ``count`` is how many linears of exactly this shape, EC rank and routing the model holds (e.g. the
    layer count for ``q_proj``). ``routes`` lists ``(up_to_m, route)`` pairs in increasing ``up_to_m``:
    the kernel route taken for M rows up to that bound; M above the last bound takes the last route.
    Empty ``routes`` means the single route ``"reference"`` (dense ``F.linear`` plus the EC's two
    skinny matmuls when ``ec_rank > 0``). ``ops``: the compiled ops that run it (from the backend's
    record); the measurement runs those instead of the route's reference."""

    name: str
    in_features: int
    out_features: int
    ec_rank: int = 0
    count: int = 1
    routes: Tuple[Tuple[int, str], ...] = ()
    ops: Tuple[PlannedOp, ...] = ()

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
        object.__setattr__(self, "ops", tuple(self.ops))
        for i, o in enumerate(self.ops):
            if not isinstance(o, PlannedOp):
                raise ValueError(f"{who}: ops[{i}]={o!r} must be a PlannedOp")
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
        return route_at(self.routes, m)

    @property
    def route_names(self) -> Tuple[str, ...]:
        """The routes this linear takes at some M (``("reference",)`` without ``routes``)."""
        return tuple(r for _, r in self.routes) or ("reference",)


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
        return tuple(sorted({r for lin in self.linears for r in lin.route_names}))
