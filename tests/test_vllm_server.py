"""bench/vllm_server.py: starting and stopping a vLLM server, against a stand-in for vLLM.

The stand-in (tests/fake_vllm.py) is a module at vLLM's path on PYTHONPATH, run by this very
Python: it serves on the port it is given, or fails the way its `--served-model-name` says, and
starts a child process as vLLM starts its engine core. vLLM itself is never needed here.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

import fake_vllm
from specdecode.bench.serve_client import Endpoint, probe
from specdecode.bench.vllm_server import VllmServer, free_port


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory) -> Path:
    return fake_vllm.install(tmp_path_factory.mktemp("fake_vllm"))


def server(stand_in: Path, tmp_path: Path, name: str = "target", **options) -> VllmServer:
    return VllmServer(
        sys.executable,
        "/models/qwen",
        served_name=name,
        env={"PYTHONPATH": str(stand_in)},
        log=str(tmp_path / "vllm.log"),
        **options,
    )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


def child_pid(log: Path) -> int:
    line = next(line for line in log.read_text().splitlines() if line.startswith("CHILD"))
    return int(line.split()[1])


def test_it_serves_then_nothing_is_left_running(stand_in, tmp_path):
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    vllm = server(stand_in, tmp_path, speculative_config=spec, start_timeout_s=60)
    with vllm.running() as url:
        assert probe(Endpoint.parse(url)) == ["target"]
        child = child_pid(tmp_path / "vllm.log")
        assert alive(child)
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child)  # vLLM's engine core (here: the stand-in's child) stopped too
    started = (tmp_path / "vllm.log").read_text()
    assert '"speculative_config": "{\\"method\\": \\"ngram\\"' in started
    command = vllm.serve_command()
    assert command.startswith("vllm serve /models/qwen --served-model-name target")
    assert '--speculative-config \'{"method": "ngram", "num_speculative_tokens": 3}\'' in command


def start(vllm: VllmServer) -> None:
    with vllm.running():
        pass


def test_failures_are_one_line_each(stand_in, tmp_path):
    # a config vLLM refuses: its own last error line
    with pytest.raises(
        ValueError,
        match=r"exited \(1\) before serving: ValueError: this speculative config is refused",
    ):
        start(server(stand_in, tmp_path, "refused", start_timeout_s=60))
    # a server that never becomes healthy: stopped after the timeout, child and all
    with pytest.raises(ValueError, match="did not become healthy within 3 s"):
        start(server(stand_in, tmp_path, "never", start_timeout_s=3))
    child = child_pid(tmp_path / "vllm.log")
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child)
    # a port in use
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ValueError, match=f"port {port} on 127.0.0.1 is in use"):
            start(server(stand_in, tmp_path, port=port))
    # no such Python
    missing = VllmServer(str(tmp_path / "nowhere" / "python"), "m", port=free_port())
    with pytest.raises(ValueError, match="no such Python"):
        start(missing)


def test_its_environment_takes_the_compile_cache_that_loads(stand_in, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    env = server(stand_in, tmp_path).environment()
    assert env["VLLM_USE_AOT_COMPILE"] == "0" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")  # the caller's own choice stands
    assert server(stand_in, tmp_path).environment()["VLLM_USE_AOT_COMPILE"] == "1"
