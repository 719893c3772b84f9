"""The OpenAI-compatible HTTP front end: ``build_app(engine, config)`` returns a FastAPI app.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with SSE
streaming), GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics.

A request is parsed strictly, checked against the server limits and then against
the engine (``engine.check_request``) before any token is generated, so every
user error is a 4xx in the OpenAI error shape and the server keeps serving. A
client that disconnects mid-request has its engine request aborted. Running the
app under uvicorn is ``cluster/runner.py``'s job.

Hostile input: the body limit is derived from the model's context (``PromptBounds``) unless
server.max_body_bytes sets one; a text prompt that is longer than the context could hold even
if every token were the vocabulary's longest is refused in O(1) before it is tokenised; a long
prompt is tokenised in a worker thread (at most TOKENIZE_THREADS at once), never on the event
loop. No worker ready: 503 with Retry-After, for /health too.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from lockserve.cluster.engine_client import EngineClient, RequestError, RequestOptions, SamplingParams
from lockserve.cluster.errors import APIError, describe_validation_error, param_of
from lockserve.cluster.generation import (
    Job,
    Primed,
    chat_sse,
    collect,
    completion_sse,
    prime,
    run_unless_disconnected,
)
from lockserve.cluster.metrics import ServerMetrics
from lockserve.cluster.middleware import BearerAuthMiddleware, BodyLimitMiddleware
from lockserve.cluster.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    LockserveOptions,
    ModelCard,
    ModelList,
    new_id,
    now,
)
from lockserve.configs.schema import ServerConfig
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

SSE = "text/event-stream"
ID_PREFIXES = {"completions": "cmpl", "chat": "chatcmpl"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Tokenising a long prompt can take a while; beyond this many characters it runs in a
# worker thread so the event loop keeps streaming other requests.
TOKENIZE_INLINE_CHARS = 16384
TOKENIZE_THREADS = 2  # long prompts tokenised at once: a flood of them queues, not the loop
DEFAULT_MAX_BODY_BYTES = 32 << 20  # when neither server.max_body_bytes nor the engine gives one
HEALTH_RETRY_AFTER_S = 2


def build_app(engine: EngineClient, config: ServerConfig) -> FastAPI:
    """The app serving ``engine`` under ``config``'s limits. ``config.api_key`` (if set) is required
    as a bearer token on every path but /health. Binding/auth policy for the listen address is
    checked by ``runner.resolve_server_config``, not here."""
    api = OpenAIServer(engine, config)
    app = FastAPI(title="lockserve", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.lockserve = api
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", api.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", api.get_model, methods=["GET"])
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/metrics", api.metrics_text, methods=["GET"])
    _add_error_handlers(app, api.metrics)
    app.add_middleware(BodyLimitMiddleware, max_bytes=body_limit(engine, config))
    if config.api_key is not None:  # added last = outermost: no body is read before auth
        app.add_middleware(BearerAuthMiddleware, api_key=config.api_key.get_secret_value())
    return app


def body_limit(engine: EngineClient, config: ServerConfig) -> int:
    """server.max_body_bytes, else the largest body whose prompt could fit the engine's context."""
    if config.max_body_bytes is not None:
        return config.max_body_bytes
    bounds = engine.prompt_bounds()
    return bounds.body_limit() if bounds is not None else DEFAULT_MAX_BODY_BYTES


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    async def on_api_error(_: Request, err: APIError) -> JSONResponse:
        metrics.rejected.labels(str(err.status)).inc()
        return err.response()

    async def on_request_error(_: Request, err: RequestError) -> JSONResponse:
        metrics.rejected.labels(str(err.status)).inc()
        return APIError(err.status, err.message, err.param, err.code, err.retry_after).response()

    async def on_http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return APIError(err.status_code, str(err.detail)).response(headers=getattr(err, "headers", None))

    async def on_unexpected(_: Request, err: Exception) -> JSONResponse:
        log.error("unhandled error", exc_info=err)
        return APIError(500, f"internal server error: {type(err).__name__}").response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestError, on_request_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)


