"""`specdecode serve` on a network: limits before work, the API key, a bounded drain on SIGTERM,
and /metrics under vLLM's names. A real uvicorn server on 127.0.0.1, as in test_server.py (whose
tiny models and helpers these tests share); the SIGTERM test runs the server in a subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from specdecode.server.cli_serve import API_KEY_ENV, _check_args, add_serve_parser  # noqa: E402
from specdecode.server.limits import MAX_STOP_CHARS, MAX_STOPS  # noqa: E402
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

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"


@pytest.fixture(scope="module")
def models():
    return tiny_models()


def _error(response, status: int, code: str | None = None, param: str | None = None) -> dict:
    """The OpenAI-shaped error of `response`, checked."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    assert error["param"] == param, error
    return error


def _raw_request(base: str, head: bytes, body_start: bytes) -> bytes:
    """Send a request's head and only the start of its body, then read what the server answers:
    an answer proves the server did not wait for the rest of the body."""
    host, port = base.removeprefix("http://").split(":")
    answer = b""
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + b"\r\n\r\n" + body_start)
        while not _complete(answer):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    return answer


def _complete(answer: bytes) -> bool:
    """Whether `answer` holds a whole HTTP response (its head, then Content-Length bytes)."""
    head, sep, body = answer.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return True


def _head(path: str, length: int, *extra: bytes) -> bytes:
    lines = [f"POST {path} HTTP/1.1".encode(), b"Host: test", b"Content-Type: application/json"]
    return b"\r\n".join([*lines, f"Content-Length: {length}".encode(), *extra])


class _Stream(threading.Thread):
    """A streamed completion read to its end in a thread: status and events."""

    def __init__(self, base: str, body: dict, headers: dict | None = None) -> None:
        super().__init__(daemon=True)
        self.base, self.body, self.headers = base, body, headers or {}
        self.status: int | None = None
        self.events: list = []

    def run(self) -> None:
        body = {**self.body, "stream": True}
        with httpx.stream(
            "POST", self.base + C, json=body, headers=self.headers, timeout=60
        ) as response:
            self.status = response.status_code
            self.events = sse_events(response) if response.status_code == 200 else []


# -- limits, before work is spent -----------------------------------------------------------


def test_big_body_gets_413_while_a_stream_keeps_flowing(models):
    with serving(_slow_engine(models), max_body_bytes=1 << 20) as base:
        stream = _Stream(base, {**GOOD, "max_tokens": 40})
        stream.start()
        assert _wait_for(base, "vllm:num_requests_running", 1)["vllm:num_requests_running"] == 1
        json_body = {"Content-Type": "application/json"}  # else 415 comes first
        with httpx.Client(timeout=60, headers=json_body) as http:
            # Content-Length says 50 MB: refused before a byte of the body is read
            declared = http.post(base + C, content=b"x" * (50 << 20))
            _error(declared, 413, "request_too_large")
            # chunked, no Content-Length: cut off once 1 MiB has been read, before parsing
            chunked = http.post(base + C, content=(b"x" * (1 << 20) for _ in range(50)))
            _error(chunked, 413, "request_too_large")
            # a body just under the limit is read and parsed (and is not valid JSON)
            _error(http.post(base + C, content=b"{" * (1 << 19)), 400, "invalid_json")
        stream.join(60)
        assert stream.status == 200 and stream.events[-1] == "[DONE]"
        assert stream.events[-2]["choices"][0]["finish_reason"] == "length"
        values = metric_values(httpx.get(base + "/metrics").text)
        assert values['specdecode_requests_total{endpoint="/v1/completions",status="413"}'] == 2


def test_full_queue_answers_429_before_the_body_is_read(models):
    with serving(_slow_engine(models), queue_size=0, max_batch=1) as base:
        stream = _Stream(base, {**GOOD, "max_tokens": 30})
        stream.start()
        _wait_for(base, "vllm:num_requests_running", 1)
        answer = _raw_request(base, _head(C, 1000), b'{"model": ')  # 990 bytes never sent
        assert answer.startswith(b"HTTP/1.1 429"), answer[:200]
        assert b'"code":"queue_full"' in answer.replace(b" ", b"")
        stream.join(60)
        assert stream.events[-1] == "[DONE]"


