"""Holes a user found in `specdecode serve`, each closed and checked here:

1. usage says what ran: a token tree's shape, depth and nodes per step; a chain's k_max and policy;
2. shutdown: an idle server exits at once on SIGTERM, and a stream cut by the drain (or by the
   per-request timeout) says so (finish_reason "abort" and an error event), never "length";
3. a lone UTF-16 surrogate in any text that reaches the tokenizer is a 400 naming the field;
4. POST bodies on /v1/* must be JSON (415 otherwise), and the API key guards the API docs too.

A real uvicorn server on 127.0.0.1 over the tiny models of test_server.py; the SIGTERM tests run
`specdecode serve` itself in a subprocess, over the tiny models saved by conftest's tiny_folders.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from specdecode import SpeculativeDecoder  # noqa: E402
from specdecode.server.app import create_app  # noqa: E402
from specdecode.server.background import serve_in_thread  # noqa: E402
from test_server import (  # noqa: E402
    CH,
    GOOD,
    HI,
    MODEL,
    C,
    _slow_engine,
    _wait_for,
    make_engine,
    metric_values,
    serving,
    sse_events,
    tiny_models,
)
from test_server_ops import _error, _free_port, _Stream, _wait_draining  # noqa: E402

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def models():
    return tiny_models()


# -- 1. usage says what ran ---------------------------------------------------------------------

TREE = "dynamic:11,8,3,0.2,0.05"


def test_usage_reports_the_tree_that_ran(models):
    target, draft = models
    engine = SpeculativeDecoder(target, draft, k=4, tree=TREE, k_policy="fixed")
    body = {**GOOD, "prompt": "hello", "max_tokens": 16}
    with serving(engine) as base, httpx.Client(timeout=60) as http:
        spec = http.post(base + C, json=body).json()["usage"]["speculative"]
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", base + C, json=streamed) as response:
            stream_spec = sse_events(response)[-2]["usage"]["speculative"]
    assert spec["drafter"] == "tree" and spec["tree"] == TREE
    assert spec["tree_depth"] == 8
    # k_max is the most tokens a step may accept: the tree's depth, not the unused chain k (4)
    assert spec["k_max"] == 8 and spec["k_policy"] is None
    assert spec["steps"] > 0 and spec["drafted"] <= 8 * spec["steps"]
    # every node the target verified: at least one per level of each step's tree
    assert spec["nodes_verified"] >= spec["drafted"] > 0
    assert spec["nodes_per_step"] == pytest.approx(spec["nodes_verified"] / spec["steps"])
    assert stream_spec == spec


def test_usage_reports_the_chain_and_its_policy(models):
    target, draft = models
    engine = SpeculativeDecoder(target, draft, k=3, k_policy="heuristic")
    with serving(engine) as base, httpx.Client(timeout=60) as http:
        spec = http.post(base + C, json={**GOOD, "max_tokens": 12}).json()["usage"]["speculative"]
    assert spec["drafter"] == "chain" and spec["tree"] is None and spec["tree_depth"] is None
    assert spec["k_max"] == 6 and spec["k_policy"] == "heuristic"  # heuristic: up to 2k
    # a chain's target verifies exactly the drafted tokens
    assert spec["nodes_verified"] == spec["drafted"] > 0
    assert spec["nodes_per_step"] == pytest.approx(spec["drafted"] / spec["steps"])


def test_usage_without_a_draft_says_so(models):
    target, _ = models
    with serving(SpeculativeDecoder(target, None)) as base:
        spec = httpx.post(base + C, json=GOOD, timeout=60).json()["usage"]["speculative"]
    assert spec["drafter"] is None and spec["k_max"] == 0 and spec["k_policy"] is None
    assert spec["drafted"] == 0 and spec["nodes_verified"] == 0 and spec["nodes_per_step"] == 0


# -- 2. shutdown: at once when idle; a cut stream says it was cut -------------------------------


def _serve_cli(tiny_folders: Path, port: int) -> subprocess.Popen:
    """`specdecode serve` over the tiny saved models, in a subprocess (signals reach its main
    thread there, as in production)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)])}
    command = [sys.executable, "-m", "specdecode.cli", "serve"]
    command += ["--target", str(tiny_folders / "target"), "--draft", str(tiny_folders / "draft")]
    command += ["--port", str(port), "--log-level", "warning"]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_up(base: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read().decode(errors="replace"))
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("the server did not start")


