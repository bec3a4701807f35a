"""Starting and stopping the server: the model, the engine, the service, uvicorn.

``load_model(cfg)`` -> (model, tokenizer): the built-in SmolLM2-135M or a Hugging Face directory,
quantized W4 here with the configured compensators, or a spear artifact served as saved.
``build_service(cfg)`` starts an ``Engine`` on it (warm-up, and with compile on the first compilation,
happen here, before the port opens) and wraps it in a ``Service``. ``serve(cfg)`` runs uvicorn until
SIGINT / SIGTERM and prints ``spear serve: listening on http://HOST:PORT`` (the bound port, also for
``port=0``) once requests are accepted.

Graceful shutdown: on the first SIGINT / SIGTERM the service stops accepting (``/health`` and new
requests answer 503), uvicorn closes the listening socket and lets in-flight requests, streams included,
finish for up to ``shutdown_timeout_s``; what still runs then is cancelled (its engine requests
cancelled, KV blocks freed); then the engine stops. uvicorn then re-raises the signal, so the process
ends as one stopped by SIGTERM (status -15); after Ctrl-C / SIGINT ``spear serve`` exits with 130.
"""
from __future__ import annotations

import copy
import os
from typing import Callable, Optional, Tuple

from .config import ServeConfig


def _device(cfg: ServeConfig) -> str:
    import torch

    if cfg.device is not None:
        if cfg.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={cfg.device!r}: CUDA is not available on this machine")
        return cfg.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def _builtin_tokenizer(name: str):
    if name == "smollm2-135m":
        from transformers import AutoTokenizer

        from ..models.smollm2 import GGUF_FILE, smollm2_dir

        return AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=GGUF_FILE)
    return None


def load_model(cfg: ServeConfig, log: Callable[[str], None] = print) -> Tuple[object, object]:
    """(model in eval mode on the device, tokenizer) for ``cfg.model`` (module docstring)."""
    import torch

    import spear_compile as spear
    from ..artifacts import CONFIG_FILE, _read_config
    from ..models import BUILTIN, load, load_hub

    device = _device(cfg)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    spec = cfg.model
    if os.path.isdir(spec) and os.path.isfile(os.path.join(spec, CONFIG_FILE)):
        if cfg.ec not in ("auto",):
            raise ValueError(f"ec={cfg.ec!r}: {spec} is a spear artifact, served with the compensators it saved; "
                             f"leave ec at 'auto'")
        log(f"spear serve: loading the spear artifact {spec}")
        model = spear.load(spec).eval()
        src = _read_config(spec)["model"]
        tok = None
        if cfg.tokenizer is not None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(cfg.tokenizer)
        elif src.get("source") == "builtin":
            tok = _builtin_tokenizer(src.get("name"))
        if tok is None:
            raise ValueError(f"model {spec!r}: the artifact does not name a tokenizer; pass tokenizer= (--tokenizer DIR)")
        return model.to(device), tok
    if spec in BUILTIN:
        if spec == "tiny-llama":
            raise ValueError("model 'tiny-llama' has no tokenizer; serve smollm2-135m, a Hugging Face directory "
                             "or a spear artifact")
        log(f"spear serve: loading {spec} (offline)")
        ref, tok = load(spec, dtype=dtype)
    elif os.path.isdir(spec):
        log(f"spear serve: loading the Hugging Face model in {spec}")
        ref, tok = load_hub(spec, dtype=dtype)
        if cfg.tokenizer is not None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(cfg.tokenizer)
    else:
        raise ValueError(f"model {spec!r}: expected smollm2-135m, a Hugging Face model directory or a spear "
                         f"artifact directory (no such directory)")
    ref = ref.to(device)
    model = spear.quantize_(copy.deepcopy(ref), spear.QuantConfig(group_size=cfg.group_size or None), progress=False)
    ec = "svd" if cfg.ec == "auto" else cfg.ec
    if ec != "none":
        from ..compensators.init import random_ecs, svd_ecs

        ec_cfg = spear.ECConfig(rank=cfg.ec_rank)
        ecs = svd_ecs(model, ref, ec_cfg) if ec == "svd" else random_ecs(model, spear.ECConfig(rank=cfg.ec_rank,
                                                                                               gate_hidden=4), seed=0)
        spear.attach_(model, {k: v.to(device, dtype) for k, v in ecs.items()})
        log(f"spear serve: W4 ({'per-channel' if not cfg.group_size else f'group {cfg.group_size}'}) with "
            f"{ec} compensators of rank {cfg.ec_rank} on {len(ecs)} linears")
    del ref
    return model.eval(), tok


def build_service(cfg: ServeConfig, model=None, tokenizer=None, log: Callable[[str], None] = print):
    """A started ``Engine`` on the model (``load_model(cfg)`` unless given) and its ``Service``."""
    from ..runtime import Engine, StaticChunkPolicy
    from .generation import Service
    from .metrics import Metrics

    if model is None:
        model, tokenizer = load_model(cfg, log)
    compile_on = cfg.compile == "on" or (cfg.compile == "auto" and _device(cfg).startswith("cuda"))
    policy = StaticChunkPolicy(cfg.max_batch_tokens or 1 << 30) if cfg.policy == "static" else None
    engine = Engine(model, tokenizer, policy=policy, slo_itl_ms=cfg.slo_itl_ms if policy is None else None,
                    max_queue=cfg.max_queue, compile=compile_on, block_size=cfg.block_size, num_blocks=cfg.num_blocks,
                    max_batch_tokens=cfg.max_batch_tokens, online_correction=cfg.online_correction, log=log)
    engine.start()
    kv_tokens = engine.kv_total_blocks * engine.kv_block_size
    text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    positions = getattr(text_cfg, "max_position_embeddings", None) or kv_tokens
    max_len = min(kv_tokens, positions, cfg.max_model_len or kv_tokens)
    svc = Service(engine, tokenizer, cfg.name, max_model_len=max_len, max_tokens=min(cfg.max_tokens, max_len),
                  metrics=Metrics(engine.stats, cfg.slo_itl_ms))
    return svc


def make_server(cfg: ServeConfig, svc, announce: Optional[Callable[[str], None]] = None):
    """A uvicorn server for ``svc`` that marks the service draining on the first exit signal and calls
    ``announce(url)`` once it listens."""
    import uvicorn

    from .app import create_app

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            svc.accepting = False  # /health and new requests: 503 from now on
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started and announce is not None:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                announce(f"http://{host}:{port}")

    config = uvicorn.Config(create_app(svc), host=cfg.host, port=cfg.port, log_level="info",
                            access_log=cfg.access_log, timeout_graceful_shutdown=cfg.shutdown_timeout_s,
                            lifespan="on")
    return Server(config)


def serve(cfg: ServeConfig, log: Callable[[str], None] = print) -> int:
    """Load, start, serve until a signal (module docstring); the exit status."""
    svc = build_service(cfg, log=log)
    server = make_server(cfg, svc, announce=lambda url: print(f"spear serve: listening on {url}", flush=True))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down gracefully
        log("spear serve: stopped")
        return 130
    finally:
        if svc.engine.running:
            svc.engine.stop(wait=False)
    log("spear serve: stopped")
    return 0 if server.started else 1


__all__ = ["build_service", "load_model", "make_server", "serve"]
