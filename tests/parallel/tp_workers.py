"""What the spawned ranks of the tensor-parallel tests run (gloo on loopback through a FileStore).

Every rank builds the same tiny quantized Llama with ECs on every linear (same seeds), keeps a copy as
the single-process model, shards the other for its rank and writes what it measured to
``<out>/rank<i>.pt`` for the parent process to check.
"""
from __future__ import annotations

import datetime
import os
import time
import traceback

import torch

POST_MORTEM_S = 3.0  # spear_compile.ops.collective.POST_MORTEM_S
SHAPES = dict(hidden=192, layers=1, heads=6, kv_heads=6, intermediate=384, vocab=128)  # divisible by 2 and 3


def tiny_tp_model(group_size=32, rank=8, seed=0):
    """The tiny Llama of the TP tests, quantized (group ``group_size``; None: per channel), with a random
    non-trivial EC of rank ``rank`` on every linear."""
    import spear_compile as spear
    from spear_compile.models.tiny import tiny_llama

    m = tiny_llama(**SHAPES, seed=seed)
    spear.quantize_(m, spear.QuantConfig(group_size=group_size), progress=False)
    ecs = {}
    gen = torch.Generator().manual_seed(seed + 1)
    for i, (fqn, mod) in enumerate((n, x) for n, x in m.named_modules() if type(x).__name__ == "QuantLinear"):
        if fqn.endswith("lm_head"):
            continue
        ec = spear.ErrorCompensator(mod.in_features, mod.out_features, spear.ECConfig(rank=rank, gate_hidden=4))
        with torch.no_grad():
            for p in ec.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
            ec.B.mul_(3.0)  # a correction large enough that a wrong gate shows
        ecs[fqn] = ec
    spear.attach_(m, ecs)
    return m


def init(rank: int, world: int, store_path: str, timeout_s: float = 60.0) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _save(out_dir: str, rank: int, result: dict) -> None:
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def numerics(rank: int, world: int, store_path: str, out_dir: str, group_size, compile_: bool,
             artifact: str = "", dtype: torch.dtype = torch.float32) -> None:
    """Logits of the sharded model (eager, as the fused op, and compiled by the spear backend with
    ``compile_``) against the single-process model's; the eager logits of the wrong variant that gates each
    rank's partial. ``dtype``: the models' dtype. With ``artifact`` both models come from that single-process
    artifact (``load`` and ``load_sharded``); else from ``tiny_tp_model(group_size)``."""
    import copy

    import torch.distributed as dist

    import spear_compile as spear
    from spear_compile.parallel import load_sharded, shard_llama_

    result: dict = {}
    try:
        init(rank, world, store_path)
        ref_model = (spear.load(artifact) if artifact else tiny_tp_model(group_size)).to(dtype)
        ids = torch.tensor([[3, 17, 42, 99]])
        with torch.no_grad():
            ref = ref_model(ids, use_cache=False).logits
            tp = load_sharded(artifact).to(dtype) if artifact else shard_llama_(copy.deepcopy(ref_model))
            out = tp(ids, use_cache=False).logits
            result["eager"] = (out - ref).abs().max().item()
            if dtype != torch.float32:  # how far each is from the fp32 model: the dtype's own error
                ref32 = copy.deepcopy(ref_model).float()(ids, use_cache=False).logits
                result["single_vs_fp32"] = (ref.float() - ref32).abs().max().item()
                result["tp_vs_fp32"] = (out.float() - ref32).abs().max().item()
            result["wrong_gate"] = (_gating_the_partial(tp, ids) - ref).abs().max().item()
            result["fused_eager"] = (_fused(tp, ids) - ref).abs().max().item()
            result["ref_scale"] = ref.abs().max().item()
            if compile_:
                result.update(compiled_counts(tp, ids, ref))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - reported to the parent
        result["error"] = traceback.format_exc()
    _save(out_dir, rank, result)


