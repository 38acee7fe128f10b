"""Errors a client gets back, in the OpenAI shape `{"error": {message, type, param, code}}`.

Plain Python (no web framework): the worker raises these too; app.py turns them into responses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class APIError(Exception):
    """An error answered to the client with `status` and an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def shutting_down(message: str = "the server is shutting down") -> APIError:
    """503 for a request the draining server will not run (new, queued, or cut before its
    end): a client may retry it on another replica."""
    return APIError(503, message, type="server_error", code="server_shutdown")


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def from_validation_errors(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """The first pydantic/FastAPI validation error as a 400, naming the offending parameter."""
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    # FastAPI prefixes locations with "body"/"query"; pydantic unions add the member type tried
    # ("stop", "list[str]", 1): keep field names and indices only
    loc = [
        str(part)
        for part in first.get("loc", ())
        if part not in ("body", "query") and not _is_type_tag(part)
    ]
    param = loc[0] if loc else None
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json")
    where = ".".join(loc)
    # a validator's own message already names its parameter
    text = f"{where}: {message}" if where and not message.startswith(loc[-1]) else message
    return APIError(400, text, param=param, code=str(first.get("type") or "invalid_value"))


def _is_type_tag(part: Any) -> bool:
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))