def _exit_after_sigterm(proc: subprocess.Popen) -> tuple[int, float]:
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    try:
        status = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return status, time.monotonic() - sent


@contextlib.contextmanager
def _running_cli(tiny_folders: Path) -> Iterator[tuple[subprocess.Popen, int]]:
    """`specdecode serve` started and up (`_serve_cli`), killed at the end if still running."""
    port = _free_port()
    proc = _serve_cli(tiny_folders, port)
    try:
        _wait_up(f"http://127.0.0.1:{port}", proc)
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _check_clean_exit(proc: subprocess.Popen, status: int, took: float) -> None:
    assert status == 0, proc.stdout.read().decode(errors="replace")
    assert took < 2.0, f"exited {took:.2f} s after SIGTERM"


def test_sigterm_on_an_idle_server_exits_within_2_s(tiny_folders):
    with _running_cli(tiny_folders) as (proc, _):
        status, took = _exit_after_sigterm(proc)
    _check_clean_exit(proc, status, took)


def test_sigterm_does_not_wait_for_a_half_sent_body(tiny_folders):
    """No generation runs: a client still sending its body (and one idle keep-alive client)
    must not hold the exit. The half-sent request gets 503 at once, not a 500 after uvicorn's
    flush timeout."""
    with _running_cli(tiny_folders) as (proc, port):
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=10) as keep_alive:
            assert keep_alive.get(base + "/health").status_code == 200
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            head = f"POST {C} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            sock.sendall((head + "Content-Length: 100\r\n\r\n{").encode())
            time.sleep(0.5)  # the handler is reading the body
            status, took = _exit_after_sigterm(proc)
            answer = sock.recv(65536)
            sock.close()
    _check_clean_exit(proc, status, took)
    assert answer.startswith(b"HTTP/1.1 503"), answer
    assert b'"code":"server_shutdown"' in answer, answer


def _drain(app, timeout_s: float) -> threading.Thread:
    """Run the app's drain on a loop of its own (it only polls the worker and sets flags)."""
    thread = threading.Thread(
        target=asyncio.run, args=(app.state.server.drain(timeout_s),), daemon=True
    )
    thread.start()
    return thread


def _cut_events(events: list) -> tuple[dict, dict]:
    """(the last chunk's choice, the error event) of a stream cut by the server."""
    assert events[-1] == "[DONE]", events[-3:]
    error = events[-2]
    assert set(error) == {"error"}, error
    choices = [e for e in events[:-2] if e.get("choices")]
    return choices[-1]["choices"][0], error["error"]


def test_a_stream_cut_by_the_drain_ends_with_abort_not_length(models):
    app = create_app(_slow_engine(models), MODEL, max_batch=2)
    with serve_in_thread(app) as base:
        body = {**GOOD, "max_tokens": 200, "stream_options": {"include_usage": True}}
        stream = _Stream(base, body)
        stream.start()
        plain: dict = {}
        waiting = threading.Thread(
            target=lambda: plain.update(r=httpx.post(base + C, json=body, timeout=60)),
            daemon=True,
        )
        waiting.start()
        _wait_for(base, "vllm:num_requests_running", 2)
        drained = _drain(app, 0.2)
        assert _wait_draining(base)["status"] == "draining"
        drained.join(30)
        stream.join(30)
        waiting.join(30)
        values = metric_values(httpx.get(base + "/metrics").text)
    final, error = _cut_events(stream.events)
    assert final["finish_reason"] == "abort"  # not "length": max_tokens was not reached
    assert error["type"] == "server_error" and error["code"] == "server_shutdown"
    usage = [e for e in stream.events[:-1] if isinstance(e, dict) and e.get("usage")]
    assert usage and usage[-1]["usage"]["completion_tokens"] < 200
    # the non-streamed one cut by the drain: 503, for a client to retry elsewhere
    assert _error(plain["r"], 503, "server_shutdown")["type"] == "server_error"
    shutdown = 'specdecode_generations_total{endpoint="/v1/completions",outcome="shutdown"}'
    assert values[shutdown] == 2
    assert values['vllm:request_success_total{finished_reason="abort"}'] == 2
    assert values['vllm:request_success_total{finished_reason="length"}'] == 0


def test_a_stream_cut_by_the_timeout_ends_with_abort(models):
    with serving(_slow_engine(models), timeout_s=0.3) as base, httpx.Client(timeout=30) as http:
        body = {**GOOD, "max_tokens": 200, "stream": True}
        with http.stream("POST", base + C, json=body) as streamed:
            assert streamed.status_code == 200
            events = sse_events(streamed)
        # the openai client yields the chunks, "abort" last, then raises at the error event
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        seen = []
        with pytest.raises(openai.APIError) as raised:
            for chunk in client.completions.create(
                model=MODEL, prompt="hi", max_tokens=200, temperature=0, stream=True
            ):
                seen.append(chunk.choices[0].finish_reason)
        values = metric_values(http.get(base + "/metrics").text)
    final, error = _cut_events(events)
    assert final["finish_reason"] == "abort"
    assert error["type"] == "timeout" and error["code"] == "timeout"
    assert seen[-1] == "abort" and raised.value.body["code"] == "timeout"
    assert values['vllm:request_success_total{finished_reason="abort"}'] == 2
    assert values['vllm:request_success_total{finished_reason="length"}'] == 0


class SlowPrefill(SpeculativeDecoder):
    """Each request's prefill (its join to the batch) takes a second; `prefilling` is set once
    one has begun."""

    prefilling = threading.Event()

    def batch_session(self, *args, **kwargs):
        session = super().batch_session(*args, **kwargs)
        add = session.add

        def slowly(*a, **k):
            self.prefilling.set()
            time.sleep(1.0)
            return add(*a, **k)

        session.add = slowly
        return session


def test_the_drain_counts_a_request_in_its_prefill(models):
    """A job the worker took from the queue but has not yet added to the batch is not idle:
    the drain must wait for it (and end it), not return at once and let it run on."""
    engine = make_engine(models, SlowPrefill)
    engine.eos_token_ids = set()
    engine.prefilling = threading.Event()
    app = create_app(engine, MODEL)
    with serve_in_thread(app) as base:
        stream = _Stream(base, {**GOOD, "max_tokens": 200})
        stream.start()
        assert engine.prefilling.wait(30)  # in its prefill: neither waiting nor running
        assert not app.state.server.worker.idle
        drained = _drain(app, 0.0)
        drained.join(30)
        stream.join(30)
        assert not drained.is_alive() and not stream.is_alive()
        assert app.state.server.worker.idle
    final, error = _cut_events(stream.events)
    assert final["finish_reason"] == "abort" and error["code"] == "server_shutdown"


def test_finish_reasons_agree_with_the_metrics():
    from specdecode.server.responses import finish_reason
    from specdecode.server.telemetry import FINISHED_REASONS, finished_reason

    assert finish_reason("stop") == "stop" and finish_reason("length") == "length"
    for outcome in ("timeout", "shutdown", "cancelled", "error"):
        assert finish_reason(outcome) == "abort"
    for outcome in ("stop", "length", "timeout", "shutdown", "cancelled", "error"):
        assert finish_reason(outcome) == finished_reason(outcome) in FINISHED_REASONS


# -- 3. a lone surrogate is the client's error: 400 naming the field ---------------------------

CHAT = {"model": MODEL, "messages": HI, "max_tokens": 4, "temperature": 0}
LONE = "hi \ud800 there"
SURROGATES = [
    # (path, fields merged into the body, param, the field named in the message)
    (C, {"prompt": LONE}, "prompt", "prompt"),
    (C, {"prompt": [LONE]}, "prompt", "prompt[0]"),
    (C, {"stop": "\udfff"}, "stop", "stop"),
    (C, {"stop": ["ok", "a\ud800"]}, "stop", "stop[1]"),
    (CH, {"stop": ["\ud800"]}, "stop", "stop[0]"),
    (CH, {"messages": [{"role": "user", "content": LONE}]}, "messages", "messages[0].content"),
    (
        CH,
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": LONE}],
                },
            ]
        },
        "messages",
        "messages[1].content[1].text",
    ),
]


