"""The OpenAI request and response bodies the server speaks, validated with pydantic.

Contract:

* ``parse(Model, raw_bytes)`` turns a request body into a ``CompletionRequest`` or a
  ``ChatCompletionRequest``, or raises ``ProtocolError`` (HTTP 400) whose message and ``param`` name
  the field at fault: malformed JSON, a body that is not an object, a field of the wrong type (types
  are strict: ``"max_tokens": "5"`` or ``true`` is refused, not coerced), a value out of range, an
  unknown field, or a known OpenAI field this server does not implement with a value other than its
  neutral one (``n`` != 1, ``temperature`` > 0, ``logprobs``, penalties, ``logit_bias``, tools, ...).
  Nothing is silently ignored, except ``user`` and ``seed``: neither changes a greedy output.
* ``stop``: up to 4 non-empty strings; the text ends before the first one that appears (OpenAI's rule).
* The server decodes greedily (the engine's generation config), so ``temperature`` is accepted only as
  0 or left out, and ``top_p`` only as 1.
* Response and stream-chunk bodies are built by the functions at the end, in the OpenAI shapes
  (``text_completion`` / ``chat.completion`` / ``chat.completion.chunk``), so the official client parses them.
"""
from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class ProtocolError(ValueError):
    """A request the server refuses: ``status`` (HTTP), ``param`` (the field at fault, or None), ``code``
    and ``kind`` (OpenAI's ``error.code`` and ``error.type``)."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 code: Optional[str] = "invalid_value", kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind

    def body(self) -> Dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> Dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ------------------------------------------------------------------ requests

#: Known OpenAI fields and the only values this server accepts for them (None: left out).
_NEUTRAL = {
    "n": (1,), "best_of": (1,), "temperature": (0,), "top_p": (1,), "presence_penalty": (0,),
    "frequency_penalty": (0,), "echo": (False,), "logprobs": (False,), "top_logprobs": (0,), "suffix": (),
    "logit_bias": ({},), "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (),
    "response_format": ({"type": "text"},), "functions": ([],), "function_call": ("none",),
}
_WHY = {
    "n": "one choice per request; send n requests",
    "best_of": "one candidate per request",
    "temperature": "the server decodes greedily; send 0 or leave it out",
    "top_p": "the server decodes greedily; send 1 or leave it out",
    "logprobs": "log-probabilities are not returned",
    "top_logprobs": "log-probabilities are not returned",
}


def _same(v, ok) -> bool:
    """``v == ok`` where a bool equals only a bool (``logprobs=0`` is not ``False``)."""
    if isinstance(v, bool) or isinstance(ok, bool):
        return type(v) is type(ok) and v == ok
    return v == ok


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str = Field(min_length=1)
    max_tokens: Optional[int] = Field(default=None, ge=1)
    stream: bool = False
    stream_options: Optional["StreamOptions"] = None
    user: Optional[str] = None
    seed: Optional[int] = None
    # known, not implemented: accepted only at their neutral value (checked in _check_neutral)
    n: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[Dict[str, Any]] = None
    stop: Optional[Union[str, List[str]]] = None

    def _check_neutral(self) -> None:
        for name in type(self).model_fields:
            if name not in _NEUTRAL:
                continue
            v = getattr(self, name)
            if v is None or any(_same(v, ok) for ok in _NEUTRAL[name]):
                continue
            why = _WHY.get(name, "not supported by this server")
            raise ProtocolError(f"{name}={v!r} is not supported: {why}", param=name, code="unsupported_parameter")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else v
        if stops is not None and (len(stops) > 4 or any(not s for s in stops)):
            raise ValueError("expected up to 4 non-empty strings")
        return v

    @property
    def stops(self) -> List[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def model_post_init(self, _ctx) -> None:
        self._check_neutral()
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("stream_options is only allowed with stream: true", param="stream_options")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class CompletionRequest(_Request):
    """``POST /v1/completions``: one prompt, text or token ids (a list of one text is accepted too)."""

    prompt: Union[str, List[int], List[str]]
    max_tokens: Optional[int] = Field(default=16, ge=1)  # OpenAI's default for completions
    best_of: Optional[int] = None
    echo: Optional[bool] = None
    logprobs: Optional[int] = None
    suffix: Optional[str] = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError(f"a batch of {len(v)} prompts is not supported; send one request per prompt")
            v = v[0]
        if isinstance(v, list) and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        if not v:
            raise ValueError("the prompt is empty")
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant"]
    content: Union[str, List[TextPart]]
    name: Optional[str] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``: messages rendered by the tokenizer's chat template."""

    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    response_format: Optional[Dict[str, Any]] = None
    tools: Optional[List[Any]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None

    def model_post_init(self, ctx) -> None:
        super().model_post_init(ctx)
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ProtocolError(f"max_tokens={self.max_tokens} and max_completion_tokens="
                                f"{self.max_completion_tokens} disagree; send one of them", param="max_completion_tokens")

    @property
    def token_limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


_Request.model_rebuild()


def _param(loc) -> str:
    """pydantic's error location as OpenAI's ``param``: ``messages[0].content``."""
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p in ("str", "list[int]", "list[str]", "list[TextPart]") or "[" in str(p) or str(p).startswith(
                ("function-", "literal[")):
            continue  # the union branch pydantic tried, not a field
        else:
            out += ("." if out else "") + str(p)
    return out


def parse(model: type, raw: bytes):
    """The request body ``raw`` as ``model`` (module docstring); ``ProtocolError`` naming the field."""
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"the request body must be a JSON object, got {type(obj).__name__}", code="invalid_json")
    try:
        return model.model_validate(obj)
    except ProtocolError:
        raise
    except ValidationError as e:
        errs = e.errors()
        err = max(errs, key=lambda x: len(x["loc"]))  # of a union's branches, the one that got furthest
        if isinstance(err.get("ctx", {}).get("error"), ProtocolError):
            raise err["ctx"]["error"] from None
        param = _param(err["loc"])
        if err["type"] == "extra_forbidden":
            raise ProtocolError(f"unsupported parameter {param!r}", param=param,
                                code="unsupported_parameter") from None
        if err["type"] == "missing":
            raise ProtocolError(f"{param} is required", param=param, code="missing_required_parameter") from None
        msg = err["msg"].removeprefix("Value error, ")
        got = err.get("input")
        shown = "" if isinstance(got, (dict, list)) and len(json.dumps(got)) > 80 else f" (got {json.dumps(got)})"
        raise ProtocolError(f"{param}: {msg}{shown}", param=param) from None


# ------------------------------------------------------------------ responses


def usage(prompt_tokens: int, completion_tokens: int) -> Dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion(rid: str, model: str, text: str, finish: str, prompt_tokens: int, completion_tokens: int,
               created: Optional[int] = None) -> Dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created or int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            "usage": usage(prompt_tokens, completion_tokens)}


def completion_chunk(rid: str, model: str, created: int, text: str, finish: Optional[str] = None) -> Dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat_completion(rid: str, model: str, text: str, finish: str, prompt_tokens: int, completion_tokens: int,
                    created: Optional[int] = None) -> Dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": created or int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish}],
            "usage": usage(prompt_tokens, completion_tokens)}


def chat_chunk(rid: str, model: str, created: int, delta: Dict[str, str], finish: Optional[str] = None) -> Dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, prompt_tokens: int, completion_tokens: int):
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def sse(obj) -> bytes:
    """One server-sent event carrying ``obj`` as JSON (or the literal ``[DONE]``)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "ProtocolError", "chat_chunk",
           "chat_completion", "completion", "completion_chunk", "error_body", "parse", "sse", "usage", "usage_chunk"]
