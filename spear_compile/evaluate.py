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
  spear  CKA damage -> entropy plan with greedy ranks -> QERA-exact init -> KL calibration
         on self-sampled text (``compensators/spear.py``), with ``spear.preset(device)``'s
         settings (GPU_PRESET on CUDA, CPU_PRESET otherwise) unless a SpearConfig is given
  serq   one least-squares correction matrix on the k most salient input channels per linear
         (k from the budget), with SmoothQuant-style flattening folded offline when
         activations are quantized (``compensators/serq.py``)

``act_bits`` (8 or 4) fake-quantizes every quantized linear's input per token (W4A8 / W4A4,
``quant/actquant.py``) in the base model and in every method, so ``ppl_quant`` and
``gap_recovered`` are measured at that activation precision. SERQ quantizes its own (flattened)
activations; flattening is on only then, since with 16-bit activations it can only move
weight error around (measured worse on SmolLM2, see the NOTE in ``serq.py``).

``calibration_seconds`` counts everything the method needs after quantization: sampling the
calibration text from the fp model, and for SPEAR damage, statistics, init and training
(``seconds`` breaks it down).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import time
from typing import Optional, Sequence

import torch
from torch import nn

from . import ECConfig, ErrorCompensator, QuantConfig, attach_, quantize_, quantized_linears
from .config import _GROUP_SIZES
from .compensators.calibrate import sample_calibration, short_context
from .compensators.selection import ec_bytes
from .compensators.serq import apply_serq_, collect_serq_stats
from .compensators.spear import SpearConfig, fit_spear_, preset
from .compensators.static import lorc, lqer, qera_exact
from .quant.stats import collect_input_stats
from .config import default_device
from .data import DEFAULT_EVAL_PLAYS, perplexity, read_text, windows
from .quant.actquant import add_act_quant_

METHODS = ("none", "spear", "lorc", "lqer", "qera", "serq")
QUANTS = ("rtn", "gptq", "awq")


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
        ec = ErrorCompensator(m.in_features, m.out_features, ECConfig(rank=rr), device=m.qweight.device)
        with torch.no_grad():
            ec.A.copy_(A)
            ec.B.copy_(B)
        ecs[n] = ec
    return ecs


