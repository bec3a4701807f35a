"""``ServeConfig``: everything ``spear serve`` is started with, frozen and validated where it is written.

The defaults run on a fresh machine with no GPU: SmolLM2-135M (offline), per-channel W4 RTN, SVD-of-error
compensators of rank 8 on every linear, eager spear ops on CPU.

NOTE: ``compile="auto"`` compiles with ``backend="spear"`` on CUDA only. Measured on 2 shared CPU cores
(SmolLM2-135M W4 + rank-8 ECs, 2026-12-03): the compiled engine took 66 s to start (the warm-up compiles
every layer) and decoded at 1.60 s per token at batch 1 (median), 11.0 s for 8 requests x 8 tokens;
eagerly it started in 0.05 s and decoded at 0.60-0.67 s per token, 8.2 s for the 8 x 8.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from ..config import check_types

EC_KINDS = ("auto", "svd", "random", "none")
COMPILE_MODES = ("auto", "on", "off")
POLICIES = ("auto", "static")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """What to serve and how.

    model: ``smollm2-135m``, a Hugging Face model directory (quantized here) or a spear artifact directory
        (``spear.save``; served as saved, its ECs included). ``served_model_name``: the ``model`` clients
        send (default: ``model``). ``tokenizer``: a tokenizer directory, for an artifact that cannot name one.
    group_size: W4 group (0: per-channel). ``ec``: compensators on the quantized linears: ``svd`` (SVD of
        each weight's quantization error, rank ``ec_rank``), ``random`` (for tests: cheap, not for quality),
        ``none``; ``auto`` = ``svd``, or an artifact's own.
    slo_itl_ms: the inter-token latency SLO: ``/metrics`` scores every gap against it, and with
        ``policy="auto"`` the engine plans each step with ``SloChunkPolicy`` under it (its latency model is
        measured once per device and cached); ``policy="static"``: a fixed token budget per step.
        ``online_correction``: that policy plans against its latency model corrected by the served steps
        (``runtime.online``; on, as ``Engine``'s default).
    max_queue: admitted requests that may wait to start (more: 429). ``max_tokens``: most output tokens
        per request. ``max_model_len``: most prompt + output tokens (default: the model's positions and the
        KV cache, whichever is smaller). ``num_blocks`` / ``block_size`` / ``max_batch_tokens``: the KV cache
        and the step budget (None: transformers sizes them). ``compile``: ``auto`` (on with CUDA), on, off.
    shutdown_timeout_s: on SIGTERM / Ctrl-C, how long in-flight requests may run before they are cancelled.
    """

    model: str = "smollm2-135m"
    served_model_name: Optional[str] = None
    tokenizer: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 8000
    device: Optional[str] = None
    group_size: int = 0
    ec: str = "auto"
    ec_rank: int = 8
    slo_itl_ms: Optional[float] = None
    policy: str = "auto"
    online_correction: bool = True
    max_queue: int = 64
    max_tokens: int = 512
    max_model_len: Optional[int] = None
    num_blocks: Optional[int] = None
    block_size: Optional[int] = None
    max_batch_tokens: Optional[int] = None
    compile: str = "auto"
    shutdown_timeout_s: float = 30.0
    access_log: bool = False

    def __post_init__(self) -> None:
        check_types(self)
        name = type(self).__name__
        for field, allowed in (("ec", EC_KINDS), ("compile", COMPILE_MODES), ("policy", POLICIES)):
            if getattr(self, field) not in allowed:
                raise ValueError(f"{name}.{field}={getattr(self, field)!r}: expected one of {allowed}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"{name}.port={self.port}: expected 0..65535 (0: any free port)")
        for field in ("ec_rank", "max_queue", "max_tokens", "max_model_len", "num_blocks", "block_size",
                      "max_batch_tokens"):
            v = getattr(self, field)
            if v is not None and v < 1:
                raise ValueError(f"{name}.{field}={v}: expected an integer >= 1")
        if self.slo_itl_ms is not None and not self.slo_itl_ms > 0:
            raise ValueError(f"{name}.slo_itl_ms={self.slo_itl_ms}: expected a positive number of milliseconds")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"{name}.shutdown_timeout_s={self.shutdown_timeout_s}: expected >= 0")
        if not self.model:
            raise ValueError(f"{name}.model is empty")

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    def replace(self, **kw) -> "ServeConfig":
        return dataclasses.replace(self, **kw)


__all__ = ["COMPILE_MODES", "EC_KINDS", "POLICIES", "ServeConfig"]