def compiled_counts(model, ids, ref) -> dict:
    """Compile ``model`` with the spear backend once (passes observed), run it on ``ids``: the error against
    ``ref``, the ``fuse_peer_reduce`` matches and the op counts of the graph the passes leave."""
    import collections

    from spear_compile.passes import backend

    seen = {"matched": 0, "ops": collections.Counter()}

    def observe(phase, pass_name, graph, pass_obj):
        if phase == "after" and pass_name == "fuse_peer_reduce":
            seen["matched"] += pass_obj.matched_count
        if phase == "after" and pass_name == "record_plan":
            seen["ops"].update(str(n.target) for n in graph.nodes if n.op == "call_function")

    torch._dynamo.reset()
    backend._OBSERVERS.append(observe)
    try:
        out = torch.compile(model, backend="spear")(ids, use_cache=False).logits
    finally:
        backend._OBSERVERS.remove(observe)
    return {"compiled": (out - ref).abs().max().item(), "matched": seen["matched"], "ops": dict(seen["ops"])}


def _with_forward(tp_model, ids, forward) -> torch.Tensor:
    from spear_compile.parallel import RowParallelLinear

    saved = RowParallelLinear.forward
    RowParallelLinear.forward = forward
    try:
        return tp_model(ids, use_cache=False).logits
    finally:
        RowParallelLinear.forward = saved


def _fused(tp_model, ids) -> torch.Tensor:
    """The logits with every row-parallel EC layer run as the fused op, eagerly (its CPU path: the gloo
    all-reduce of the stacked partial)."""
    def fused(self, x):
        loc, ec = self.local, self.ec
        return torch.ops.spear.ec_linear_peer_reduce(x, loc.qweight, loc.scales, loc.zeros, loc.group_size, self.bias,
                                                     ec.A, ec.B, ec.W1, ec.b1, ec.W2, ec.b2, ec.alpha, ec.act, "spear",
                                                     self.group_name)

    return _with_forward(tp_model, ids, fused)


def _gating_the_partial(tp_model, ids) -> torch.Tensor:
    """The model's logits when every row-parallel EC gates this rank's partial ``A_i x_i`` and the gated
    outputs are summed (``ec_linear`` on the shard, then an all-reduce): the function this package avoids."""
    import torch.distributed as dist

    def wrong(self, x):
        loc, ec = self.local, self.ec
        y = torch.ops.spear.ec_linear(x, loc.qweight, loc.scales, loc.zeros, loc.group_size, None, ec.A, ec.B, ec.W1,
                                      ec.b1, ec.W2, ec.b2, ec.alpha, ec.act)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias

    return _with_forward(tp_model, ids, wrong)


def dead_peer(rank: int, world: int, store_path: str, out_dir: str, timeout_s: float, mode: str = "dies") -> None:
    """The last rank exits before the reduction (``mode="dies"``) or stays alive elsewhere past the timeout
    (``"hangs"``); the others must raise PeerTimeoutError naming it."""
    import torch.distributed as dist

    import spear_compile as spear
    from spear_compile.errors import PeerTimeoutError
    from spear_compile.parallel import shard_row

    result: dict = {}
    try:
        init(rank, world, store_path, timeout_s=timeout_s)
        whole = spear.QuantLinear.from_linear(torch.nn.Linear(192, 96, bias=False), spear.QuantConfig())
        whole.ec = spear.ErrorCompensator(192, 96, spear.ECConfig(rank=4, gate_hidden=4))
        layer = shard_row(whole, rank, world, dist.group.WORLD.group_name, "o_proj")  # one row-parallel layer
        dist.barrier()
        if rank == world - 1:
            if mode == "hangs":
                time.sleep(timeout_s + 2 * POST_MORTEM_S)  # alive, but busy elsewhere past the others' timeout
            os._exit(0)  # never reaches the reduction
        loc, ec = layer.local, layer.ec
        x = torch.randn(1, loc.in_features)
        try:
            torch.ops.spear.ec_linear_peer_reduce(x, loc.qweight, loc.scales, loc.zeros, loc.group_size, None, ec.A,
                                                  ec.B, ec.W1, ec.b1, ec.W2, ec.b2, ec.alpha, ec.act, "spear",
                                                  layer.group_name, timeout_s)
            result["error"] = "no error raised"
        except PeerTimeoutError as e:
            result.update(message=str(e), missing=e.missing, rank=e.rank)
    except Exception:  # noqa: BLE001
        result["error"] = traceback.format_exc()
    _save(out_dir, rank, result)
    os._exit(0)  # the group is broken: do not wait in destroy_process_group