class OpenAIServer:
    """Endpoint handlers over one engine; holds the app's metrics."""

    def __init__(self, engine: EngineClient, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.metrics = ServerMetrics(engine.stats)
        self.created = now()
        self.bounds = engine.prompt_bounds()
        self.defaults = engine.sampling_defaults()
        self._tokenize_limiter: anyio.CapacityLimiter | None = None  # made on the server's loop

    # ----- endpoints -------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        req = await parse_body(request, CompletionRequest)
        self._check_common(req)
        prompt = completion_prompt(req.prompt)
        params = self._sampling_params(req, "max_tokens", req.max_tokens)
        job = await self._admit(req, prompt, params, "completions", arrival, param="prompt")
        if req.stream:
            primed = await run_unless_disconnected(request, prime(self.engine, job))
            return _stream(primed, completion_sse, job)
        result = await run_unless_disconnected(request, collect(self.engine, job))
        if result is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        choice = CompletionChoice(text=result.text, finish_reason=result.finish_reason)
        body = CompletionResponse(
            id=job.request_id, created=job.created, model=job.model, choices=[choice], usage=result.usage
        )
        return JSONResponse(body.model_dump())

    async def chat_completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        req = await parse_body(request, ChatCompletionRequest)
        self._check_common(req)
        field, value = "max_tokens", req.max_tokens
        if req.max_completion_tokens is not None:
            field, value = "max_completion_tokens", req.max_completion_tokens
        params = self._sampling_params(req, field, value)
        prompt = self._chat_prompt(req)
        job = await self._admit(req, prompt, params, "chat", arrival, param="messages")
        if req.stream:
            primed = await run_unless_disconnected(request, prime(self.engine, job))
            return _stream(primed, chat_sse, job)
        result = await run_unless_disconnected(request, collect(self.engine, job))
        if result is None:
            return Response(status_code=499)
        choice = ChatChoice(message=ChatMessageOut(content=result.text), finish_reason=result.finish_reason)
        body = ChatCompletionResponse(
            id=job.request_id, created=job.created, model=job.model, choices=[choice], usage=result.usage
        )
        return JSONResponse(body.model_dump())

    async def list_models(self) -> JSONResponse:
        return JSONResponse(ModelList(data=[self._model_card()]).model_dump())

    async def get_model(self, model_id: str) -> JSONResponse:
        self._check_model(model_id)
        return JSONResponse(self._model_card().model_dump())

    async def health(self) -> JSONResponse:
        """200 "ok" (every worker ready) or "degraded" (some), 503 "unavailable" + Retry-After
        (none): what a load balancer needs to route around a restarting server."""
        health = self.engine.health()
        ready, total = health.get("ready", 0), health.get("total", 0)
        status = "ok" if ready == total and total else "degraded" if ready else "unavailable"
        body = {"status": status, "model": self.engine.model_name, **health}
        if status == "unavailable":
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(HEALTH_RETRY_AFTER_S)})
        return JSONResponse(body)

    async def metrics_text(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ----- request preparation ----------------------------------------------------

    def _model_card(self) -> ModelCard:
        return ModelCard(id=self.engine.model_name, created=self.created)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.engine.model_name:
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {self.engine.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _check_common(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        self._check_model(req.model)
        unsupported = req.unsupported_fields()
        if unsupported:
            field, reason = unsupported[0]
            raise APIError(400, reason, param=field)

    def _sampling_params(self, req: Any, field: str, max_tokens: int | None) -> SamplingParams:
        limit = self.config.max_tokens_limit
        if max_tokens is None:
            max_tokens = self.config.default_max_tokens
        if max_tokens < 1:
            raise APIError(400, f"{field} ({max_tokens}) must be >= 1", param=field)
        if max_tokens > limit:
            raise APIError(
                400, f"{field} ({max_tokens}) must be <= {limit} (server max_tokens_limit)", param=field
            )
        defaults = self.defaults  # the model's own (generation config), else the OpenAI API's
        return _contract_call(
            SamplingParams,
            max_tokens=max_tokens,
            temperature=defaults.get("temperature", 1.0) if req.temperature is None else req.temperature,
            top_p=defaults.get("top_p", 1.0) if req.top_p is None else req.top_p,
            top_k=defaults.get("top_k", 0) if req.top_k is None else req.top_k,
            seed=req.seed,
            stop=req.stop_list(),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
        )

    def _chat_prompt(self, req: ChatCompletionRequest) -> str:
        messages = [{"role": m.role, "content": message_text(m, i)} for i, m in enumerate(req.messages)]
        return _contract_call(self.engine.apply_chat_template, messages)

    async def _admit(
        self, req: Any, prompt: str | list[int], params: SamplingParams, endpoint: str, arrival: float,
        param: str,
    ) -> Job:
        """Check the prompt's size, tokenise, build options, ask the engine whether it can serve it."""
        options = request_options(req)
        self._check_size(prompt, params.max_tokens, param)
        prompt_ids = await self._tokenize(prompt, chat=endpoint == "chat")
        _contract_call(self.engine.check_request, len(prompt_ids), params, options)
        return Job(
            request_id=new_id(ID_PREFIXES[endpoint]),
            created=now(),
            model=self.engine.model_name,
            prompt_ids=prompt_ids,
            params=params,
            options=options,
            include_usage=req.include_usage(),
            endpoint=endpoint,
            arrival=arrival,
            metrics=self.metrics,
        )

    def _check_size(self, prompt: str | list[int], max_tokens: int, param: str) -> None:
        """Refuse, in O(1), a prompt that cannot fit the context whatever its tokens turn out to be."""
        if self.bounds is None:
            return
        context = self.bounds.context_tokens
        if isinstance(prompt, list):
            tokens, what = len(prompt), f"{len(prompt)} tokens"
        else:
            tokens = self.bounds.min_tokens(prompt)
            what = f"{len(prompt)} characters, at least {tokens} tokens"
        if tokens + max_tokens > context:
            raise APIError(400, f"{param} ({what}) + max_tokens ({max_tokens}) exceeds the model's context "
                                f"({context} tokens); shorten the prompt", param=param)

    async def _tokenize(self, prompt: str | list[int], chat: bool) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        tokenize = self.engine.tokenize_chat if chat else self.engine.tokenize
        if len(prompt) > TOKENIZE_INLINE_CHARS:
            if self._tokenize_limiter is None:
                self._tokenize_limiter = anyio.CapacityLimiter(TOKENIZE_THREADS)
            return await anyio.to_thread.run_sync(_contract_call, tokenize, prompt,
                                                  limiter=self._tokenize_limiter)
        return _contract_call(tokenize, prompt)


def _stream(primed: Primed | None, body: Any, job: Job) -> Response:
    """The SSE response of a primed job; 499 when the client left while it was being primed.
    The background task stops the job if the response never ran its body (client gone)."""
    if primed is None:
        return Response(status_code=499)
    return StreamingResponse(body(primed, job), media_type=SSE, headers=SSE_HEADERS,
                             background=BackgroundTask(primed.aclose))


def _contract_call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call an engine-contract function: RequestError passes through (its own status), a
    ValueError (a user error by contract) becomes a 400, any other failure a 500 answered here."""
    try:
        return fn(*args, **kwargs)
    except RequestError:
        raise
    except ValueError as err:
        raise APIError(400, str(err), param=param_of(str(err))) from err
    except Exception as err:
        log.error("engine call %s failed", getattr(fn, "__name__", fn), exc_info=err)
        raise APIError(500, f"engine error: {type(err).__name__}: {err}") from err


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """The request body validated as ``model``; 400 naming the problem otherwise."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"malformed JSON body: {err}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}")
    if SURROGATE_ESCAPE.search(raw):
        _refuse_lone_surrogates(data)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        message, param = describe_validation_error(err, model)
        raise APIError(400, message, param=param) from None


# A JSON escape of a UTF-16 surrogate: paired ones decode to one character, a lone one to a str that
# is not valid Unicode (no tokenizer or UTF-8 encoder takes it).
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abAB]")


def _refuse_lone_surrogates(data: dict) -> None:
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as err:
        char = err.object[err.start]
        raise APIError(400, f"request body holds a lone UTF-16 surrogate (\\u{ord(char):04x}), which is not "
                            "valid Unicode") from None


def completion_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    """A single prompt (text or token ids); one-element batches are unwrapped."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise APIError(
                400,
                f"prompt: batches of {len(prompt)} prompts are not supported; send one per request",
                param="prompt",
            )
        prompt = prompt[0]
    if len(prompt) == 0:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt, list):
        bad = next((i for i, t in enumerate(prompt) if t < 0), None)
        if bad is not None:
            raise APIError(
                400, f"prompt token ids must be >= 0 (got {prompt[bad]} at index {bad})", param="prompt"
            )
    return prompt


def message_text(message: Any, index: int) -> str:
    """The text of chat message ``index``; content parts other than text are refused."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise APIError(
                400,
                f"messages[{index}].content[{j}].type ({part.type!r}) is not supported; only 'text'",
                param="messages",
            )
        texts.append(part.text)
    return "".join(texts)


def request_options(req: Any) -> RequestOptions:
    """LOCKS extras from ``lockserve: {...}`` and the top-level ``budget_tokens`` shorthand."""
    extras = req.lockserve or LockserveOptions()
    budget = extras.budget_tokens
    if req.budget_tokens is not None:
        if budget is not None and budget != req.budget_tokens:
            raise APIError(
                400,
                f"budget_tokens ({req.budget_tokens}) and lockserve.budget_tokens ({budget}) "
                "disagree; set one",
                param="budget_tokens",
            )
        budget = req.budget_tokens
    return _contract_call(RequestOptions, budget_tokens=budget, tier=extras.tier, attention=extras.attention)


__all__ = ["OpenAIServer", "build_app"]
