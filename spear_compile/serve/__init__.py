"""``spear serve``: an OpenAI-compatible HTTP server on the runtime's ``Engine`` (FastAPI + uvicorn).

* ``config``: ``ServeConfig`` (what to serve, limits, the KV cache, shutdown);
* ``protocol``: the OpenAI request bodies (validated, errors naming the field) and response shapes;
* ``generation``: one request on the engine (admission, text deltas, cancellation, timings);
* ``metrics``: the Prometheus series of ``/metrics``;
* ``app``: the routes; ``server``: loading the model, starting the engine, running uvicorn, shutdown;
* ``loadgen``: concurrent streaming clients (the official ``openai`` client) for load tests and the
  serving benchmark over HTTP.

Needs the ``serve`` extra (``pip install 'spear_compile[serve]'``: fastapi, uvicorn, prometheus_client);
importing ``spear_compile`` does not import this package, and this package imports them only in the
modules that use them.
"""
from .config import ServeConfig

__all__ = ["ServeConfig"]
