"""`create_app`: the FastAPI application (routes, errors, streaming) over one generation worker.

Threading: the event loop only parses, queues and relays; every engine and tokenizer call runs on
the worker's single thread (worker.py). A request waits for its first event before anything is
sent, so a prompt that does not fit or a timeout in the queue is still a proper 4xx/5xx even for
streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdecode.engine import SpeculativeDecoder
from specdecode.server import prom
from specdecode.server.errors import APIError, error_body, from_validation_errors
from specdecode.server.responses import DONE, Shape, sse
from specdecode.server.schemas import ChatCompletionBody, CompletionBody
from specdecode.server.telemetry import ServerMetrics
from specdecode.server.worker import (
    Delta,
    Event,
    Failed,
    Finished,
    GenerationParams,
    GenerationWorker,
    Job,
    Outcome,
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT, "/v1/models", "/health", "/metrics")
DISCONNECT_POLL_S = 0.25  # how often a waiting non-streaming request checks for its client
CLIENT_CLOSED = 499  # nginx's status for "client closed the request": only ever in /metrics

Body = TypeVar("Body", bound=BaseModel)


class _ClientGone(Exception):
    """The client of a request disconnected before its answer."""


class _DeadlineInQueue(Exception):
    """A request's timeout passed before its generation started."""


class _CountRequests:
    """Counts each response by endpoint and status when it starts (pure ASGI: streams untouched)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_request(endpoint, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


class _JobStream(StreamingResponse):
    """A stream that cancels its job however it ends: finished, client gone, or error."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()  # a no-op when the generation already ended


