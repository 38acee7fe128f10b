"""`specdecode bench-serve`: closed-loop streamed load against a real server, and its statistics.

The load runs against our own server on 127.0.0.1 (test_server.py's tiny float32 models, greedy,
so every request's token count can be checked against the engine's own `generate`), and against
a stub HTTP server whose answers fail in each way a request can (500, 429, a stream cut short,
a connection closed without an answer). The statistics are checked on synthetic records.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from specdecode.bench.serve_client import Endpoint, sse_data
from specdecode.bench.serve_stats import percentile, summarize_level
from specdecode.cli import main
from test_server import make_engine, serving, tiny_models

PROMPTS = [
    {"id": "a1", "category": "alpha", "prompt": "the cat sat on"},
    {"id": "a2", "category": "alpha", "prompt": "hello there, how"},
    {"id": "b1", "category": "beta", "turns": ["why is the sky blue?", "and at night?"]},
]
ORDER = ["a1", "b1", "a2"]  # interleaved by category: the order requests take them in
TEXT = {p["id"]: p.get("prompt") or p["turns"][0] for p in PROMPTS}
TOKENS = 8


@pytest.fixture(scope="module")
def models():
    return tiny_models()


@pytest.fixture(scope="module")
def url(models) -> Iterator[str]:
    with serving(make_engine(models)) as base:
        yield base


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def bench(*argv: str) -> int:
    return main(["bench-serve", *argv])


def read_run(out: Path) -> tuple[list[dict], dict]:
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return records, json.loads((out / "summary.json").read_text())


def assert_ordered(stats: dict) -> None:
    assert stats["n"] > 0
    assert stats["p50"] <= stats["p95"] <= stats["p99"]


# -- against our server -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def completions_run(url, prompts_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "completions"
    argv = ["--endpoint", url, "--concurrency", "1,2", "--prompts", str(prompts_file)]
    argv += ["--max-new-tokens", str(TOKENS), "--requests-per-level", "4", "--label", "ours"]
    assert bench(*argv, "--out", str(out)) == 0
    return out


def test_completions_run_records_every_request(completions_run, models, url):
    out = completions_run
    for name in ("results.jsonl", "summary.json", "report.md", "throughput.png", "latency.png"):
        assert (out / name).stat().st_size > 0, name
    records, summary = read_run(out)
    assert [(r["concurrency"], r["index"]) for r in records] == [
        (c, i) for c in (1, 2) for i in range(4)
    ]
    assert [r["prompt_id"] for r in records] == [ORDER[i % 3] for i in range(4)] * 2
    assert {r["client"] for r in records if r["concurrency"] == 2} <= {0, 1}
    reference = make_engine(models)
    for r in records:
        assert r["kind"] == "ok" and r["status"] == 200 and r["error"] is None, r
        expected = reference.generate(TEXT[r["prompt_id"]], max_new_tokens=TOKENS, temperature=0)
        assert r["token_source"] == "usage"
        assert r["completion_tokens"] == len(expected.token_ids)
        assert r["prompt_tokens"] == len(expected.prompt_ids)
        assert 1 <= r["chunks"] <= r["completion_tokens"]  # a step's tokens share a chunk
        assert len(r["itl_s"]) == r["chunks"] - 1
        assert 0 < r["ttft_s"] <= r["latency_s"] <= r["end_s"] - r["start_s"] + 1e-3
        assert r["tokens_per_s"] == pytest.approx(r["completion_tokens"] / r["latency_s"], 1e-3)

    assert summary["label"] == "ours" and summary["model"] == "tiny"
    assert summary["route"] == "/v1/completions" and summary["endpoint"] == url
    assert summary["token_counting"] == {"usage": 8, "chunks": 0}
    assert summary["settings"]["concurrency"] == [1, 2]
    assert summary["settings"]["max_new_tokens"] == TOKENS
    assert "api_key" not in summary["settings"]
    for level, c in zip(summary["levels"], (1, 2), strict=True):
        mine = [r for r in records if r["concurrency"] == c]
        tokens = sum(r["completion_tokens"] for r in mine)
        assert level["concurrency"] == c and level["requests"] == level["ok"] == 4
        assert level["errors"] == level["rate_limited"] == 0
        assert level["completion_tokens"] == tokens
        assert level["total_tokens_per_s"] == pytest.approx(tokens / level["wall_s"])
        wall = max(r["end_s"] for r in mine) - min(r["start_s"] for r in mine)
        assert level["wall_s"] == pytest.approx(wall)
        for key in ("ttft_s", "latency_s", "request_tokens_per_s"):
            assert_ordered(level[key])
        assert level["ttft_s"]["p95"] <= level["latency_s"]["p99"]
        assert set(level["per_category"]) == {"alpha", "beta"}
        assert sum(s["requests"] for s in level["per_category"].values()) == 4
        assert sum(s["completion_tokens"] for s in level["per_category"].values()) == tokens
    report = (out / "report.md").read_text()
    assert "| concurrency | requests | errors | 429 | total tok/s |" in report
    assert "the server's `usage` count" in report


def test_continue_takes_each_levels_prompts_after_the_last_ones(url, prompts_file, tmp_path):
    out = tmp_path / "continue"
    argv = ["--endpoint", url, "--concurrency", "1,2", "--prompts", str(prompts_file)]
    argv += ["--max-new-tokens", "2", "--requests-per-level", "2", "--prompt-order", "continue"]
    assert bench(*argv, "--out", str(out)) == 0
    records, summary = read_run(out)
    # the warm-up took ORDER[0]; level 1 the next two, level 2 the two after them
    assert [r["prompt_id"] for r in records] == [ORDER[i % 3] for i in range(1, 5)]
    assert summary["settings"]["prompt_order"] == "continue"
    assert "each level after the last one's prompts" in (out / "report.md").read_text()


def test_chat_without_usage_counts_chunks_and_compares(url, prompts_file, completions_run):
    out = completions_run.parent / "chat"
    argv = ["--endpoint", f"{url}/v1", "--concurrency", "2", "--prompts", str(prompts_file)]
    argv += ["--categories", "alpha", "--max-new-tokens", str(TOKENS), "--chat", "--no-usage"]
    assert bench(*argv, "--requests-per-level", "2", "--warmup", "0", "--out", str(out)) == 0
    records, summary = read_run(out)
    assert [r["prompt_id"] for r in records] == ["a1", "a2"]
    for r in records:
        assert r["kind"] == "ok" and r["token_source"] == "chunks"
        assert r["completion_tokens"] == r["chunks"] >= 1 and r["prompt_tokens"] is None
    assert summary["route"] == "/v1/chat/completions"
    assert summary["token_counting"] == {"usage": 0, "chunks": 2}
    assert summary["levels"][0]["tokens_per_chunk"] is None  # unknown without usage

    both = completions_run.parent / "both"
    assert bench("--compare", str(completions_run), str(out), "--out", str(both)) == 0
    result = json.loads((both / "compare.json").read_text())
    assert [r["label"] for r in result["runs"]] == ["ours", "chat"]
    assert [(r["run"], r["concurrency"]) for r in result["rows"]] == [
        ("ours", 1),
        ("ours", 2),
        ("chat", 2),
    ]
    assert result["differences"]["route"] == ["/v1/completions", "/v1/chat/completions"]
    assert result["differences"]["chat"] == [False, True]
    report = (both / "compare.md").read_text()
    assert "### total tokens/s" in report and "| concurrency | ours | chat |" in report
    for name in ("compare_throughput.png", "compare_latency.png"):
        assert (both / name).stat().st_size > 0


# -- failures: a stub server -------------------------------------------------------------------

FAILURES = ("500", "429", "cut", "reset", "ok")  # the stub's answers, in turn


class Stub(BaseHTTPRequestHandler):
    counter = itertools.count()
    lock = threading.Lock()
    delay_s = 0.0

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self.reply(200, json.dumps({"object": "list", "data": [{"id": "stub"}]}))

    def reply(self, status: int, body: str, headers: dict | None = None) -> None:
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body.encode())

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        with self.lock:
            mode = FAILURES[next(self.counter) % len(FAILURES)] if self.delay_s == 0 else "ok"
        time.sleep(self.delay_s)
        error = {"error": {"message": "boom", "type": "server_error"}}
        if mode == "500":
            return self.reply(500, json.dumps(error))
        if mode == "429":
            return self.reply(429, json.dumps(error), {"Retry-After": "0"})
        if mode == "reset":
            self.close_connection = True
            return self.connection.shutdown(socket.SHUT_RDWR)
        chunk = {"choices": [{"index": 0, "text": "hi", "finish_reason": None}]}
        events = [f"data: {json.dumps(chunk)}\n\n"]
        if mode == "ok":
            events += [": a comment\n", f"data: {json.dumps(chunk)}\n\n", "data: [DONE]\n\n"]
        self.reply(200, "".join(events), {"Content-Type": "text/event-stream"})


@contextlib.contextmanager
def http_stub(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """`handler` served on a free loopback port in a thread; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def stub_server(delay_s: float = 0.0) -> contextlib.AbstractContextManager[str]:
    return http_stub(
        type("StubHandler", (Stub,), {"counter": itertools.count(), "delay_s": delay_s})
    )


