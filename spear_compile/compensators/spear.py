"""The SPEAR pipeline: where ECs go, how they start, and how they are trained.

``fit_spear_(ref, q, seqs, budget_bytes)`` runs, on the quantized copy ``q`` of ``ref``:

1. damage   per-module ``1 - CKA`` with only that module quantized (``selection.module_damage``)
            on the first ``damage_seqs`` self-sampled sequences;
2. stats    E[x x^T] of every quantized linear's full-precision input, on all sequences;
3. plan     entropy of the damage -> how many modules; ranks by greedy damage-weighted
            output-error reduction per byte (``selection.plan`` with ``spectra``), or one
            shared rank (``allocation="shared"``);
4. init     QERA-exact ``B A`` (R_xx-whitened SVD of the weight error, the closed-form
            optimum of the expected output error), gate pass-through;
5. train    KL(p_fp || p_q+EC) on the same self-sampled sequences (``calibrate.calibrate_``).

It reads no dataset: ``seqs`` are sampled from ``ref`` by ``calibrate.sample_sequences``.
Timings of each phase are returned so the 10-minute CPU budget can be checked.
"""
from __future__ import annotations

import dataclasses
import json
import time

import torch
from torch import nn
from tqdm.auto import tqdm

from ..config import ECConfig, check_gate_bias, check_types, default_device
from ..quant.linear import QuantLinear
from .calibrate import CalibConfig, calibrate_
from .ec import ErrorCompensator
from .registry import attach_
from .selection import Plan, module_damage, plan, shapes_of
from .static import output_error_spectrum
from ..quant.stats import collect_input_stats

_ALLOCATIONS = ("greedy", "shared")
_SELECTS = ("entropy", "all")


@dataclasses.dataclass(frozen=True)
class SpearConfig:
    """damage_seqs: sequences (of the calibration set) the CKA damage is measured on.
    allocation: "greedy" per-module ranks from output-error spectra, or "shared" rank.
    select: "entropy" (the n_eff = exp(H) best modules) or "all" (every damaged module is offered
    to the allocation). max_rank / min_rank: cap and floor (greedy only) of a module's rank.
    gate_hidden: width of each EC's gate MLP. gate_init_bias: the gate's initial pre-activation
    (``ECConfig.gate_init_bias``; the EC starts as a pass-through whatever it is, but sigmoid's
    slope there, 0.0025 at 6.0, scales how far the gate can move from it). calib: the KL training."""

    damage_seqs: int = 2
    allocation: str = "greedy"
    select: str = "entropy"
    max_rank: int = 256
    min_rank: int = 0
    gate_hidden: int = 8
    gate_init_bias: float = 6.0
    stats_batch: int = 4
    calib: CalibConfig = CalibConfig()

    def __post_init__(self) -> None:
        check_types(self)
        if not isinstance(self.calib, CalibConfig):
            raise ValueError(f"SpearConfig.calib={self.calib!r}: expected a CalibConfig (SpearConfig.replace(steps=...) "
                             f"sets its fields)")
        check_gate_bias("SpearConfig", self.gate_init_bias)
        if self.min_rank > self.max_rank:
            raise ValueError(f"SpearConfig.min_rank={self.min_rank} exceeds max_rank={self.max_rank}")
        if self.allocation not in _ALLOCATIONS:
            raise ValueError(f"SpearConfig.allocation={self.allocation!r}: expected one of {_ALLOCATIONS}")
        if self.select not in _SELECTS:
            raise ValueError(f"SpearConfig.select={self.select!r}: expected one of {_SELECTS}")
        if self.damage_seqs < 1 or self.stats_batch < 1 or self.gate_hidden < 1 or self.max_rank < 1:
            raise ValueError(f"SpearConfig: damage_seqs, stats_batch, gate_hidden and max_rank must be >= 1 (got {self})")
        if self.min_rank < 0 or (self.min_rank and self.allocation != "greedy"):
            raise ValueError(f"SpearConfig.min_rank={self.min_rank}: must be >= 0, and only the greedy allocation has one")

    def replace(self, **overrides) -> "SpearConfig":
        """A copy with ``overrides``; keys of ``CalibConfig`` go to ``calib`` (so a sweep or a CLI
        can say ``steps=240`` or ``select="all"``). Unknown keys raise, naming them."""
        own = {f.name for f in dataclasses.fields(self)} - {"calib"}
        cal = {f.name for f in dataclasses.fields(self.calib)}
        unknown = sorted(set(overrides) - own - cal)
        if unknown:
            raise ValueError(f"SpearConfig.replace: unknown field(s) {unknown}; SpearConfig has {sorted(own)}, "
                             f"CalibConfig has {sorted(cal)}")
        calib = dataclasses.replace(self.calib, **{k: v for k, v in overrides.items() if k in cal})
        return dataclasses.replace(self, calib=calib, **{k: v for k, v in overrides.items() if k in own})


