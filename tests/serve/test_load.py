"""``spear serve`` as a real process under load, with clients killed mid-stream, then shut down by SIGTERM.

Real parts: the ``spear serve`` command in a subprocess (SmolLM2-135M W4 per-channel, random rank-4
compensators, eager spear ops on CPU, a KV cache of 8 blocks of 16 tokens, a queue of 2, so that a few
clients are past capacity), the official ``openai`` client in threads (``serve/loadgen.py``), and client
processes killed with SIGKILL.

* Load: ``CLIENTS`` clients send streamed requests back to back for ``SECONDS`` seconds (more than the
  cache and queue hold, so some are refused): every admitted request completes with its full output (the
  text of the same request sent alone before the load), every refused one gets 429 / 503 with an error
  body, none is lost, ``/health`` answers 200 throughout (polled every 0.5 s); afterwards the engine holds
  no request and no KV block and the server's RSS is back within ``RSS_TOLERANCE_MB`` of what it was
  before the load (measured after a warm-up; on 2 CPU cores it grew by 0-30 MB).
* Faults: client processes killed mid-stream: the KV cache is empty again and their requests count as
  cancelled.
* Shutdown: SIGTERM while a stream is in flight: the stream finishes whole, the app's shutdown (which
  stops the engine) completes, nothing listens any more, and the process ends by the signal (uvicorn
  re-raises it after its graceful shutdown).
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")

from spear_compile.serve import loadgen  # noqa: E402

MODEL = "smollm2-135m"
CLIENTS, SECONDS, NEW = 14, 20.0, 4
PROMPTS = ["The capital of France is", "1, 2, 3,", "Once upon a time", "To be, or not to be"]
RSS_TOLERANCE_MB = 64
SERVE = ["--ec", "random", "--ec-rank", "4", "--port", "0", "--compile", "off", "--policy", "static",
         "--num-blocks", "8", "--block-size", "16", "--max-batch-tokens", "64", "--max-queue", "2",
         "--max-tokens", "16", "--slo-itl-ms", "3000", "--shutdown-timeout", "20"]


@pytest.fixture(scope="module")
def server():
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "spear_compile.cli", "serve", *SERVE], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines, url = [], None
    deadline = time.time() + 300
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "spear serve: listening on " in line:
            url = line.split("listening on ")[1].strip()
            break
    if url is None:
        proc.kill()
        pytest.fail("spear serve did not start:\n" + "".join(lines[-30:]))
    log = []
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()  # keep the pipe drained
    yield proc, url, log
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Nothing compiles in this process (the package conftest resets Dynamo)."""
    yield


def _metrics(url):
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


def _idle(url, timeout=30.0):
    deadline = time.time() + timeout
    while True:
        m = _metrics(url)
        if (m["spear_kv_blocks_used"], m["spear_requests_running"], m["spear_queue_depth"],
                m["spear_requests_in_flight"]) == (0, 0, 0, 0):
            return m
        if time.time() > deadline:
            raise AssertionError(f"not idle after {timeout} s: " + json.dumps(
                {k: v for k, v in m.items() if k.startswith(("spear_kv", "spear_requests_", "spear_queue"))}))
        time.sleep(0.2)


def _rss_mb(pid):
    return psutil.Process(pid).memory_info().rss / 2 ** 20


@pytest.mark.slow
def test_load_past_capacity_admits_completes_or_rejects_cleanly_and_memory_returns(server):
    proc, url, _ = server
    client = loadgen.client_for(url)
    # warm-up and references: each prompt alone, its full greedy output
    refs = {}
    for pair in (0, 2):  # two at a time: the queue holds 2
        threads = [threading.Thread(target=lambda i=i: refs.__setitem__(i, loadgen.stream_completion(
            client, MODEL, PROMPTS[i], NEW))) for i in (pair, pair + 1)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(300)
    assert all(o.status == "ok" for o in refs.values()), [o.error for o in refs.values()]
    _idle(url)
    rss0 = _rss_mb(proc.pid)
    res = loadgen.closed_loop(url, MODEL, PROMPTS, clients=CLIENTS, duration_s=SECONDS, max_tokens=NEW,
                              expected={i: o.text for i, o in refs.items()})
    m = _idle(url)
    rss1 = _rss_mb(proc.pid)
    res.update(rss_before_mb=round(rss0, 1), rss_after_mb=round(rss1, 1))
    print("\nload:", json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in res.items()}))
    assert res["lost"] == 0 and res["errors"] == 0, res["examples"]
    assert res["completed"] >= CLIENTS // 2 and res["completed"] == res["admitted"]
    assert res["rejected"] > 0 and set(res["rejected_status"]) <= {429, 503}, res
    assert res["health"]["checks"] >= SECONDS and res["health"]["failed"] == 0, res["health"]
    assert m["spear_requests_rejected_total{reason=queue_full}"] == res["rejected"]
    assert rss1 - rss0 < RSS_TOLERANCE_MB, (rss0, rss1)


CLIENT = """
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
for chunk in c.completions.create(model="smollm2-135m", prompt=sys.argv[2], max_tokens=16, stream=True):
    print("chunk", flush=True)
"""


@pytest.mark.slow
def test_clients_killed_mid_stream_leave_the_kv_cache_empty(server):
    proc, url, _ = server
    before = _metrics(url).get("spear_requests_total{endpoint=completions,outcome=cancelled}", 0)
    kids = [subprocess.Popen([sys.executable, "-c", CLIENT, url, p], stdout=subprocess.PIPE, text=True)
            for p in PROMPTS[:3]]
    try:
        for k in kids:  # each has its first chunk: its request runs and holds KV
            assert k.stdout.readline().strip() == "chunk"
        m = _metrics(url)
        assert m["spear_kv_blocks_used"] > 0 and m["spear_requests_running"] == 3
    finally:
        for k in kids:
            k.send_signal(signal.SIGKILL)
            k.wait(30)
    m = _idle(url)
    assert m["spear_kv_blocks_used"] == 0 and m["spear_kv_usage_ratio"] == 0
    assert m["spear_requests_total{endpoint=completions,outcome=cancelled}"] == before + 3


@pytest.mark.slow
def test_sigterm_lets_the_stream_in_flight_finish_and_exits_cleanly(server):
    proc, url, log = server
    client = loadgen.client_for(url)
    got = {}
    th = threading.Thread(target=lambda: got.setdefault("o", loadgen.stream_completion(client, MODEL, PROMPTS[0], 10)))
    th.start()
    deadline = time.time() + 60
    while _metrics(url)["spear_requests_running"] < 1 and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    th.join(120)
    o = got["o"]
    assert o.status == "ok" and o.finish_reason in ("stop", "length") and o.text, o  # whole: finish and usage came
    assert o.completion_tokens == 10 or o.finish_reason == "stop"
    # uvicorn re-raises the signal once it has shut down gracefully: the exit status says "ended by SIGTERM"
    assert proc.wait(60) in (0, -signal.SIGTERM)
    with pytest.raises(httpx.HTTPError):  # nothing listens any more
        httpx.get(url + "/health", timeout=5)
    time.sleep(0.5)
    assert any("Application shutdown complete" in line for line in log), log[-10:]  # the engine was stopped
