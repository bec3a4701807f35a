"""One generation request on the engine, as the HTTP routes need it.

``Service`` holds what every request shares: the ``Engine`` (started), its tokenizer, the served model
name, the limits (``max_model_len``: prompt + output tokens; ``max_tokens``: the most output tokens
one request may ask for) and the ``Metrics``. It turns a validated request into prompt token ids
(``encode_prompt``; ``encode_chat`` through the tokenizer's chat template), checks the limits
(``ProtocolError`` naming ``max_tokens`` or the prompt field) and starts a ``Generation``.

``Generation`` is the request's life: ``await start()`` admits it on the engine and waits for its first
token (a full queue is ``ProtocolError`` 429 ``queue_full`` at once, never a wait; a stopping server
503), then ``deltas()`` yields the rest as text deltas (incremental detokenization: the text of all
tokens so far, decoded with ``skip_special_tokens``, less what was sent; a trailing incomplete UTF-8
character is held back), so the deltas add up to ``tokenizer.decode(tokens, skip_special_tokens=True)``,
what ``Engine.generate(..., output="text")`` returns; with stop strings, that text up to the first one
(finish reason ``"stop"``; the request is cancelled on the engine there). ``close()`` ends it: a request left before its
end (client disconnect, task cancelled) is cancelled on the engine, which frees its KV blocks before
the next step. Timings go to the metrics: TTFT from ``Generation``'s creation (the request's arrival)
to its first token, ITL between successive tokens.

``until_disconnected(request, awaitable)`` runs an awaitable but cancels it when the HTTP client goes
away first: the non-streaming routes and the wait for a stream's first token use it (once a stream's
response has started, Starlette itself cancels it when the client disconnects).
"""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, List, Optional, Sequence

from ..errors import AdmissionError, EngineError
from .metrics import Metrics
from .protocol import ChatCompletionRequest, ProtocolError

_END = object()


class ClientGone(Exception):
    """The HTTP client disconnected before the response was sent."""