def _install_error_handlers(app: FastAPI) -> None:
    def reply(err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return reply(err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return reply(from_validation_errors(err.errors()))  # 400, as OpenAI (not FastAPI's 422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if err.status_code < 500 else "server_error"
        body = error_body(str(err.detail), kind)
        return JSONResponse(body, status_code=err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def crash(request: Request, err: Exception) -> JSONResponse:
        return JSONResponse(error_body("internal server error", "server_error"), status_code=500)


async def _parse(request: Request, model: type[Body]) -> Body:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise RequestValidationError(err.errors(include_url=False, include_input=False)) from None


class _Client:
    """Relays a job's events to a handler, checking every DISCONNECT_POLL_S (between events or
    while waiting for one) whether the client of a non-streaming request has gone."""

    def __init__(self, request: Request, events: asyncio.Queue[Event]) -> None:
        self.request, self.events = request, events
        self.next_check = time.monotonic() + DISCONNECT_POLL_S

    async def next_event(self, deadline: float | None = None) -> Event:
        """The job's next event; _ClientGone if the client disconnects first, _DeadlineInQueue
        if `deadline` (time.monotonic) passes first."""
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise _DeadlineInQueue
            wait = min(self.next_check, math.inf if deadline is None else deadline) - now
            if wait > 0:
                with contextlib.suppress(asyncio.TimeoutError):  # not builtin TimeoutError on 3.10
                    return await asyncio.wait_for(self.events.get(), wait)
            if time.monotonic() < self.next_check:
                continue  # woken by the deadline
            self.next_check = time.monotonic() + DISCONNECT_POLL_S
            if await self.request.is_disconnected():
                raise _ClientGone

    async def outcome(self) -> Outcome:
        """Wait for the end of the generation (the text deltas are not needed)."""
        while True:
            event = await self.next_event()
            if isinstance(event, Finished):
                return event.outcome
            if isinstance(event, Failed):
                raise event.error


def _unstarted_error(outcome: str, timeout_s: float | None) -> APIError:
    """The error for a request that ended without an answer: timed out, or stopped by shutdown."""
    if outcome == "timeout":
        return APIError(
            504,
            f"the request did not finish within the server's timeout of {timeout_s} s",
            type="timeout",
            code="timeout",
        )
    return APIError(503, "the server is shutting down", type="server_error")


def create_app(
    engine: SpeculativeDecoder,
    model_name: str,
    *,
    queue_size: int = 16,
    timeout_s: float | None = 600.0,
    max_prompt_tokens: int | None = None,
) -> FastAPI:
    """The OpenAI-compatible app serving `engine` under the name `model_name`.

    `queue_size`: requests allowed to wait while one generates (more get 429). `timeout_s`: the
    limit per request from its arrival, queueing included (None: none). `max_prompt_tokens`: a
    limit below the model's context (None: the context only).
    """
    if queue_size < 0:
        raise ValueError(f"queue_size must be >= 0 (got {queue_size})")
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"timeout must be > 0 seconds (got {timeout_s})")
    worker = GenerationWorker(engine, queue_size=queue_size, max_prompt_tokens=max_prompt_tokens)
    metrics = ServerMetrics(lambda: worker.queue_depth, lambda: worker.running)
    worker.metrics = metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="specdecode", summary="speculative decoding, OpenAI API", lifespan=lifespan)
    app.state.worker, app.state.metrics, app.state.model_name = worker, metrics, model_name
    app.add_middleware(_CountRequests, metrics=metrics)
    _install_error_handlers(app)

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "specdecode"}

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist: this server serves {model_name!r}",
                param="model",
                code="model_not_found",
            )

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "queue_depth": worker.queue_depth, "running": worker.running}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=prom.CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str) -> dict[str, Any]:
        check_model(name)
        return model_card()

    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionBody)
        check_model(body.model)
        params = _params(body, body.prompt, chat=False, max_tokens=body.max_tokens)
        return await run(request, body, params, COMPLETIONS)

    @app.post(CHAT)
    async def chat_completions(request: Request) -> Response:
        body = await _parse(request, ChatCompletionBody)
        check_model(body.model)
        prompt = body.template_messages()
        params = _params(body, prompt, chat=True, max_tokens=body.max_new_tokens)
        return await run(request, body, params, CHAT)

    async def run(request: Request, body: Any, params: GenerationParams, endpoint: str) -> Response:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def deliver(event: Event) -> None:  # called on the worker thread
            # RuntimeError: the loop is closed, the server is shutting down
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(events.put_nowait, event)

        job = Job(params, endpoint, deliver, timeout_s)
        worker.submit(job)  # APIError 429 when the queue is full
        shape = Shape(endpoint == CHAT, model_name)
        streaming = False
        client = _Client(request, events)
        deadline = None if timeout_s is None else job.arrival + timeout_s
        try:
            first = await client.next_event(deadline)
            if isinstance(first, Failed):
                raise first.error
            if isinstance(first, Finished):  # ended before it started
                raise _unstarted_error(first.outcome.finish_reason, timeout_s)
            if body.stream:
                streaming = True
                stream = _sse(shape, events, body.include_usage)
                return _JobStream(stream, on_close=lambda: worker.cancel(job))
            outcome = await client.outcome()
            if outcome.finish_reason in ("timeout", "cancelled"):
                raise _unstarted_error(outcome.finish_reason, timeout_s)
            return JSONResponse(shape.response(outcome.text, outcome.finish_reason, outcome.stats))
        except _ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        except _DeadlineInQueue:
            worker.cancel(job, outcome="timeout")  # frees its place in the queue now
            raise _unstarted_error("timeout", timeout_s) from None
        finally:
            if not streaming:
                worker.cancel(job)  # frees the queue place or stops generation; no-op if over

    return app


def _params(body: Any, prompt: Any, *, chat: bool, max_tokens: int | None) -> GenerationParams:
    return GenerationParams(
        prompt=prompt,
        chat=chat,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p if body.top_p < 1.0 else None,
        top_k=body.top_k,
        seed=body.seed,
        stops=body.stops,
        prompt_param="messages" if chat else "prompt",
    )


async def _sse(
    shape: Shape, events: asyncio.Queue[Event], include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""

    def send(chunk: dict[str, Any]) -> str:
        if include_usage:
            chunk["usage"] = None  # as OpenAI: only the last chunk carries usage
        return sse(chunk)

    if shape.chat:
        yield send(shape.chunk("", role=True))  # OpenAI's first chat chunk names the role
    while True:
        event = await events.get()
        if isinstance(event, Delta):
            yield send(shape.chunk(event.text))
        elif isinstance(event, Finished):
            yield send(shape.chunk(None, event.outcome.finish_reason))
            if include_usage:
                yield sse(shape.usage_chunk(event.outcome.stats))
            yield DONE
            return
        elif isinstance(event, Failed):  # a failure after the stream began: OpenAI's error event
            yield sse(event.error.body())
            return
