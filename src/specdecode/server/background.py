"""Run an app under uvicorn in a background thread (tests, benchmarks, notebooks)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from specdecode.kernels import openmp


@contextlib.contextmanager
def serve_in_thread(
    app: Any, host: str = "127.0.0.1", startup_timeout_s: float = 60.0
) -> Iterator[str]:
    """Serve `app` on a free port of `host` until the block ends; yield its base URL.

    The calling thread (which loaded the models, typically) lets go of its OpenMP threads first,
    as `specdecode serve` does (kernels/openmp.py); PyTorch work it runs while the server serves
    takes them back, and slows the server's forwards as long as it holds them."""
    import uvicorn  # optional: specdecode[serve]

    sock = socket.socket()
    sock.bind((host, 0))  # the port is ours from here on: no race with another process
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    # uvicorn installs signal handlers only on the main thread, so this thread is safe to use
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    openmp.release_pool()  # before the worker's pool exists (the app's start-up makes it)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