async def until_disconnected(request, awaitable):
    """``await awaitable``, or cancel it and raise ``ClientGone`` if ``request``'s client disconnects first."""
    task = asyncio.ensure_future(awaitable)

    async def watch():
        while True:
            if (await request.receive())["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001  (the client is gone: nobody to tell)
                pass
            raise ClientGone()
    return task.result()


class Service:
    """What the routes share (module docstring). ``eos`` is the set of end-of-sequence token ids (a
    request that ended on one finished with ``"stop"``, else ``"length"``)."""

    def __init__(self, engine, tokenizer, model_name: str, max_model_len: int, max_tokens: int,
                 metrics: Metrics) -> None:
        if tokenizer is None:
            raise ValueError("Service: the server needs the model's tokenizer")
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_model_len, self.max_tokens, self.metrics = max_model_len, max_tokens, metrics
        eos = engine.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        self.accepting = True
        self.created = int(time.time())

    # -- requests to prompt ids

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            self.metrics.reject("unknown_model")
            raise ProtocolError(f"model {name!r} does not exist; this server serves {self.model_name!r}",
                                param="model", status=404, code="model_not_found")

    def encode_prompt(self, prompt) -> List[int]:
        if isinstance(prompt, str):
            ids = list(self.tokenizer(prompt).input_ids)
        else:
            vocab = len(self.tokenizer)
            bad = [t for t in prompt if t >= vocab]
            if bad:
                raise ProtocolError(f"prompt: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                                    param="prompt")
            ids = list(prompt)
        if not ids:
            raise ProtocolError("prompt: it encodes to no tokens", param="prompt")
        return ids

    def encode_chat(self, req: ChatCompletionRequest) -> List[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ProtocolError(f"model {self.model_name!r} has no chat template; use /v1/completions",
                                param="messages")
        msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
        out = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(t) for t in ids]

    def limit(self, ids: List[int], max_tokens: Optional[int], prompt_param: str) -> int:
        """The request's output budget: ``max_tokens`` (or, left out, what the context leaves, at most the
        server's ``max_tokens``), checked against both limits."""
        room = self.max_model_len - len(ids)
        if room < 1:
            self.metrics.reject("too_long")
            raise ProtocolError(f"{prompt_param}: {len(ids)} tokens leave no room for output in the server's "
                                f"max_model_len of {self.max_model_len} tokens", param=prompt_param,
                                code="context_length_exceeded")
        if max_tokens is None:
            return min(room, self.max_tokens)
        if max_tokens > self.max_tokens:
            self.metrics.reject("too_long")
            raise ProtocolError(f"max_tokens={max_tokens} is more than this server allows per request "
                                f"({self.max_tokens})", param="max_tokens")
        if max_tokens > room:
            self.metrics.reject("too_long")
            raise ProtocolError(f"max_tokens={max_tokens}: the prompt's {len(ids)} tokens plus {max_tokens} exceed "
                                f"the server's max_model_len of {self.max_model_len} tokens", param="max_tokens",
                                code="context_length_exceeded")
        return max_tokens

    def generation(self, ids: List[int], max_tokens: int, request_id: str, endpoint: str,
                   stops: Sequence[str] = ()) -> "Generation":
        if not self.accepting or not self.engine.running:
            self.metrics.reject("shutting_down")
            raise ProtocolError("the server is shutting down; retry on another replica", status=503,
                                code="shutting_down", kind="server_error")
        return Generation(self, ids, max_tokens, request_id, endpoint, stops)


class Generation:
    """One request's tokens and text (module docstring)."""

    def __init__(self, svc: Service, ids: List[int], max_tokens: int, request_id: str, endpoint: str,
                 stops: Sequence[str] = ()) -> None:
        self.svc, self.ids, self.max_tokens, self.request_id, self.endpoint = svc, ids, max_tokens, request_id, endpoint
        self.stops, self.stopped = list(stops), False
        self.tokens: List[int] = []
        self.t_arrival = time.perf_counter()
        self._t_last: Optional[float] = None
        self._agen = svc.engine.astream(ids, max_tokens, request_id=request_id)
        self._first: Optional[int] = None
        self._sent = ""
        self._outcome: Optional[str] = None
        svc.metrics.enter()

    @property
    def prompt_tokens(self) -> int:
        return len(self.ids)

    @property
    def finish_reason(self) -> str:
        return "stop" if self.stopped or self.tokens and (self.tokens[-1] in self.svc.eos or len(self.tokens) < self.max_tokens) \
            else "length"

    async def _next(self):
        try:
            t = await self._agen.__anext__()
        except StopAsyncIteration:
            return _END
        now = time.perf_counter()
        if self._t_last is None:
            self.svc.metrics.first_token(now - self.t_arrival)
        else:
            self.svc.metrics.gap(now - self._t_last)
        self._t_last = now
        self.tokens.append(t)
        self.svc.metrics.generation_tokens.inc()
        return t

    async def start(self) -> None:
        """Admit the request and wait for its first token (``ProtocolError`` if it is refused or fails)."""
        try:
            self._first = await self._next()
        except AdmissionError as e:
            await self.close("rejected")
            if e.limit == "max_queue":
                self.svc.metrics.reject("queue_full")
                raise ProtocolError(f"the server is at capacity: {e}", status=429, code="queue_full",
                                    kind="rate_limit_exceeded") from None
            self.svc.metrics.reject("too_long")
            raise ProtocolError(str(e), param="max_tokens", code="context_length_exceeded") from None
        except EngineError as e:
            await self.close("failed")
            raise ProtocolError(f"the request failed: {e}", status=503, code="engine_error", kind="server_error") from None
        except BaseException:
            await self.close("cancelled")
            raise
        self.svc.metrics.prompt_tokens.inc(len(self.ids))

    def _delta(self, final: bool = False) -> str:
        """The text not sent yet. With stop strings: the text ends before the first one found (``stopped``),
        and a tail that could be the start of one is held back until the next token decides."""
        text = self.svc.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 character: wait for the rest of it
        end = len(text)
        for s in self.stops:
            i = text.find(s)
            if 0 <= i < end:
                end, self.stopped = i, True
        if not self.stopped and not final:
            end -= max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        text = text[:end]
        delta = text[len(self._sent):] if text.startswith(self._sent) else ""
        self._sent += delta
        return delta

    async def deltas(self) -> AsyncIterator[str]:
        """The text deltas after ``start()``, the first token's included; ends when the request ends and
        closes the generation (cancelling it on the engine if left early). Engine failures raise ``EngineError``."""
        outcome = "cancelled"
        try:
            t = self._first
            while t is not _END:
                d = self._delta()
                if d:
                    yield d
                if self.stopped:
                    break  # a stop string: close() cancels the rest on the engine
                t = await self._next()
            else:
                d = self._delta(final=True)
                if d:
                    yield d
            outcome = "finished"
        except (EngineError, AdmissionError):
            outcome = "failed"
            raise
        finally:
            await self.close(outcome)

    async def text(self) -> str:
        """Start, then all the text (for the non-streaming routes)."""
        await self.start()
        return "".join([d async for d in self.deltas()])

    async def close(self, outcome: str) -> None:
        if self._outcome is not None:
            return
        self._outcome = outcome
        await self._agen.aclose()  # cancels the request on the engine if it had not ended
        self.svc.metrics.leave(self.endpoint, outcome)


__all__ = ["ClientGone", "Generation", "Service", "until_disconnected"]
