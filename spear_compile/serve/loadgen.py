"""Concurrent streaming clients for an OpenAI-compatible server, on the official ``openai`` client.

* ``stream_completion(client, model, prompt, max_tokens)`` -> ``Outcome``: one streamed
  ``/v1/completions`` request (with ``include_usage``): its HTTP result (``ok``, ``rejected`` = 429 / 503
  with an error body, ``error`` = any other status, ``lost`` = a broken stream or a connection failure),
  the arrival time of every text chunk, the text, ``finish_reason`` and the completion tokens the usage
  reports.
* ``closed_loop(base_url, model, prompts, clients, duration_s, max_tokens)``: ``clients`` threads, each
  sending request after request (prompt ``i % len(prompts)``) until ``duration_s`` has passed, a
  rejected one retried after ``backoff_s``; a thread polls ``/health`` meanwhile. Returns the counts
  (admitted, rejected, lost, errors), TTFT / ITL percentiles in ms and the health checks.
* ``open_loop(base_url, model, requests, timeout_s)``: requests sent at their arrival times (the serving
  benchmark's Poisson workload); per request the chunk arrival times, as ``benchmarks/serving.py`` scores them.
* ``send_at_arrivals(requests, t0, start, timeout_s)``: the pacing of ``open_loop`` (and of the serving
  benchmark's in-process runs): each request started at its arrival time, each on its own thread.

Times are ``time.perf_counter()`` seconds. Needs ``openai`` and ``httpx`` (the ``test`` extra).
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Union

Prompt = Union[str, List[int]]


def pct(xs: Sequence[float], q: float) -> Optional[float]:
    """The ``q``-th percentile of ``xs`` (linear interpolation), None when empty."""
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


@dataclasses.dataclass
class Outcome:
    status: str  # ok | rejected | error | lost
    t_start: float
    chunk_times: List[float] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: Optional[str] = None
    completion_tokens: Optional[int] = None
    http_status: Optional[int] = None
    error: str = ""
    prompt_index: int = -1

    @property
    def ttft_s(self) -> Optional[float]:
        return self.chunk_times[0] - self.t_start if self.chunk_times else None

    @property
    def gaps_s(self) -> List[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def client_for(base_url: str, timeout_s: float = 120.0):
    """An ``openai.OpenAI`` client for ``base_url`` (``http://host:port``) with retries off (a 429 is data here)."""
    import openai

    return openai.OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=timeout_s)


def stream_completion(client, model: str, prompt: Prompt, max_tokens: int) -> Outcome:
    """One streamed completion (module docstring)."""
    import openai

    out = Outcome("lost", time.perf_counter())
    try:
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                           stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices:
                c = chunk.choices[0]
                if c.text:
                    out.chunk_times.append(time.perf_counter())
                    out.text += c.text
                if c.finish_reason is not None:
                    out.finish_reason = c.finish_reason
            if chunk.usage is not None:
                out.completion_tokens = chunk.usage.completion_tokens
        out.status = "ok" if out.finish_reason is not None and out.completion_tokens is not None else "lost"
        if out.status == "lost":
            out.error = "the stream ended without its finish reason or usage"
    except openai.APIStatusError as e:
        out.http_status = e.status_code
        out.status = "rejected" if e.status_code in (429, 503) else "error"
        out.error = str(e)[:300]
    except (openai.APIConnectionError, openai.APITimeoutError) as e:
        out.error = f"{type(e).__name__}: {e}"[:300]
    except Exception as e:  # noqa: BLE001  (a broken stream: recorded as lost)
        out.error = f"{type(e).__name__}: {e}"[:300]
    return out


class _Health(threading.Thread):
    def __init__(self, base_url: str, interval_s: float) -> None:
        super().__init__(daemon=True, name="loadgen-health")
        self.url, self.interval_s = base_url.rstrip("/") + "/health", interval_s
        self.stop = threading.Event()
        self.checks: List[tuple] = []  # (ok, seconds)

    def run(self) -> None:
        import httpx

        with httpx.Client(timeout=10.0) as c:
            while not self.stop.is_set():
                t = time.perf_counter()
                try:
                    ok = c.get(self.url).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.checks.append((ok, time.perf_counter() - t))
                self.stop.wait(self.interval_s)


