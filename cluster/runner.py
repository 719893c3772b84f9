"""Running the front end under uvicorn (uvloop): blocking ``serve_app`` and ``BackgroundServer``.

Policy lives outside the app (``listen.py``): the API key comes from the config or the
``LOCKSERVE_API_KEY`` environment variable, and any bind address other than loopback requires
one (``resolve_server_config``). The listening socket is bound before uvicorn starts, so a busy
port is a clear ``BindError`` and port 0 gets a free port whose number is known up front.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
import time

import uvicorn
from fastapi import FastAPI
from lockserve.cluster.engine_client import EngineClient
from lockserve.cluster.listen import bind_socket, resolve_server_config
from lockserve.cluster.server import build_app
from lockserve.configs.schema import ServeConfig, ServerConfig

log = logging.getLogger(__name__)


def _uvicorn_server(app: FastAPI, config: ServerConfig) -> uvicorn.Server:
    uv = uvicorn.Config(
        app,
        loop="uvloop",
        log_level=config.log_level,
        timeout_graceful_shutdown=5,  # streams in flight get this long before being cut
        lifespan="off",
    )
    return uvicorn.Server(uv)


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve_app(
    engine: EngineClient, config: ServeConfig | ServerConfig, sock: socket.socket | None = None
) -> None:
    """Serve ``engine`` over HTTP until SIGINT or SIGTERM, then shut down gracefully and return.

    Blocks; call from the main thread. Raises ConfigError (non-loopback bind without an
    API key) or BindError before serving anything. ``sock``: a socket bound by the caller
    (``lockserve serve`` binds it before starting Ray, so a busy port fails in a second); it is
    closed on return.
    """
    server_config = config.server if isinstance(config, ServeConfig) else config
    server_config = resolve_server_config(server_config)
    sock = sock if sock is not None else bind_socket(server_config.host, server_config.port)
    app = build_app(engine, server_config)
    print(f"lockserve: serving {engine.model_name!r} at {url_of(sock)}", file=sys.stderr, flush=True)
    # uvicorn handles both signals while serving, then re-raises the one it got after
    # restoring the previous handlers; SIGTERM's default would kill the process before the
    # caller's cleanup (engine.close), so both signals end as a KeyboardInterrupt here.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        _uvicorn_server(app, server_config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # the normal way to stop a server
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class BackgroundServer:
    """The app under uvicorn in a daemon thread with its own event loop; for tests and embedding.

    ``with BackgroundServer(app) as server: httpx.get(server.url + "/health")``.
    ``config.host``/``port`` choose the address (port 0 = a free port).
    """

    def __init__(self, app: FastAPI, config: ServerConfig | None = None):
        self.config = config or ServerConfig(port=0, log_level="warning")
        self._app = app
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self.url = ""

    def start(self, timeout_s: float = 20.0) -> BackgroundServer:
        self._sock = bind_socket(self.config.host, self.config.port)
        self.url = url_of(self._sock)
        self._server = _uvicorn_server(self._app, self.config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="lockserve-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the HTTP server at {self.url} exited during startup")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the HTTP server at {self.url} did not start within {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive():
                log.error("the HTTP server thread did not stop within %.0f s", timeout_s)
        if self._sock is not None:
            self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
