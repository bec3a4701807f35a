"""The tuned table: measured kernel choices and configs per GPU, typed and validated.

A table maps typed keys (one frozen dataclass per kind: ``GemmKey(M, N, K, G)``, ``Gemv1Key(N, K, G,
ec)``, ...) to typed values (``TileConfig``, ``GemmChoice``, ``SelfChoice``, ``Flag``, ``Structure``,
``Crossover``). Every entry is validated when it is loaded or stored; a bad entry raises
``TableError`` naming the file, the entry and what is wrong. The file format carries
``SCHEMA_VERSION``; a file without it or with another version is stale and is refused (convert a
table of the older format, a flat ``{"kind|N|K|G": value}`` dict, with ``convert_legacy``).

Two places, read in this order:

* the user's table, ``<cache>/tuned/<name>_<GPU>.json`` (``envs.cache_dir()``): what
  ``benchmarks/kernels.py`` and the other tuners write (``save``), never into the installed package;
* the shipped table, package data ``spear_compile/dispatch/tuned/<name>_<GPU>.json``.

A user table replaces the shipped one for its GPU as a whole (tuners start from the table in use and
write it back complete, so an entry they drop stays dropped).

Access for the kernel choice goes through ``route()`` (``dispatch/route.py``); ``table[key]`` and
``table.get(key)`` give an entry's value in its wire form (the JSON list / string / integer the
launch code unpacks), ``table.typed(key)`` the value object.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import ClassVar, Iterator, Optional, Union

import torch

from .. import envs

SCHEMA_VERSION = 2
SHIPPED_DIR = os.path.join(os.path.dirname(__file__), "tuned")
M_BUCKET_MAX = 4096


class TableError(ValueError):
    """A tuned-table file or entry that does not validate (names the file and the entry)."""


def _pow2(v) -> bool:
    return isinstance(v, int) and v >= 1 and v & (v - 1) == 0


def _pos_ints(vals, what: str, n: Union[int, tuple]) -> tuple:
    vals = tuple(vals)
    ns = (n,) if isinstance(n, int) else n
    if len(vals) not in ns or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in vals):
        raise ValueError(f"{what}: expected {' or '.join(map(str, ns))} non-negative integers, got {list(vals)}")
    return vals


def m_bucket(M: int) -> int:
    """The table's row bucket of M rows: the next power of two, at most ``M_BUCKET_MAX``."""
    return min(1 << max(0, (int(M) - 1).bit_length()), M_BUCKET_MAX)


# ---------------------------------------------------------------- keys


@dataclass(frozen=True)
class Key:
    """A table key: the kind plus its integer fields, written ``kind|f1|f2|...`` in files. The fields are
    checked by name: every one a positive integer (``ec`` 0 or 1), ``M`` a row bucket, ``R`` a rank bucket."""

    KIND: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if f.name == "ec" else 1):
                raise ValueError(f"{self.KIND} key: {f.name}={v!r} must be a positive integer")
        if hasattr(self, "ec") and self.ec not in (0, 1):
            raise ValueError(f"{self.KIND} key: ec={self.ec!r} must be 0 or 1")
        if hasattr(self, "M") and (not _pow2(self.M) or self.M > M_BUCKET_MAX):
            raise ValueError(f"{self.KIND} key: M={self.M} must be a row bucket (a power of two <= {M_BUCKET_MAX})")
        if hasattr(self, "R") and not _pow2(self.R):
            raise ValueError(f"{self.KIND} key: R={self.R} must be a rank bucket (a power of two)")

    def fields(self) -> dict:
        return dataclasses.asdict(self)

    def wire(self) -> str:
        return "|".join([self.KIND, *(str(v) for v in dataclasses.astuple(self))])

    def __str__(self) -> str:
        return self.wire()


