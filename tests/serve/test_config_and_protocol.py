"""The server's pieces that need no model: ``ServeConfig`` checks, ``spear serve`` flags, request parsing,
the SSE framing, and that ``import spear_compile`` (and the CLI) work without the ``serve`` extra."""
import json
import subprocess
import sys

import pytest

from spear_compile.serve import ServeConfig
from spear_compile.serve import protocol as P


@pytest.mark.parametrize("kw,part", [
    (dict(ec="lora"), "ServeConfig.ec='lora'"),
    (dict(port=70000), "ServeConfig.port=70000"),
    (dict(max_queue=0), "ServeConfig.max_queue=0"),
    (dict(max_tokens=True), "ServeConfig.max_tokens=True"),
    (dict(slo_itl_ms=-1.0), "ServeConfig.slo_itl_ms=-1.0"),
    (dict(compile="yes"), "ServeConfig.compile='yes'"),
    (dict(model=""), "ServeConfig.model is empty"),
    (dict(online_correction="no"), "ServeConfig.online_correction='no'"),
])
def test_serve_config_names_the_bad_field(kw, part):
    with pytest.raises(ValueError, match=part.replace("(", r"\(").replace(".", r"\.")):
        ServeConfig(**kw)
    assert ServeConfig().name == "smollm2-135m" and ServeConfig(served_model_name="m").name == "m"


@pytest.mark.parametrize("argv,part", [
    (["--port", "x"], "--port 'x': expected 0..65535"),
    (["--model", "/no/such/dir"], "--model '/no/such/dir': expected smollm2-135m"),
    (["--slo-itl-ms", "0"], "--slo-itl-ms '0': expected a positive number"),
    (["--max-queue", "0"], "--max-queue '0': expected a positive integer"),
    (["--ec", "lora"], "invalid choice: 'lora'"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout '-1': expected a number of seconds >= 0"),
])
def test_spear_serve_checks_its_flags_before_loading(argv, part, capsys):
    from spear_compile.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", *argv])
    assert e.value.code == 2 and part in capsys.readouterr().err


def test_spear_serve_turns_the_online_correction_off_on_request():
    from spear_compile.cli import build_parser

    p = build_parser()
    assert p.parse_args(["serve"]).online_correction is True
    assert p.parse_args(["serve", "--no-online-correction"]).online_correction is False
    assert ServeConfig().online_correction is True


def test_the_package_and_the_cli_import_without_the_serve_extra():
    code = ("import sys\n"
            "for m in ('fastapi', 'uvicorn', 'starlette', 'prometheus_client'): sys.modules[m] = None\n"
            "import spear_compile, spear_compile.serve\n"
            "from spear_compile.cli import build_parser, main\n"
            "build_parser().parse_args(['serve', '--port', '0'])\n"
            "try:\n"
            "    main(['serve', '--port', '0'])\n"
            "except SystemExit as e:\n"
            "    print(e.code)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "needs the 'serve' extra" in out.stdout and "pip install 'spear_compile[serve]'" in out.stdout


def _err(model, body):
    with pytest.raises(P.ProtocolError) as e:
        P.parse(model, json.dumps(body).encode() if not isinstance(body, bytes) else body)
    return e.value


def test_requests_parse_strictly_and_errors_name_the_field():
    ok = P.parse(P.CompletionRequest, b'{"model": "m", "prompt": ["one prompt"], "temperature": 0, "seed": 3}')
    assert ok.prompt == "one prompt" and ok.max_tokens == 16 and not ok.stream
    assert P.parse(P.CompletionRequest, b'{"model": "m", "prompt": [1, 2]}').prompt == [1, 2]
    chat = P.parse(P.ChatCompletionRequest, json.dumps({"model": "m", "max_completion_tokens": 3, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}).encode())
    assert chat.messages[0].text() == "ab" and chat.token_limit == 3
    e = _err(P.CompletionRequest, b"{nope")
    assert e.status == 400 and e.code == "invalid_json" and e.param is None
    assert _err(P.CompletionRequest, {"model": "m", "prompt": "x", "max_tokens": True}).param == "max_tokens"
    assert _err(P.CompletionRequest, {"model": "m", "prompt": "x", "stream": "yes"}).param == "stream"
    e = _err(P.CompletionRequest, {"model": "m", "prompt": ["a", "b"]})
    assert e.param == "prompt" and "send one request per prompt" in e.message
    e = _err(P.CompletionRequest, {"model": "m", "prompt": "x", "logprobs": 0})
    assert e.param == "logprobs" and e.code == "unsupported_parameter"
    e = _err(P.CompletionRequest, {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}})
    assert e.param == "stream_options"
    e = _err(P.ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x", "x": 1}]})
    assert e.param == "messages[0].x" and e.code == "unsupported_parameter"
    e = _err(P.ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                       "max_tokens": 3, "max_completion_tokens": 4})
    assert e.param == "max_completion_tokens" and "disagree" in e.message
    assert e.body() == {"error": {"message": e.message, "type": "invalid_request_error",
                                  "param": "max_completion_tokens", "code": "invalid_value"}}


def test_sse_framing():
    assert P.sse("[DONE]") == b"data: [DONE]\n\n"
    assert P.sse({"a": 1}) == b'data: {"a":1}\n\n'
    u = P.usage_chunk("id", "m", 1, "text_completion", 5, 2)
    assert u["choices"] == [] and u["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
