"""One streamed request to any OpenAI-compatible endpoint, on the standard library only.

`Endpoint.parse` takes a base URL (`http://HOST:PORT`, a path prefix and `/v1` allowed);
`probe` lists the models of `GET /v1/models` (and says clearly when the endpoint cannot be
reached); `stream_one` POSTs one streamed completion on a fresh connection and times its
server-sent events as they arrive: the first content chunk (time to first token), the gaps
between content chunks (a server may put several tokens in one chunk), the whole request, and
the completion tokens from the final `usage` chunk (`stream_options.include_usage`) where the
server sends one, else the number of content chunks (`token_source` says which). A failure (an
HTTP error, 429, a reset connection, a timeout, an error event in the stream) is an `Outcome`
with its kind, never an exception.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

OK, RATE_LIMITED = "ok", "rate_limited"
HTTP_ERROR, CONNECTION, TIMEOUT, STREAM_ERROR = (
    "http_error",
    "connection",
    "timeout",
    "stream_error",
)
KINDS = (OK, RATE_LIMITED, HTTP_ERROR, CONNECTION, TIMEOUT, STREAM_ERROR)
MAX_ERROR_CHARS = 300  # of a server's error message kept in a record


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server's base URL (everything before `/v1/...`)."""

    scheme: str
    host: str
    port: int | None
    prefix: str  # a path before /v1, "" for none
    api_key: str | None = None

    @classmethod
    def parse(cls, url: str, api_key: str | None = None) -> Endpoint:
        """`http://HOST:PORT`, `https://HOST/PREFIX`, with or without a trailing `/v1`."""
        parsed = urllib.parse.urlsplit(url.strip())
        expected = "expected a base URL such as http://127.0.0.1:8000 (a trailing /v1 is optional)"
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"--endpoint {url!r}: {expected}")
        try:
            port = parsed.port
        except ValueError:
            raise ValueError(f"--endpoint {url!r}: not a valid port; {expected}") from None
        if parsed.query or parsed.fragment:
            raise ValueError(f"--endpoint {url!r}: no query or fragment; {expected}")
        prefix = parsed.path.rstrip("/")
        prefix = prefix.removesuffix("/v1")
        return cls(parsed.scheme, parsed.hostname, port, prefix, api_key or None)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        port = "" if self.port is None else f":{self.port}"
        return f"{self.scheme}://{host}{port}{self.prefix}"

    def path(self, route: str) -> str:
        return self.prefix + route

    def connection(self, timeout_s: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout_s)

    def headers(self, body: bool = False) -> dict[str, str]:
        headers = {"Accept": "text/event-stream" if body else "application/json"}
        if body:
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


