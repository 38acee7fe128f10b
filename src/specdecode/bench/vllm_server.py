"""Start and stop a vLLM OpenAI-compatible server from its own Python, for the lab to measure.

vLLM is a peer, never our dependency: it lives in a virtual environment of its own
(`benchmarks/install_vllm.sh` builds one; docs/usage.md, "Other engines"), named by that
environment's `python`. `VllmServer` starts `python -m vllm.entrypoints.openai.api_server` (the
same arguments as `vllm serve`) on loopback, in a process group of its own with its output in a
log file, waits until `/health` answers, and on leaving stops the whole group (SIGTERM, then
SIGKILL after `stop_timeout_s`): nothing is left running, whatever happened. Every failure is one
line: the Python that is missing, the port in use, the server that exited or never became healthy
(with vLLM's own last error line).

On a CPU, vLLM runs faster with tcmalloc and Intel's OpenMP preloaded: where the environment
holds `libiomp5.so` and the system `libtcmalloc_minimal.so.4`, both are put in `LD_PRELOAD`
(unless the caller's environment sets it), and `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache)
defaults to 2.

`VLLM_USE_AOT_COMPILE` defaults to 0: vLLM's older compile cache, which the next start of the same
model loads. Its newer AOT cache (the default with torch >= 2.10) fails to load on vLLM 0.32 with
torch 2.13 ("'function' object has no attribute 'finalize_loading'"), so every start compiled
the model again; a tuner starts one server per candidate.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shlex
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
TCMALLOC = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
)


@dataclass
class VllmServer:
    """One vLLM server: `python` (its environment's), the model folder or id, the served name,
    and its `speculative_config` (None: no speculation)."""

    python: str
    model: str
    served_name: str = "model"
    speculative_config: dict[str, Any] | None = None
    args: Sequence[str] = ()  # more `vllm serve` arguments
    env: dict[str, str] = field(default_factory=dict)
    port: int | None = None  # None: a free one
    log: str | None = None  # the server's output (None: a temporary file)
    start_timeout_s: float = 900.0
    stop_timeout_s: float = 30.0

    def command(self, port: int) -> list[str]:
        """The command line it runs (the same arguments `vllm serve MODEL` takes)."""
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model]
        cmd += ["--served-model-name", self.served_name, "--host", HOST, "--port", str(port)]
        if self.speculative_config is not None:
            cmd += ["--speculative-config", json.dumps(self.speculative_config)]
        return [*cmd, *self.args]

    def serve_command(self) -> str:
        """The command a user runs to serve the same way (`vllm serve`, their port)."""
        return shlex.join(["vllm", "serve", self.model, *self.command(8000)[5:]])

    @contextlib.contextmanager
    def running(self) -> Iterator[str]:
        """Start it, wait until healthy, yield its base URL; stop it (and its children) after."""
        python = Path(self.python)
        if not python.is_file() or not os.access(python, os.X_OK):
            raise ValueError(f"--vllm-python {self.python}: no such Python (give the `python` of "
                             "the environment vLLM is installed in)")  # fmt: skip
        port = self.port if self.port is not None else free_port()
        if self.port is not None and not port_is_free(port):
            raise ValueError(f"port {port} on {HOST} is in use: stop what holds it or leave the "
                             "port out to take a free one")  # fmt: skip
        log_path = Path(self.log) if self.log else Path(_temporary_log())
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log:
            process = subprocess.Popen(
                self.command(port),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,  # its own process group: stopped as one
            )
        try:
            url = f"http://{HOST}:{port}"
            self._wait_healthy(process, url, log_path)
            yield url
        finally:
            stop(process, self.stop_timeout_s)

    def environment(self) -> dict[str, str]:
        """The environment it runs in: ours, the CPU defaults (module docstring), `env`."""
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        env.setdefault("VLLM_USE_AOT_COMPILE", "0")  # a cache that loads (module docstring)
        if Path(self.model).is_dir():  # a local folder: nothing to ask the hub for
            env.setdefault("HF_HUB_OFFLINE", "1")
        if "LD_PRELOAD" not in env:
            iomp = Path(self.python).parent.parent / "lib" / "libiomp5.so"
            preload = [p for p in TCMALLOC if Path(p).exists()][:1]
            preload += [str(iomp)] if iomp.exists() else []
            if preload:
                env["LD_PRELOAD"] = ":".join(preload)
        env.update(self.env)
        return env

    def _wait_healthy(self, process: subprocess.Popen, url: str, log_path: Path) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            code = process.poll()
            if code is not None:
                raise ValueError(
                    f"vLLM exited ({code}) before serving: {last_error(log_path)} "
                    f"(its output: {log_path})"
                )
            if _healthy(url):
                return
            time.sleep(2.0)
        raise ValueError(
            f"vLLM did not become healthy within {self.start_timeout_s:g} s: "
            f"{last_error(log_path)} (its output: {log_path})"
        )


def _temporary_log() -> str:
    handle, path = tempfile.mkstemp(prefix="vllm-", suffix=".log")
    os.close(handle)
    return path


def _healthy(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def stop(process: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM to the process group, SIGKILL after `timeout_s`; returns when it is gone."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    # children that outlived their parent (vLLM's engine core) share its group
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def last_error(log_path: Path) -> str:
    """vLLM's last error line in its output (else its last line)."""
    try:
        lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines()]
    except OSError:
        return "(no output)"
    lines = [line for line in lines if line]
    for line in reversed(lines):
        if "Error" in line or "error:" in line:
            return line[-300:]
    return lines[-1][-300:] if lines else "(no output)"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True
