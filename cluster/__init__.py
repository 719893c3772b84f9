"""lockserve.cluster: the user-facing front end.

- ``engine_client``: the contract between the HTTP server and an engine
  (``EngineClient``, ``SamplingParams``, ``RequestOptions``, ``TokenEvent``, ``RequestError``).
- ``server``: ``build_app(engine, config)``, the OpenAI-compatible FastAPI app.
- ``runner``: ``serve_app(engine, config)`` (blocking, uvicorn + uvloop) and ``BackgroundServer``.
- ``metrics``: per-app Prometheus registry; ``cli``: the ``lockserve`` command.
"""

from lockserve.cluster.engine_client import (
    EngineClient,
    RequestError,
    RequestOptions,
    SamplingParams,
    TokenEvent,
)
from lockserve.cluster.runner import BackgroundServer, serve_app
from lockserve.cluster.server import build_app

__all__ = [
    "BackgroundServer",
    "EngineClient",
    "RequestError",
    "RequestOptions",
    "SamplingParams",
    "TokenEvent",
    "build_app",
    "serve_app",
]
