"""From a job's events to the client: waiting with disconnect checks, and the SSE stream."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from specdecode.server.responses import DONE, Shape, interruption, sse
from specdecode.server.worker import Delta, Event, Failed, Finished, Outcome

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streaming request checks for its client


class ClientGone(Exception):
    """The client of a request disconnected before its answer."""


class DeadlineInQueue(Exception):
    """A request's timeout passed before its generation started."""


class Client:
    """Relays a job's events to a handler, checking every DISCONNECT_POLL_S (between events or
    while waiting for one) whether the client of a non-streaming request has gone."""

    def __init__(self, request: Request, events: asyncio.Queue[Event]) -> None:
        self.request, self.events = request, events
        self.next_check = time.monotonic() + DISCONNECT_POLL_S

    async def next_event(self, deadline: float | None = None) -> Event:
        """The job's next event; ClientGone if the client disconnects first, DeadlineInQueue
        if `deadline` (time.monotonic) passes first."""
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise DeadlineInQueue
            wait = min(self.next_check, math.inf if deadline is None else deadline) - now
            if wait > 0:
                with contextlib.suppress(asyncio.TimeoutError):  # not builtin TimeoutError on 3.10
                    return await asyncio.wait_for(self.events.get(), wait)
            if time.monotonic() < self.next_check:
                continue  # woken by the deadline
            self.next_check = time.monotonic() + DISCONNECT_POLL_S
            if await self.request.is_disconnected():
                raise ClientGone

    async def outcome(self) -> Outcome:
        """Wait for the end of the generation (the text deltas are not needed)."""
        while True:
            event = await self.next_event()
            if isinstance(event, Finished):
                return event.outcome
            if isinstance(event, Failed):
                raise event.error


class JobStream(StreamingResponse):
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


async def sse_events(
    shape: Shape, events: asyncio.Queue[Event], include_usage: bool
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`. A generation the
    server ended (shutdown, timeout) ends with finish_reason "abort", the usage chunk if asked
    for, then an error event that says why (responses.interruption), then `[DONE]`."""

    def send(chunk: dict[str, Any]) -> str:
        if include_usage:
            chunk["usage"] = None  # as OpenAI: only the last chunk carries usage
        return sse(chunk)

    if shape.chat:
        yield send(shape.chunk("", role=True))  # OpenAI's first chat chunk names the role
    while True:
        event = await events.get()
        if isinstance(event, Delta):
            yield send(shape.chunk(event.text, logprobs=event.logprobs))
        elif isinstance(event, Finished):
            reason = event.outcome.finish_reason
            yield send(shape.chunk(None, reason))
            if include_usage:
                yield sse(shape.usage_chunk(event.outcome.stats))
            cut = interruption(reason)
            if cut is not None:  # ended by the server ("abort"): say why, as an error event
                yield sse(cut.body())
            yield DONE
            return
        elif isinstance(event, Failed):  # a failure after the stream began: OpenAI's error event
            yield sse(event.error.body())
            return
