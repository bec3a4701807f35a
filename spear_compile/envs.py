"""Every environment variable spear_compile reads, with what it does.

Read them through the functions here (never ``os.environ`` elsewhere in the package), so the set of
switches is listed in one place and the compile cache key (``passes/manager.py``) can hash them all.

Kill switches keep the same numerics and change only which kernel runs; they exist for A/B
measurements and as an escape hatch if a kernel misbehaves on some GPU or driver:

* ``SPEAR_NO_TMA_GEMV=1``: never route an M = 1 GEMV to the TMA-fed Gluon kernel; the CUDA-core
  Triton GEMV runs everywhere (and ``fuse_glu`` / ``fuse_rmsnorm``, which need the TMA kernel, no
  longer rewrite).
* ``SPEAR_NO_TMA_EC=1``: never add a decode EC in the TMA kernel's epilogue; the CUDA-core producer +
  GEMV pair runs instead.
* ``SPEAR_NO_PDL=1``: launch the decode EC's producer grid and GEMV in plain stream order instead of
  with programmatic dependent launch (same kernels, same results; the GEMV starts after the producer).

* ``SPEAR_NO_PEER_WRITE=1``: run the tensor-parallel row-parallel EC (``spear::ec_linear_peer_reduce``) on
  CUDA through its host path (the reference partial, an NCCL all-reduce over the group and the gated
  apply) instead of the peer-write kernel pair (``lowering/ec_peer_reduce.py``: no collective call on the
  decode path). The pair matches its reference under Triton's interpreter with emulated peers, and on one
  H200 (2026-12-04, world size 1) the compiled sharded model through it is as close to the fp32 model as
  the single-process compiled model (``tests/parallel/test_sharding.py``); it has not yet run on several
  GPUs.
Opt-in switches (same numerics within rounding; off until a GPU run has measured them faster where users run them):

* ``SPEAR_SPLIT_KV=1``: the engine's varlen attention (``runtime/attention.py``) hands a step of decodes
  only to the split-KV decode kernel (``lowering/split_kv_decode.py``) and a step with a prefill piece to
  torch's variable-length kernel whole. Checked on an H100; served there at a 16 ms SLO it lost on p99 ITL
  (16.3 ms against 15.9-16.0 with the online correction, 19.3-19.4 against 16.4-18.1 without:
  ``benchmarks/results/serving/2026-12-07_h100_online_correction_ab``), though one decode at 2k keys takes
  0.30-0.47x torch's kernel time a layer.
* ``SPEAR_TMA_ROWS=1``: the tuners (``spear tune``, ``benchmarks/small_m_gemm.py --tma-rows``) time the TMA
  GEMV with x's rows in the MMA's columns (``lowering/w4a16_gemv_tma_rows.py``) as a GEMM choice at M <= 16, and
  the route takes it where a table names it. Its GPU tests pass (H100, 2026-12-08), but it is not yet timed the
  benchmarks' way and an eager call measured ~240 us of host time: off, a table entry naming it falls back to
  the shape's default GEMM.

Paths:

* ``SPEAR_CACHE_DIR``: where tables a user produces (tuned kernel configs, measured crossovers) are
  written and read; default ``~/.cache/spear_compile``. Nothing is ever written into the installed
  package.
"""
from __future__ import annotations

import os

# every switch that changes which kernel runs (hashed into the compile cache key below)
SWITCHES = ("SPEAR_NO_TMA_GEMV", "SPEAR_NO_TMA_EC", "SPEAR_NO_PDL", "SPEAR_NO_PEER_WRITE", "SPEAR_SPLIT_KV",
            "SPEAR_TMA_ROWS")


def _on(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


def no_tma_gemv() -> bool:
    """``SPEAR_NO_TMA_GEMV`` is set: the M = 1 GEMV never takes the TMA kernel."""
    return _on("SPEAR_NO_TMA_GEMV")


def no_tma_ec() -> bool:
    """``SPEAR_NO_TMA_EC`` is set: a decode EC never runs in the TMA kernel's epilogue."""
    return _on("SPEAR_NO_TMA_EC")


def no_pdl() -> bool:
    """``SPEAR_NO_PDL`` is set: the decode EC pair is launched in plain stream order."""
    return _on("SPEAR_NO_PDL")


def split_kv() -> bool:
    """``SPEAR_SPLIT_KV`` is set: the engine's varlen attention hands decodes to the split-KV kernel."""
    return _on("SPEAR_SPLIT_KV")


def tma_rows() -> bool:
    """``SPEAR_TMA_ROWS`` is set: the multi-row TMA GEMV is a GEMM choice at M <= 16 (tuned and routed)."""
    return _on("SPEAR_TMA_ROWS")


def no_peer_write() -> bool:
    """``SPEAR_NO_PEER_WRITE`` is set: the row-parallel EC's CUDA path never takes the peer-write kernel pair."""
    return _on("SPEAR_NO_PEER_WRITE")


def cache_dir() -> str:
    """The user cache directory (``SPEAR_CACHE_DIR``, else ``~/.cache/spear_compile``)."""
    return os.environ.get("SPEAR_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "spear_compile")


def fingerprint() -> str:
    """The kill switches' values, for cache keys."""
    return ";".join(f"{v}={os.environ.get(v, '')}" for v in SWITCHES)