def test_stop_strings_are_bounded(models):
    with serving(make_engine(models)) as base, httpx.Client(timeout=60) as http:
        many = http.post(base + C, json={**GOOD, "stop": ["ab"] * 10**5})
        assert f"at most {MAX_STOPS}" in _error(many, 400, param="stop")["message"]
        _error(
            http.post(base + C, json={**GOOD, "stop": ["a"] * (MAX_STOPS + 1)}), 400, param="stop"
        )
        long_stop = "x" * (MAX_STOP_CHARS + 1)
        _error(
            http.post(base + CH, json={"model": MODEL, "messages": HI, "stop": long_stop}),
            400,
            param="stop",
        )
        at_limits = ["x" * MAX_STOP_CHARS, "q", "zz", "!!"]
        assert http.post(base + C, json={**GOOD, "stop": at_limits}).status_code == 200


class CountingEngine:
    """Wraps make_engine's engine, counting how often a prompt is tokenized."""

    @staticmethod
    def make(models):
        engine = make_engine(models)
        engine.encoded = 0
        encode = engine.encode_prompt

        def counting(prompt, chat=False):
            engine.encoded += 1
            return encode(prompt, chat=chat)

        engine.encode_prompt = counting
        return engine


def test_prompt_length_bounded_in_characters_before_tokens(models):
    engine = CountingEngine.make(models)
    # the char tokenizer's longest entry is "<unk>" (5): 100 tokens can hold 500 characters at most
    with serving(engine, max_prompt_tokens=100) as base, httpx.Client(timeout=60) as http:
        huge = http.post(base + C, json={**GOOD, "prompt": "a" * 501})
        error = _error(huge, 400, "context_length_exceeded", "prompt")
        assert "501 characters" in error["message"]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "a" * 600}]}
        _error(http.post(base + CH, json=chat), 400, "context_length_exceeded", "messages")
        ids = http.post(base + C, json={**GOOD, "prompt": [5] * 101})
        assert "101 tokens" in _error(ids, 400, "context_length_exceeded", "prompt")["message"]
        assert engine.encoded == 0  # none of them was tokenized
        # within the character bound but over the token limit: tokenized, then refused
        over = http.post(base + C, json={**GOOD, "prompt": "a" * 300})
        assert "tokens" in _error(over, 400, "context_length_exceeded", "prompt")["message"]
        assert engine.encoded == 1
    with serving(make_engine(models), max_prompt_chars=20) as base:
        short = httpx.post(base + C, json={**GOOD, "prompt": "a" * 21}, timeout=60)
        _error(short, 400, "context_length_exceeded", "prompt")


# -- the API key --------------------------------------------------------------------------------

KEY = "sk-test-0123456789"


def test_api_key_required_on_v1_only(models):
    with serving(make_engine(models), api_key=KEY) as base, httpx.Client(timeout=60) as http:
        _error(http.get(base + "/v1/models"), 401, "invalid_api_key")
        wrong = http.post(base + C, json=GOOD, headers={"Authorization": "Bearer nope"})
        assert wrong.headers["www-authenticate"] == "Bearer"
        _error(wrong, 401, "invalid_api_key")
        _error(http.post(base + C, json=GOOD, headers={"Authorization": KEY}), 401)  # no scheme
        ok = http.post(base + C, json=GOOD, headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200, ok.text
        assert http.get(base + "/health").status_code == 200  # open: probes carry no key
        assert http.get(base + "/metrics").status_code == 200  # open without --metrics-auth
        # refused before the body is read: an unauthenticated client costs no parsing
        answer = _raw_request(base, _head(C, 10_000), b"{")
        assert answer.startswith(b"HTTP/1.1 401"), answer[:200]

        client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
        assert client.completions.create(**GOOD).choices[0].text is not None
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="bad", max_retries=0).models.list()
        values = metric_values(http.get(base + "/metrics").text)
        assert values['specdecode_requests_total{endpoint="/v1/completions",status="401"}'] == 3


