"""The OpenMP pool a thread started is handed back (kernels/openmp.py), and the server's worker
has its starting thread do so: one pool per thread on the same CPUs throttles both."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import specdecode.server.worker as worker_module
from specdecode.kernels.openmp import _libgomp, release_pool
from specdecode.server.worker import GenerationWorker
from test_server import make_engine, tiny_models


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def start_pool() -> None:
    """Parallel work on this thread: at::parallel_for over 8 M elements uses every thread."""
    torch.ones(1 << 23).add_(1.0)


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux's /proc")
def test_release_pool_lets_go_of_the_calling_threads_openmp_threads():
    if _libgomp() is None:
        pytest.skip("needs PyTorch on GNU OpenMP")
    before = torch.get_num_threads()  # 1 in the tests (conftest.py)
    torch.set_num_threads(3)  # a pool of 2 helpers, whatever the machine's cores
    try:
        start_pool()
        with_pool = threads()
        assert release_pool()
        deadline = time.monotonic() + 5
        while threads() > with_pool - 2 and time.monotonic() < deadline:  # helpers exit alone
            time.sleep(0.01)
        assert threads() == with_pool - 2
        start_pool()  # a new pool when parallel work comes again
        assert threads() == with_pool
        assert torch.ones(1 << 23).add_(1.0).sum().item() == 2 * (1 << 23)
    finally:
        release_pool()
        torch.set_num_threads(before)


def test_the_worker_releases_the_pool_of_the_thread_that_starts_it(monkeypatch):
    callers = []
    monkeypatch.setattr(
        worker_module, "release_pool", lambda: callers.append(threading.current_thread())
    )
    worker = GenerationWorker(make_engine(tiny_models()), max_batch=2, max_len=64)
    worker.start()
    try:
        assert callers == [threading.current_thread()]
    finally:
        worker.stop()


def test_serving_in_a_thread_releases_the_pool_of_the_calling_thread(monkeypatch):
    import specdecode.kernels.openmp as openmp
    from specdecode.server.app import create_app
    from specdecode.server.background import serve_in_thread

    callers = []
    monkeypatch.setattr(openmp, "release_pool", lambda: callers.append(threading.current_thread()))
    monkeypatch.setattr(worker_module, "release_pool", lambda: None)  # the worker's own start
    app = create_app(make_engine(tiny_models()), "tiny", max_batch=2, max_len=64)
    with serve_in_thread(app):
        assert callers == [threading.current_thread()]