def _key(name: str, kind: str, fields: str, doc: str, **defaults) -> type:
    """A frozen ``Key`` dataclass ``name`` of kind ``kind`` with the integer ``fields`` (in file order; ``defaults``
    for the trailing ones)."""
    ns = {"__module__": __name__, "__qualname__": name, "__doc__": doc, "KIND": kind,
          "__annotations__": {f: int for f in fields.split()}, **defaults}
    return dataclass(frozen=True)(type(name, (Key,), ns))


_NKG, _MNKG = "N K G", "M N K G"
GemvKey = _key("GemvKey", "gemv", _NKG + " ec", "The M > 1 GEMV's tile for [N, K] weights of group size G, without / "
               "with a fused EC.", ec=0)
Gemv1Key = _key("Gemv1Key", "gemv1", _NKG + " ec", "The M = 1 CUDA-core GEMV's tile, without / with the EC in the same "
                "launch.", ec=0)
Gemv1PdlKey = _key("Gemv1PdlKey", "gemv1pdl", _NKG, "The GEMV tile of the decode EC's producer + PDL-launched GEMV pair.")
Gemv1TmaEcKey = _key("Gemv1TmaEcKey", "gemv1tmaec", _NKG, "Whether a single decode EC of this shape takes the TMA GEMV's "
                     "EC pair (1) or the CUDA-core pair (0).")
Gemv1TmaKey = _key("Gemv1TmaKey", "gemv1tma", _NKG, "The TMA-fed Gluon GEMV's config, present only where it measured "
                   "faster than the CUDA-core GEMV.")
Gemv1SelfKey = _key("Gemv1SelfKey", "gemv1self", _NKG, "The one-launch decode EC (measured at rank 64): which kernel "
                    "and config, where it measured fastest.")
Gemv1SelfRankKey = _key("Gemv1SelfRankKey", "gemv1selfr", _NKG + " R", "The one-launch decode EC's choice for one rank "
                        "bucket R (a power of two).", R=1)
GemmKey = _key("GemmKey", "gemm", _MNKG, "The W4 GEMM for M rows (bucket): which kernel and its config.")
GemmWgKey = _key("GemmWgKey", "gemmwg", _MNKG, "The shared-memory-operand wgmma GEMM's fastest config (host of the "
                 "\"in_gemm\" EC structure).")
GemmRaKey = _key("GemmRaKey", "gemmra", _MNKG, "The register-operand wgmma GEMM's fastest config (host of the "
                 "\"in_gemm_self\" EC structure).")
EcSelfKey = _key("EcSelfKey", "ecself", _MNKG, "The \"in_gemm_self\" EC structure's own launch config.")
EcStructKey = _key("EcStructKey", "ecstruct", _MNKG, "The prefill EC structure measured fastest.")


@dataclass(frozen=True)
class CrossoverKey(Key):
    """The fused / overlapped crossover M of an [N, K] weight (the ``crossover`` table)."""
    KIND: ClassVar[str] = "crossover"
    N: int
    K: int

    def wire(self) -> str:
        return f"{self.N}x{self.K}"


CONFIG_KEYS = {k.KIND: k for k in (GemvKey, Gemv1Key, Gemv1PdlKey, Gemv1TmaEcKey, Gemv1TmaKey, Gemv1SelfKey,
                                   Gemv1SelfRankKey, GemmKey, GemmWgKey, GemmRaKey, EcSelfKey, EcStructKey)}


def parse_key(wire: str, table: str = "configs") -> Key:
    """The typed key of a wire key (``kind|f1|...``; ``NxK`` in the crossover table)."""
    if table == "crossover":
        n, _, k = wire.partition("x")
        return CrossoverKey(N=int(n), K=int(k))
    kind, *vals = wire.split("|")
    cls = CONFIG_KEYS.get(kind)
    if cls is None:
        raise ValueError(f"unknown key kind {kind!r}; expected one of {sorted(CONFIG_KEYS)}")
    names = [f.name for f in dataclasses.fields(cls)]
    if len(vals) != len(names):
        raise ValueError(f"{kind} key: expected fields {names}, got {vals}")
    return cls(**{n: int(v) for n, v in zip(names, vals)})


