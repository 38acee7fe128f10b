"""`create_app`: the FastAPI application (routes, errors, streaming) over one generation worker.

Threading: the event loop only parses, queues and relays; every engine and tokenizer call runs on
the worker's single thread (worker.py). A request waits for its first event before anything is
sent, so a prompt that does not fit or a timeout in the queue is still a proper 4xx/5xx even for
streams.

Work is refused as early as it can be (limits.py): a full queue or a draining server before the
body is read, an oversized body while it is read (middleware.py), a prompt that cannot fit before
it is tokenized.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from specdecode.runtime.engine import SpeculativeDecoder
from specdecode.server.errors import APIError, error_body, from_validation_errors, shutting_down
from specdecode.server.limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_PREFIX_CACHE_MB,
    PREFILL_CHUNK,
    check_prompt_size,
)
from specdecode.server.middleware import (
    DOCS_PATHS,
    CountRequests,
    LimitBody,
    RequireAPIKey,
    RequireJSON,
)
from specdecode.server.relay import Client, ClientGone, DeadlineInQueue, JobStream, sse_events
from specdecode.server.responses import Shape
from specdecode.server.schemas import ChatCompletionBody, CompletionBody
from specdecode.server.state import ServerOptions, ServerState
from specdecode.server.telemetry import CONTENT_TYPE
from specdecode.server.worker import Event, Failed, Finished, GenerationParams, Job

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT, "/v1/models", "/health", "/metrics")
CLIENT_CLOSED = 499  # nginx's status for "client closed the request": only ever in /metrics
BODY_POLL_S = 0.05  # how often a request still reading its body checks for the drain

Body = TypeVar("Body", bound=BaseModel)


def create_app(
    engine: SpeculativeDecoder,
    model_name: str,
    *,
    queue_size: int = 16,
    max_batch: int = 8,
    max_len: int | None = None,
    timeout_s: float | None = 600.0,
    max_prompt_tokens: int | None = None,
    max_prompt_chars: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    api_key: str | None = None,
    metrics_auth: bool = False,
    prefill_chunk: int = PREFILL_CHUNK,
    prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
) -> FastAPI:
    """The OpenAI-compatible app serving `engine` under the name `model_name` (options: see
    `ServerOptions`). `app.state.server` is its `ServerState`; `await state.drain(s)` before
    uvicorn's shutdown ends it gracefully (run.py does so on SIGTERM)."""
    options = ServerOptions(
        queue_size=queue_size,
        max_batch=max_batch,
        max_len=max_len,
        timeout_s=timeout_s,
        max_prompt_tokens=max_prompt_tokens,
        max_prompt_chars=max_prompt_chars,
        max_body_bytes=max_body_bytes,
        api_key=api_key,
        metrics_auth=metrics_auth,
        prefill_chunk=prefill_chunk,
        prefix_cache_mb=prefix_cache_mb,
    )
    options.check()
    openapi, docs, oauth2_redirect, redoc = DOCS_PATHS
    # the API documentation: open without a key; with one, RequireAPIKey guards it (docs/server.md)
    app = FastAPI(
        title="specdecode",
        summary="speculative decoding, OpenAI API",
        lifespan=_lifespan,
        openapi_url=openapi,
        docs_url=docs,
        swagger_ui_oauth2_redirect_url=oauth2_redirect,
        redoc_url=redoc,
    )
    app.state.server = state = ServerState(engine, model_name, options)
    _install_middleware(app, state)
    _install_error_handlers(app)
    _add_routes(app)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    worker = app.state.server.worker
    worker.start()
    try:
        yield
    finally:
        worker.stop()


def _install_middleware(app: FastAPI, state: ServerState) -> None:
    # each add_middleware wraps the ones added before: innermost first (order: middleware.py)
    options = state.options
    app.add_middleware(LimitBody, max_bytes=options.max_body_bytes)
    app.add_middleware(RequireJSON)
    if options.api_key is not None:
        app.add_middleware(RequireAPIKey, api_key=options.api_key, metrics=options.metrics_auth)
    app.add_middleware(CountRequests, metrics=state.metrics, endpoints=ENDPOINTS)


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


def _add_routes(app: FastAPI) -> None:
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{name:path}", get_model, methods=["GET"])
    app.add_api_route(COMPLETIONS, completions, methods=["POST"])
    app.add_api_route(CHAT, chat_completions, methods=["POST"])


# -- routes -----------------------------------------------------------------------------------


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def health(request: Request) -> JSONResponse:
    state = _state(request)
    body = {
        "status": "draining" if state.draining else "ok",
        "queue_depth": state.worker.queue_depth,
        "running": state.worker.running,
    }
    return JSONResponse(body, status_code=503 if state.draining else 200)


async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_state(request).model_card()]}


