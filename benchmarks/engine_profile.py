"""Where an engine step's time goes: transformers' continuous-batching step, part by part, on the real engine.

``spear_compile.runtime.Engine`` (compiled with ``backend="spear"``, transformers' CUDA graphs on where it
compiles on CUDA) serves one request alone (batch-1 decode) and then ``--batch`` requests at once. Every
part of transformers' generation-loop step is timed on the generation thread (wall, ``perf_counter``):

* ``prepare_next_batch``: our scheduler's plan plus transformers' host-side batch building;
* ``get_model_kwargs``: the padded device inputs; ``compute_batch``: the forward (a CUDA-graph replay,
  or a capture: counted apart), logits processing and sampling, as launched; ``retrieve_device_outputs``:
  the copy of the sampled tokens to the host (it waits for the GPU: the step's device time shows here);
* ``update_batch``: the host-side bookkeeping of the new tokens and the output delivery.

The GPU's own kernel time per step comes from ``torch.profiler`` (CUPTI) over a window of decode steps:
``gpu_busy_ms_per_step`` against the step's wall time says whether the step is host or device bound.
``gpu_launches``: per kernel, the distribution of single launches (a kernel that is slow only on some
launches - a spin, a dependent-launch wait - shows as a wide min..max). ``cprofile_top``: the generation
thread's functions by own time over the same window (cProfile). ``--trace`` also writes the window's
Chrome trace (kernel order, grids, times).

    python benchmarks/engine_profile.py --device cuda --model llama2-7b --out OUT
    python benchmarks/engine_profile.py --device cpu --model smollm2 --out OUT --no-compile

Writes ``OUT/engine_profile_<device>.json``.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import statistics
import time

import torch

from _syspath import unshadow  # noqa: E402

unshadow()

from benchmarks.serving import build_model, meta, set_ec_density  # noqa: E402

from spear_compile.envs import fingerprint  # noqa: E402
from spear_compile.runtime import Engine, StaticChunkPolicy  # noqa: E402


class PartTimer:
    """Wall time of named methods of transformers' batch processor, per call, on whichever thread calls."""

    def __init__(self):
        self.t = collections.defaultdict(list)
        self.captures = 0
        self.on = False
        self.prof = None

    def wrap(self, obj, name, label=None):
        fn = getattr(obj, name)
        label = label or name

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if self.on:
                    self.t[label].append((time.perf_counter() - t0) * 1e3)
        setattr(obj, name, timed)

    def summary(self) -> dict:
        return {k: {"calls": len(v), "median_ms": round(statistics.median(v), 4), "mean_ms": round(sum(v) / len(v), 4),
                    "max_ms": round(max(v), 3)} for k, v in self.t.items() if v}


def instrument(engine, timer: PartTimer) -> None:
    bp = engine._manager.batch_processor
    for name in ("prepare_next_batch", "update_batch"):
        timer.wrap(bp, name)
    io = bp.inputs_and_outputs
    for name in ("get_model_kwargs", "retrieve_device_outputs"):
        timer.wrap(io, name)
    mr = bp.model_runner
    timer.wrap(mr, "compute_batch")
    cap = mr._capture_graph

    def counted(*a, **k):
        timer.captures += 1
        return cap(*a, **k)
    mr._capture_graph = counted
    # the generation thread's own functions: cProfile is per thread, so it is switched on inside the step
    step = engine._manager._generation_step

    def profiled():
        prof = timer.prof  # read once: the consumer thread may end the window during this step
        if prof is not None:
            prof.enable()
            try:
                return step()
            finally:
                prof.disable()
        return step()
    engine._manager._generation_step = profiled


def launch_stats(prof, steps: int, top: int = 12) -> list:
    """Per kernel name (the ``top`` by total time): launches per step and the single-launch time
    distribution in us (min, median, p90, max), from the profiler's device events."""
    per = collections.defaultdict(list)
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            per[e.name].append(e.time_range.elapsed_us())
    rows = sorted(per.items(), key=lambda kv: -sum(kv[1]))[:top]
    out = []
    for name, ts in rows:
        ts = sorted(ts)
        out.append({"name": name[:120], "launches_per_step": round(len(ts) / steps, 2), "min_us": round(ts[0], 2),
                    "median_us": round(statistics.median(ts), 2), "p90_us": round(ts[int(0.9 * (len(ts) - 1))], 2),
                    "max_us": round(ts[-1], 2)})
    return out