def test_lone_surrogates_get_400_naming_the_field(models):
    with serving(make_engine(models)) as base, httpx.Client(timeout=30) as http:
        for path, fields, param, where in SURROGATES:
            for stream in (False, True):
                body = {**(GOOD if path == C else CHAT), **fields, "stream": stream}
                raw = json.dumps(body)  # ensure_ascii: the lone surrogate as a raw \ud8xx escape
                assert "\\ud8" in raw or "\\udf" in raw
                response = http.post(base + path, content=raw, headers=JSON)
                case = f"{path} {fields!r} stream={stream}"
                assert response.status_code == 400, f"{case}: {response.text}"
                error = response.json()["error"]
                assert error["type"] == "invalid_request_error", case
                assert error["param"] == param and error["code"] == "invalid_unicode", case
                assert error["message"].startswith(where + ":"), f"{case}: {error}"
        # a surrogate pair is one character (U+1F600), not an error
        pair = json.dumps({**GOOD, "prompt": "hi \U0001f600"})
        assert "\\ud83d\\ude00" in pair
        assert http.post(base + C, content=pair, headers=JSON).status_code == 200
        values = metric_values(http.get(base + "/metrics").text)
    assert not any('status="500"' in key for key in values), values
    assert not any('outcome="error"' in key and v for key, v in values.items())