class EvalSession:
    """One model and evaluation text, many (quantizer, method, budget) runs.

    Caches what runs share: the reference perplexity, the self-sampled calibration text,
    each quantized base model and its perplexity. Every run still reports the sampling time
    in its ``calibration_seconds``: a single ``spear eval`` has to pay it.
    """

    def __init__(self, model_name: str = "smollm2-135m", texts: Sequence[str] = DEFAULT_EVAL_PLAYS,
                 seq_len: int = 2048, max_tokens: Optional[int] = None, spear: Optional[SpearConfig] = None,
                 progress: bool = True, device: Optional[str] = None, calib_text: Optional[str] = None) -> None:
        from .models import load

        self.device = default_device(device)
        spear = spear if spear is not None else preset(self.device)
        self.model_name, self.texts, self.seq_len, self.spear, self.progress = model_name, list(texts), seq_len, spear, progress
        torch.manual_seed(spear.calib.seed)
        self.ref, tok = load(model_name)
        if tok is None:
            raise ValueError(f"spear eval: model {model_name!r} has no tokenizer")
        self.ref.to(self.device)
        self.wins = torch.cat([windows(tok(read_text(t), return_tensors="pt").input_ids[0], seq_len, max_tokens)
                               for t in texts]).to(self.device)
        self.ref_bytes = fp16_bytes(self.ref)
        self.tok, self.calib_text = tok, calib_text
        if calib_text is not None and calib_text in self.texts:
            raise ValueError(f"spear eval: calibration text {calib_text!r} is also an evaluation text")
        self._ppl_ref: Optional[float] = None
        self._seqs: Optional[torch.Tensor] = None
        self.sampling_seconds = 0.0
        self._bases: dict = {}

    def _check_group_size(self, group_size: Optional[int]) -> None:
        """Before any pass: every linear that gets quantized (all but ``lm_head``) must split into
        whole groups."""
        if not group_size:
            return
        from .api import default_filter

        for name, m in self.ref.named_modules():
            if name and default_filter(m, name) and m.in_features % group_size:
                raise ValueError(f"spear eval: --group-size {group_size} does not divide in_features "
                                 f"{m.in_features} of {name} ({self.model_name})")

    @property
    def ppl_ref(self) -> float:
        if self._ppl_ref is None:
            self._ppl_ref = perplexity(self.ref, self.wins, progress=self.progress, desc="ppl ref")
        return self._ppl_ref

    @property
    def seqs(self) -> torch.Tensor:
        """The calibration data: text the full-precision model writes, or with ``calib_text`` the
        first ``n_seqs x seq_len`` tokens of that text (the real-text baseline for static methods)."""
        if self._seqs is None:
            c = self.spear.calib
            t0 = time.time()
            if self.calib_text is not None:
                ids = self.tok(read_text(self.calib_text), return_tensors="pt").input_ids[0]
                if ids.numel() < c.n_seqs * c.seq_len:
                    raise ValueError(f"spear eval: calibration text {self.calib_text!r} has {ids.numel()} tokens, "
                                     f"fewer than n_seqs x seq_len = {c.n_seqs * c.seq_len}")
                self._seqs = ids[: c.n_seqs * c.seq_len].reshape(c.n_seqs, c.seq_len).to(self.device)
                return self._seqs
            self._seqs = sample_calibration(self.ref, c, progress=self.progress)
            self.sampling_seconds = time.time() - t0
        return self._seqs

    def base(self, quant: str, group_size: int, act_bits: Optional[int] = None) -> tuple[nn.Module, float]:
        """(quantized copy of the reference, its perplexity), cached per (quant, group_size, act_bits)."""
        if quant not in QUANTS:
            raise ValueError(f"spear eval: quant {quant!r}; expected one of {QUANTS}")
        key = (quant, group_size, act_bits)
        if act_bits is not None and key not in self._bases:
            q = copy.deepcopy(self.base(quant, group_size)[0])
            add_act_quant_(q, act_bits)
            self._bases[key] = (q, perplexity(q, self.wins, progress=self.progress, desc=f"ppl {quant} a{act_bits}"))
        if key not in self._bases:
            seqs = self.seqs if quant != "rtn" else None
            if seqs is not None and quant == "gptq" and self.calib_text is None:
                seqs = short_context(seqs, self.ref.config.bos_token_id)  # self-sampled: <= 256 tokens of context
            calib = None if seqs is None else [seqs[i:i + 4] for i in range(0, len(seqs), 4)]
            q = quantize_(copy.deepcopy(self.ref), QuantConfig(group_size=group_size or None, method=quant),
                          progress=self.progress, calib=calib)
            self._bases[key] = (q, perplexity(q, self.wins, progress=self.progress, desc=f"ppl {quant}"))
        return self._bases[key]

    def reference_for(self, quant: str, group_size: int) -> nn.Module:
        """The fp model in the quantized base's coordinates. AWQ quantized ``W diag(s)`` fed
        ``x / s``, so weight errors and input statistics must come from the folded reference
        (same function as ``self.ref``); other quantizers use ``self.ref`` itself."""
        if quant != "awq":
            return self.ref
        key = ("folded", quant, group_size)
        if key not in self._bases:
            from .quant.awq import fold_awq_

            self._bases[key] = fold_awq_(copy.deepcopy(self.ref), self.base(quant, group_size)[0]._spear_awq.scales)
        return self._bases[key]

    def run(self, quant: str = "rtn", group_size: int = 0, method: str = "spear", budget: float = 0.01,
            act_bits: Optional[int] = None) -> dict:
        if method not in METHODS:
            raise ValueError(f"spear eval: method {method!r}; expected one of {METHODS}")
        self._check_group_size(group_size)
        ref, spear, calib = self.reference_for(quant, group_size), self.spear, self.spear.calib
        torch.manual_seed(calib.seed)
        budget_bytes = int(budget * self.ref_bytes)
        ppl_ref = self.ppl_ref  # of the original reference (the folded one computes the same function)
        base, ppl_quant = self.base(quant, group_size, act_bits)
        # SERQ replaces the layers and quantizes its own inputs: start it from the W4A16 base
        q = copy.deepcopy(self.base(quant, group_size)[0] if method == "serq" else base)
        # Sample (or reuse) the calibration text before the clock starts: its time is added once,
        # from ``sampling_seconds``, so a session's first run does not count it twice.
        seqs = self.seqs if method != "none" else None
        t0 = time.time()
        ecs: dict[str, ErrorCompensator] = {}
        log: dict = {}
        serq: dict = {}
        if seqs is not None:
            t_fit = time.time()  # the methods' own work; with SPEAR its log's phases
            batches = [seqs[i:i + 4] for i in range(0, len(seqs), 4)]
            if method == "serq":
                stats = collect_serq_stats(ref, batches, names=list(quantized_linears(q)))
                serq = apply_serq_(ref, q, stats, budget_bytes, act_bits=act_bits,
                                   smooth_alpha=0.5 if act_bits and quant != "awq" else None,
                                   quant_cfg=QuantConfig(group_size=group_size or None, method=quant))
            elif method == "spear":
                ecs, log = fit_spear_(ref, q, seqs, budget_bytes, spear, progress=self.progress)
            else:
                stats = collect_input_stats(ref, batches,
                                            names=list(quantized_linears(q)), module_type=nn.Linear,
                                            full=(method == "qera"))
                ecs = _static_ecs(method, ref, q, stats, budget_bytes)
                attach_(q, ecs)
            if method != "spear":
                log = {"seconds": {"total": time.time() - t_fit}}
        calib_s = time.time() - t0 + (self.sampling_seconds if method != "none" else 0.0)
        changed = ecs or serq or (method == "spear" and calib.train_quant)  # train_quant: new scales
        ppl_method = (perplexity(q, self.wins, progress=self.progress, desc=f"ppl {method}") if changed
                      else ppl_quant)
        if method == "serq":
            used = sum(r["bytes"] + r["extra_bytes"] for r in serq.values())
        elif method == "spear":
            used = sum(ec_bytes(e.out_features, e.in_features, e.rank, spear.gate_hidden) for e in ecs.values())
        else:
            used = sum(2 * e.rank * (e.in_features + e.out_features) for e in ecs.values())
        qls = quantized_linears(q).values()
        w4_bytes = sum(m.qweight.numel() + 2 * (m.scales.numel() + m.zeros.numel()) for m in qls)
        w4_model_bytes = self.ref_bytes - 2 * sum(m.in_features * m.out_features for m in qls) + w4_bytes
        gap = ppl_quant - ppl_ref
        return {
            "model": self.model_name, "device": torch.cuda.get_device_name(self.device)
            if self.device.type == "cuda" else "cpu", "texts": self.texts, "tokens": int(self.wins.numel()), "seq_len": self.seq_len,
            "quant": quant, "group_size": group_size, "method": method, "budget": budget,
            "ppl_ref": ppl_ref, "ppl_quant": ppl_quant, "ppl_method": ppl_method,
            "gap_recovered": (ppl_quant - ppl_method) / gap if gap > 0 else math.nan,
            "ec_bytes": used, "ref_model_bytes": self.ref_bytes, "memory_overhead": used / self.ref_bytes,
            "memory_overhead_of_w4": used / w4_model_bytes,
            "act_bits": act_bits,
            "modules": ([{"name": n, "rank": r["k"]} for n, r in sorted(serq.items())] if serq else
                        [{"name": n, "rank": e.rank} for n, e in sorted(ecs.items())]),
            "calibration_seconds": calib_s,
            "seconds": {"sampling": self.sampling_seconds if method != "none" else 0.0, **log.get("seconds", {})},
            "calibration": dataclasses.asdict(calib),
            "calibration_data": self.calib_text or "self-sampled",
            "spear": {k: v for k, v in dataclasses.asdict(spear).items() if k != "calib"},
            "calibration_losses": log.get("losses", []), "plan": log.get("plan"),
        }


