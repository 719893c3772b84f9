"""Pure ASGI middlewares that run before any request body is parsed.

``BearerAuthMiddleware`` rejects unauthenticated requests before their body is
read; ``BodyLimitMiddleware`` reads the body itself, answers 413 as soon as it
grows past the limit, and replays it to the app. Both answer in the OpenAI
error shape so clients see one format for every error.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


async def send_error(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": head + (headers or [])})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class BearerAuthMiddleware:
    """401 unless ``Authorization: Bearer <api_key>``; paths in ``open_paths`` need no key."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = frozenset({"/health"})):
        if not api_key:
            raise ValueError("api_key must be a non-empty string")
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open_paths:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self._expected):  # constant time: no key-guessing by timing
            await self.app(scope, receive, send)
            return
        reason = "missing Authorization header" if not given else "invalid API key"
        body = error_body(
            f"{reason}: send 'Authorization: Bearer <api key>'",
            "invalid_request_error",
            code="invalid_api_key",
        )
        await send_error(send, 401, body, [(b"www-authenticate", b"Bearer")])


class BodyLimitMiddleware:
    """413 for request bodies over ``max_bytes``, checked on Content-Length and while reading."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"max_bytes ({max_bytes}) must be >= 1")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send, int(declared))
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body; nothing to answer
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._reject(send, len(body))
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), receive), send)

    async def _reject(self, send: Send, size: int) -> None:
        message = (
            f"request body ({size} bytes) exceeds the limit of {self.max_bytes} bytes (server.max_body_bytes)"
        )
        await send_error(send, 413, error_body(message, "invalid_request_error", code="request_too_large"))


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that yields ``body`` once, then defers to the real one (for disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
