"""``spear eval``: quantize, compensate, calibrate and measure perplexity, as one JSON contract.

Output keys (stable; other tools read them): ``ppl_ref``, ``ppl_quant``, ``ppl_method``,
``gap_recovered`` = (ppl_quant - ppl_method) / (ppl_quant - ppl_ref), ``ec_bytes``,
``ref_model_bytes`` (fp16 bytes of the reference), ``memory_overhead`` = ec_bytes /
ref_model_bytes, ``memory_overhead_of_w4``, ``modules`` ([{name, rank}]),
``calibration_seconds``, plus the settings used.

Methods at a byte budget (``--budget 0.01`` = EC bytes <= 1 % of the fp16 model):
  none   the quantized model alone
  lorc / lqer / qera   static rank-r corrections on every quantized linear, the largest
         uniform r that fits (A, B stored in fp16); statistics from self-sampled text
  spear  CKA damage -> entropy plan (``compensators/selection.py``) -> activation-scaled
         SVD init -> KL calibration on self-sampled text (``compensators/calibrate.py``)
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from typing import Optional, Sequence

import torch
from torch import nn

from . import ECConfig, ErrorCompensator, QuantConfig, attach_, quantize_, quantized_linears
from .compensators.calibrate import CalibConfig, calibrate_, sample_sequences
from .compensators.selection import ec_bytes, module_damage, plan, shapes_of
from .compensators.static import lorc, lqer, qera_exact
from .compensators.stats import collect_input_stats
from .data import DEFAULT_EVAL_PLAYS, perplexity, read_text, windows

METHODS = ("none", "spear", "lorc", "lqer", "qera")


def fp16_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for p in list(model.parameters()) + list(model.buffers()):
        if p.data_ptr() in seen or not p.is_floating_point():
            continue
        seen.add(p.data_ptr())
        total += p.numel() * 2
    return total


def _static_ecs(method: str, ref: nn.Module, q: nn.Module, stats, budget_bytes: int) -> dict[str, ErrorCompensator]:
    qls = quantized_linears(q)
    shapes = {n: (m.out_features, m.in_features) for n, m in qls.items()}
    per_rank = sum(2 * (N + K) for N, K in shapes.values())  # A and B in fp16, no gate
    r = budget_bytes // per_rank
    if r < 1:
        return {}
    ref_mods = dict(ref.named_modules())
    ecs = {}
    for n, m in qls.items():
        err = ref_mods[n].weight.detach().float() - m.dequantize(torch.float32)
        rr = min(r, *err.shape)
        if method == "lorc":
            A, B = lorc(err, rr)
        elif method == "lqer":
            A, B = lqer(err, rr, stats[n].mean_abs)
        else:
            A, B = qera_exact(err, rr, stats[n].rxx)
        ec = ErrorCompensator(m.in_features, m.out_features, ECConfig(rank=rr))
        with torch.no_grad():
            ec.A.copy_(A)
            ec.B.copy_(B)
        ecs[n] = ec
    return ecs


def run_eval(model_name: str = "smollm2-135m", texts: Sequence[str] = DEFAULT_EVAL_PLAYS, quant: str = "rtn",
             group_size: int = 0, method: str = "spear", budget: float = 0.01, seq_len: int = 2048,
             max_tokens: Optional[int] = None, calib: CalibConfig = CalibConfig(), gate_hidden: int = 8,
             progress: bool = True) -> dict:
    from .models import load

    if method not in METHODS:
        raise ValueError(f"spear eval: method {method!r}; expected one of {METHODS}")
    if quant not in ("rtn", "gptq"):
        raise NotImplementedError(f"spear eval: --quant {quant} is not implemented yet (rtn, gptq)")
    torch.manual_seed(calib.seed)
    ref, tok = load(model_name)
    if tok is None:
        raise ValueError(f"spear eval: model {model_name!r} has no tokenizer")
    wins = torch.cat([windows(tok(read_text(t), return_tensors="pt").input_ids[0], seq_len, max_tokens) for t in texts])
    ref_bytes = fp16_bytes(ref)
    budget_bytes = int(budget * ref_bytes)
    ppl_ref = perplexity(ref, wins, progress=progress, desc="ppl ref")
    seqs = None
    if quant == "gptq" or method != "none":  # the only calibration data: text the fp model writes
        seqs = sample_sequences(ref, calib.n_seqs, calib.seq_len, ref.config.bos_token_id, seed=calib.seed,
                                progress=progress)
    q = quantize_(copy.deepcopy(ref), QuantConfig(group_size=group_size or None, method=quant), progress=progress,
                  calib=None if seqs is None else [seqs[i:i + 4] for i in range(0, len(seqs), 4)])
    ppl_quant = perplexity(q, wins, progress=progress, desc="ppl quant")
    t0 = time.time()
    ecs: dict[str, ErrorCompensator] = {}
    log: dict = {}
    if method != "none":
        if method == "spear":
            damage = module_damage(ref, q, [seqs[i:i + 4] for i in range(0, min(8, len(seqs)), 4)],
                                   progress=progress)
            p = plan(damage, shapes_of(q, damage), budget_bytes, gate_hidden=gate_hidden)
            names = [m.name for m in p.modules]
            stats = collect_input_stats(ref, [seqs[i:i + 4] for i in range(0, len(seqs), 4)], names=names,
                                        module_type=nn.Linear)
            ref_mods = dict(ref.named_modules())
            for m in p.modules:
                ql = q.get_submodule(m.name)
                ecs[m.name] = ErrorCompensator.from_weight_error(
                    ref_mods[m.name].weight, ql.dequantize(torch.float32),
                    ECConfig(rank=m.rank, gate_hidden=gate_hidden), act_scale=stats[m.name].mean_sq.sqrt())
            attach_(q, ecs)
            log = calibrate_(q, ref, seqs, calib, progress=progress)
            log["plan"] = json.loads(p.to_json())
        else:
            stats = collect_input_stats(ref, [seqs[i:i + 4] for i in range(0, len(seqs), 4)],
                                        names=list(quantized_linears(q)), module_type=nn.Linear,
                                        full=(method == "qera"))
            ecs = _static_ecs(method, ref, q, stats, budget_bytes)
            attach_(q, ecs)
    calib_s = time.time() - t0
    ppl_method = perplexity(q, wins, progress=progress, desc=f"ppl {method}") if ecs else ppl_quant
    if method == "spear":
        used = sum(ec_bytes(e.out_features, e.in_features, e.rank, gate_hidden) for e in ecs.values())
    else:
        used = sum(2 * e.rank * (e.in_features + e.out_features) for e in ecs.values())
    w4_bytes = sum(m.qweight.numel() + 2 * (m.scales.numel() + m.zeros.numel()) for m in quantized_linears(q).values())
    gap = ppl_quant - ppl_ref
    return {
        "model": model_name, "texts": list(texts), "tokens": int(wins.numel()), "seq_len": seq_len,
        "quant": quant, "group_size": group_size, "method": method, "budget": budget,
        "ppl_ref": ppl_ref, "ppl_quant": ppl_quant, "ppl_method": ppl_method,
        "gap_recovered": (ppl_quant - ppl_method) / gap if gap > 0 else math.nan,
        "ec_bytes": used, "ref_model_bytes": ref_bytes, "memory_overhead": used / ref_bytes,
        "memory_overhead_of_w4": used / (ref_bytes - 2 * sum(m.in_features * m.out_features
                                                             for m in quantized_linears(q).values()) + w4_bytes),
        "modules": [{"name": n, "rank": e.rank} for n, e in sorted(ecs.items())],
        "calibration_seconds": calib_s, "calibration": dataclasses.asdict(calib),
        "calibration_losses": log.get("losses", []), "plan": log.get("plan"),
    }