# ---------------------------------------------------------------- values

TMA_OPS = (0, 1, 2)  # the TMA GEMV's operand modes (w4a16_gemv_tma: OPS_GLOBAL, OPS_PREFETCH, OPS_SMEM)
GEMM_KERNELS = ("triton", "dequant_cublas", "dequant_cublas_pipe", "wgmma", "wgmma_ra", "gemv_tma_rows")
SELF_KERNELS = ("cc", "tma", "pair")
STRUCTURES = ("side", "side_hi", "c_operand", "c_operand_hi", "in_gemm", "in_gemm_sk", "in_gemm_self")


@dataclass(frozen=True)
class Value:
    def wire(self):  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass(frozen=True)
class TileConfig(Value):
    """A kernel's launch config, the positional tuple its launch unpacks."""
    config: tuple

    def wire(self):
        return list(self.config)


@dataclass(frozen=True)
class GemmChoice(Value):
    """The GEMM kernel and its config. Wire form: the Triton GEMM's 5 integers, else [kernel, *config]."""
    kernel: str
    config: tuple = ()

    def wire(self):
        return list(self.config) if self.kernel == "triton" else [self.kernel, *self.config]


@dataclass(frozen=True)
class SelfChoice(Value):
    """The one-launch decode EC's kernel ("cc" CUDA-core, "tma" TMA-fed, or "pair": a two-launch pair)."""
    kernel: str
    config: tuple = ()

    def wire(self):
        return [self.kernel, *self.config]


@dataclass(frozen=True)
class Flag(Value):
    on: bool

    def wire(self):
        return int(self.on)


@dataclass(frozen=True)
class Structure(Value):
    name: str

    def wire(self):
        return self.name


@dataclass(frozen=True)
class Crossover(Value):
    M: int

    def wire(self):
        return self.M


def _tma_config(vals, what: str) -> tuple:
    cfg = _pos_ints(vals, what, (5, 6))
    warps, rb, ch, stages, ops = cfg[:5]
    split = cfg[5] if len(cfg) > 5 else 1
    if not all(_pow2(v) for v in (warps, rb, ch)) or stages < 2 or ops not in TMA_OPS or split not in (1, 2):
        raise ValueError(f"{what}: (WARPS, RB, CH, STAGES, OPS[, SPLIT]) = {list(cfg)}: WARPS, RB, CH "
                         f"powers of two, STAGES >= 2, OPS in {TMA_OPS}, SPLIT 1 or 2")
    return cfg


def _ra_config(vals, what: str, n=(4, 5)) -> tuple:
    cfg = _pos_ints(vals, what, n)
    if not all(v > 0 for v in cfg[:4]):
        raise ValueError(f"{what}: (BNW, BMX, STAGES, WARPS[, PF]) = {list(cfg)} must be positive")
    return cfg


def _gemv1_tile(vals, what: str) -> tuple:
    cfg = _pos_ints(vals, what, 4)
    if not all(v > 0 for v in cfg[:3]) or cfg[3] not in (0, 1):
        raise ValueError(f"{what}: (BLOCK_N, BLOCK_W, num_warps, prefetch 0/1) = {list(cfg)}")
    return cfg


def _positive(vals, what: str, n) -> tuple:
    cfg = _pos_ints(vals, what, n)
    if not all(v > 0 for v in cfg):
        raise ValueError(f"{what}: {list(cfg)} must be positive integers")
    return cfg


