"""The OpenAI-compatible API against the official ``openai`` client, on a real uvicorn server on loopback.

Real parts: SmolLM2-135M quantized W4 (per-channel) with random rank-4 compensators attached (cheap to
build; the served outputs are compared with the engine's, not judged for quality), the runtime's
``Engine`` with the spear ops run eagerly (``compile="off"``: on 2 CPU cores the compiled engine starts in
~66 s and decodes slower than eager, see ``spear_compile/serve/config.py``), a real uvicorn server in a
background thread of this process on a free port, and the ``openai`` client (httpx for raw bodies).
One server for the module: the model loads once. Its KV cache is small (16 blocks of 16 tokens) and
its queue short (10), so capacity is easy to reach.

The reference for every output is ``Engine.generate`` on the same engine with the same greedy request.
"""
import concurrent.futures as cf
import json
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import spear_compile as spear  # noqa: E402
from spear_compile.compensators.init import random_ecs  # noqa: E402
from spear_compile.runtime import StaticChunkPolicy, StepPlan  # noqa: E402

MODEL = "smollm2-135m"
NEW = 6
PROMPTS = ["The capital of France is", "1, 2, 3,"]
CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server():
    from spear_compile.models import load
    from spear_compile.serve import ServeConfig
    from spear_compile.serve.server import build_service, make_server

    torch.manual_seed(0)
    model, tok = load(MODEL)
    spear.quantize_(model, spear.QuantConfig(group_size=None), progress=False)
    spear.attach_(model, random_ecs(model, spear.ECConfig(rank=4, gate_hidden=4), seed=0))
    cfg = ServeConfig(port=0, compile="off", policy="static", num_blocks=16, block_size=16, max_batch_tokens=64,
                      max_queue=10, max_tokens=24, slo_itl_ms=5000.0, shutdown_timeout_s=5.0)
    svc = build_service(cfg, model, tok, log=lambda m: None)
    urls = []
    srv = make_server(cfg, svc, announce=urls.append)
    th = threading.Thread(target=srv.run, name="uvicorn", daemon=True)
    th.start()
    deadline = time.time() + 60
    while not urls and time.time() < deadline and th.is_alive():
        time.sleep(0.05)
    assert urls, "the server did not start"
    yield svc, urls[0]
    srv.should_exit = True
    th.join(30)
    assert not svc.engine.running  # the lifespan stopped the engine


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """The engine runs eagerly; nothing to reset between tests (the package conftest resets Dynamo)."""
    yield


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0, timeout=120)