# -- 4. JSON bodies only; the API key guards the docs -------------------------------------------


def test_post_bodies_must_be_json(models):
    body = json.dumps(GOOD)
    with serving(make_engine(models)) as base, httpx.Client(timeout=30) as http:
        for path, payload in ((C, body), (CH, json.dumps(CHAT))):
            for content_type in (
                "text/plain",
                "text/plain;charset=UTF-8",
                "application/x-www-form-urlencoded",
                "multipart/form-data; boundary=x",
                "application/jsonx",
                None,
            ):
                headers = {} if content_type is None else {"Content-Type": content_type}
                response = http.post(base + path, content=payload, headers=headers)
                error = _error(response, 415, "unsupported_media_type")
                assert error["type"] == "invalid_request_error"
            for content_type in (
                "application/json",
                "application/json; charset=utf-8",
                "Application/JSON;Charset=UTF-8",
            ):
                response = http.post(
                    base + path, content=payload, headers={"Content-Type": content_type}
                )
                assert response.status_code == 200, f"{content_type}: {response.text}"
        # refused from the header alone: the body is never read
        sock = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=10)
        sock.sendall(f"POST {C} HTTP/1.1\r\nHost: t\r\nContent-Type: text/plain\r\n".encode())
        sock.sendall(b"Content-Length: 1000000\r\n\r\n{")
        answer = sock.recv(65536)
        sock.close()
        assert answer.startswith(b"HTTP/1.1 415"), answer
        values = metric_values(http.get(base + "/metrics").text)
    assert values[f'specdecode_requests_total{{endpoint="{C}",status="415"}}'] == 7
    generations = [v for k, v in values.items() if k.startswith("specdecode_generations_total")]
    assert sum(generations) == 6  # the JSON ones only


def test_the_api_key_guards_the_docs(models):
    engine = make_engine(models)
    with serving(engine) as base:  # no key: the docs are open, as documented
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert httpx.get(base + path).status_code == 200, path
    with serving(make_engine(models), api_key="k3y") as base:
        for path in ("/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"):
            _error(httpx.get(base + path), 401, "invalid_api_key")
        keyed = httpx.get(base + "/openapi.json", headers={"Authorization": "Bearer k3y"})
        assert keyed.status_code == 200 and "/v1/completions" in keyed.json()["paths"]
        assert httpx.get(base + "/health").status_code == 200  # probes carry no key