#: Settings for a GPU, chosen by ``benchmarks/spear_sweep.py`` on development plays (Lear, The Tempest,
#: Twelfth Night; never the evaluation plays): 192 self-sampled sequences of 1024 tokens, every damaged
#: module offered to the greedy allocation, 480 cosine-decayed steps with A/B at lr 1e-3, each step one
#: CUDA graph replay (``CalibConfig.cuda_graph``; 2.3x faster per step than eager on SmolLM2's shapes).
#: More self-sampled tokens paid (dev plays: 96 x 512 78.5 %, 160 x 512 79.1 %, 96 x 1024 80.0 %,
#: 192 x 1024 80.4 %), longer sequences at equal tokens did not (64 x 1024 78.4 %, 32 x 2048 77.6 %).
#: 192 x 1024 became affordable when the static-cache sampler (``sampler="static"``, grouped-query
#: attention) drew it in 21 s on an H200 (``generate``: 83.7 s for half as many).
#: Sweeps: ``benchmarks/results/quality/2026-11-30_h200_sweep_calib_tokens/`` (earlier:
#: ``benchmarks/results/spear_sweep/``). Selection + calibration on one H200: 126 s at
#: 1 % (its ``eval0/``); on a 2-core CPU it would take hours. The teacher cache (19 GB of
#: fp16 log-probs here) is capped by the GPU's free memory (``calibrate.teacher_cache_fits``).
GPU_PRESET = SpearConfig(select="all", calib=CalibConfig(n_seqs=192, seq_len=1024, steps=480, lr_ab=1e-3,
                                                         schedule="cosine", sample_batch=64,
                                                         teacher_cache_bytes=48_000_000_000, cuda_graph=True,
                                                         sampler="static"))
#: Settings for a CPU: the 10-minute budget on 2 cores. The sweep's gain that costs nothing (A/B at
#: lr 1e-3, cosine-decayed) on the original data (32 x 256 tokens), with 64 steps instead of 80:
#: 565 s on 2 cores, 70.3 % of the gap at 1 % (``benchmarks/results/quality/2026-11-29_cpu_preset/``).
CPU_PRESET = SpearConfig(calib=CalibConfig(steps=64, lr_ab=1e-3, schedule="cosine"))


def preset(device=None, name: str = "auto") -> SpearConfig:
    """``name`` "gpu" / "cpu": that preset; "auto": ``GPU_PRESET`` on a CUDA ``device``, else
    ``CPU_PRESET`` (``device`` None: CUDA when present)."""
    if name not in ("auto", "gpu", "cpu"):
        raise ValueError(f"preset: name={name!r}; expected 'auto', 'gpu' or 'cpu'")
    if name == "auto":
        dev = default_device(device)
        name = "gpu" if dev.type == "cuda" else "cpu"
    return GPU_PRESET if name == "gpu" else CPU_PRESET


def parse_overrides(spec: str) -> dict:
    """``"select=all,steps=240,lr_ab=1e-3"`` -> ``{"select": "all", "steps": 240, "lr_ab": 0.001}``
    (values parsed as JSON, else kept as strings), for ``SpearConfig.replace``."""
    types = {f.name: f.type for cls in (SpearConfig, CalibConfig) for f in dataclasses.fields(cls)}
    out = {}
    for item in filter(None, (i.strip() for i in spec.split(","))):
        if "=" not in item:
            raise ValueError(f"SPEAR setting {item!r} is not key=value")
        k, v = (t.strip() for t in item.split("=", 1))
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
        if types.get(k) == "float" and isinstance(out[k], str):  # ".001", "1.e-3": floats JSON does not parse
            try:
                out[k] = float(v)
            except ValueError:
                raise ValueError(f"SPEAR setting {k}={v!r}: expected a number") from None
    return out