def _gemm_choice(w, what: str) -> GemmChoice:
    if not isinstance(w, list) or not w:
        raise ValueError(f"{what}: expected a list, got {w!r}")
    if not isinstance(w[0], str):
        return GemmChoice("triton", _positive(w, what + " (BM, BN, BK, warps, stages)", 5))
    kernel, rest = w[0], w[1:]
    if kernel == "dequant_cublas" and not rest:
        return GemmChoice(kernel)
    if kernel == "dequant_cublas_pipe" and len(rest) == 1 and isinstance(rest[0], int) and rest[0] >= 2:
        return GemmChoice(kernel, tuple(rest))
    if kernel == "wgmma":
        return GemmChoice(kernel, _positive(rest, what + " (BM, BN, STAGES, WARPS)", 4))
    if kernel == "wgmma_ra":  # (a sixth value: the K split of the small-M tiles)
        return GemmChoice(kernel, _ra_config(rest, what, (4, 5, 6)))
    if kernel == "gemv_tma_rows":  # the TMA GEMV with x's rows in the MMA's columns (w4a16_gemv_tma_rows)
        cfg = _pos_ints(rest, what + " (WARPS, RB, CH, STAGES)", 4)
        if not all(_pow2(v) for v in cfg[:3]) or cfg[3] < 2:
            raise ValueError(f"{what}: gemv_tma_rows (WARPS, RB, CH, STAGES) = {list(cfg)}: WARPS, RB, CH powers "
                             "of two, STAGES >= 2")
        return GemmChoice(kernel, cfg)
    raise ValueError(f"{what}: GEMM choice {w!r}; expected one of {GEMM_KERNELS} with its config")


def _self_choice(w, what: str, pair_ok: bool) -> SelfChoice:
    if not isinstance(w, list) or not w or w[0] not in SELF_KERNELS:
        raise ValueError(f"{what}: expected [kernel, *config] with kernel in {SELF_KERNELS}, got {w!r}")
    if w[0] == "pair":
        if not pair_ok or len(w) != 1:
            raise ValueError(f"{what}: ['pair'] is a per-rank value only, without a config")
        return SelfChoice("pair")
    if w[0] == "cc":
        return SelfChoice("cc", _gemv1_tile(w[1:], what))
    cfg = _tma_config(w[1:], what)
    if (cfg[5] if len(cfg) > 5 else 1) != 1:
        raise ValueError(f"{what}: the one-launch EC on the TMA kernel needs no K-split")
    return SelfChoice("tma", cfg)


def parse_value(key: Key, w) -> Value:
    """The typed value of wire value ``w`` for ``key`` (raises ValueError saying what is wrong)."""
    what = f"{key.KIND} value"
    kind = key.KIND
    if isinstance(w, Value):
        w = w.wire()
    if kind == "crossover":
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            raise ValueError(f"{what}: expected an integer M >= 1, got {w!r}")
        return Crossover(w)
    if kind == "gemv1tmaec":
        if w not in (0, 1) or isinstance(w, bool):
            raise ValueError(f"{what}: expected 0 or 1, got {w!r}")
        return Flag(bool(w))
    if kind == "ecstruct":
        if w not in STRUCTURES:
            raise ValueError(f"{what}: expected one of {STRUCTURES}, got {w!r}")
        return Structure(w)
    if kind == "gemm":
        return _gemm_choice(w, what)
    if kind in ("gemv1self", "gemv1selfr"):
        return _self_choice(w, what, pair_ok=kind == "gemv1selfr")
    if not isinstance(w, (list, tuple)):
        raise ValueError(f"{what}: expected a list, got {w!r}")
    if kind == "gemv":
        return TileConfig(_positive(w, what + " (BLOCK_N, BLOCK_K, warps, stages)", 4))
    if kind in ("gemv1", "gemv1pdl"):
        return TileConfig(_gemv1_tile(w, what))
    if kind == "gemv1tma":
        return TileConfig(_tma_config(w, what))
    if kind == "gemmwg":
        return TileConfig(_positive(w, what + " (BM, BN, STAGES, WARPS)", 4))
    if kind == "gemmra":
        return TileConfig(_ra_config(w, what))
    if kind == "ecself":
        return TileConfig(_ra_config(w, what))
    raise ValueError(f"no value schema for key kind {kind!r}")  # pragma: no cover


# ---------------------------------------------------------------- the table


