"""The one host-side collective of the spear ops: a sum all-reduce that times out naming the rank.

``spear::ec_linear_peer_reduce`` on CPU (and on GPU where the peer-write kernels cannot run) sums its
stacked partial ``[y_i | A_i x_i]`` over the tensor-parallel group with ``torch.distributed.all_reduce``.
A peer that died or never reaches the same op would otherwise leave the others blocked for the process
group's timeout (30 minutes by default) with an error that names neither rank. Here the reduction waits
at most ``timeout_s``; when it fails, every surviving rank writes a key to the process group's store and
waits a moment for the others' keys, so the error names this rank and the ranks that did not arrive
(:class:`~spear_compile.errors.PeerTimeoutError`).

The group is named, not passed: the op's schema carries ``group_name`` (a ``str``), as the functional
collectives do; ``""`` (or a group of one) means no reduction - the single-process model.
"""
from __future__ import annotations

import datetime
import time

import torch

from ..errors import PeerTimeoutError

_SEQ: dict[str, int] = {}  # per group: how many reductions this process has entered (equal on every rank)
POST_MORTEM_S = 3.0  # how long a failed rank waits for the others' keys before naming the missing ones


def group_of(group_name: str):
    """The process group called ``group_name``, or None for ``""`` / no initialised torch.distributed."""
    if not group_name:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"spear tensor parallelism: group {group_name!r} named, but torch.distributed is not "
                           "initialised in this process (init_process_group first)")
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(group_name)
    except (KeyError, ValueError, RuntimeError) as e:
        raise RuntimeError(f"spear tensor parallelism: no process group named {group_name!r} ({e})") from None


def world_of(group_name: str) -> int:
    pg = group_of(group_name)
    return 1 if pg is None else pg.size()


def all_reduce_sum(t: torch.Tensor, group_name: str, timeout_s: float, where: str) -> torch.Tensor:
    """``t`` summed over the group (in place; returned), or a :class:`PeerTimeoutError` after ``timeout_s``."""
    pg = group_of(group_name)
    if pg is None or pg.size() == 1:
        return t
    import torch.distributed as dist

    seq = _SEQ[group_name] = _SEQ.get(group_name, 0) + 1
    try:
        work = dist.all_reduce(t, group=pg, async_op=True)
        work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        rank = dist.get_rank()
        missing = _missing_ranks(pg, group_name, seq)
        who = (f"rank(s) {', '.join(map(str, missing))} did not arrive" if missing
               else "the peers could not be told apart (the store did not answer)")
        raise PeerTimeoutError(
            f"{where}: rank {rank} of tensor-parallel group {group_name!r} (size {pg.size()}) waited at most "
            f"{timeout_s:g} s in reduction #{seq}: {who} ({type(e).__name__}: {str(e).splitlines()[0][:200]})",
            rank=rank, missing=missing) from None
    return t


def _missing_ranks(pg, group_name: str, seq: int) -> tuple:
    """Global ranks of the group that did not mark reduction ``seq`` as reached within ``POST_MORTEM_S``."""
    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()
        prefix = f"spear/peer_reduce/{group_name}/{seq}/"
        store.set(prefix + str(dist.get_rank()), "1")
        ranks = [dist.get_global_rank(pg, i) for i in range(pg.size())]
        deadline = time.monotonic() + POST_MORTEM_S
        while True:
            missing = tuple(r for r in ranks if not store.check([prefix + str(r)]))
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - the store died with its host: say so rather than raise from here
        return ()