def test_failed_requests_are_recorded_not_raised(prompts_file, tmp_path):
    out = tmp_path / "stub"
    with stub_server() as base:
        argv = ["--endpoint", base, "--concurrency", "1,2", "--prompts", str(prompts_file)]
        argv += ["--requests-per-level", "10", "--warmup", "0", "--out", str(out)]
        assert bench(*argv) == 0
    records, summary = read_run(out)
    assert len(records) == 20
    kinds = [r["kind"] for r in records if r["concurrency"] == 1]
    assert kinds == ["http_error", "rate_limited", "stream_error", "connection", "ok"] * 2
    by_kind = {r["kind"]: r for r in records}
    assert by_kind["http_error"]["status"] == 500 and "boom" in by_kind["http_error"]["error"]
    assert by_kind["rate_limited"]["status"] == 429
    assert "without data: [DONE]" in by_kind["stream_error"]["error"]
    assert by_kind["connection"]["status"] is None
    assert by_kind["ok"]["completion_tokens"] == 2 and by_kind["ok"]["token_source"] == "chunks"
    for level in summary["levels"]:
        assert level["requests"] == 10 and level["ok"] == 2
        assert level["errors"] == 6 and level["rate_limited"] == 2  # 429 apart
        assert level["errors_by_kind"] == {
            "connection": 2,
            "http_error": 2,
            "rate_limited": 2,
            "stream_error": 2,
        }
        assert level["completion_tokens"] == 4 and level["latency_s"]["n"] == 2

    # a warm-up that fails stops the run before anything is measured
    with stub_server() as base:
        code = bench(
            "--endpoint", base, "--prompts", str(prompts_file), "--out", str(tmp_path / "w")
        )
    assert code == 2 and not (tmp_path / "w").exists()


