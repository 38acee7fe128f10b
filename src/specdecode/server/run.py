"""Run the app under uvicorn in the main thread, with a bounded graceful shutdown on SIGTERM.

uvicorn alone, on SIGTERM, closes the listening socket and then waits for every response to end:
a long stream holds the process for as long as it generates, and /health can say nothing about it.
Here the first SIGTERM (or Ctrl-C) drains the app first (`ServerState.drain`): the socket stays
open so that /health answers 503 "draining" and new generation requests get 503; queued requests
get 503; the running generation may finish within `graceful_timeout_s`, then it is ended at its
next step (a stream gets its last chunk and `[DONE]`). Only then does uvicorn's own shutdown run,
with little left to wait for. A second signal skips the rest of the drain (uvicorn's shutdown);
Ctrl-C a third time quits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import uvicorn

# after the drain: time for the last chunks to reach their clients before uvicorn cancels them
FLUSH_TIMEOUT_S = 5

logger = logging.getLogger("uvicorn.error")  # uvicorn's own: its log config prints it


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first exit signal runs `drain()` before uvicorn's shutdown."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)  # a second signal, or one before start-up: uvicorn's
            return
        # a signal handler runs between two bytecodes of the loop's own thread: only schedule
        self._draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        logger.info("Draining: new and queued requests get 503 (a second signal skips the drain)")
        try:
            await self._drain()
        finally:
            self.should_exit = True  # uvicorn's main loop sees it within 0.1 s


def serve(
    app: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    graceful_timeout_s: float = 30.0,
    log_level: str = "info",
) -> None:
    """Serve `app` (from `create_app`) until SIGTERM or Ctrl-C; returns after a graceful drain.

    Signals are only delivered to the main thread: call this from it (tests that need a server
    in a thread use background.serve_in_thread, without the drain)."""
    if graceful_timeout_s < 0:
        raise ValueError(f"graceful timeout must be >= 0 seconds (got {graceful_timeout_s})")
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=FLUSH_TIMEOUT_S
    )
    server = DrainingServer(config, drain=lambda: app.state.server.drain(graceful_timeout_s))
    main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM) if main}
    try:
        # uvicorn re-raises a signal it handled once it has shut down, to the handler found
        # before it started: make that one a no-op, so a drained server exits with status 0
        for sig in previous:
            signal.signal(sig, _ignore)
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _ignore(sig: int, frame: FrameType | None) -> None:
    pass