def get(endpoint: Endpoint, route: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
    """`GET route` on a fresh connection: (status, body); ValueError when it cannot be reached."""
    conn = endpoint.connection(timeout_s)
    try:
        conn.request("GET", endpoint.path(route), headers=endpoint.headers())
        response = conn.getresponse()
        return response.status, response.read()
    except (OSError, http.client.HTTPException) as err:
        where = f"{endpoint.url} (GET {endpoint.path(route)})"
        raise ValueError(f"cannot reach {where}: {_reason(err)}") from None
    finally:
        conn.close()


def probe(endpoint: Endpoint, timeout_s: float = 10.0) -> list[str]:
    """The model ids `GET /v1/models` lists; ValueError when the endpoint cannot be reached or
    does not answer with an OpenAI model list."""
    where = f"{endpoint.url} (GET {endpoint.path('/v1/models')})"
    status, raw = get(endpoint, "/v1/models", timeout_s)
    if status != 200:
        raise ValueError(f"{where} answered HTTP {status}: {error_message(raw)}")
    try:
        data = json.loads(raw)["data"]
        return [str(model["id"]) for model in data]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{where} did not answer with an OpenAI model list") from None


@dataclass
class Outcome:
    """What one streamed request did; times in seconds from just before it was sent."""

    kind: str  # one of KINDS
    status: int | None = None  # the HTTP status; None: no response
    error: str | None = None
    ttft_s: float | None = None  # the first content chunk
    latency_s: float = 0.0  # until [DONE] (or the failure)
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks
    chunks: int = 0  # content chunks (non-empty text)
    completion_tokens: int | None = None
    token_source: str | None = None  # "usage" (the server's count) or "chunks"
    prompt_tokens: int | None = None  # from usage, where sent
    finish_reason: str | None = None
    retry_after_s: float | None = None  # a 429's Retry-After
    text: str = ""  # the content chunks' text, joined


def stream_one(
    endpoint: Endpoint,
    route: str,
    body: dict[str, Any],
    *,
    chat: bool,
    timeout_s: float,
    clock: Callable[[], float] = time.perf_counter,
) -> Outcome:
    """POST `body` (with `stream: true`) to `route` on a new connection and time its events.
    `timeout_s` bounds each wait for the server (connecting, or the next bytes)."""
    start = clock()
    outcome = Outcome(kind=OK)
    conn = endpoint.connection(timeout_s)
    try:
        payload = json.dumps(body).encode()
        conn.request("POST", endpoint.path(route), body=payload, headers=endpoint.headers(True))
        response = conn.getresponse()
        outcome.status = response.status
        if response.status != 200:
            raw = response.read(65536)
            outcome.kind = RATE_LIMITED if response.status == 429 else HTTP_ERROR
            outcome.error = f"HTTP {response.status}: {error_message(raw)}"
            outcome.retry_after_s = _seconds(response.getheader("Retry-After"))
        else:
            _read_stream(iter(response.readline, b""), outcome, chat, start, clock)
    except TimeoutError as err:
        outcome.kind, outcome.error = TIMEOUT, f"no answer within {timeout_s:g} s ({_reason(err)})"
    except (OSError, http.client.HTTPException) as err:
        outcome.kind, outcome.error = CONNECTION, _reason(err)
    finally:
        conn.close()
    outcome.latency_s = clock() - start
    if outcome.kind == OK and outcome.completion_tokens is None:
        outcome.completion_tokens, outcome.token_source = outcome.chunks, "chunks"
    return outcome


def _read_stream(
    lines: Iterable[bytes], outcome: Outcome, chat: bool, start: float, clock: Callable[[], float]
) -> None:
    last = None
    for data in sse_data(lines):
        now = clock()
        if data.strip() == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            outcome.kind, outcome.error = STREAM_ERROR, f"an event is not JSON: {data[:80]!r}"
            return
        if not isinstance(chunk, dict):
            outcome.kind, outcome.error = STREAM_ERROR, f"an event is not an object: {data[:80]!r}"
            return
        if "error" in chunk:  # OpenAI's error event after the stream began
            outcome.kind, outcome.error = STREAM_ERROR, f"error event: {error_message(data)}"
            return
        usage = chunk.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            outcome.completion_tokens, outcome.token_source = usage["completion_tokens"], "usage"
            if isinstance(usage.get("prompt_tokens"), int):
                outcome.prompt_tokens = usage["prompt_tokens"]
        if _content(chunk, outcome, chat):
            outcome.chunks += 1
            if last is None:
                outcome.ttft_s = now - start
            else:
                outcome.itl_s.append(now - last)
            last = now
    outcome.kind, outcome.error = STREAM_ERROR, "the stream ended without data: [DONE]"


def _content(chunk: dict[str, Any], outcome: Outcome, chat: bool) -> bool:
    """Whether `chunk` carries new text (noting a finish_reason on the way)."""
    found = False
    choices = chunk.get("choices")
    for choice in choices if isinstance(choices, list) else []:
        if not isinstance(choice, dict):
            continue
        if choice.get("finish_reason"):
            outcome.finish_reason = str(choice["finish_reason"])
        delta = choice.get("delta")
        text = (
            (delta.get("content") if isinstance(delta, dict) else None)
            if chat
            else choice.get("text")
        )
        if isinstance(text, str) and text != "":
            outcome.text += text
            found = True
    return found


def sse_data(lines: Iterable[bytes]) -> Iterator[str]:
    """The data of each server-sent event, as soon as its closing blank line arrives (several
    `data:` lines of one event joined by newlines; comments and other fields skipped)."""
    data: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value.removeprefix(" "))
    if data:
        yield "\n".join(data)


def error_message(raw: bytes | str) -> str:
    """The message of an OpenAI-shaped error body, else the body's start."""
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    try:
        error = json.loads(text)["error"]
        message = error["message"] if isinstance(error, dict) else error
    except (ValueError, KeyError, TypeError):
        message = text
    message = " ".join(str(message).split()) or "(empty body)"
    return message[:MAX_ERROR_CHARS]


def _seconds(header: str | None) -> float | None:
    try:
        return max(0.0, float(header)) if header is not None else None
    except ValueError:
        return None  # an HTTP date: not worth parsing for a benchmark


def _reason(err: BaseException) -> str:
    return str(err) or type(err).__name__