def test_duration_bounds_a_level(prompts_file, tmp_path):
    out = tmp_path / "timed"
    with stub_server(delay_s=0.05) as base:
        argv = ["--endpoint", base, "--concurrency", "2", "--prompts", str(prompts_file)]
        assert bench(*argv, "--duration", "0.3", "--warmup", "0", "--out", str(out)) == 0
    records, summary = read_run(out)
    assert len(records) >= 1 and all(r["kind"] == "ok" for r in records)
    assert [r["index"] for r in records] == list(range(len(records)))
    assert summary["settings"]["duration_s"] == 0.3
    assert summary["levels"][0]["requests"] == len(records)
    assert "0.3 s per level" in (out / "report.md").read_text()


# -- bad input: one line, exit status 2, before anything is sent ---------------------------------


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--endpoint", "http://127.0.0.1:{port}"], "cannot reach http://127.0.0.1:{port}"),
        (["--endpoint", "127.0.0.1:8000"], "expected a base URL"),
        (["--endpoint", "http://x", "--concurrency", "0,2"], "from 1 to 1024 (got 0)"),
        (["--endpoint", "http://x", "--concurrency", ","], "at least one level"),
        (["--endpoint", "http://x", "--concurrency", "2,2"], "appears twice"),
        (["--endpoint", "http://x", "--requests-per-level", "1", "--concurrency", "2"], "below"),
        (["--endpoint", "http://x", "--categories", "nope"], "unknown category 'nope'; avail"),
        (["--endpoint", "http://x", "--prompts", "{empty}"], "no prompts in the file"),
        (["--endpoint", "http://x", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--endpoint", "http://x", "--duration", "0"], "--duration must be > 0"),
        (
            ["--endpoint", "http://x", "--prompt-order", "shuffle"],
            "one of restart, continue (got 'shuffle')",
        ),
        ([], "give --endpoint URL to measure"),
        (["--compare", "{tmp}"], "two or more folders"),
        (["--compare", "{tmp}", "{tmp}/none"], "summary.json does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    values = {"port": closed_port(), "empty": empty, "tmp": tmp_path}
    argv = [a.format(**values) for a in argv]
    assert bench(*argv, "--out", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert message.format(**values) in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_unknown_model_and_a_non_integer_level(prompts_file, tmp_path, capsys):
    with stub_server() as base:
        argv = ["--endpoint", base, "--prompts", str(prompts_file), "--out", str(tmp_path)]
        assert bench(*argv, "--model", "other") == 2
    assert "does not serve model 'other' (it lists: stub)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        bench("--endpoint", "http://x", "--concurrency", "1,two")
    assert exit_.value.code == 2
    assert "expected comma-separated integers" in capsys.readouterr().err


# -- the pieces --------------------------------------------------------------------------------


def test_percentile_interpolates_between_ranks():
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 95) == pytest.approx(3.85)
    with pytest.raises(ValueError):
        percentile(values, 101)


def record(kind="ok", category="x", tokens=10, ttft=0.1, latency=1.0, itl=(0.1, 0.2), **extra):
    base = {
        "concurrency": 4,
        "category": category,
        "kind": kind,
        "start_s": 0.0,
        "end_s": latency,
        "ttft_s": ttft if kind == "ok" else None,
        "latency_s": latency,
        "itl_s": list(itl) if kind == "ok" else [],
        "chunks": len(itl) + 1 if kind == "ok" else 0,
        "completion_tokens": tokens if kind == "ok" else None,
        "token_source": "usage" if kind == "ok" else None,
    }
    base.update(extra)
    from specdecode.bench.serve_stats import per_request

    return base | per_request(base)


def test_level_summary_on_synthetic_records():
    records = [
        record(category="x", tokens=10, latency=1.0, end_s=1.0),
        record(category="y", tokens=30, latency=2.0, ttft=0.5, end_s=4.0, itl=(0.3,)),
        record(kind="rate_limited", category="y", latency=0.01, end_s=0.5),
        record(kind="http_error", category="x", latency=0.02, end_s=0.6),
    ]
    level = summarize_level(records)
    assert level["concurrency"] == 4 and level["requests"] == 4 and level["ok"] == 2
    assert level["errors"] == 1 and level["rate_limited"] == 1
    assert level["errors_by_kind"] == {"http_error": 1, "rate_limited": 1}
    assert level["wall_s"] == 4.0 and level["completion_tokens"] == 40
    assert level["total_tokens_per_s"] == 10.0 and level["requests_per_s"] == 0.5
    assert level["tokens_per_chunk"] == 40 / 5
    assert level["ttft_s"]["p50"] == pytest.approx(0.3) and level["ttft_s"]["n"] == 2
    assert level["itl_s"]["n"] == 3 and level["itl_s"]["p50"] == pytest.approx(0.2)
    assert level["latency_s"]["mean"] == 1.5  # failures leave latencies alone
    # TPOT: after the first chunk, per following token
    assert level["tpot_s"]["p50"] == pytest.approx(((0.9 / 9) + (1.5 / 29)) / 2)
    assert level["request_tokens_per_s"]["p50"] == pytest.approx(12.5)
    x, y = level["per_category"]["x"], level["per_category"]["y"]
    assert (x["requests"], x["errors"], x["completion_tokens"]) == (2, 1, 10)
    assert (y["requests"], y["rate_limited"], y["completion_tokens"]) == (2, 1, 30)
    assert x["total_tokens_per_s"] == 10 / 4.0  # its share over the level's wall time
    nothing = summarize_level([record(kind="timeout")])
    assert nothing["ok"] == 0 and nothing["ttft_s"]["p95"] is None
    assert nothing["total_tokens_per_s"] == 0.0


def test_sse_events_and_endpoints():
    lines = [b": keep-alive\n", b'data: {"a": 1}\r\n', b"\r\n", b"event: x\n", b"data: one\n"]
    lines += [b"data:two\n", b"\n", b"data: [DONE]"]
    assert list(sse_data(lines)) == ['{"a": 1}', "one\ntwo", "[DONE]"]
    assert Endpoint.parse("http://h:8080/v1/").url == "http://h:8080"
    https = Endpoint.parse("https://example.org/api/v1", "key")
    assert https.path("/v1/models") == "/api/v1/models" and https.port is None
    assert https.headers(True)["Authorization"] == "Bearer key"
    for bad in ("ftp://h", "http://", "http://h:port", "http://h?x=1"):
        with pytest.raises(ValueError, match="base URL"):
            Endpoint.parse(bad)


def test_the_api_key_is_not_recorded():
    from specdecode.bench.cli_bench_serve import _command

    argv = ["bench-serve", "--api-key", "secret", "--api-k=secret2", "--endpoint", "http://x"]
    shown = _command(argv)
    assert "secret" not in shown and shown.count("***") == 2
