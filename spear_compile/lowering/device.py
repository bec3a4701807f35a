"""The one device-capability probe: what the GPU a tensor lives on can run, asked once per device.

Every kernel constraint that depends on the GPU goes through here (the TMA and wgmma kernels need
sm_90+, programmatic dependent launch needs sm_90+ and a Triton with grid dependency control, the
one-launch EC sizes its producers by the SM count).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import envs
from ._triton import INTERPRET, gdc_wait

_CAP: dict = {}  # device index -> (major, minor)
_SMS: dict = {}  # device index -> SM count


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def capability(device: torch.device) -> Optional[tuple]:
    """(major, minor) of a CUDA device, None elsewhere (or without CUDA)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    idx = _index(device)
    if idx not in _CAP:
        _CAP[idx] = tuple(torch.cuda.get_device_capability(idx))
    return _CAP[idx]


def is_sm90(device: torch.device) -> bool:
    """A Hopper-class GPU (sm_90+): TMA and warpgroup MMA."""
    cap = capability(device)
    return cap is not None and cap[0] >= 9


def pdl(device: torch.device) -> bool:
    """Whether launches here can use programmatic dependent launch (sm_90+, a Triton with grid dependency
    control, not Triton's interpreter): decides which decode EC kernels run."""
    return not INTERPRET and gdc_wait is not None and is_sm90(device)


def pdl_launch(device: torch.device) -> bool:
    """Whether the decode EC's GEMV is launched with PDL behind its producer grid (``pdl``, unless
    ``SPEAR_NO_PDL`` is set: the same kernels in plain stream order)."""
    return pdl(device) and not envs.no_pdl()


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device."""
    idx = _index(device)
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


HIGH_PRIORITY = -1  # CUDA stream priorities: lower is higher; 0 is the default, -1 exists on every GPU
_SIDE_STREAMS: dict = {}


def side_stream(device: torch.device, priority: int = 0) -> "torch.cuda.Stream":
    """One side stream per (device, priority), made once (so captured graphs and eager calls share it): the
    prefill EC structures run the EC beside the W4 GEMM on it."""
    idx = _index(device)
    s = _SIDE_STREAMS.get((idx, priority))
    if s is None:
        s = _SIDE_STREAMS[(idx, priority)] = torch.cuda.Stream(device=idx, priority=priority)
    return s