async def get_model(name: str, request: Request) -> dict[str, Any]:
    state = _state(request)
    state.check_model(name)
    return state.model_card()


async def completions(request: Request) -> Response:
    state = _state(request)
    state.worker.check_room()  # 429 / 503 before the body is read
    body = await _parse(request, CompletionBody)
    state.check_model(body.model)
    params = _params(body, body.prompt, chat=False, max_tokens=body.max_tokens)
    return await _generate(request, state, body, params, COMPLETIONS)


async def chat_completions(request: Request) -> Response:
    state = _state(request)
    state.worker.check_room()
    body = await _parse(request, ChatCompletionBody)
    state.check_model(body.model)
    params = _params(body, body.template_messages(), chat=True, max_tokens=body.max_new_tokens)
    return await _generate(request, state, body, params, CHAT)


# -- generation -------------------------------------------------------------------------------


async def _read_body(request: Request) -> bytes:
    """The request's body; 503 at once if the server starts draining while it still arrives (its
    job would be refused anyway, and a slow client must not hold the shutdown). LimitBody stops
    the read at --max-body-bytes."""
    state = _state(request)
    reading = asyncio.ensure_future(request.body())
    try:
        while not state.draining:
            done, _ = await asyncio.wait({reading}, timeout=BODY_POLL_S)
            if done:
                return reading.result()
        raise shutting_down()
    except ClientDisconnect:
        raise APIError(CLIENT_CLOSED, "the client closed the connection") from None
    finally:
        reading.cancel()  # a no-op once it is done


async def _parse(request: Request, model: type[Body]) -> Body:
    raw = await _read_body(request)
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


def _params(body: Any, prompt: Any, *, chat: bool, max_tokens: int | None) -> GenerationParams:
    return GenerationParams(
        prompt=prompt,
        chat=chat,
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,  # 1.0 (no top-p) stays explicit: it overrides the model's top_p
        top_k=body.top_k,
        seed=body.seed,
        stops=body.stops,
        prompt_param="messages" if chat else "prompt",
        logprobs=body.logprob_count,
    )


def _submit(
    state: ServerState, params: GenerationParams, endpoint: str
) -> tuple[Job, asyncio.Queue[Event]]:
    """Queue a job for `params` (APIError 429/503 when there is no room); its events arrive on
    the returned queue, posted from the worker thread."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Event] = asyncio.Queue()

    def deliver(event: Event) -> None:  # called on the worker thread
        # RuntimeError: the loop is closed, the server is shutting down
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(events.put_nowait, event)

    job = Job(params, endpoint, deliver, state.options.timeout_s)
    state.worker.submit(job)
    return job, events


async def _generate(
    request: Request, state: ServerState, body: Any, params: GenerationParams, endpoint: str
) -> Response:
    timeout_s = state.options.timeout_s
    check_prompt_size(
        params.prompt,
        params.prompt_param,
        max_chars=state.max_prompt_chars,
        max_tokens=state.max_prompt_tokens,
    )
    job, events = _submit(state, params, endpoint)
    shape = Shape(endpoint == CHAT, state.model_name, state.drafting)
    client = Client(request, events)
    streaming = False
    try:
        await _started(client, None if timeout_s is None else job.arrival + timeout_s, timeout_s)
        if body.stream:
            streaming = True
            stream = sse_events(shape, events, body.include_usage)
            return JobStream(stream, on_close=lambda: state.worker.cancel(job))
        outcome = await client.outcome()
        if outcome.finish_reason not in ("stop", "length"):  # cut by the server: no answer
            raise _unstarted_error(outcome.finish_reason, timeout_s)
        return JSONResponse(
            shape.response(outcome.text, outcome.finish_reason, outcome.stats, outcome.logprobs)
        )
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    except DeadlineInQueue:
        state.worker.cancel(job, outcome="timeout")  # frees its place in the queue now
        raise _unstarted_error("timeout", timeout_s) from None
    finally:
        if not streaming:
            state.worker.cancel(job)  # frees the queue place or stops generation; no-op if over


async def _started(client: Client, deadline: float | None, timeout_s: float | None) -> None:
    """Wait for the job's first event: it started, or the error that ended it first."""
    first = await client.next_event(deadline)
    if isinstance(first, Failed):
        raise first.error
    if isinstance(first, Finished):  # ended before it started
        raise _unstarted_error(first.outcome.finish_reason, timeout_s)


def _unstarted_error(outcome: str, timeout_s: float | None) -> APIError:
    """The error for a request that ended without an answer: it timed out (504), or the server
    stopped it (503, for a client to retry elsewhere; a non-streamed request cut by the drain
    gets this, not its partial text)."""
    if outcome == "timeout":
        return APIError(
            504,
            f"the request did not finish within the server's timeout of {timeout_s} s",
            type="timeout",
            code="timeout",
        )
    return shutting_down()