def _idle(svc, timeout=15.0):
    """Wait until the engine holds no request and no KV block; its stats."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = svc.engine.stats()
        if s["live"] == 0 and s["queued"] == 0 and s["kv_free_blocks"] == s["kv_total_blocks"] \
                and s["scheduler_requests"] == 0 and svc.metrics.in_flight == 0:
            return s
        time.sleep(0.05)
    raise AssertionError(f"the engine did not become idle: {svc.engine.stats()}, in flight {svc.metrics.in_flight}")


@pytest.mark.slow
def test_completions_and_chat_streamed_or_not_equal_engine_generate(server, client):
    svc, _ = server
    tok = svc.tokenizer
    chat_ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)

    def complete(p):
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=NEW, temperature=0)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens, r.usage.prompt_tokens

    def complete_stream(p):
        chunks = list(client.completions.create(model=MODEL, prompt=p, max_tokens=NEW, stream=True,
                                                stream_options={"include_usage": True}))
        assert chunks[-1].usage is not None and chunks[-1].choices == []
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-2].choices[0].finish_reason, \
            chunks[-1].usage.completion_tokens

    def chat():
        r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=NEW)
        return r.choices[0].message.content, r.choices[0].message.role, r.usage.prompt_tokens

    def chat_stream():
        chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=NEW,
                                                     stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason

    with cf.ThreadPoolExecutor(8) as pool:  # all at once: they share the engine's steps
        jobs = [pool.submit(complete, PROMPTS[0]), pool.submit(complete_stream, PROMPTS[0]),
                pool.submit(complete, tok(PROMPTS[1]).input_ids), pool.submit(complete_stream, PROMPTS[1]),
                pool.submit(chat), pool.submit(chat_stream)]
        refs = svc.engine.generate([PROMPTS[0], PROMPTS[1], chat_ids], max_new_tokens=NEW)
        got = [j.result(timeout=300) for j in jobs]
    text = [tok.decode(r, skip_special_tokens=True) for r in refs]
    eos = svc.eos
    finish = ["stop" if r[-1] in eos else "length" for r in refs]
    assert got[0] == (text[0], finish[0], len(refs[0]), len(tok(PROMPTS[0]).input_ids))
    assert got[1] == (text[0], finish[0], len(refs[0]))
    assert got[2][:3] == (text[1], finish[1], len(refs[1]))  # token-id prompt
    assert got[3] == (text[1], finish[1], len(refs[1]))
    assert got[4] == (text[2], "assistant", len(chat_ids))
    assert got[5] == (text[2], finish[2])
    _idle(svc)


@pytest.mark.slow
def test_models_health_and_metrics(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    svc, url = server
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    h = httpx.get(url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("spear_queue_depth", "spear_requests_running", "spear_kv_blocks_used", "spear_kv_usage_ratio",
                 "spear_time_to_first_token_seconds", "spear_inter_token_latency_seconds", "spear_slo_attainment",
                 "spear_requests_rejected", "spear_requests"):
        assert name in fams, sorted(fams)
    value = {s.name: s.value for f in fams.values() for s in f.samples if not s.labels}
    assert value["spear_kv_blocks_total"] == 16 and value["spear_kv_blocks_used"] == 0
    if value["spear_itl_observed_total"]:  # after the first test: gaps were scored against the 5 s SLO
        assert 0 <= value["spear_slo_attainment"] <= 1 and value["spear_time_to_first_token_seconds_count"] > 0


BAD = [  # (body, status, param, message part)
    (b'{"model": "smollm2-135m", "prompt": "x",', 400, None, "not valid JSON"),
    (b'["not", "an", "object"]', 400, None, "must be a JSON object"),
    (b'{"prompt": "x"}', 400, "model", "model is required"),
    (b'{"model": "smollm2-135m", "prompt": "x", "max_tokens": "5"}', 400, "max_tokens", "valid integer"),
    (b'{"model": "smollm2-135m", "prompt": "x", "max_tokens": 0}', 400, "max_tokens", "greater than or equal to 1"),
    (b'{"model": "smollm2-135m", "prompt": 7}', 400, "prompt", "valid string"),
    (b'{"model": "smollm2-135m", "prompt": [1, 99999999]}', 400, "prompt", "outside the vocabulary"),
    (b'{"model": "gpt-4", "prompt": "x"}', 404, "model", "does not exist"),
    (b'{"model": "smollm2-135m", "prompt": "x", "max_tokens": 25}', 400, "max_tokens", "allows per request (24)"),
    (json.dumps({"model": MODEL, "prompt": "word " * 300}).encode(), 400, "prompt", "max_model_len of 256"),
    (b'{"model": "smollm2-135m", "prompt": "x", "n": 2}', 400, "n", "one choice per request"),
    (b'{"model": "smollm2-135m", "prompt": "x", "temperature": 0.8}', 400, "temperature", "decodes greedily"),
    (b'{"model": "smollm2-135m", "prompt": "x", "stop": ["a", ""]}', 400, "stop", "up to 4 non-empty strings"),
    (b'{"model": "smollm2-135m", "prompt": "x", "frobnicate": 1}', 400, "frobnicate", "unsupported parameter"),
]
BAD_CHAT = [
    (b'{"model": "smollm2-135m", "messages": []}', 400, "messages", "at least 1"),
    (b'{"model": "smollm2-135m", "messages": [{"role": "robot", "content": "x"}]}', 400, "messages[0].role",
     "'system', 'user' or 'assistant'"),
    (b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400,
     "messages[0].content[0].type", "'text'"),
    (b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
     400, "tools", "not supported"),
]


@pytest.mark.slow
@pytest.mark.parametrize("route,body,status,param,part",
                         [("completions", *b) for b in BAD] + [("chat/completions", *b) for b in BAD_CHAT],
                         ids=[f"completions-{i}" for i in range(len(BAD))] + [f"chat-{i}" for i in range(len(BAD_CHAT))])
def test_bad_requests_get_an_openai_error_naming_the_field(server, route, body, status, param, part):
    svc, url = server
    r = httpx.post(f"{url}/v1/{route}", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and part in err["message"], err
    assert err["type"] == "invalid_request_error"


@pytest.mark.slow
def test_the_openai_client_raises_its_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=NEW, logit_bias={"5": 10})
    assert e.value.param == "logit_bias"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="other", messages=CHAT)
    assert e.value.code == "model_not_found"


class _Hold:
    """A policy that schedules nothing: admitted requests stay queued."""

    def plan(self, state):
        return StepPlan((), ())


@pytest.mark.slow
def test_a_full_queue_is_429_at_once_and_the_queued_requests_still_complete(server, client):
    svc, url = server
    eng = svc.engine
    eng.set_policy(_Hold())
    pool = cf.ThreadPoolExecutor(eng.max_queue)
    try:
        queued = [pool.submit(client.completions.create, model=MODEL, prompt=PROMPTS[0], max_tokens=2)
                  for _ in range(eng.max_queue)]
        deadline = time.time() + 20
        while eng.stats()["queued"] < eng.max_queue and time.time() < deadline:
            time.sleep(0.05)
        assert eng.stats()["queued"] == eng.max_queue
        t0 = time.perf_counter()
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=2)
        assert time.perf_counter() - t0 < 2.0
        assert e.value.code == "queue_full" and "max_queue=10" in e.value.message
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "stream": True})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"  # a status, not a broken stream
    finally:
        eng.set_policy(StaticChunkPolicy(64))
    outs = [q.result(timeout=120) for q in queued]
    assert all(o.usage.completion_tokens == 2 for o in outs)
    pool.shutdown()
    assert 'spear_requests_rejected_total{reason="queue_full"} 2.0' in httpx.get(url + "/metrics").text
    _idle(svc)


@pytest.mark.slow
def test_a_client_gone_mid_stream_or_while_queued_cancels_its_request_and_frees_its_kv(server):
    svc, url = server
    eng = svc.engine
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 24, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                if len(events) == 2:
                    break
            assert eng.stats()["kv_free_blocks"] < eng.stats()["kv_total_blocks"]  # it holds KV now
    # the connection is closed with 22 tokens to go: the server cancels the request
    s = _idle(svc)
    assert s["kv_free_blocks"] == 16
    eng.set_policy(_Hold())
    try:  # a non-streamed request whose client hangs up while it waits in the queue
        host, port = url.removeprefix("http://").split(":")
        payload = json.dumps({**body, "stream": False}).encode()
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        deadline = time.time() + 20
        while eng.stats()["queued"] == 0 and time.time() < deadline:
            time.sleep(0.05)
        assert eng.stats()["queued"] == 1
        sock.close()
        _idle(svc)  # the queued request went with its client
    finally:
        eng.set_policy(StaticChunkPolicy(64))
    text = httpx.get(url + "/metrics").text
    assert 'spear_requests_total{endpoint="completions",outcome="cancelled"} 2.0' in text, text


@pytest.mark.slow
def test_a_stop_string_ends_the_text_before_it_and_frees_the_request(server, client):
    svc, _ = server
    ref = svc.engine.generate([PROMPTS[1]], max_new_tokens=NEW, output="text")[0]
    stop = ref.strip()[2:4] if len(ref.strip()) >= 4 else ref.strip()[-1:]
    want = ref[:ref.find(stop)]
    with cf.ThreadPoolExecutor(2) as pool:
        whole = pool.submit(client.completions.create, model=MODEL, prompt=PROMPTS[1], max_tokens=NEW,
                            stop=[stop, "never seen"])
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=NEW, stop=stop,
                                                stream=True))
        r = whole.result(timeout=120)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop"), (ref, stop)
    assert "".join(c.choices[0].text for c in chunks) == want and chunks[-1].choices[0].finish_reason == "stop"
    _idle(svc)
