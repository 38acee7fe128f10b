"""The files of `specdecode run-batch`: requests in, answers out, and an output that resumes.

Input: JSON Lines, each either a request of OpenAI's Batch API (`custom_id`, `method` "POST",
`url` "/v1/chat/completions" or "/v1/completions", `body`) or, for convenience, a plain
`{"prompt": ...}` / `{"messages": [...]}` object whose other fields are the body's (`model`
defaults to the served name; `custom_id` to "line-N", N the line's number from 1). A line that
is not a request (not JSON, a field missing) is that line's error; a file that is not JSON Lines
at all (its first line is not JSON, it is not UTF-8, it holds no request) or that names one
`custom_id` twice is refused whole (`BatchFileError`).

Output: one line per request in the Batch API's output format (`id`, `custom_id`, `response`
with the server's `status_code` and `body`, or `error`). Lines are appended as requests finish
(each written whole and flushed to disk before the next); once every request has its line, the
file is rewritten in the input's order. Running again over a partial output keeps the lines it
has (a last line cut short by a crash is dropped) and answers the rest: nothing is computed
twice, nothing is written twice.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
URLS = (CHAT, COMPLETIONS)


class BatchFileError(ValueError):
    """The input or output file as a whole cannot be used (one line says why)."""


@dataclass(frozen=True)
class BatchRequest:
    """One input line: its request (`url`, `body`), or the `error` that stops it being one."""

    line: int  # from 1
    custom_id: str
    url: str | None = None
    body: dict[str, Any] | None = None
    error: dict[str, str] | None = None  # {"code", "message"}


def _line_error(line: int, custom_id: str, code: str, message: str) -> BatchRequest:
    return BatchRequest(line, custom_id, error={"code": code, "message": f"line {line}: {message}"})


def parse_line(line: int, text: str, model: str) -> BatchRequest:
    """The request on input line `line` (`model`: the name a plain line's body gets)."""
    default_id = f"line-{line}"
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as err:
        return _line_error(line, default_id, "invalid_json", f"not valid JSON ({err})")
    if not isinstance(data, dict):
        return _line_error(line, default_id, "invalid_request", "not a JSON object")
    custom_id = data.get("custom_id", default_id)
    if not isinstance(custom_id, str) or not custom_id:
        return _line_error(line, default_id, "invalid_request", "custom_id must be a string")
    if any(key in data for key in ("body", "url", "method")):  # the Batch API's request
        for key in ("custom_id", "method", "url", "body"):
            if key not in data:
                return _line_error(line, custom_id, "invalid_request", f"{key} is missing")
        if data["method"] != "POST":
            return _line_error(line, custom_id, "invalid_request", "method must be POST")
        if data["url"] not in URLS:
            return _line_error(
                line, custom_id, "invalid_url", f"url must be one of {', '.join(URLS)}"
            )
        url, body = data["url"], data["body"]
    elif "messages" in data or "prompt" in data:  # a plain line: the body itself
        url = CHAT if "messages" in data else COMPLETIONS
        body = {key: value for key, value in data.items() if key != "custom_id"}
        body.setdefault("model", model)
    else:
        return _line_error(
            line,
            custom_id,
            "invalid_request",
            "needs the Batch API's custom_id, method, url and body, or a prompt or messages",
        )
    if not isinstance(body, dict):
        return _line_error(line, custom_id, "invalid_request", "body must be a JSON object")
    if body.get("stream"):
        return _line_error(line, custom_id, "invalid_request", "stream is not supported in a batch")
    return BatchRequest(line, custom_id, url, body)


def read_requests(path: Path, model: str) -> list[BatchRequest]:
    """Every request of the input file, in order (blank lines skipped). BatchFileError for a file
    that is not JSON Lines or that names a custom_id twice."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise BatchFileError(f"cannot read {path}: {err.strerror or err}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BatchFileError(f"{path} is not JSON Lines: it is not UTF-8 text") from None
    requests: list[BatchRequest] = []
    seen: dict[str, int] = {}
    # lines end at "\n" only: str.splitlines would also cut at characters a JSON string may
    # hold raw (U+2028, U+0085, ...)
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        request = parse_line(number, line, model)
        if not requests and request.error and request.error["code"] == "invalid_json":
            raise BatchFileError(f"{path} is not JSON Lines: line {number} is not a JSON value")
        if request.custom_id in seen:
            raise BatchFileError(
                f"{path}: custom_id {request.custom_id!r} is on lines {seen[request.custom_id]} "
                f"and {number}: each request needs its own"
            )
        seen[request.custom_id] = number
        requests.append(request)
    if not requests:
        raise BatchFileError(f"{path} holds no requests")
    return requests


def answer_line(custom_id: str, status: int, body: Any) -> dict[str, Any]:
    """An output line for the server's answer (`status`, its JSON `body`)."""
    response = {"status_code": status, "request_id": uuid.uuid4().hex, "body": body}
    return _output_line(custom_id, response, None)


def error_line(request: BatchRequest) -> dict[str, Any]:
    """The output line of an input line that is not a request."""
    return _output_line(request.custom_id, None, request.error)


def _output_line(custom_id: str, response: Any, error: Any) -> dict[str, Any]:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }


def _encoded(record: dict[str, Any]) -> bytes:
    """One output line, its newline included (written in one call: whole, or cut short)."""
    return json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n"


class ResumableOutput:
    """The output file: the lines it holds already (by custom_id), and appending more, each one
    whole on disk before `write` returns."""

    def __init__(self, path: Path, requests: list[BatchRequest]) -> None:
        self.path = path
        self.order = {request.custom_id: i for i, request in enumerate(requests)}
        self.done: dict[str, dict[str, Any]] = {}
        self._file: Any = None
        if path.exists():
            self._keep_whole_lines()

    def _keep_whole_lines(self) -> None:
        """Read what an earlier run wrote; cut a last line it did not finish."""
        try:
            raw = self.path.read_bytes()
        except OSError as err:
            raise BatchFileError(f"cannot read {self.path}: {err.strerror or err}") from None
        whole = raw[: raw.rfind(b"\n") + 1]  # a line is written whole with its newline, or cut
        for number, line in enumerate(whole.splitlines(), start=1):
            try:
                record = json.loads(line)
                custom_id = record["custom_id"]
            except (ValueError, TypeError, KeyError):
                raise BatchFileError(
                    f"{self.path}: line {number} is not a run-batch output line; "
                    "name another --output (or remove this file to start over)"
                ) from None
            if custom_id not in self.order:
                raise BatchFileError(
                    f"{self.path}: custom_id {custom_id!r} (line {number}) is not in the input: "
                    "this output belongs to another input file"
                )
            self.done[custom_id] = record
        if len(whole) < len(raw):
            with self.path.open("r+b") as f:  # the crash's half line: answered again below
                f.truncate(len(whole))

    def pending(self, requests: list[BatchRequest]) -> Iterator[BatchRequest]:
        return (request for request in requests if request.custom_id not in self.done)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            self._file = self.path.open("ab")
        self._file.write(_encoded(record))
        self._file.flush()
        os.fsync(self._file.fileno())
        self.done[record["custom_id"]] = record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    @property
    def complete(self) -> bool:
        return len(self.done) == len(self.order)

    def finish(self) -> None:
        """Every request answered: the file rewritten in the input's order (a new file renamed
        over the old one, so a crash leaves one or the other whole)."""
        self.close()
        ordered = sorted(self.done.values(), key=lambda record: self.order[record["custom_id"]])
        partial = self.path.with_name(self.path.name + ".partial")
        with partial.open("wb") as f:
            for record in ordered:
                f.write(_encoded(record))
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, self.path)
