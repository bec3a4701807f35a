"""The HTTP routes: an OpenAI-compatible API on FastAPI over a ``Service`` (``generation.py``).

    POST /v1/completions        prompt (text or token ids) -> text; ``stream: true``: server-sent events
    POST /v1/chat/completions   messages -> the tokenizer's chat template -> the assistant's reply
    GET  /v1/models[/{id}]      the one served model (with its ``max_model_len``)
    GET  /health                200 while the server accepts requests, 503 once it shuts down
    GET  /metrics               Prometheus text format (``metrics.py`` lists the series)

Contract: every error is a JSON body ``{"error": {"message", "type", "param", "code"}}`` with a 4xx / 5xx
status: 400 for a malformed or invalid request (``param`` names the field), 404 for an unknown model
or route, 429 when the engine's queue is full (at once, never a wait), 503 while shutting down. A
streamed response sends ``data: {chunk}`` events in OpenAI's chunk format and ends with ``data: [DONE]``;
with ``stream_options: {"include_usage": true}`` a last chunk carries the usage. The response's
headers go out with the first token, so a refused request gets its status code, not a broken stream.
If the client disconnects, before or during the stream, its request is cancelled on the engine (its KV
blocks are free at the next step). On shutdown (``lifespan``) the service stops accepting (503) and the
engine stops after the HTTP server has let the in-flight requests finish (``server.py``).
"""
from __future__ import annotations

import contextlib
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..errors import AdmissionError, EngineError
from . import protocol as P
from .generation import ClientGone, Generation, Service, until_disconnected
from .metrics import CONTENT_TYPE

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _json(obj, status: int = 200) -> Response:
    return Response(json.dumps(obj, separators=(",", ":")), status_code=status, media_type="application/json")


def create_app(svc: Service, stop_engine_on_shutdown: bool = True) -> FastAPI:
    """The FastAPI app serving ``svc`` (module docstring). ``stop_engine_on_shutdown``: the app's lifespan
    stops the engine when the server shuts down."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        svc.accepting = True
        yield
        svc.accepting = False
        if stop_engine_on_shutdown:
            svc.engine.stop(wait=False)  # the HTTP server has let its requests finish (or cancelled them)

    app = FastAPI(title="spear_compile", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(P.ProtocolError)
    async def _protocol_error(request, e: P.ProtocolError):
        return _json(e.body(), e.status)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return _json(P.error_body(f"{request.method} {request.url.path}: {e.detail}", kind,
                                  code="not_found" if e.status_code == 404 else None), e.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request, e: Exception):
        return _json(P.error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), 500)

    @app.get("/health")
    async def health():
        ok = svc.accepting and svc.engine.running
        return _json({"status": "ok" if ok else "unavailable", "model": svc.model_name, **svc.engine.stats()},
                     200 if ok else 503)

    def _card():
        return {"id": svc.model_name, "object": "model", "created": svc.created, "owned_by": "spear_compile",
                "max_model_len": svc.max_model_len}

    @app.get("/v1/models")
    async def models():
        return _json({"object": "list", "data": [_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        svc.check_model(model_id)
        return _json(_card())

    @app.get("/metrics")
    async def metrics():
        return Response(svc.metrics.render(), media_type=CONTENT_TYPE)

    async def _parse(request: Request, kind):
        try:
            return P.parse(kind, await request.body())
        except P.ProtocolError:
            svc.metrics.reject("invalid")
            raise

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse(request, P.CompletionRequest)
        svc.check_model(req.model)
        ids = svc.encode_prompt(req.prompt)
        m = svc.limit(ids, req.max_tokens, "prompt")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        gen = svc.generation(ids, m, rid, "completions", req.stops)

        def chunk(text, finish=None):
            return P.completion_chunk(rid, svc.model_name, created, text, finish)

        if req.stream:
            await _started(request, gen)
            usage = req.stream_options is not None and req.stream_options.include_usage
            return StreamingResponse(_events(gen, chunk, lambda: chunk("", gen.finish_reason), usage, created,
                                             "text_completion"), media_type="text/event-stream", headers=SSE_HEADERS)
        text = await _whole(request, gen)
        return _json(P.completion(rid, svc.model_name, text, gen.finish_reason, gen.prompt_tokens,
                                  len(gen.tokens), created))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _parse(request, P.ChatCompletionRequest)
        svc.check_model(req.model)
        ids = svc.encode_chat(req)
        m = svc.limit(ids, req.token_limit, "messages")
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        gen = svc.generation(ids, m, rid, "chat", req.stops)

        def chunk(text, finish=None, first=False):
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            return P.chat_chunk(rid, svc.model_name, created, delta, finish)

        if req.stream:
            await _started(request, gen)
            usage = req.stream_options is not None and req.stream_options.include_usage

            async def events():
                yield P.sse(chunk("", first=True))
                async for e in _events(gen, chunk, lambda: P.chat_chunk(rid, svc.model_name, created, {},
                                                                        gen.finish_reason),
                                       usage, created, "chat.completion.chunk"):
                    yield e

            return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)
        text = await _whole(request, gen)
        return _json(P.chat_completion(rid, svc.model_name, text, gen.finish_reason, gen.prompt_tokens,
                                       len(gen.tokens), created))

    return app


async def _started(request: Request, gen: Generation) -> None:
    """Admit ``gen`` and wait for its first token; a client gone meanwhile cancels it (an empty 499)."""
    try:
        await until_disconnected(request, gen.start())
    except ClientGone:
        await gen.close("cancelled")
        raise _Gone() from None


async def _whole(request: Request, gen: Generation) -> str:
    try:
        return await until_disconnected(request, gen.text())
    except ClientGone:
        await gen.close("cancelled")
        raise _Gone() from None
    except (EngineError, AdmissionError) as e:
        raise P.ProtocolError(f"the request failed: {e}", status=503, code="engine_error", kind="server_error") from None


class _Gone(P.ProtocolError):
    """The client left: nobody reads the response (nginx's 499)."""

    def __init__(self) -> None:
        super().__init__("client disconnected", status=499, code="client_disconnected")


async def _events(gen: Generation, chunk, last, usage: bool, created: int, obj: str):
    """The stream's events after the first token: a chunk per text delta, the finish chunk, the usage
    chunk (if asked), ``[DONE]``. An engine failure mid-stream sends an error event before ``[DONE]``;
    a client gone (the task cancelled) ends it at once, and ``Generation`` cancels the request."""
    try:
        async for d in gen.deltas():
            yield P.sse(chunk(d))
        yield P.sse(last())
        if usage:
            yield P.sse(P.usage_chunk(gen.request_id, gen.svc.model_name, created, obj, gen.prompt_tokens,
                                      len(gen.tokens)))
    except (EngineError, AdmissionError) as e:
        yield P.sse(P.error_body(f"the request failed: {e}", "server_error", code="engine_error"))
    yield P.sse("[DONE]")


__all__ = ["create_app"]
