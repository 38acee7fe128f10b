"""Pure ASGI middleware (streams pass through untouched): request counts, the API key, the body's
media type and size.

Outermost first: `CountRequests` (so that 401, 415 and 413 are counted too), `RequireAPIKey` (no
byte of an unauthenticated body is read), `RequireJSON` (415 from the Content-Type header alone),
`LimitBody` (413 before the body is parsed).
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdecode.server.errors import APIError
from specdecode.server.telemetry import ServerMetrics

# FastAPI's API documentation: the schema, and the Swagger UI and ReDoc pages that render it
DOCS_PATHS = ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")
# methods whose body the /v1/* routes read
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


async def send_error(send: Send, err: APIError) -> None:
    """Answer `err` as a complete JSON response in OpenAI's error shape."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:  # ASGI servers lower-case header names
            return value
    return None


def _v1(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


class CountRequests:
    """Counts each response by endpoint and status when it starts."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, endpoints: tuple[str, ...]) -> None:
        self.app, self.metrics, self.endpoints = app, metrics, endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in self.endpoints else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_request(endpoint, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)


class RequireAPIKey:
    """`Authorization: Bearer KEY` on /v1/* and the API documentation (DOCS_PATHS; and /metrics
    when `metrics` is true), else 401."""

    def __init__(self, app: ASGIApp, api_key: str, metrics: bool = False) -> None:
        if not api_key:
            raise ValueError("the API key must not be empty")
        self.app, self.key, self.metrics = app, api_key.encode(), metrics

    def _protected(self, path: str) -> bool:
        return _v1(path) or path in DOCS_PATHS or (self.metrics and path == "/metrics")

    def _authorized(self, scope: Scope) -> bool:
        value = _header(scope, b"authorization") or b""
        scheme, _, token = value.partition(b" ")
        # compare_digest: the time taken does not tell how much of the key was right
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refused = scope["type"] == "http" and self._protected(scope["path"])
        if refused and not self._authorized(scope):
            await send_error(send, _unauthorized(_header(scope, b"authorization") is None))
            return
        await self.app(scope, receive, send)


def _unauthorized(missing: bool) -> APIError:
    message = (
        "no API key: send it in an Authorization header (Authorization: Bearer YOUR_KEY)"
        if missing
        else "incorrect API key provided"
    )
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def is_json(content_type: bytes | None) -> bool:
    """Whether a Content-Type header says JSON: `application/json`, any case, with or without
    parameters (`; charset=utf-8`)."""
    if content_type is None:
        return False
    media_type = content_type.split(b";", 1)[0].strip().lower()
    return media_type == b"application/json"


class RequireJSON:
    """415 for a request body on /v1/* that is not `Content-Type: application/json`.

    What a web page can send to another origin without the browser asking first (a CORS
    preflight) is a form (`application/x-www-form-urlencoded`, `multipart/form-data`) or
    `text/plain`: refusing them, and a body with no Content-Type, means that no page a browser
    visits can make it spend this server's compute. A JSON body from another origin needs a
    preflight, which this server does not answer with CORS headers, so the browser never sends it.
    Only the header is read, before any byte of the body."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        checked = scope["type"] == "http" and scope["method"] in BODY_METHODS
        if checked and _v1(scope["path"]) and not is_json(_header(scope, b"content-type")):
            await send_error(send, _not_json(_header(scope, b"content-type")))
            return
        await self.app(scope, receive, send)


def _not_json(content_type: bytes | None) -> APIError:
    sent = (
        "no Content-Type"
        if content_type is None
        else f"Content-Type {content_type.decode('latin-1')!r}"
    )
    return APIError(
        415,
        f"the request body must be JSON, sent with Content-Type: application/json (got {sent})",
        code="unsupported_media_type",
    )


class LimitBody:
    """413 for a body over `max_bytes`: from Content-Length before reading, else while reading.

    The bytes are counted as the app receives them, so a chunked body is cut off at the limit, not
    read to its end. The server (uvicorn) discards whatever the client still sends.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1 (got {max_bytes})")
        self.app, self.max_bytes = app, max_bytes

    def too_large(self, size: int | None) -> APIError:
        limit = f"at most {self.max_bytes} bytes (--max-body-bytes)"
        what = "is larger" if size is None else f"has {size} bytes"
        return APIError(
            413, f"the request body {what}: this server accepts {limit}", code="request_too_large"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await send_error(send, self.too_large(int(declared)))
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # raised inside the handler's body read: the app's APIError handler answers
                    raise self.too_large(None)
            return message

        await self.app(scope, counting_receive, send)
