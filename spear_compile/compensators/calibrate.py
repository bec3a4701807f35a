"""Calibration without external data: KL(p_fp || p_quant+EC) on text the fp model writes.

1. ``sample_sequences``: the full-precision model samples ``n`` sequences of ``seq_len``
   tokens from its BOS token (seeded, batched; on the model's device). No dataset is read.
2. ``calibrate_``: minimise the token-mean KL divergence between the fp model's next-token
   distribution and the quantized model's (with ECs) over those sequences with Adam,
   training the gates and, with ``train_ab=True``, A, B and alpha. The teacher's
   log-probabilities are computed once for all sequences and kept in fp16 when they fit
   ``teacher_cache_bytes`` (32 x 256 tokens x 49k vocabulary = 0.8 GB): on a CPU the
   teacher forward is a third of a step's compute, so caching makes every step ~1.5x
   cheaper. Larger sets recompute the teacher per minibatch.
   With ``dense_weights`` the student's 4-bit weights are dequantized once for the whole run
   (fp32 copies, 4 bytes per weight) instead of in every forward and every backward of every
   step; the same reference math (``ops/w4a16_ref.py``, ``ops/ec_ref.py``), so the
   losses are unchanged (tested). With ``train_quant`` the scales and zero points are trained
   too (``QuantParams``): those weights are rebuilt from their 4-bit codes in every forward, and
   the trained values are written back into the modules when training ends (normally or by
   Ctrl-C; after any other error the base is left unchanged).

Deterministic under a seed; a progress bar shows the running KL; ``KeyboardInterrupt``
stops cleanly after the current step and keeps the parameters trained so far.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Optional, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from ..config import check_types
from ..ops.packing import unpack_int4
from ..ops.w4a16_ref import dequantize_ref
from ..quant.linear import QuantLinear
from .sampling import eos_ids, force_first, sample_static


_SCHEDULES = ("constant", "cosine")
SAMPLERS = ("hf", "static")


@dataclasses.dataclass(frozen=True)
class CalibConfig:
    """The KL training and its data.

    n_seqs x seq_len: self-sampled tokens (drawn ``sample_batch`` sequences at a time, at sampling
    ``temperature``).
    steps, batch_size: Adam steps, sequences per step. lr / lr_ab: gate / (A, B, alpha)
    learning rates; ``train_ab=False`` trains the gates alone. schedule: "constant", or
    "cosine" (decayed to zero over ``steps``). teacher_cache_bytes: cache the teacher's
    log-probs when they fit in it and, on a GPU, in half its free memory (``teacher_cache_fits``).
    dense_weights: dequantize the student's weights once per run.
    cuda_graph: on CUDA with the teacher cached, run each step as one CUDA graph replay
    (``graphed_step.py``; the same minibatches and learning rates as the eager loop).
    sampler: "hf" (``model.generate``) or "static" (``sampling.py``: a static-KV-cache loop with
    grouped-query attention, its decode step a CUDA graph on CUDA; samples of the same model, equal
    to "hf"'s up to fp32 rounding in the attention: H200, 192 x 1024 tokens in 21 s where
    ``generate`` took 83.7 s for 96 x 1024; GPU_PRESET uses it).
    train_norms: also train the model's RMSNorm weights (at ``lr_norm``): no extra bytes (the
    quantized model keeps its norms in 16 bits anyway), but it changes weights outside the ECs,
    so results with it are reported apart from SPEAR's. Off by default.
    train_quant: also train every quantized linear's scales and zero points (relative scale
    ``s0 * (1 + u)`` and zero ``z0 + v``, at ``lr_quant``; the 4-bit codes stay as RTN/GPTQ/AWQ
    chose them). No extra bytes and no kernel change: the format already stores both as floats
    (``quant/format.py``). Like ``train_norms`` it changes the base quantization, so results with
    it are reported apart from the ECs-only ones. Needs ``dense_weights``. Off by default.
    random_first: the fraction of sequences whose first token after BOS is drawn uniformly from
    the vocabulary (BOS, EOS and pad excluded) instead of sampled; the rest of each sequence is
    the model's own continuation. Why: started from BOS, a small model writes mostly one register
    (modern web prose), and the calibration text's domain is what caps recovery on text of
    another domain (``docs/quality.md``, 2026-11-30: 70 -> 82 % from the text alone). A random
    first token steers each sequence somewhere else the model can go, with no external data
    (LLM-QAT's data-free generation does the same). Measured (H200, GPU_PRESET, 2026-11-30): no
    gain - 0.25 is within noise of 0 and larger fractions cost recovery (the random starts lead
    to code and lists, not to older English). 0 (default): every sequence from BOS.
    """

    n_seqs: int = 32
    seq_len: int = 256
    steps: int = 80
    batch_size: int = 4
    lr: float = 2e-3
    lr_ab: float = 2e-4
    train_ab: bool = True
    seed: int = 0
    temperature: float = 1.0
    teacher_cache_bytes: int = 2 << 30
    dense_weights: bool = True
    schedule: str = "constant"
    sample_batch: int = 32
    cuda_graph: bool = False
    sampler: str = "hf"
    train_norms: bool = False
    lr_norm: float = 1e-4
    train_quant: bool = False
    lr_quant: float = 1e-3
    random_first: float = 0.0

    def __post_init__(self) -> None:
        check_types(self)
        for f in ("lr", "lr_ab", "lr_norm", "lr_quant", "teacher_cache_bytes", "seed"):
            if getattr(self, f) < 0:
                raise ValueError(f"CalibConfig.{f}={getattr(self, f)}: must be >= 0")
        if self.temperature <= 0:
            raise ValueError(f"CalibConfig.temperature={self.temperature}: must be > 0")
        for f in ("n_seqs", "seq_len", "steps", "batch_size", "sample_batch"):
            if getattr(self, f) < 1:
                raise ValueError(f"CalibConfig.{f}={getattr(self, f)}: must be >= 1")
        if self.schedule not in _SCHEDULES:
            raise ValueError(f"CalibConfig.schedule={self.schedule!r}: expected one of {_SCHEDULES}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"CalibConfig.sampler={self.sampler!r}: expected one of {SAMPLERS}")
        if not 0.0 <= self.random_first <= 1.0:
            raise ValueError(f"CalibConfig.random_first={self.random_first}: must be a fraction in [0, 1]")
        if self.train_quant and not self.dense_weights:
            raise ValueError("CalibConfig.train_quant=True needs dense_weights=True (the packed ops have no "
                             "gradient for scales and zero points)")


@torch.no_grad()
def sample_sequences(model: nn.Module, n: int, seq_len: int, bos_token_id: int, batch_size: int = 32,
                     seed: int = 0, temperature: float = 1.0, progress: bool = True,
                     sampler: str = "hf", random_first: float = 0.0) -> torch.Tensor:
    """[n, seq_len] token ids sampled (pure ancestral sampling, no top-k/top-p) from ``model``
    (a Hugging Face causal LM) starting at BOS; EOS is suppressed so every row is full length.
    Large batches: a CPU decode step of a 135M model is mostly per-op overhead, so one batch of 32
    costs little more than one of 8. ``sampler="static"``: the same draws through ``sampling.py``'s
    static-cache loop instead of ``generate``. ``random_first``: the fraction of rows (spread
    evenly over the n) whose token after BOS is drawn uniformly from the vocabulary
    (``first_tokens``); the draw for every other token is unchanged."""
    if sampler not in SAMPLERS:
        raise ValueError(f"sample_sequences: sampler={sampler!r}; expected one of {SAMPLERS}")
    if seq_len < 2 and random_first > 0:
        raise ValueError(f"sample_sequences: random_first={random_first} needs seq_len >= 2 (got {seq_len})")
    device = next(model.parameters()).device
    out = []
    for i in tqdm(range(0, n, batch_size), desc="self-sampling", disable=not progress, leave=False):
        b = min(batch_size, n - i)
        first = first_tokens(model, range(i, i + b), random_first, seed, bos_token_id) if random_first > 0 else None
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed * 100_003 + i)
            if sampler == "static":
                gen = sample_static(model, b, seq_len, bos_token_id, temperature=temperature,
                                    first=None if first is None else first.to(device))
            else:
                ids = torch.full((b, 1), bos_token_id, dtype=torch.long, device=device)
                extra = {}
                if first is not None:
                    from transformers import LogitsProcessorList
                    extra["logits_processor"] = LogitsProcessorList([_ForceFirst(first.to(device))])
                gen = model.generate(ids, do_sample=True, max_new_tokens=seq_len - 1, min_new_tokens=seq_len - 1,
                                     temperature=temperature, top_k=0, top_p=1.0,
                                     pad_token_id=bos_token_id, attention_mask=torch.ones_like(ids), **extra)
        out.append(gen[:, :seq_len])
    return torch.cat(out)


def first_tokens(model: nn.Module, rows: range, frac: float, seed: int,
                 bos_token_id: Optional[int] = None) -> torch.Tensor:
    """[len(rows)] long: for each global row index, a token id drawn uniformly from the vocabulary
    less BOS (``bos_token_id``, the one sampling starts from, and the config's) / EOS / pad where the row is one of the ``frac`` chosen (row k is chosen when
    ``floor((k + 1) frac) > floor(k frac)``: evenly spread, the same whatever the batch size),
    else -1 ("sample it"). A generator of its own, seeded by ``seed`` and the row, so the
    sampling stream is untouched and the draw does not depend on batching."""
    cfg = model.config
    keep = torch.ones(cfg.vocab_size, dtype=torch.bool)
    keep[[t for t in {bos_token_id, cfg.bos_token_id, cfg.pad_token_id, *eos_ids(model)} - {None}
          if 0 <= t < cfg.vocab_size]] = False
    allowed = keep.nonzero()[:, 0]  # ascending ids, as before
    out = torch.full((len(rows),), -1, dtype=torch.long)
    for j, k in enumerate(rows):
        if math.floor((k + 1) * frac) > math.floor(k * frac):
            g = torch.Generator().manual_seed(seed * 1_000_003 + k)
            out[j] = allowed[torch.randint(len(allowed), (1,), generator=g)]
    return out


class _ForceFirst:
    """``generate`` logits processor: at the first generated position, rows with ``first`` >= 0
    get that token with probability one (``sampling.force_first``) - the same draws as the static
    loop's."""

    def __init__(self, first: torch.Tensor):
        self.first = first

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return force_first(scores, self.first) if input_ids.shape[1] == 1 else scores


def sample_calibration(model: nn.Module, cfg: CalibConfig, progress: bool = True) -> torch.Tensor:
    """``cfg.n_seqs x cfg.seq_len`` calibration tokens sampled from ``model`` with ``cfg``'s sampling
    settings: the one place ``CalibConfig``'s sampling fields reach ``sample_sequences``."""
    return sample_sequences(model, cfg.n_seqs, cfg.seq_len, model.config.bos_token_id, batch_size=cfg.sample_batch,
                            seed=cfg.seed, temperature=cfg.temperature, progress=progress, sampler=cfg.sampler,
                            random_first=cfg.random_first)


def short_context(seqs: torch.Tensor, bos_token_id: int, max_len: int = 256) -> torch.Tensor:
    """Self-sampled ``[n, T]`` sequences as ``[n * (T // max_len), max_len]`` pieces, each piece
    after a sequence's first restarting from BOS (its first token is replaced by BOS); a tail
    shorter than ``max_len`` is dropped. Sequences of at most ``max_len`` tokens are returned as
    they are.

    Why: GPTQ's Hessian from 512-token self-sampled sequences made SmolLM2-135M *worse* than
    RTN on a development play (Lear, ppl fp 37.16, RTN 63.23: GPTQ 66.48), while the same
    tokens seen with at most 256 tokens of context gave 59.79 (first halves) and 56.60
    (second halves, BOS-restarted), and 512-token real text 53.24 (``docs/quality.md``,
    2026-11-29). A small model's own text drifts over long contexts; its late activations
    are not what real text produces.
    """
    n, T = seqs.shape
    if T <= max_len:
        return seqs
    pieces = [seqs[:, :max_len]]
    for start in range(max_len, T - max_len + 1, max_len):
        bos = torch.full((n, 1), bos_token_id, dtype=seqs.dtype, device=seqs.device)
        pieces.append(torch.cat([bos, seqs[:, start + 1:start + max_len]], 1))
    return torch.cat(pieces).contiguous()


def teacher_cache_fits(nbytes: int, limit: int, device) -> bool:
    """Whether ``nbytes`` of cached teacher log-probs fit ``limit`` and, on CUDA, half the device's
    free memory (the student's activations and gradients need the rest): GPU_PRESET allows 48 GB
    for an H200; a smaller GPU recomputes the teacher per minibatch instead of running out of memory."""
    device = torch.device(device)
    if device.type == "cuda":
        limit = min(limit, torch.cuda.mem_get_info(device)[0] // 2)
    return nbytes <= limit


def kl_fp_q(fp_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Token-mean KL(p_fp || p_q)."""
    return kl_logp_q(torch.log_softmax(fp_logits.float(), -1), q_logits)


def kl_logp_q(fp_logp: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Token-mean KL(p_fp || p_q) from the teacher's log-probabilities."""
    lp = fp_logp.float()
    lq = torch.log_softmax(q_logits.float(), -1)
    return (lp.exp() * (lp - lq)).sum(-1).mean()


@torch.no_grad()
def teacher_logprobs(ref: nn.Module, seqs: torch.Tensor, batch_size: int = 4, dtype: torch.dtype = torch.float16,
                     progress: bool = True) -> torch.Tensor:
    """[n, T, vocab] log-probabilities of ``ref`` on ``seqs``, stored in ``dtype``."""
    out = []
    for i in tqdm(range(0, seqs.shape[0], batch_size), desc="teacher log-probs", disable=not progress, leave=False):
        out.append(torch.log_softmax(_logits(ref, seqs[i:i + batch_size]).float(), -1).to(dtype))
    return torch.cat(out)


class QuantParams:
    """Trainable offsets of one quantized linear's scales and zero points (``train_quant``).

    ``u`` and ``v`` start at zero, so training starts at the base quantization exactly; the
    weight is ``(q - (z0 + v)) * s0 * (1 + u)`` with the 4-bit codes ``q`` fixed. Relative
    scales put every module's step size on one scale for one learning rate."""

    def __init__(self, m: QuantLinear):
        self.module = m
        self.q = unpack_int4(m.qweight)  # uint8 codes [N, K]: 1 byte per weight
        self.s0, self.z0 = m.scales.detach().float().clone(), m.zeros.detach().float().clone()
        self.u = nn.Parameter(torch.zeros_like(self.s0))
        self.v = nn.Parameter(torch.zeros_like(self.z0))

    def scales_zeros(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The trained scales and zeros as the module will store them (rounded to its buffers'
        dtype, straight-through: the forward sees the stored values, the gradient passes as if
        unrounded), so a bf16 model trains what it keeps."""
        dt = self.module.scales.dtype
        s, z = self.s0 * (1 + self.u), self.z0 + self.v
        return s + (s.to(dt).float() - s).detach(), z + (z.to(dt).float() - z).detach()

    def weight(self) -> torch.Tensor:

        s, z = self.scales_zeros()
        return dequantize_ref(self.q, s, z, self.module.group_size, "unpacked", dtype=torch.float32)

    @torch.no_grad()
    def write_back(self) -> None:
        """Store the trained scales and zeros in the module (its buffers' dtype)."""
        s, z = self.scales_zeros()
        self.module.scales.copy_(s)
        self.module.zeros.copy_(z)


def quant_params(model: nn.Module) -> list[QuantParams]:
    """A :class:`QuantParams` for every ``QuantLinear`` of ``model``."""
    return [QuantParams(m) for m in model.modules() if isinstance(m, QuantLinear)]


@contextlib.contextmanager
def _dense_forward(model: nn.Module, enabled: bool, qparams: Sequence[QuantParams] = ()):
    """Temporarily run every QuantLinear as ``x W^T (+ bias) (+ EC delta)`` with W dequantized once,
    or, for the modules in ``qparams``, rebuilt from their trainable scales and zeros per call."""

    trained = {id(p.module): p for p in qparams}
    if trained and not enabled:
        raise ValueError("_dense_forward: trainable scales and zeros need the dense forward")
    patched = []
    try:
        if enabled:
            for m in model.modules():
                if isinstance(m, QuantLinear) and type(m).forward is QuantLinear.forward:
                    qp = trained.get(id(m))
                    W = None if qp else dequantize_ref(m.qweight, m.scales, m.zeros, m.group_size, "spear").detach()

                    def fwd(x, m=m, W=W, qp=qp):
                        x2 = x.reshape(-1, x.shape[-1])
                        w = (qp.weight() if qp else W).to(x.dtype)
                        y = torch.addmm(m.bias, x2, w.t()) if m.bias is not None else torch.mm(x2, w.t())
                        y = y.reshape(*x.shape[:-1], y.shape[-1])
                        return y if m.ec is None else y + m.ec(x)

                    m.forward = fwd
                    patched.append(m)
        yield
    finally:
        for m in patched:
            del m.forward


def _logits(model, ids):
    out = model(ids)
    return getattr(out, "logits", out)


def norm_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The weights of the model's RMSNorm modules (any class named ``*RMSNorm``)."""
    return [m.weight for m in model.modules()
            if type(m).__name__.endswith("RMSNorm") and isinstance(getattr(m, "weight", None), nn.Parameter)]


def ec_parameters(model: nn.Module, train_ab: bool) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    gate, ab = [], []
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.ec is not None:
            gate += [m.ec.W1, m.ec.b1, m.ec.W2, m.ec.b2]
            if train_ab:
                ab += [m.ec.A, m.ec.B, m.ec.alpha]
    return gate, ab


@torch.no_grad()
def mean_kl(ref: nn.Module, model: nn.Module, seqs: torch.Tensor, batch_size: int = 4) -> float:
    tot = 0.0
    for i in range(0, seqs.shape[0], batch_size):
        b = seqs[i:i + batch_size]
        tot += float(kl_fp_q(_logits(ref, b), _logits(model, b))) * b.shape[0]
    return tot / seqs.shape[0]


def calibrate_(model: nn.Module, ref: nn.Module, seqs: torch.Tensor, cfg: CalibConfig = CalibConfig(),
               progress: bool = True) -> dict:
    """Train the attached ECs of ``model`` in place (and, with ``cfg.train_quant``, its scales and
    zero points); returns a log (losses, seconds, steps run)."""
    gate, ab = ec_parameters(model, cfg.train_ab)
    if not gate and not cfg.train_quant:
        raise ValueError("calibrate_: the model has no attached ECs (use attach_ first)")
    norms = norm_parameters(model) if cfg.train_norms else []
    qparams = quant_params(model) if cfg.train_quant else []
    if cfg.train_quant and not qparams:
        raise ValueError("calibrate_: train_quant=True but the model has no quantized linears")
    quant = [p for qp in qparams for p in (qp.u, qp.v)]
    # every non-EC parameter (norms included) gets its own flag back afterwards; EC ones end frozen
    others = [p for p in model.parameters() if all(p is not q for q in gate + ab)]
    req = [p.requires_grad for p in others]
    for p in others:
        p.requires_grad_(False)
    for p in gate + ab + norms:
        p.requires_grad_(True)
    t0 = time.time()
    vocab = getattr(getattr(ref, "config", None), "vocab_size", None)
    cached = None
    if vocab is not None and teacher_cache_fits(seqs.numel() * vocab * 2, cfg.teacher_cache_bytes, seqs.device):
        cached = teacher_logprobs(ref, seqs, cfg.batch_size, progress=progress)
    graphed = cfg.cuda_graph and cached is not None and seqs.is_cuda and cached.is_cuda
    # a captured Adam update reads its learning rates from device tensors the schedule fills
    lr = (lambda v: torch.tensor(v, device=seqs.device)) if graphed else (lambda v: v)  # noqa: E731
    groups = [{"params": params, "lr": lr(rate)} for params, rate in
              ((gate, cfg.lr), (ab, cfg.lr_ab), (norms, cfg.lr_norm), (quant, cfg.lr_quant)) if params]
    opt = torch.optim.Adam(groups, capturable=True) if graphed else torch.optim.Adam(groups)
    sched = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.steps) if cfg.schedule == "cosine" else None)
    gen = torch.Generator().manual_seed(cfg.seed)
    losses = []
    step_fn = None
    if graphed:
        from .graphed_step import GraphedKLStep

        step_fn = GraphedKLStep(lambda t, ids: kl_logp_q(t, _logits(model, ids)), opt, seqs, cached, cfg.batch_size)
    bar = tqdm(range(cfg.steps), desc="KL calibration", disable=not progress, leave=False)
    was_training = model.training
    model.eval()
    trained = gate + ab + norms
    before = [p.detach().clone() for p in trained]  # small (ECs, norms): restored if the KL blows up
    try:
        with _dense_forward(model, cfg.dense_weights, qparams):
            for step in bar:
                idx = torch.randperm(seqs.shape[0], generator=gen)[: cfg.batch_size]
                if step_fn is not None:  # one CUDA graph replay: forward, backward, Adam
                    loss = step_fn(idx)
                else:
                    b = seqs[idx]
                    if cached is not None:
                        loss = kl_logp_q(cached[idx], _logits(model, b))
                    else:
                        with torch.no_grad():
                            t = _logits(ref, b)
                        loss = kl_fp_q(t, _logits(model, b))
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                if sched is not None:
                    sched.step()
                losses.append(float(loss.detach()))
                bar.set_postfix(kl=f"{losses[-1]:.4f}")
                if not math.isfinite(losses[-1]):
                    raise FloatingPointError(
                        f"calibrate_: the KL is {losses[-1]} at step {step}; the ECs (and norms) were restored to "
                        f"their state before calibration - lower the learning rates (lr={cfg.lr}, lr_ab={cfg.lr_ab}, "
                        f"lr_norm={cfg.lr_norm}, lr_quant={cfg.lr_quant})")
    except KeyboardInterrupt:  # stop cleanly: keep what was trained
        pass
    except FloatingPointError:
        with torch.no_grad():
            for p, b in zip(trained, before):
                p.copy_(b)
        raise
    finally:  # on any other exception the base's scales and zeros stay as they were
        for p, r in zip(others, req):
            p.requires_grad_(r)
        for p in gate + ab:
            p.requires_grad_(False)
        model.train(was_training)
    _write_back(qparams)
    return {"losses": losses, "seconds": time.time() - t0, "steps": len(losses)}


def _write_back(qparams: Sequence[QuantParams]) -> None:
    """Store trained scales and zeros, all or none: a non-finite one leaves the base unchanged."""
    bad = [qp.module.name for qp in qparams if not (bool(torch.isfinite(qp.u).all()) and bool(torch.isfinite(qp.v).all()))]
    if bad:
        raise FloatingPointError(f"calibrate_: train_quant made non-finite scales or zeros in {len(bad)} module(s) "
                                 f"({', '.join(bad[:3])}); the base quantization was left unchanged (lower lr_quant)")
    for qp in qparams:
        qp.write_back()