def fit_spear_(ref: nn.Module, q: nn.Module, seqs: torch.Tensor, budget_bytes: int,
               cfg: SpearConfig = SpearConfig(), progress: bool = True) -> tuple[dict[str, ErrorCompensator], dict]:
    """Select, initialise, attach and train ECs on ``q`` in place; returns (ECs, log)."""
    if seqs.dim() != 2 or seqs.shape[0] < 1:
        raise ValueError(f"fit_spear_: seqs must be [n, T] token ids, got shape {tuple(seqs.shape)}")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"fit_spear_: budget_bytes={budget_bytes!r}: expected an integer >= 0")
    if seqs.is_floating_point() or seqs.is_complex():
        raise ValueError(f"fit_spear_: seqs must be integer token ids, got {seqs.dtype}")
    vocab = getattr(getattr(ref, "config", None), "vocab_size", None)
    if vocab is not None and seqs.numel() and (int(seqs.min()) < 0 or int(seqs.max()) >= vocab):
        raise ValueError(f"fit_spear_: token ids span [{int(seqs.min())}, {int(seqs.max())}], outside the "
                         f"vocabulary [0, {vocab})")
    qmods = {n: m for n, m in q.named_modules() if isinstance(m, QuantLinear)}
    names = list(qmods)
    if not names:
        raise ValueError("fit_spear_: the model has no quantized linears (run quantize_ first)")
    ref_mods = dict(ref.named_modules())
    swapped = [n for n in names if isinstance(ref_mods.get(n), QuantLinear)]
    if swapped:
        raise ValueError(f"fit_spear_: ref must be the full-precision model, but {swapped[0]!r} is a QuantLinear in "
                         f"ref (arguments swapped, or ref quantized?)")
    attached = [n for n, m in qmods.items() if m.ec is not None]
    if attached:
        raise ValueError(f"fit_spear_: {len(attached)} module(s) of the model already carry ECs (e.g. {attached[0]!r}); "
                         f"a second fit would stack a new plan over the old one's bytes - detach_ first")
    log: dict = {"seconds": {}}
    t = time.time()
    damage = module_damage(ref, q, [seqs[:cfg.damage_seqs]], names=names, progress=progress)
    log["seconds"]["damage"] = time.time() - t

    t = time.time()
    batches = [seqs[i:i + cfg.stats_batch] for i in range(0, seqs.shape[0], cfg.stats_batch)]
    stats = collect_input_stats(ref, batches, names=names, full=True, module_type=nn.Linear)
    ref_mods, q_mods = dict(ref.named_modules()), dict(q.named_modules())
    errs = {n: ref_mods[n].weight.detach().float() - q_mods[n].dequantize(torch.float32) for n in names}
    spectra = None
    if cfg.allocation == "greedy":
        spectra = {n: output_error_spectrum(errs[n], stats[n].rxx)
                   for n in tqdm(names, desc="error spectra", disable=not progress, leave=False)}
    log["seconds"]["stats"] = time.time() - t

    p: Plan = plan(damage, shapes_of(q, names), budget_bytes, gate_hidden=cfg.gate_hidden, spectra=spectra,
                   select=cfg.select, max_rank=cfg.max_rank, min_rank=cfg.min_rank)
    t = time.time()
    ecs = {}
    for m in p.modules:
        ec_cfg = ECConfig(rank=m.rank, gate_hidden=cfg.gate_hidden, gate_init_bias=cfg.gate_init_bias)
        ec = ErrorCompensator.from_weight_error(ref_mods[m.name].weight, q_mods[m.name].dequantize(torch.float32),
                                                ec_cfg, rxx=stats[m.name].rxx)
        ecs[m.name] = ec.to(q_mods[m.name].scales.device)
    del stats, errs
    attach_(q, ecs)
    log["seconds"]["init"] = time.time() - t
    log["plan"] = json.loads(p.to_json())
    if ecs or cfg.calib.train_quant:
        train = calibrate_(q, ref, seqs, cfg.calib, progress=progress)
        log["losses"], log["seconds"]["calibrate"] = train["losses"], train["seconds"]
    log["seconds"]["total"] = sum(log["seconds"].values())
    return ecs, log
