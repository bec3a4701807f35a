"""The ``meta`` block at the top of a benchmark's JSON record: the date (UTC), the git commit, the GPU,
versions and the script's arguments.

``run_meta(args, versions, head=..., tail=..., cpu=...)`` returns, in this order: ``date``, ``commit``
(``git rev-parse HEAD`` in the working directory, ``"unknown"`` where git fails), ``head``'s fields,
``gpu`` (``torch.cuda.get_device_name()`` when ``args.device == "cuda"``, else ``cpu``), ``torch``,
``versions``' fields, ``tail``'s fields and ``args`` (``vars(args)``).
"""
from __future__ import annotations

import datetime
import subprocess
from typing import Optional

import torch


def git(*a: str) -> str:
    """``git *a``'s output, stripped; ``"unknown"`` when git cannot be run."""
    try:
        return subprocess.run(["git", *a], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def run_meta(args, versions: dict, head: Optional[dict] = None, tail: Optional[dict] = None,
             cpu: str = "cpu") -> dict:
    """The meta block (module docstring) for a run with the parsed ``args``."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": git("rev-parse", "HEAD"), **(head or {}),
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else cpu,
            "torch": torch.__version__, **versions, **(tail or {}), "args": vars(args)}