def run_eval(model_name: str = "smollm2-135m", texts: Sequence[str] = DEFAULT_EVAL_PLAYS, quant: str = "rtn",
             group_size: int = 0, method: str = "spear", budget: float = 0.01, seq_len: int = 2048,
             max_tokens: Optional[int] = None, spear: Optional[SpearConfig] = None, progress: bool = True,
             device: Optional[str] = None, act_bits: Optional[int] = None) -> dict:
    """One ``spear eval`` run (see the module doc for the keys)."""
    if quant not in QUANTS:
        raise NotImplementedError(f"spear eval: --quant {quant} is not implemented yet ({', '.join(QUANTS)})")
    check_eval_args(texts, group_size, method, budget, seq_len, max_tokens)
    session = EvalSession(model_name, texts, seq_len, max_tokens, spear, progress, device)
    return session.run(quant, group_size, method, budget, act_bits)


def check_eval_args(texts: Sequence[str], group_size: int, method: str, budget: float, seq_len: int,
                    max_tokens: Optional[int], prog: str = "spear eval") -> None:
    """Raise ``ValueError`` naming the bad argument (messages start with ``prog``) before anything
    is loaded: a mistyped value must not surface as a traceback (or a meaningless 0 %) after
    minutes of perplexity passes."""
    from .data.shakespeare import check_text

    if method not in METHODS:
        raise ValueError(f"{prog}: method {method!r}; expected one of {METHODS}")
    try:
        QuantConfig(group_size=group_size)  # the one rule for group sizes
    except ValueError:
        raise ValueError(f"{prog}: --group-size {group_size!r}; expected 0 (per-channel) or one of "
                         f"{', '.join(map(str, _GROUP_SIZES[1:]))}") from None
    if not isinstance(budget, (int, float)) or not math.isfinite(budget) or not 0 <= budget <= 1:
        raise ValueError(f"{prog}: --budget {budget!r}; expected a fraction of the fp16 model's bytes in [0, 1] "
                         f"(0.01 = 1 %)")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"{prog}: --seq-len {seq_len!r}; expected an integer >= 2")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < seq_len):
        raise ValueError(f"{prog}: --max-tokens {max_tokens!r}; expected an integer >= --seq-len ({seq_len}), "
                         f"or none for the whole text")
    if not texts:
        raise ValueError(f"{prog}: no --text given")
    for t in texts:
        try:
            check_text(t)
        except ValueError as e:
            raise ValueError(f"{prog}: --text: {e}") from None
