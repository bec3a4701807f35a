"""Serving under an inter-token-latency SLO: SPEAR's dynamic chunks against static chunks, on the real engine.

Every run goes through ``spear_compile.runtime.Engine`` (transformers' continuous batching with our
scheduler, the model compiled with ``backend="spear"``). Per EC density one engine is started and kept
across the policies, as a server would be: its forward compiled once, and before the timed runs each
policy serves ``--warmup-requests`` unrecorded requests (another seed), so that the timed runs find
the CUDA graphs of their step shapes captured (each new (tokens, KV pages) shape costs a capture of
the whole forward: 0.1-0.3 s for a 32-layer 7B on an H100; the rows count those left in the timed
run, ``graph_captures``). Poisson arrivals at ``--rates`` requests per
second, prompt and output lengths drawn from the stated distributions (seeded, the same workload for
every policy), ECs on ``--densities`` percent of the linears (random EC weights of rank ``--rank``:
the latency does not depend on their values). Policies: ``dynamic`` (``scheduler_for(model, slo)``:
the largest prefill chunk whose predicted step time keeps the ITL within the SLO) at each SLO (label
``dynamic``) and, with ``--correction on`` (or ``off on``), planned against the latency model corrected
online by the engine's measured steps (``runtime.online``; label ``dynamic_online``), each starting a request
only where the decode-only step it joins is predicted within the SLO with ``--decode-headroom on`` (label
suffix ``_headroom``; ``off``, the default, runs without that rule; ``on off`` both), and
static chunks (``StaticChunkPolicy``, Sarathi / vLLM's fixed token budget) of ``--chunks`` tokens,
each run once and scored against every SLO.

Per (policy, chunk or "dynamic", ec_density, slo_ms, rate) a row holds p50 / p99 ITL, SLO attainment
(the share of inter-token gaps within the SLO), mean / p99 TTFT (first token - arrival), throughput
(generated tokens / makespan), the policy's planning cost per step (p99 microseconds, and its share
of the mean step), and the latency model's error on that run's steps: each engine step's wall time (the
gap between two successive calls of the policy) against ``predict_step_ms`` for what it ran (median
and p90 of the absolute relative error; ``steady_*``: the same over the steps that captured or compiled
no graph, ``first_use.FirstUseMarker``; ``steady_online_*``: the same model corrected online,
``online.replay`` over the run's steps in order, whatever the policy). The dynamic policy's latency model is the op tables with the
step overhead calibrated on the engine's own steps (``runtime.calibrate``, as ``Engine(slo_itl_ms=...)``
does when it starts); rows also give the error of the op tables alone (``prediction_op_tables_only``),
and the record the calibration's held-out error per density. Written to ``OUT/serving_<device>.json`` with the GPU, versions, date and commit at
the top, ``OUT/serving_<device>.svg`` (p99 ITL and mean TTFT per policy and density), and
``OUT/steps_<device>.json``: every calibration step and every served step (decode contexts, prefill pieces,
measured ms, whether it captured or compiled a graph, the online offset the policy planned with) with the op-table and calibrated models per density,
for offline refits. A row's ``prediction`` is the calibrated model's (the parts' factor held at 1,
``calibrate``'s default); ``prediction_scale_fitted`` fits that factor on the same calibration steps.

Models: ``--model smollm2`` (the real SmolLM2-135M, fp32 on CPU, SLO scaled to its measured decode
step: ``--slo-ms auto`` = 1.5x and 2.5x the median batch-1 decode step through the engine) or
``llama2-7b`` (Llama-2-7B-shaped ``LlamaForCausalLM`` with random bf16 weights on CUDA, SLOs 16 and 22
ms). W4 group 128 (SmolLM2: 64, its hidden size 576 is not a multiple of 128).

    python benchmarks/serving.py --device cpu --out results/serving/cpu         # SmolLM2, a small grid
    python benchmarks/serving.py --device cuda --model llama2-7b --out OUT      # the H200 grid

Over HTTP (``--http URL``): the same workload, sent by the official ``openai`` client as streamed
``/v1/completions`` requests (token-id prompts) to a running ``spear serve`` at its arrival times, scored
into the same fields (the planning cost and the latency model's error need the engine in this process,
so they are absent); with ``--load-clients N --load-seconds S`` also a closed-loop load of N clients for
S seconds (``spear_compile/serve/loadgen.py``): requests admitted / completed / rejected / lost, p50 / p99
TTFT and ITL, ``/health`` during the load. Written to ``OUT/serving_http_<device>.json``.

    spear serve --ec random --num-blocks 8 --block-size 16 --max-queue 2 --slo-itl-ms 3000 &
    python benchmarks/serving.py --http http://127.0.0.1:8000 --device cpu --requests 8 --out OUT \
        --load-clients 14 --load-seconds 20
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time

import torch

try:
    from _syspath import unshadow  # run as a script: benchmarks/ is first on sys.path
except ImportError:  # imported as benchmarks.serving
    from benchmarks._syspath import unshadow
unshadow()  # before transformers is imported (benchmarks/kernels.py would shadow the ``kernels`` package)

import spear_compile as spear  # noqa: E402
from spear_compile import QuantConfig, runtime  # noqa: E402
from spear_compile.runtime import Engine, StaticChunkPolicy  # noqa: E402
from spear_compile.runtime.first_use import FirstUseMarker, cuda_graph_count  # noqa: E402
from spear_compile.runtime.calibrate import TRIM  # noqa: E402
from spear_compile.runtime.fit import fit_scaled  # noqa: E402
from spear_compile.runtime.online import replay  # noqa: E402
from spear_compile.runtime.step_gaps import attributed_gaps  # noqa: E402
from spear_compile.serve.loadgen import pct, send_at_arrivals  # noqa: E402

from benchmarks._meta import run_meta  # noqa: E402


# ---------------------------------------------------------------- model and ECs


def build_model(name: str, device: str, layers: int = 32):
    """SmolLM2-135M (real weights) or a Llama-2-7B-shaped model (random weights, ``layers`` decoder layers), W4."""
    if name == "smollm2":
        from spear_compile.models.smollm2 import load_smollm2

        model, _ = load_smollm2(torch.float32)
        group = 64
    elif name == "llama2-7b":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers, num_attention_heads=32,
                          num_key_value_heads=32, vocab_size=32000, max_position_embeddings=8192)
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        group = 128
    else:
        raise SystemExit(f"--model {name!r}: expected smollm2 or llama2-7b")
    model = model.to(device).eval()
    spear.quantize_(model, QuantConfig(group_size=group))
    return model


def set_ec_density(model, percent: int, rank: int, seed: int = 0) -> list:
    """ECs (random, rank ``rank``) on ``percent`` % of the quantized linears, evenly spread; returns their names."""
    spear.detach_(model)
    lins = list(spear.quantized_linears(model).items())
    n = round(len(lins) * percent / 100)
    if n == 0:
        return []
    pick = [lins[int(i * len(lins) / n)] for i in range(n)]
    g = torch.Generator().manual_seed(seed)
    ecs = {}
    for fqn, mod in pick:
        ec = spear.ErrorCompensator(mod.in_features, mod.out_features, spear.ECConfig(rank=rank))
        with torch.no_grad():
            for p in ec.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        ecs[fqn] = ec.to(device=mod.qweight.device, dtype=mod.scales.dtype)
    spear.attach_(model, ecs)
    return [f for f, _ in pick]


# ---------------------------------------------------------------- workload


def workload(n: int, rate: float, prompt: tuple, output: tuple, vocab: int, seed: int) -> list:
    """``n`` requests: (arrival s, prompt ids, max_new_tokens). Prompt lengths lognormal around ``prompt[0]``
    clipped to ``prompt[1:]``; outputs uniform in ``output``; inter-arrivals exponential of mean 1/rate."""
    g = torch.Generator().manual_seed(seed)
    t, out = 0.0, []
    mean, lo, hi = prompt
    for _ in range(n):
        t += float(torch.empty(1).exponential_(rate, generator=g))
        p = int(min(hi, max(lo, round(mean * float(torch.empty(1).log_normal_(0.0, 0.5, generator=g))))))
        o = int(torch.randint(output[0], output[1] + 1, (1,), generator=g))
        out.append((t, torch.randint(10, vocab - 10, (p,), generator=g).tolist(), o))
    return out


class GcClock:
    """Microseconds the interpreter has spent in its cyclic garbage collector since ``install()``
    (``gc.callbacks``): a collection that starts inside a plan is paid by the plan, though the objects it
    walks were made by the rest of the engine."""

    def __init__(self):
        self.us, self._t0, self.pauses = 0.0, None, []  # pauses: (generation, us) of every collection

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter_ns()
        elif self._t0 is not None:
            us = (time.perf_counter_ns() - self._t0) / 1e3
            self.us += us
            self.pauses.append((info.get("generation"), us))
            self._t0 = None

    def summary(self, since: int) -> dict:
        """Collections after ``pauses[since]``: how many of each generation, their total and longest pause."""
        ps = self.pauses[since:]
        return {"gc_collections": [sum(g == i for g, _ in ps) for i in range(3)],
                "gc_total_ms": sum(u for _, u in ps) / 1e3, "gc_max_pause_ms": max((u for _, u in ps), default=0.0) / 1e3}

    def install(self) -> "GcClock":
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self


GC_CLOCK = GcClock()


class TimedPolicy:
    """A policy that records its planning time, when it was asked (one call per engine step: the gap to
    the next call is that step's wall time) and what it planned (decode contexts, prefill pieces).
    ``us``: wall time of each plan (it includes waits for the GIL while the engine's other threads and the
    benchmark's streaming threads run); ``cpu_us``: the generation thread's own CPU time in it (what
    planning costs, without those waits); ``gc_us``: the part of ``us`` the garbage collector ran
    (``GcClock``)."""

    def __init__(self, inner, marker=None):
        self.inner, self.marker, self.us, self.cpu_us, self.gc_us, self.steps = inner, marker, [], [], [], []
        GC_CLOCK.install()

    def plan(self, state):
        mark = self.marker() if self.marker is not None else None  # before the clock: not planning time
        corr = getattr(self.inner, "correction", None)
        offset = corr.offset_ms if corr is not None else None
        g0 = GC_CLOCK.us
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        p = self.inner.plan(state)
        self.us.append((time.perf_counter_ns() - t0) / 1e3)
        self.cpu_us.append((time.thread_time_ns() - c0) / 1e3)
        self.gc_us.append(GC_CLOCK.us - g0)
        ctx = {d.request_id: d.context_len for d in state.decodes}
        done = {w.request_id: w.prefilled for w in state.waiting}
        self.steps.append((t0 / 1e6, tuple(ctx[r] for r in p.decode_ids),
                           tuple((c, done.get(r, 0)) for r, c in p.prefill), mark, offset))
        return p

    def idle(self):
        """The engine found no request left (``PolicyScheduler.has_pending_requests``): the last step's gap
        ends here, and the wait that follows is recorded as a call that planned nothing (no step's time)."""
        mark = self.marker() if self.marker is not None else None
        self.steps.append((time.perf_counter_ns() / 1e6, (), (), mark, None))


def measured_steps(steps: list, lag: int = 0):
    """``(decode contexts, prefill pieces, measured ms, first use, online offset)`` for each of
    ``TimedPolicy.steps`` that ran work and is timed by a gap between two calls of a busy engine
    (``runtime.step_gaps``: the gap after its call, or with asynchronous batching, ``lag`` 1, the one after
    the next call; an idle engine waits between calls, which is not step time); first use: a graph was
    captured or compiled in that gap; online offset: the policy's online correction when it planned the step
    (None without one)."""
    for p, g in attributed_gaps([bool(x[1] or x[2]) for x in steps], lag):
        _, dec, pre, _, off = steps[p]
        (t, _, _, mark, _), (t2, _, _, mark2, _) = steps[g], steps[g + 1]
        yield dec, pre, t2 - t, mark2 != mark, off


def prediction_error(steps: list, latency_model, lag: int = 0) -> dict:
    """|predicted - measured| / measured over ``measured_steps``; and the same over the steps that captured or
    compiled no graph (``steady_*``: what the latency model describes)."""
    errs, steady, pts, rows = [], [], [], []
    for dec, pre, measured, first_use, _ in measured_steps(steps, lag):
        pred = latency_model.predict_step_ms(dec, pre)
        errs.append(abs(pred - measured) / measured)
        if not first_use:
            steady.append(errs[-1])
        rows.append((pred, measured, first_use, bool(pre)))
        pts.append((len(dec), sum(c for c, _ in pre), round(pred, 3), round(measured, 3), first_use))
    if not errs:
        return {}
    # the same model corrected online (runtime.online), replayed over the run's steps in order: its
    # accuracy with the median of 8 steps, and how often a steady step with prefill ran over its prediction
    # plus the planning offset (the default upper quantile), what puts a step planned at the budget over it
    online = [abs(c - m) / m for c, (_, m, first, _) in zip(replay(rows, window=8, quantile=0.5), rows) if not first]
    over = [m > c for c, (_, m, first, pre) in zip(replay(rows), rows) if not first and pre]
    return {"median_abs_err": pct(errs, 50), "p90_abs_err": pct(errs, 90), "steps": len(errs),
            "steady_median_abs_err": pct(steady, 50), "steady_p90_abs_err": pct(steady, 90),
            "steady_online_median_abs_err": pct(online, 50), "steady_online_p90_abs_err": pct(online, 90),
            "steady_prefill_over_planning_offset": sum(over) / len(over) if over else None,
            "steady_steps": len(steady), "sample": pts[:: max(1, len(pts) // 40)]}


def sample_json(s) -> list:
    """A ``StepSample`` as ``[decode contexts, prefill (tokens, prefilled) pieces, measured ms]``."""
    return [list(s.decode_contexts), [list(p) for p in s.prefill_chunks], round(s.measured_ms, 4)]


def served_json(steps: list, lag: int = 0) -> list:
    """``measured_steps`` as ``[decode contexts, prefill pieces, measured ms, first use, online offset]``
    lists."""
    return [[list(dec), [list(p) for p in pre], round(ms, 4), first_use, None if off is None else round(off, 4)]
            for dec, pre, ms, first_use, off in measured_steps(steps, lag)]


def serve(eng, policy, reqs: list, timeout_s: float) -> dict:
    """Serve ``reqs`` on the started engine ``eng`` with ``policy``; token arrival times per request. Requests
    still running at the timeout are cancelled, so the next run starts on an idle engine."""
    timed = TimedPolicy(policy, FirstUseMarker(eng))
    gc0 = len(GC_CLOCK.pauses)
    if eng.correction is not None:
        eng.correction.reset()  # each run starts without the last run's history
    eng.set_policy(timed)
    graphs0 = cuda_graph_count(eng)
    times = [[] for _ in reqs]
    rids = [None] * len(reqs)
    t0 = time.perf_counter()
    errors = []

    def consume(i, rid):
        try:
            for _ in eng.stream(rid):
                times[i].append(time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001  (recorded and reported in the row)
            errors.append(f"{rid}: {e}")

    def start(i, req):  # at the request's arrival: add it, and stream it on a thread of its own
        rid = rids[i] = eng.add_request(req[1], max_new_tokens=req[2], eos_token_id=-1)
        return lambda: consume(i, rid)

    makespan = send_at_arrivals(reqs, t0, start, timeout_s)
    cut = sum(eng.cancel(r) for r in rids if r is not None)
    return {"times": times, "makespan": makespan, "sched_us": timed.us, "sched_cpu_us": timed.cpu_us,
            "sched_gc_us": timed.gc_us, "steps": timed.steps, "errors": errors + ([f"{cut} requests cut at the timeout"] if cut else []),
            "graph_captures": cuda_graph_count(eng) - graphs0, "lag": eng.step_lag, "gc": GC_CLOCK.summary(gc0)}


def score(res: dict, reqs: list, slo_ms: float, latency_model=None) -> dict:
    itl, ttft = [], []
    for (arr, _, _), ts in zip(reqs, res["times"]):
        if ts:
            ttft.append((ts[0] - arr) * 1e3)
            itl += [(b - a) * 1e3 for a, b in zip(ts, ts[1:])]
    gen = sum(len(ts) for ts in res["times"])
    step_ms = res["makespan"] * 1e3 / max(1, len(res["sched_us"]))
    us99 = pct(res["sched_us"], 99)
    return {"p50_itl_ms": pct(itl, 50), "p99_itl_ms": pct(itl, 99),
            "slo_attainment": (sum(x <= slo_ms for x in itl) / len(itl)) if itl else None,
            "mean_ttft_ms": statistics.fmean(ttft) if ttft else None, "p99_ttft_ms": pct(ttft, 99),
            "throughput_tok_s": gen / res["makespan"], "sched_us_p50": pct(res["sched_us"], 50), "sched_us_p99": us99,
            "sched_cpu_us_p50": pct(res.get("sched_cpu_us", []), 50), "sched_cpu_us_p99": pct(res.get("sched_cpu_us", []), 99),
            "sched_share_of_step": (us99 / 1e3 / step_ms) if us99 is not None else None,
            **gc_share(res.get("sched_us", []), res.get("sched_gc_us", [])), **res.get("gc", {}),
            "steps": len(res["sched_us"]), "completed": sum(1 for (_, _, m), ts in zip(reqs, res["times"])
                                                              if len(ts) >= m),
            "requests": len(reqs), "generated_tokens": gen, "errors": res["errors"][:5],
            "graph_captures": res.get("graph_captures"),
            "prediction": prediction_error(res["steps"], latency_model, res["lag"])
            if latency_model is not None else {}}


def gc_share(us: list, gc_us: list) -> dict:
    """How much of the planning cost the garbage collector was: ``sched_gc_plans`` (plans a collection ran
    in), ``sched_us_p99_without_gc`` (the p99 of the plan time less its collections)."""
    if not us or len(gc_us) != len(us):
        return {}
    return {"sched_gc_plans": sum(g > 0 for g in gc_us),
            "sched_us_p99_without_gc": pct([u - g for u, g in zip(us, gc_us)], 99)}


def decode_step_ms(eng) -> float:
    """Median gap between tokens of one request alone (batch-1 decode through the engine)."""
    res = serve(eng, StaticChunkPolicy(512), [(0.0, list(range(10, 42)), 48)], 600)
    ts = res["times"][0][8:]
    return statistics.median([(b - a) * 1e3 for a, b in zip(ts, ts[1:])])


# ---------------------------------------------------------------- plot


def svg(rows: list, path: str) -> None:
    """Two panels of bars: p99 ITL (with the SLO lines) and mean TTFT, per (density, policy)."""
    keys = sorted({(r["ec_density"], r["policy_label"]) for r in rows}, key=lambda k: (k[0], k[1]))
    pick = {}
    for r in rows:  # one SLO per bar: the tightest the row was scored against
        k = (r["ec_density"], r["policy_label"])
        if k not in pick or r["slo_ms"] < pick[k]["slo_ms"]:
            pick[k] = r
    W, H, pad = max(600, 28 * len(keys) + 120), 260, 60
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{2 * H + 40}" font-family="sans-serif" '
           f'font-size="10">']
    for panel, (field, title) in enumerate((("p99_itl_ms", "p99 ITL (ms)"), ("mean_ttft_ms", "mean TTFT (ms)"))):
        y0 = panel * (H + 20) + 20
        vals = [pick[k].get(field) or 0 for k in keys]
        top = max(vals + [1e-9]) * 1.1
        out.append(f'<text x="{pad}" y="{y0 - 5}" font-size="12">{title}</text>')
        for i, (k, v) in enumerate(zip(keys, vals)):
            x = pad + i * 28
            h = (H - 60) * v / top
            color = "#1f77b4" if k[1] == "dynamic" else "#9ecae1" if k[1].startswith("dynamic") else "#aaaaaa"
            out.append(f'<rect x="{x}" y="{y0 + H - 60 - h:.1f}" width="20" height="{h:.1f}" fill="{color}"/>')
            out.append(f'<text x="{x}" y="{y0 + H - 45}" transform="rotate(60 {x},{y0 + H - 45})">'
                       f'{k[0]}% {k[1]}</text>')
        if field == "p99_itl_ms":
            for slo in sorted({r["slo_ms"] for r in rows}):
                yy = y0 + H - 60 - (H - 60) * slo / top
                out.append(f'<line x1="{pad}" x2="{W - 10}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="red" '
                           f'stroke-dasharray="4"/><text x="{W - 60}" y="{yy - 2:.1f}">SLO {slo:g}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))


# ---------------------------------------------------------------- main


def meta(args) -> dict:
    """The record's meta block (``benchmarks/_meta.py``), with the device, transformers' version and the model."""
    import transformers

    return run_meta(args, {"transformers": transformers.__version__, "spear_compile": spear.__version__},
                    head={"device": args.device}, tail={"model": args.model}, cpu=platform.processor() or "cpu")


def main_http(args) -> None:
    """The workload and the closed-loop load against the server at ``args.http`` (module docstring)."""
    import httpx

    from spear_compile.serve import loadgen

    base = args.http.rstrip("/")
    card = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]
    slos = [float(s) for s in (args.slo_ms or ["1000"]) if s != "auto"]
    record = {"meta": {**meta(args), "server": card}, "rows": [], "load": None}
    record["meta"].update(gpu=args.server_device, server_command=args.server_command,
                          load_average_at_start=list(os.getloadavg()))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"serving_http_{args.server_device}.json")
    for rate in args.rates:
        reqs = workload(args.requests, rate, args.prompt, args.output, args.vocab, args.seed)
        print(f"   rate {rate}/s: {len(reqs)} requests over HTTP", flush=True)
        res = loadgen.open_loop(base, card["id"], reqs, timeout_s=args.timeout)
        res.update(sched_us=[], sched_cpu_us=[], sched_gc_us=[], steps=[], errors=[f"{o.status}: {o.error}" for o in res["outcomes"] if o.status != "ok"])
        outcomes = res.pop("outcomes")
        for slo in slos:
            row = {"policy": "server", "chunk": None, "policy_label": "http", "slo_ms": slo, "rate": rate,
                   **score(res, reqs, slo), "rejected": sum(o.status == "rejected" for o in outcomes)}
            record["rows"].append(row)
            print("     ", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                            if k in ("slo_ms", "p99_itl_ms", "slo_attainment", "mean_ttft_ms", "p99_ttft_ms",
                                     "throughput_tok_s", "completed", "rejected")}, flush=True)
    if args.load_clients:
        prompts = [p for _, p, _ in workload(8, 1.0, (12, 4, 24), (1, 1), args.vocab, args.seed)]
        print(f"   closed loop: {args.load_clients} clients for {args.load_seconds} s", flush=True)
        alone = {i: loadgen.stream_completion(loadgen.client_for(base), card["id"], p, args.load_tokens)
                 for i, p in enumerate(prompts[:2])}
        expected = {i: o.text for i, o in alone.items() if o.status == "ok"}
        load = loadgen.closed_loop(base, card["id"], prompts[:2], args.load_clients, args.load_seconds,
                                   args.load_tokens, expected=expected)
        record["load"] = load
        print("     ", {k: (round(v, 1) if isinstance(v, float) else v) for k, v in load.items() if k != "examples"})
    record["meta"]["load_average_at_end"] = list(os.getloadavg())
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {path}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", default=None, help="smollm2 (CPU default) or llama2-7b (CUDA default)")
    ap.add_argument("--densities", type=int, nargs="+", default=None, help="EC density, percent of the linears")
    ap.add_argument("--chunks", type=int, nargs="+", default=[256, 512, 1024, 2048], help="static chunk sizes")
    ap.add_argument("--slo-ms", nargs="+", default=None, help="ITL SLOs in ms, or 'auto' (CPU: 1.5x, 2.5x decode step)")
    ap.add_argument("--rates", type=float, nargs="+", default=None, help="arrival rates, requests per second")
    ap.add_argument("--requests", type=int, default=None, help="requests per run")
    ap.add_argument("--prompt", type=int, nargs=3, default=None, metavar=("MEAN", "MIN", "MAX"))
    ap.add_argument("--output", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    ap.add_argument("--rank", type=int, default=64, help="EC rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (default: transformers sizes it)")
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run before its stragglers are cut")
    ap.add_argument("--warmup-requests", type=int, default=None,
                    help="per density and policy, requests served unrecorded first (another seed, the highest rate), "
                         "so the timed runs find the CUDA graphs of their shapes captured (default: 24 on CUDA, 0 on CPU)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="compile the engine's forward with backend='spear' (--no-compile: the spear ops run eagerly)")
    ap.add_argument("--attention", choices=("transformers", "varlen"), default="transformers",
                    help="the engine's attention: transformers' choice (paged|sdpa without flash-attn) or "
                         "runtime.attention's varlen kernel (Engine(attention='varlen'))")
    ap.add_argument("--kv-padding", type=int, default=None,
                    help="KV-read padding in tokens (cb_config kv_padding_interval_size; default: the engine's)")
    ap.add_argument("--q-padding", type=int, default=None,
                    help="token padding of a step (cb_config q_padding_interval_size; default: transformers' 64): "
                         "smaller pads small decode batches less (a smaller M for the W4 GEMMs) at the price of "
                         "more CUDA-graph shapes")
    ap.add_argument("--correction", nargs="+", choices=("on", "off"), default=["on"],
                    help="dynamic runs with the engine's online correction of the latency model (on, the "
                         "engine's default, label 'dynamic_online'), without it (off, 'dynamic'), or both, "
                         "each its own run")
    ap.add_argument("--decode-headroom", nargs="+", choices=("on", "off"), default=["off"],
                    help="dynamic runs whose policy starts a request only where the decode-only step it joins is "
                         "predicted within the SLO (on: SloChunkPolicy(decode_headroom=True), label suffix "
                         "'_headroom'), without that rule (off, the policy's default), or both")
    ap.add_argument("--async-batching", nargs="+", choices=("on", "off"), default=["off"],
                    help="engines without / with transformers' asynchronous batching (Engine(async_batching=True); "
                         "CUDA, varlen attention); 'off on' runs both, one engine each")
    ap.add_argument("--split-kv", action="store_true",
                    help="the engine's varlen attention hands decodes to the split-KV kernel (SPEAR_SPLIT_KV=1)")
    ap.add_argument("--no-static", action="store_true",
                    help="serve only the dynamic policies (--chunks still sets the step's token budget)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--http", default=None, metavar="URL", help="drive a running spear serve at URL over HTTP")
    ap.add_argument("--server-device", default="cpu", help="--http: what the server runs on, for the record")
    ap.add_argument("--server-command", default=None, help="--http: how the server was started, for the record")
    ap.add_argument("--vocab", type=int, default=49152, help="--http: token ids of the prompts are below this")
    ap.add_argument("--load-clients", type=int, default=0, help="--http: closed-loop clients (0: no load run)")
    ap.add_argument("--load-seconds", type=float, default=20.0, help="--http: how long the closed loop runs")
    ap.add_argument("--load-tokens", type=int, default=4, help="--http: max_tokens of the closed loop's requests")
    args = ap.parse_args(argv)
    if args.http:
        args.rates = args.rates or [0.25]
        args.requests = args.requests or 8
        args.prompt = tuple(args.prompt or (48, 16, 96))
        args.output = tuple(args.output or (8, 16))
        return main_http(args)
    if args.split_kv:
        os.environ["SPEAR_SPLIT_KV"] = "1"  # read at each attention call (runtime.attention.split_kv_available)
    gpu = args.device == "cuda"
    args.model = args.model or ("llama2-7b" if gpu else "smollm2")
    args.densities = args.densities if args.densities is not None else ([0, 10, 25, 50, 100] if gpu else [0, 25, 100])
    args.rates = args.rates or ([2.0, 4.0] if gpu else [0.25])
    args.requests = args.requests or (48 if gpu else 10)
    args.warmup_requests = args.warmup_requests if args.warmup_requests is not None else (24 if gpu else 0)
    args.prompt = tuple(args.prompt or ((1024, 256, 4096) if gpu else (160, 32, 512)))
    args.output = tuple(args.output or ((32, 128) if gpu else (8, 24)))
    os.makedirs(args.out, exist_ok=True)
    name = torch.cuda.get_device_name() if gpu else ""
    tag = next((t.lower() for t in ("H200", "H100", "A100") if t in name), args.device)
    path = os.path.join(args.out, f"serving_{tag}.json")

    model = build_model(args.model, args.device)
    vocab = model.config.vocab_size
    engine_kw = dict(model=model, compile=args.compile, block_size=args.block_size, num_blocks=args.num_blocks,
                     max_batch_tokens=max(args.chunks) + 256, log=print,
                     attention=None if args.attention == "transformers" else args.attention,
                     cb_config={k: v for k, v in (("kv_padding_interval_size", args.kv_padding),
                                                  ("q_padding_interval_size", args.q_padding)) if v is not None} or None,
                     online_correction="on" in args.correction)
    engines = [(d, a == "on") for d in args.densities for a in ("off", "on") if a in args.async_batching]
    record = {"meta": meta(args), "rows": [], "latency_model": {}}
    # every calibration and served step, for offline refits (serving_refit.py)
    steps_path = os.path.join(args.out, f"steps_{tag}.json")
    steps_out = {"meta": record["meta"], "calibration": {}, "served": {}}
    for density, asy in engines:
        names = set_ec_density(model, density, args.rank, args.seed)
        print(f"== EC density {density}%: {len(names)} linears carry an EC of rank {args.rank}"
              f"{'; asynchronous batching' if asy else ''}", flush=True)
        torch._dynamo.reset()  # the ECs change the graphs: compile them afresh (and forget the old records)
        # one engine per density, warm across the policies: a server runs for long, so the runs are timed
        # on an engine that has compiled its forward and captured the CUDA graphs of its shapes
        eng = Engine(policy=StaticChunkPolicy(max(args.chunks)), async_batching=asy, **engine_kw).start()
        try:
            step = decode_step_ms(eng)
            asked = args.slo_ms or (["16", "22"] if gpu else ["auto"])
            slos = sorted({float(s) for s in asked if s != "auto"}
                          | ({round(1.5 * step, 1), round(2.5 * step, 1)} if "auto" in asked else set()))
            print(f"   batch-1 decode step {step:.2f} ms; SLOs {slos}", flush=True)
            plan = runtime.plan_of(model, eager=not args.compile)
            tables = runtime.scheduler_for(model, slos[0], max_chunk=max(args.chunks), plan=plan, progress=False,
                                           token_pad=eng.token_pad).model
            # the step overhead on the engine's own steps (what Engine(slo_itl_ms=...) does when it starts)
            calibrated, held_out, cal_steps = runtime.calibrate(eng, tables, log=print)
            print(f"   calibration: {len(cal_steps)} steps, held out {held_out}; op tables alone on those steps: "
                  f"{runtime.check(tables, cal_steps)}", flush=True)
            # the calibrated model holds the parts' factor at 1 (calibrate's default); the same calibration
            # steps with the factor fitted are reported on the served steps beside it
            variants = {"prediction_scale_fitted": fit_scaled(tables, cal_steps, trim=TRIM, scale=None)[0]}
            ekey = f"{density}/async" if asy else str(density)  # the engine's key in the records
            steps_out["calibration"][ekey] = [sample_json(s) for s in cal_steps]
            steps_out.setdefault("models", {})[ekey] = {"op_tables": tables.to_dict(),
                                                                "calibrated": calibrated.to_dict()}
            runs = [("static", c, StaticChunkPolicy(c), None) for c in args.chunks if not args.no_static]
            runs += [("dynamic", label + ("_headroom" if head == "on" else ""),
                      runtime.SloChunkPolicy(calibrated, slo, max_chunk=max(args.chunks), min_chunk=32,
                                             correction=eng.correction if on == "on" else None,
                                             decode_headroom=head == "on"), slo)
                     for slo in slos for on, label in (("off", "dynamic"), ("on", "dynamic_online"))
                     if on in args.correction for head in args.decode_headroom]
            if args.warmup_requests:
                warm = workload(args.warmup_requests, max(args.rates), args.prompt, args.output, vocab, args.seed + 1)
                for kind, chunk, pol, own_slo in runs:
                    res = serve(eng, pol, warm, args.timeout)
                    print(f"   warm-up {kind} {chunk} (slo {own_slo}): {len(res['steps'])} steps, "
                          f"{res['graph_captures']} CUDA graphs captured", flush=True)
            for rate in args.rates:
                reqs = workload(args.requests, rate, args.prompt, args.output, vocab, args.seed)
                for kind, chunk, pol, own_slo in runs:
                    print(f"   rate {rate}/s {kind} {chunk} (slo {own_slo})", flush=True)
                    res = serve(eng, pol, reqs, args.timeout)
                    for slo in ([own_slo] if own_slo is not None else slos):
                        row = {"policy": kind, "chunk": "dynamic" if kind == "dynamic" else chunk,
                               "policy_label": str(chunk), "ec_density": density,
                               "online_correction": kind == "dynamic" and pol.correction is not None,
                               "decode_headroom": kind == "dynamic" and pol.decode_headroom,
                               "async_batching": asy,
                               "slo_ms": slo, "rate": rate, "decode_step_ms": step,
                               **score(res, reqs, slo, calibrated),
                               "prediction_op_tables_only": prediction_error(res["steps"], tables, res["lag"]),
                               **{k: prediction_error(res["steps"], v, res["lag"]) for k, v in variants.items()}}
                        record["rows"].append(row)
                        print("     ", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                                        if k in ("slo_ms", "p99_itl_ms", "slo_attainment", "mean_ttft_ms",
                                                 "throughput_tok_s", "sched_us_p99", "sched_cpu_us_p99", "sched_us_p99_without_gc", "sched_gc_plans", "completed",
                                                 "graph_captures")},
                              "prediction |err| median (steps without a capture):",
                              {k: row[k].get("steady_median_abs_err") for k in ("prediction", "prediction_op_tables_only",
                                                                                *variants)},
                              "online:", row["prediction"].get("steady_online_median_abs_err"),
                              flush=True)
                    key = f"{density}/{kind}/{chunk}/{own_slo}/{rate}" + ("/async" if asy else "")
                    steps_out["served"][key] = served_json(res["steps"], res["lag"])
                    with open(path, "w") as f:
                        json.dump(record, f, indent=1)
                    with open(steps_path, "w") as f:
                        json.dump(steps_out, f)
        finally:
            eng.stop(wait=False)
            eng = None  # before the next density's engine starts: its KV cache and graphs go with it
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
        record["latency_model"][ekey] = {
            "linears": [lin.name for lin in plan.linears], "routes": list(plan.routes),
            "calibration": {"steps": len(cal_steps), "held_out": str(held_out),
                            "held_out_median_abs_err": held_out.median_abs_rel_err,
                            "held_out_p90_abs_err": held_out.p90_abs_rel_err,
                            "op_tables_only": str(runtime.check(tables, cal_steps)),
                            "overhead": calibrated.overhead.to_dict()}}
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    svg(record["rows"], os.path.join(args.out, f"serving_{tag}.svg"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