def serve(engine, reqs, timer: PartTimer, window: tuple, gpu: bool, trace: str = "") -> dict:
    """Serve ``reqs`` (prompt ids, max new tokens) at once; time the parts and profile over the steps
    ``window`` = (first, last) token index of the first request."""
    timer.t.clear()
    ids = [engine.add_request(p, max_new_tokens=m, eos_token_id=-1) for p, m in reqs]
    times, out = [], {}
    prof_ctx = None
    timer.on = True
    for i, _ in enumerate(engine.stream(ids[0])):
        times.append(time.perf_counter())
        if i == window[0]:
            timer.prof = cProfile.Profile()
            if gpu:
                prof_ctx = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                prof_ctx.__enter__()
            w0 = time.perf_counter()
        if i == window[1]:
            w1 = time.perf_counter()
            prof, timer.prof = timer.prof, None
            if prof_ctx is not None:
                torch.cuda.synchronize()
                prof_ctx.__exit__(None, None, None)
                busy = sum(e.device_time_total for e in prof_ctx.key_averages()) / 1e3  # us -> ms
                out["gpu_busy_ms_per_step"] = round(busy / (window[1] - window[0]), 4)
                top = sorted(prof_ctx.key_averages(), key=lambda e: -e.device_time_total)[:25]
                out["gpu_kernels_top"] = [{"name": e.key[:160], "calls_per_step": round(e.count / (window[1] - window[0]), 2),
                                           "ms_per_step": round(e.device_time_total / 1e3 / (window[1] - window[0]), 4)}
                                          for e in top]
                out["gpu_launches"] = launch_stats(prof_ctx, window[1] - window[0])
                if trace:
                    prof_ctx.export_chrome_trace(trace)
            out["window_wall_ms_per_step"] = round((w1 - w0) * 1e3 / (window[1] - window[0]), 4)
            st = pstats.Stats(prof)
            rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:30]
            out["cprofile_top"] = [{"fn": f"{os.path.basename(f)}:{ln}:{fn}", "calls": nc, "tottime_ms": round(tt * 1e3, 3),
                                    "cumtime_ms": round(ct * 1e3, 3)} for (f, ln, fn), (cc, nc, tt, ct, _) in rows]
    for rid in ids[1:]:
        engine.result(rid)
    timer.on = False
    gaps = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
    out["itl_ms_median"] = round(statistics.median(gaps[window[0]:]), 4)
    out["parts"] = timer.summary()
    out["graph_captures"] = timer.captures
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", default=None, help="smollm2 (CPU default) or llama2-7b (CUDA default)")
    ap.add_argument("--density", type=int, default=25, help="EC density, percent of the linears")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per request")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                    help="transformers' CUDA graphs (default: the engine's, on when compiled on CUDA)")
    ap.add_argument("--padding", choices=("engine", "transformers", "exact"), default="engine",
                    help="step shapes: the engine's (tokens to a multiple of 64, KV reads to a block), transformers' "
                         "fallback (tokens to a multiple of 64, KV reads to 16384) or exact (tokens as planned, KV "
                         "reads to a block)")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers of the llama2-7b-shaped model")
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="KV cache blocks of 256 tokens (default: transformers sizes the cache from free memory, which "
                         "with a few layers leaves too little for the CUDA graphs' pools)")
    ap.add_argument("--trace", action="store_true", help="also write the profiled window's Chrome trace per batch")
    ap.add_argument("--tag", default="", help="suffix of the output file name")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    args.model = args.model or ("llama2-7b" if args.device == "cuda" else "smollm2")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    model = build_model(args.model, args.device, args.layers)
    ecs = set_ec_density(model, args.density, args.rank)
    cb = {} if args.cuda_graph is None else {"use_cuda_graph": args.cuda_graph}
    if args.padding == "transformers":  # transformers' fallback padding when it compiles (the engine's before)
        cb.update(q_padding_interval_size=64, kv_padding_interval_size=64 * 256)
    elif args.padding == "exact":
        cb.update(q_padding_interval_size=1)
    extra = {"cb_config": cb} if cb else {}
    eng = Engine(model, None, policy=StaticChunkPolicy(512), compile=args.compile, max_batch_tokens=2048,
                 block_size=256, num_blocks=args.num_blocks, log=print, **extra)
    eng.start()
    print(f"engine up in {time.perf_counter() - t0:.1f} s")
    timer = PartTimer()
    instrument(eng, timer)
    rows = {}
    gpu = args.device == "cuda"
    for b in args.batch:
        reqs = [(list(range(10 + i, 42 + i)), args.tokens) for i in range(b)]
        serve(eng, reqs, timer, (8, 16), gpu)  # once to capture every graph this workload needs
        timer.captures = 0
        trace = os.path.join(args.out, f"trace_{args.device}{args.tag}_batch{b}.json") if args.trace and gpu else ""
        rows[f"batch{b}"] = serve(eng, reqs, timer, (16, args.tokens - 8), gpu, trace)
        print(f"batch {b}: {json.dumps({k: v for k, v in rows[f'batch{b}'].items() if k != 'cprofile_top'})}")
    eng.stop()
    rec = {"meta": meta(args), "model": args.model, "ec_density": args.density, "ecs": len(ecs), "padding": args.padding,
           "layers": args.layers, "kill_switches": fingerprint(), "compile": args.compile, "cuda_graph": args.cuda_graph, "rows": rows}
    path = os.path.join(args.out, f"engine_profile_{args.device}{args.tag}.json")
    json.dump(rec, open(path, "w"), indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