class TunedTable(MutableMapping):
    """Typed keys -> validated values. ``table[key]`` is the value's wire form (a fresh copy)."""

    def __init__(self, name: str = "configs", entries: Optional[dict] = None, source: str = "") -> None:
        self.name = name
        self.source = source
        self._entries: dict[Key, Value] = {}
        self.generation = 0  # bumped when a key is added or removed (what caches of the key set check)
        for k, v in (entries or {}).items():
            self[k] = v

    def _key(self, key) -> Key:
        if isinstance(key, Key):
            if (self.name == "crossover") != isinstance(key, CrossoverKey):
                raise KeyError(f"{key!r} is not a key of the {self.name} table")
            return key
        if isinstance(key, str):
            return parse_key(key, self.name)
        raise TypeError(f"tuned-table keys are Key dataclasses (or their wire strings), not {type(key).__name__}")

    def __getitem__(self, key):
        return self._entries[self._key(key)].wire()

    def __setitem__(self, key, value) -> None:
        k = self._key(key)
        if k not in self._entries:
            self.generation += 1
        self._entries[k] = parse_value(k, value)

    def __delitem__(self, key) -> None:
        del self._entries[self._key(key)]
        self.generation += 1

    def __iter__(self) -> Iterator[Key]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        try:
            return self._key(key) in self._entries
        except (ValueError, KeyError, TypeError):
            return False

    def typed(self, key) -> Optional[Value]:
        """The value object of ``key``, or None."""
        return self._entries.get(self._key(key))

    def keys_of(self, cls: type) -> list:
        return [k for k in self._entries if isinstance(k, cls)]

    def to_json(self, gpu: str = "") -> dict:
        rows = [{"kind": k.KIND, **k.fields(), "value": v.wire()}
                for k, v in sorted(self._entries.items(), key=lambda kv: (kv[0].KIND, dataclasses.astuple(kv[0])))]
        return {"schema_version": SCHEMA_VERSION, "table": self.name, "gpu": gpu, "entries": rows}

    def fingerprint(self) -> str:
        """A hash of the schema version and every entry (for compile cache keys)."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()

    @classmethod
    def from_json(cls, obj, source: str = "", name: Optional[str] = None) -> "TunedTable":
        """Validate a table file's contents; ``TableError`` names the entry at fault."""
        if not isinstance(obj, dict) or "schema_version" not in obj:
            raise TableError(f"{source}: a tuned table without a schema version (an older, flat format?): convert "
                             f"it with spear_compile.dispatch.table.convert_legacy, or remove it to use the shipped "
                             f"table")
        if obj["schema_version"] != SCHEMA_VERSION:
            raise TableError(f"{source}: tuned table schema version {obj['schema_version']!r}, this library reads "
                             f"version {SCHEMA_VERSION}: re-tune or remove the file")
        name = name or obj.get("table", "configs")
        if obj.get("table", name) != name:
            raise TableError(f"{source}: a {obj.get('table')!r} table where a {name!r} table was expected")
        table = cls(name, source=source)
        kinds = CONFIG_KEYS if name == "configs" else {"crossover": CrossoverKey}
        for i, row in enumerate(obj.get("entries", [])):
            try:
                row = dict(row)
                kind, value = row.pop("kind"), row.pop("value")
                kcls = kinds.get(kind)
                if kcls is None:
                    raise ValueError(f"unknown key kind {kind!r}; expected one of {sorted(kinds)}")
                key = kcls(**row)
                if key in table._entries:
                    raise ValueError("duplicate entry")
                table[key] = value
            except (ValueError, TypeError, KeyError) as e:
                raise TableError(f"{source}: entry {i} ({row!r}): {e}") from None
        return table


def convert_legacy(obj: dict, name: str = "configs", source: str = "") -> TunedTable:
    """A table of the flat format (``{"kind|N|K|G": value}``, or ``{"NxK": M}`` for crossovers), values
    unchanged, as a ``TunedTable``."""
    table = TunedTable(name, source=source)
    for wire, value in obj.items():
        try:
            table[parse_key(wire, name)] = value
        except (ValueError, TypeError) as e:
            raise TableError(f"{source}: entry {wire!r}: {e}") from None
    return table