def test_metrics_auth(models):
    with serving(make_engine(models), api_key=KEY, metrics_auth=True) as base:
        _error(httpx.get(base + "/metrics"), 401, "invalid_api_key")
        auth = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(base + "/metrics", headers=auth).status_code == 200
        assert httpx.get(base + "/health").status_code == 200


def _serve_args(*argv: str):
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", "--target", "t", *argv])


def test_cli_api_key_from_the_environment(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    args = _serve_args()
    _check_args(args)
    assert args.api_key is None
    with pytest.raises(ValueError, match="metrics-auth needs an API key"):
        _check_args(_serve_args("--metrics-auth"))
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    args = _serve_args("--metrics-auth", "--graceful-timeout", "2", "--max-body-bytes", "100")
    _check_args(args)
    assert args.api_key == "from-env" and args.graceful_timeout == 2 and args.max_body_bytes == 100
    args = _serve_args("--api-key", "flag")
    _check_args(args)
    assert args.api_key == "flag"  # the flag wins over the variable
    assert (
        _serve_args().prefix_cache_mb == 1024
        and _serve_args("--prefix-cache-mb", "0").prefix_cache_mb == 0
    )
    bad_args = (
        ["--api-key", " "],
        ["--graceful-timeout", "-1"],
        ["--max-body-bytes", "0"],
        ["--prefix-cache-mb", "-1"],
        ["--prefix-cache-mb", "nan"],
    )
    for bad in bad_args:
        with pytest.raises(ValueError):
            _check_args(_serve_args(*bad))


# -- a bounded drain on SIGTERM -----------------------------------------------------------------

GRACE_S = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not start")


def _wait_draining(base: str, timeout_s: float = 10) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = httpx.get(base + "/health", timeout=5)
        if health.status_code == 503:
            return health.json()
        time.sleep(0.05)
    raise AssertionError("/health never said draining")


def test_sigterm_ends_the_stream_with_done_and_exits_0():
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)])}
    script = [sys.executable, str(TESTS / "slow_server.py"), str(port), str(GRACE_S)]
    proc = subprocess.Popen(script, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(base, proc)
        stream = _Stream(
            base, {**GOOD, "max_tokens": 200, "stream_options": {"include_usage": True}}
        )
        stream.start()
        _wait_for(base, "vllm:num_requests_running", 1)
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(httpx.post, base + C, json=GOOD, timeout=60)
            _wait_for(base, "vllm:num_requests_waiting", 1)
            proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            health = _wait_draining(base)  # the socket stays open while draining
            assert health["status"] == "draining" and health["running"] == 1
            _error(httpx.post(base + C, json=GOOD, timeout=30), 503)  # no new work
            _error(queued.result(), 503)  # the queued request is let go at once
        stream.join(GRACE_S + 30)
        assert stream.status == 200 and stream.events[-1] == "[DONE]"
        assert stream.events[-2]["error"]["code"] == "server_shutdown"  # why it was cut
        usage = stream.events[-3]["usage"]
        final = stream.events[-4]["choices"][0]
        assert final["finish_reason"] == "abort" and usage["completion_tokens"] < 200
        assert proc.wait(timeout=max(0.1, sent + GRACE_S + 5 - time.monotonic())) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_drain_in_process_ends_stream_and_refuses_queue(models):
    """The drain itself, without signals: ServerState.drain on the app's own loop."""
    from specdecode.server.app import create_app
    from specdecode.server.background import serve_in_thread

    app = create_app(_slow_engine(models), MODEL)
    with serve_in_thread(app) as base:
        stream = _Stream(base, {**GOOD, "max_tokens": 200})
        stream.start()
        _wait_for(base, "vllm:num_requests_running", 1)
        state = app.state.server
        # run the drain on a loop of its own: it only polls the worker and sets flags
        import asyncio

        drained = threading.Thread(target=asyncio.run, args=(state.drain(0.2),), daemon=True)
        drained.start()
        assert _wait_draining(base)["status"] == "draining"
        drained.join(30)
        stream.join(30)
        assert stream.events[-1] == "[DONE]"
        assert stream.events[-2]["error"]["code"] == "server_shutdown"
        assert stream.events[-3]["choices"][0]["finish_reason"] == "abort"
        shutdown = 'specdecode_generations_total{endpoint="/v1/completions",outcome="shutdown"}'
        values = metric_values(httpx.get(base + "/metrics").text)
        assert values[shutdown] == 1
        assert values['vllm:request_success_total{finished_reason="abort"}'] == 1


# -- /metrics: vLLM's names, prometheus_client's own parser -------------------------------------

VLLM_NAMES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos",
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
)


