"""Turning an engine's TokenEvent stream into OpenAI responses (whole or SSE chunks).

Invariant: every started request ends exactly once in the metrics (``tracker.finish``)
and, unless the engine reported a finish_reason, is aborted in the engine, whether
the client read to the end, disconnected, or the engine failed.

A stream is primed (``prime``: its first event awaited) before the response starts, so a
request that fails before producing anything (refused by the engine, no worker ready, a worker
that died) gets its real HTTP status (4xx, 503 + Retry-After, 500) instead of a 200 whose body
holds an error event. After the first event, failures can only be reported in-band.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from fastapi import Request
from lockserve.cluster.engine_client import (
    EngineClient,
    RequestError,
    RequestOptions,
    SamplingParams,
    TokenEvent,
)
from lockserve.cluster.errors import APIError, param_of
from lockserve.cluster.metrics import ServerMetrics
from lockserve.cluster.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    ErrorResponse,
    UsageInfo,
)
from pydantic import BaseModel

log = logging.getLogger(__name__)
T = TypeVar("T")
DONE = b"data: [DONE]\n\n"


@dataclass
class Job:
    """One admitted request: what to run and where its metrics go. ``arrival`` is the
    time.monotonic() at which the HTTP request arrived (the start of its TTFT)."""

    request_id: str
    created: int
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    options: RequestOptions
    include_usage: bool
    endpoint: str
    arrival: float
    metrics: ServerMetrics


@dataclass
class Result:
    """A whole (non-streamed) generation."""

    text: str
    finish_reason: str
    usage: UsageInfo


async def run_job(engine: EngineClient, job: Job) -> AsyncIterator[TokenEvent]:
    """The engine's events for ``job``, ending at the first event with a finish_reason.

    If the consumer stops early (disconnect, cancellation, error), the engine request
    is aborted; the abort is shielded so the cancellation that caused it cannot cancel it.
    """
    # Tracking starts here, not at admission: a streamed response whose client left before
    # the body started never runs this generator, and must not count as in progress.
    tracker = job.metrics.track(job.endpoint, len(job.prompt_ids), arrival=job.arrival)
    finish = "error"
    stream = None
    try:
        stream = engine.generate(job.prompt_ids, job.params, job.options, job.request_id)
        async for event in stream:
            tracker.on_event(event)
            yield event
            if event.finish_reason is not None:
                finish = event.finish_reason
                break
    except (asyncio.CancelledError, GeneratorExit):
        finish = "abort"
        raise
    finally:
        with anyio.CancelScope(shield=True):
            if finish not in ("stop", "length"):
                await engine.abort(job.request_id)
            closer = getattr(stream, "aclose", None)  # None when generate() itself raised
            if closer is not None:
                await closer()
        tracker.finish(finish)


async def collect(engine: EngineClient, job: Job) -> Result:
    """Run ``job`` to the end; user errors from the engine become 4xx APIErrors, a worker that is
    unavailable or died a 503 with Retry-After, anything else a 500."""
    texts: list[str] = []
    last: TokenEvent | None = None
    try:
        async for event in run_job(engine, job):
            texts.append(event.text)
            last = event
    except (RequestError, ValueError) as err:
        raise _as_api_error(err) from err
    except Exception as err:  # answered as a 500 here, so the connection and the server stay up
        log.error("engine failed for %s", job.request_id, exc_info=err)
        raise APIError(500, f"engine error: {type(err).__name__}: {err}") from err
    if last is None or last.finish_reason is None:
        raise APIError(500, "engine stream ended without a finish_reason")
    usage = UsageInfo.of_event(last)
    return Result(text="".join(texts), finish_reason=last.finish_reason, usage=usage)


@dataclass
class Primed:
    """A started job: its first event (None if the stream ended at once) and the rest."""

    first: TokenEvent | None
    rest: AsyncIterator[TokenEvent]

    async def aclose(self) -> None:
        """Stop the job if nobody read it to the end (aborts it in the engine). Idempotent."""
        closer = getattr(self.rest, "aclose", None)
        if closer is not None:
            with anyio.CancelScope(shield=True):
                await closer()


async def prime(engine: EngineClient, job: Job) -> Primed:
    """Start ``job`` and wait for its first event; failures before it raise APIError (4xx, 503 with
    Retry-After, 500). Cancelling this (the client left) aborts the job."""
    stream = run_job(engine, job)
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        first = None
    except (RequestError, ValueError) as err:
        raise _as_api_error(err) from err
    except Exception as err:
        log.error("engine failed for %s before its first token", job.request_id, exc_info=err)
        raise APIError(500, f"engine error: {type(err).__name__}: {err}") from err
    return Primed(first, stream)


async def completion_sse(primed: Primed, job: Job) -> AsyncIterator[bytes]:
    """SSE body of a streamed completion: one chunk per event, optional usage chunk, [DONE]."""

    def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> bytes:
        return sse(
            CompletionResponse(
                id=job.request_id, created=job.created, model=job.model, choices=choices, usage=usage
            )
        )

    async for item in _events_or_error(primed, job):
        if isinstance(item, bytes):
            yield item
        elif item.text or item.finish_reason:
            yield chunk([CompletionChoice(text=item.text, finish_reason=item.finish_reason)])
            if item.finish_reason and job.include_usage:
                yield chunk([], UsageInfo.of_event(item))
    yield DONE


async def chat_sse(primed: Primed, job: Job) -> AsyncIterator[bytes]:
    """SSE body of a streamed chat completion: a role chunk, content deltas, a finish chunk,
    an optional usage chunk, [DONE]."""

    def chunk(delta: DeltaMessage | None, finish: str | None = None, usage: UsageInfo | None = None) -> bytes:
        choices = [] if delta is None else [ChatChunkChoice(delta=delta, finish_reason=finish)]
        return sse(
            ChatCompletionChunk(
                id=job.request_id, created=job.created, model=job.model, choices=choices, usage=usage
            )
        )

    yield chunk(DeltaMessage(role="assistant", content=""))
    async for item in _events_or_error(primed, job):
        if isinstance(item, bytes):
            yield item
            continue
        if item.text:
            yield chunk(DeltaMessage(content=item.text))
        if item.finish_reason:
            yield chunk(DeltaMessage(), finish=item.finish_reason)
            if job.include_usage:
                yield chunk(None, usage=UsageInfo.of_event(item))
    yield DONE


async def _events_or_error(primed: Primed, job: Job) -> AsyncIterator[TokenEvent | bytes]:
    """Events of a primed job; an engine error after the headers went out becomes one SSE error
    event (a worker that died mid-stream: code worker_unavailable, status 503 in the message)."""
    try:
        if primed.first is not None:
            yield primed.first
        async for event in primed.rest:
            yield event
    except (RequestError, ValueError) as err:
        yield sse(ErrorResponse(error=_as_api_error(err).info()))
    except Exception as err:  # the stream is already 200: report in-band, keep the server up
        log.error("engine failed mid-stream for %s", job.request_id, exc_info=err)
        yield sse(ErrorResponse(error=APIError(500, f"engine error: {type(err).__name__}: {err}").info()))
    finally:
        await primed.aclose()


def _as_api_error(err: Exception) -> APIError:
    if isinstance(err, RequestError):
        return APIError(err.status, err.message, err.param, err.code, retry_after=err.retry_after)
    return APIError(400, str(err), param=param_of(str(err)))


# Characters that str.splitlines() (and so some SSE clients, e.g. httpx's aiter_lines) take for line
# breaks although SSE does not; JSON leaves them raw inside strings, so they are escaped here.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(body: BaseModel | dict[str, Any]) -> bytes:
    """One SSE event; its JSON holds no character any client could take for a line break."""
    text = body.model_dump_json() if isinstance(body, BaseModel) else json.dumps(body)
    return b"data: " + text.translate(_LINE_BREAKS).encode() + b"\n\n"


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """``await work``, unless the client disconnects first: then ``work`` is cancelled (which
    aborts its engine request) and None is returned."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return task.result() if task in done else None


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