# ---------------------------------------------------------------- files


def gpu_key(device=None) -> str:
    """The GPU's name as table files spell it (spaces as underscores); "cpu" without CUDA."""
    name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "cpu"
    return name.replace(" ", "_")


def shipped_path(name: str, gpu: str) -> str:
    return os.path.join(SHIPPED_DIR, f"{name}_{gpu}.json")


def user_path(name: str, gpu: str) -> str:
    return os.path.join(envs.cache_dir(), "tuned", f"{name}_{gpu}.json")


def dumps(table: TunedTable, gpu: str = "") -> str:
    """A table file's text: the header, then one entry per line (diffs show entries)."""
    obj = table.to_json(gpu)
    head = {k: v for k, v in obj.items() if k != "entries"}
    rows = ",\n".join("  " + json.dumps(r) for r in obj["entries"])
    return json.dumps(head)[:-1] + ', "entries": [\n' + rows + "\n]}\n"


def read(path: str, name: Optional[str] = None) -> TunedTable:
    with open(path) as f:
        try:
            obj = json.load(f)
        except json.JSONDecodeError as e:
            raise TableError(f"{path}: not JSON: {e}") from None
    return TunedTable.from_json(obj, source=path, name=name)


def load(name: str, device=None, gpu: Optional[str] = None) -> Optional[TunedTable]:
    """This GPU's ``name`` table: the user's if there is one, else the shipped one, else None."""
    gpu = gpu or gpu_key(device)
    for path in (user_path(name, gpu), shipped_path(name, gpu)):
        if os.path.exists(path):
            return read(path, name)
    return None


def save(name: str, table, device=None, gpu: Optional[str] = None) -> str:
    """Write ``table`` (a ``TunedTable``, or a dict of wire keys / typed keys to values, validated here)
    as this GPU's user table; returns the path."""
    gpu = gpu or gpu_key(device)
    if not isinstance(table, TunedTable):
        table = TunedTable(name, dict(table))
    path = user_path(name, gpu)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(dumps(table, gpu))
    os.replace(tmp, path)
    return path


_CONFIGS: Optional[TunedTable] = None


def configs() -> TunedTable:
    """The process-wide configs table of this GPU (loaded on first use; empty without CUDA or under
    Triton's interpreter, where the kernels run their default configs)."""
    global _CONFIGS
    if _CONFIGS is None:
        interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
        got = load("configs") if torch.cuda.is_available() and not interpret else None
        _CONFIGS = got if got is not None else TunedTable("configs")
    return _CONFIGS


def set_configs(table: Optional[TunedTable]) -> None:
    """Replace the process-wide configs table (None: reload on next use). For tuners and tests."""
    global _CONFIGS
    _CONFIGS = table


def crossover(N: int, K: int, device=None) -> Optional[int]:
    """The fused / overlapped crossover M measured for an [N, K] weight on this GPU, if any."""
    table = load("crossover", device) if torch.cuda.is_available() else None
    if not table:
        return None
    v = table.typed(CrossoverKey(N=int(N), K=int(K)))
    return v.M if v is not None else None


if __name__ == "__main__":  # python -m spear_compile.dispatch.table OLD.json NEW.json [configs|crossover]
    import sys

    if len(sys.argv) < 3:
        raise SystemExit("usage: python -m spear_compile.dispatch.table OLD.json NEW.json [configs|crossover]")
    kind = sys.argv[3] if len(sys.argv) > 3 else "configs"
    with open(sys.argv[1]) as f:
        converted = convert_legacy(json.load(f), kind, source=sys.argv[1])
    gpu_name = os.path.basename(sys.argv[2])[len(kind) + 1:-len(".json")]
    with open(sys.argv[2], "w") as f:
        f.write(dumps(converted, gpu_name))
