"""lockserve.cluster: the user-facing front end.

- ``engine_client``: the contract between the HTTP server and an engine
  (``EngineClient``, ``SamplingParams``, ``RequestOptions``, ``TokenEvent``, ``RequestError``).
- ``server``: ``build_app(engine, config)``, the OpenAI-compatible FastAPI app.
- ``runner``: ``serve_app(engine, config)`` (blocking, uvicorn + uvloop) and ``BackgroundServer``.
- ``metrics``: per-app Prometheus registry; ``cli``: the ``lockserve`` command.
- ``experiments``: ``lockserve bench decode``, ``experiment capacity`` and ``report``.

The names below load on first use (PEP 562), so ``lockserve.cluster.measure`` runs where the
serve extra (FastAPI, uvicorn, httpx) is not installed, e.g. a GPU machine without network.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "EngineClient": "engine_client",
    "RequestError": "engine_client",
    "RequestOptions": "engine_client",
    "SamplingParams": "engine_client",
    "TokenEvent": "engine_client",
    "BackgroundServer": "runner",
    "serve_app": "runner",
    "build_app": "server",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
