"""Shard a quantized, error-compensated Llama-style model over a tensor-parallel group.

Column-parallel (``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``): rank ``i`` keeps the
rows ``[i N / W, (i + 1) N / W)`` of the packed weight, its scales, zeros and bias, and of the EC's ``B``;
``A`` and the gate are whole (each rank sees all of x, so its ``A x`` and gate are already global). No
communication: the attention heads (and the MLP's columns) of the next layer are split the same way.

Row-parallel (``o_proj``, ``down_proj``): rank ``i`` keeps the columns ``[i K / W, (i + 1) K / W)`` of the
weight (packed bytes, and the scale / zero groups; a per-channel weight keeps its one group per row) and
of the EC's ``A``; ``B``, the gate, ``alpha`` and the bias are whole. The layer becomes a
``RowParallelLinear``, which reduces ``[y_i | A_i x_i]`` before the gate.

Rules, each a ``ValueError`` naming the module: the heads and KV heads, N of a column-parallel layer and
K of a row-parallel one must divide by the world size; a row shard must hold whole quantization groups
and an even number of inputs. Embeddings, norms and the LM head stay replicated.

``load_sharded(path, group)`` loads a single-GPU artifact (``artifacts.load``) on every rank and shards it.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..artifacts import load
from ..compensators.ec import ErrorCompensator
from ..quant.linear import QuantLinear
from .layers import RowParallelLinear, RowShardEC

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def tp_group(group=None) -> tuple:
    """``(group name, rank in the group, world size)`` of ``group`` (default: the world group); ``("", 0, 1)``
    when torch.distributed is not initialised (a single process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("tp_group: a group was given but torch.distributed is not initialised")
        return "", 0, 1
    pg = group if group is not None else dist.group.WORLD
    return pg.group_name, dist.get_rank(pg), dist.get_world_size(pg)


def _split(n: int, world: int, rank: int, what: str) -> slice:
    if n % world:
        raise ValueError(f"{what} = {n} is not divisible by the tensor-parallel world size {world}")
    step = n // world
    return slice(rank * step, (rank + 1) * step)


def shard_column(layer: QuantLinear, rank: int, world: int, name: str) -> QuantLinear:
    """Rank ``rank``'s output rows of ``layer`` (with its EC's ``B`` rows) as a new ``QuantLinear``."""
    s = _split(layer.out_features, world, rank, f"{name}: out_features N")
    out = QuantLinear(layer.in_features, s.stop - s.start, layer.group_size, layer.bias is not None,
                      layer.scales.dtype, layer.qweight.device, name=f"{name} [rank {rank}/{world}]")
    with torch.no_grad():
        for buf in ("qweight", "scales", "zeros", "bias"):
            t = getattr(layer, buf)
            if t is not None:
                getattr(out, buf).copy_(t[s])
    ec = layer.ec
    if ec is not None:
        if not isinstance(ec, ErrorCompensator):
            raise TypeError(f"{name}: cannot shard an EC of type {type(ec).__name__}")
        # built without the constructor: its rank <= out_features rule is a whole layer's, and a shard may
        # have fewer rows than the EC's rank
        new = ErrorCompensator.__new__(ErrorCompensator)
        nn.Module.__init__(new)
        new.in_features, new.out_features, new.cfg = ec.in_features, s.stop - s.start, ec.cfg
        for p in ("A", "B", "W1", "b1", "W2", "b2", "alpha"):
            t = getattr(ec, p).detach()
            new.register_parameter(p, nn.Parameter((t[s] if p == "B" else t).clone(), requires_grad=False))
        out.ec = new
    return out


def shard_row(layer: QuantLinear, rank: int, world: int, group_name: str, name: str) -> RowParallelLinear:
    """Rank ``rank``'s input columns of ``layer`` (and of its EC's ``A``) as a ``RowParallelLinear``."""
    K, G = layer.in_features, layer.group_size
    s = _split(K, world, rank, f"{name}: in_features K")
    k_loc = s.stop - s.start
    if k_loc % 2:
        raise ValueError(f"{name}: each rank's K slice ({k_loc} = {K} / {world}) must be even to hold whole int4 bytes")
    per_channel = G == K
    if not per_channel and k_loc % G:
        raise ValueError(f"{name}: each rank's K slice ({k_loc} = {K} / {world}) must hold whole quantization groups "
                         f"of {G}")
    g = slice(0, 1) if per_channel else slice(s.start // G, s.stop // G)
    local = QuantLinear(k_loc, layer.out_features, k_loc if per_channel else G, False, layer.scales.dtype,
                        layer.qweight.device, name=f"{name} [rank {rank}/{world}]")
    with torch.no_grad():
        local.qweight.copy_(layer.qweight[:, s.start // 2:s.stop // 2])
        local.scales.copy_(layer.scales[:, g])
        local.zeros.copy_(layer.zeros[:, g])
    ec = layer.ec
    shard_ec = None
    if ec is not None:
        if not isinstance(ec, ErrorCompensator):
            raise TypeError(f"{name}: cannot shard an EC of type {type(ec).__name__}")
        shard_ec = RowShardEC(ec.A[:, s], ec.B, ec.W1, ec.b1, ec.W2, ec.b2, ec.alpha, ec.act)
    return RowParallelLinear(local, layer.bias, shard_ec, group_name, world, rank, name=name)


def shard_llama_(model: nn.Module, group=None, column=COLUMN, row=ROW) -> nn.Module:
    """Shard ``model`` in place for this rank of ``group`` (default: the world group): every ``QuantLinear``
    whose name ends in one of ``column`` / ``row`` becomes this rank's column / row shard. Returns
    ``model``. Checks every rule before changing anything."""
    group_name, rank, world = tp_group(group)
    cfg = getattr(model, "config", None)
    for attr in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(cfg, attr, None)
        if n is not None and n % world:
            raise ValueError(f"shard_llama_: {attr} = {n} is not divisible by the tensor-parallel world size {world}")
    plan = []
    for fqn, mod in model.named_modules():
        leaf = fqn.rsplit(".", 1)[-1]
        kind = "column" if leaf in column else "row" if leaf in row else None
        if kind is None:
            continue
        if not isinstance(mod, QuantLinear):
            raise TypeError(f"shard_llama_: {fqn} is a {type(mod).__name__}, expected a QuantLinear (quantize_ first)")
        plan.append((fqn, kind, mod))
    if not plan:
        raise ValueError(f"shard_llama_: no QuantLinear named {column + row} in {type(model).__name__}")
    new = {fqn: shard_column(mod, rank, world, fqn) if kind == "column"
           else shard_row(mod, rank, world, group_name, fqn)
           for fqn, kind, mod in plan}  # every shape rule checked before the model changes
    for fqn, mod in new.items():
        parent_name, _, leaf = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, mod)
    model.tp = {"group": group_name, "rank": rank, "world": world}
    return model


def load_sharded(path: str, group=None, model: Optional[nn.Module] = None) -> nn.Module:
    """Load the single-GPU artifact at ``path`` (``spear_compile.load``) and shard it for this rank."""

    return shard_llama_(load(path, model=model), group)