def test_metrics_parse_with_vllm_names(models):
    from prometheus_client.parser import text_string_to_metric_families

    with serving(make_engine(models)) as base, httpx.Client(timeout=60) as http:
        assert http.post(base + C, json={**GOOD, "max_tokens": 8}).status_code == 200
        response = http.get(base + "/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    for name in VLLM_NAMES:
        assert name in families, name
        assert families[name].documentation, name
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    assert families["vllm:num_requests_waiting"].type == "gauge"
    assert families["vllm:prompt_tokens"].type == "counter"
    own = [n for n in families if not n.startswith("vllm:")]
    assert own and all(n.startswith("specdecode_") for n in own), own
    for family in families.values():
        for sample in family.samples:
            assert sample.labels["model_name"] == MODEL, sample
    assert json.dumps(metric_values(response.text))  # every value a finite or infinite float


def test_models_say_the_generation_defaults_and_requests_use_them():
    """Unset temperature / top_p / top_k come from the model's generation config; /v1/models
    says which; `--generation-config none` (generation_config="none") restores OpenAI's."""
    from transformers import GenerationConfig

    from specdecode import SpeculativeDecoder

    target, draft = tiny_models()
    target.model.generation_config = GenerationConfig(
        do_sample=True, temperature=0.7, top_p=0.8, top_k=20
    )
    body = {"model": MODEL, "prompt": "the cat", "max_tokens": 20, "seed": 7}

    def completion(base: str, **extra) -> str:
        out = httpx.post(f"{base}/v1/completions", json={**body, **extra}, timeout=60)
        assert out.status_code == 200, out.text
        return out.json()["choices"][0]["text"]

    def expected(engine, **sampling) -> str:
        return engine.generate("the cat", 20, seed=7, **sampling).text

    for mode, card, sampling in [
        (
            "auto",
            {"temperature": 0.7, "top_p": 0.8, "top_k": 20},
            dict(temperature=0.7, top_k=20, top_p=0.8),
        ),
        ("none", {"temperature": 1.0, "top_p": 1.0, "top_k": None}, dict(temperature=1.0)),
    ]:
        reference = SpeculativeDecoder(target, draft, k=3, generation_config=mode, k_policy="fixed")
        with serving(
            SpeculativeDecoder(target, draft, k=3, generation_config=mode, k_policy="fixed")
        ) as base:
            (model,) = httpx.get(f"{base}/v1/models").json()["data"]
            sources = ["temperature", "top_k", "top_p"] if mode == "auto" else []
            assert model["generation_defaults"] == {**card, "from_generation_config": sources}
            assert completion(base) == expected(reference, **sampling)
            # what a request sets wins, option by option; top_p 1 turns the model's top_p off
            hot = completion(base, temperature=1.3, top_p=1.0)
            assert hot == expected(reference, **{**sampling, "temperature": 1.3, "top_p": 1.0})
            assert completion(base, temperature=0) == expected(reference, temperature=0.0)


def test_cli_serve_takes_generation_config():
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--target", "x", "--generation-config", "none"])
    assert args.generation_config == "none"
    assert parser.parse_args(["serve", "--target", "x"]).generation_config == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--target", "x", "--generation-config", "vllm"])