def summarize(outcomes: List[Outcome], expected: Optional[Dict[int, str]] = None) -> Dict:
    """Counts and latency percentiles of ``outcomes``. ``expected``: the full text per prompt index; an
    admitted request whose text differs is counted ``lost`` (it did not get its full output)."""
    ok = [o for o in outcomes if o.status == "ok"]
    wrong = [o for o in ok if expected is not None and o.text != expected.get(o.prompt_index)]
    ttft = [o.ttft_s * 1e3 for o in ok if o.ttft_s is not None]
    itl = [g * 1e3 for o in ok for g in o.gaps_s]
    return {
        "requests": len(outcomes), "admitted": len(ok) + sum(o.status == "lost" for o in outcomes),
        "completed": len(ok) - len(wrong), "rejected": sum(o.status == "rejected" for o in outcomes),
        "lost": sum(o.status == "lost" for o in outcomes) + len(wrong),
        "errors": sum(o.status == "error" for o in outcomes),
        "rejected_status": sorted({o.http_status for o in outcomes if o.status == "rejected"}),
        "p50_ttft_ms": pct(ttft, 50), "p99_ttft_ms": pct(ttft, 99),
        "p50_itl_ms": pct(itl, 50), "p99_itl_ms": pct(itl, 99),
        "completion_tokens": sum(o.completion_tokens or 0 for o in ok),
        "examples": [o.error for o in outcomes if o.status in ("lost", "error")][:3]
        + [f"text {o.text!r} != {expected.get(o.prompt_index)!r}" for o in wrong[:2]],
    }


def closed_loop(base_url: str, model: str, prompts: Sequence[Prompt], clients: int, duration_s: float,
                max_tokens: int, backoff_s: float = 0.25, health_interval_s: float = 0.5,
                expected: Optional[Dict[int, str]] = None) -> Dict:
    """``clients`` concurrent clients for ``duration_s`` (module docstring); ``summarize``'s fields plus
    ``clients``, ``duration_s``, ``wall_s`` and ``health`` (checks, failures, slowest in ms)."""
    client = client_for(base_url)
    outcomes: List[Outcome] = []
    lock = threading.Lock()
    t_end = time.perf_counter() + duration_s

    def worker(w: int) -> None:
        i = w
        while time.perf_counter() < t_end:
            o = stream_completion(client, model, prompts[i % len(prompts)], max_tokens)
            o.prompt_index = i % len(prompts)
            with lock:
                outcomes.append(o)
            i += clients
            if o.status != "ok":
                time.sleep(backoff_s)

    health = _Health(base_url, health_interval_s)
    health.start()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    health.stop.set()
    health.join(15)
    checks = health.checks
    res = summarize(outcomes, expected)
    res.update(clients=clients, duration_s=duration_s, wall_s=wall, max_tokens=max_tokens,
               health={"checks": len(checks), "failed": sum(not ok for ok, _ in checks),
                       "max_ms": max((s for _, s in checks), default=0.0) * 1e3})
    return res


def send_at_arrivals(requests: Sequence[tuple], t0: float, start: Callable[[int, tuple], Callable[[], None]],
                     timeout_s: float) -> float:
    """For each request in turn, at its arrival time (its first field, seconds after ``t0``, a
    ``time.perf_counter()`` time): ``start(i, request)`` on this thread, and what it returns on a daemon thread
    of its own. Then waits for those threads, at most ``timeout_s`` after the last one started; returns the
    makespan (seconds from ``t0`` to then)."""
    threads = []
    for i, req in enumerate(requests):
        wait = req[0] - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        th = threading.Thread(target=start(i, req), daemon=True)
        th.start()
        threads.append(th)
    deadline = time.perf_counter() + timeout_s
    for th in threads:
        th.join(max(0.0, deadline - time.perf_counter()))
    return time.perf_counter() - t0


def open_loop(base_url: str, model: str, requests: Sequence[tuple], timeout_s: float = 600.0) -> Dict:
    """``requests``: (arrival s, prompt, max_tokens), sent at their arrival times from the start; returns
    ``times`` (per request, chunk arrival times from the start), ``makespan``, ``outcomes``."""
    client = client_for(base_url, timeout_s)
    t0 = time.perf_counter()
    outcomes: List[Optional[Outcome]] = [None] * len(requests)

    def start(i: int, req: tuple) -> Callable[[], None]:
        def one() -> None:
            outcomes[i] = stream_completion(client, model, req[1], req[2])

        return one

    makespan = send_at_arrivals(requests, t0, start, timeout_s)
    outs = [o or Outcome("lost", t0, error="no answer before the timeout") for o in outcomes]
    return {"times": [[t - t0 for t in o.chunk_times] for o in outs], "makespan": makespan, "outcomes": outs}


__all__ = ["Outcome", "client_for", "closed_loop", "open_loop", "pct", "send_at_arrivals", "stream_completion",
           "summarize"]
