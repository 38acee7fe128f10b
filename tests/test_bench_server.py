"""`specdecode bench --server`: the suite through OpenAI-compatible servers, acceptance from their
Prometheus counters.

Against two of our own servers on 127.0.0.1 (test_server.py's tiny float32 models, greedy): one
without a draft labelled `ar`, one speculating; every request's counts must equal what the engine
itself measures on the same chat prompt. Against stub servers: one without counters (speed alone),
one whose counters lag a request behind (the category's last scrape catches up). And the
counters' parser on text shaped as vLLM writes it.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from specdecode import SpeculativeDecoder
from specdecode.bench.server_counters import Counters, parse_counters
from specdecode.cli import main
from test_bench_serve import PROMPTS, http_stub, read_run
from test_server import make_engine, serving, tiny_models

TOKENS = 12


@pytest.fixture(scope="module")
def models():
    return tiny_models()


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def bench(*argv: str) -> int:
    return main(["bench", *argv])


def overall(summary: dict, setting: str) -> dict:
    return next(r for r in summary["rows"] if r["setting"] == setting and r["category"] == "all")


def test_our_servers_side_by_side(models, prompts_file, tmp_path):
    out = tmp_path / "servers"
    target, _ = models
    with serving(SpeculativeDecoder(target)) as ar, serving(make_engine(models)) as spec:
        argv = ["--server", f"ar={ar}", "--server", f"spec={spec}", "--turns", "all"]
        argv += ["--prompts", str(prompts_file), "--max-new-tokens", str(TOKENS)]
        assert bench(*argv, "--out", str(out)) == 0
    records, summary = read_run(out)
    # every prompt and turn on both servers, one category at a time (alpha's two, then beta's)
    assert [(r["prompt_id"], r["turn"]) for r in records if r["setting"] == "spec"] == [
        ("a1", 0),
        ("a2", 0),
        ("b1", 0),
        ("b1", 1),
    ]
    reference = make_engine(models)
    for record in (r for r in records if r["setting"] == "spec"):
        prompt = next(p for p in PROMPTS if p["id"] == record["prompt_id"])
        turns = prompt.get("turns") or [prompt["prompt"]]
        messages = []
        for turn in range(record["turn"] + 1):
            messages.append({"role": "user", "content": turns[turn]})
            if turn < record["turn"]:  # the server's own earlier answer, as it was sent
                earlier = next(
                    r for r in records if r["setting"] == "spec" and r["prompt_id"] == prompt["id"]
                )
                messages.append({"role": "assistant", "content": earlier["text"]})
        result = reference.generate(messages, max_new_tokens=TOKENS, chat=True)
        assert record["text"] == result.text
        assert record["new_tokens"] == len(result.token_ids)
        # the counters the server exported around this request are the engine's own counts
        assert record["drafted"] == result.stats.drafted
        assert record["accepted"] == result.stats.accepted
        assert record["identical_to_ar"] is True
        assert record["k"] == (3 if record["drafted"] else 0) and record["method"] == "server"
    for record in (r for r in records if r["setting"] == "ar"):
        assert record["method"] == "ar" and not record["drafted"]
    row = overall(summary, "spec")
    assert row["identical"] == row["compared"] == 4
    spec = [r for r in records if r["setting"] == "spec"]
    drafted, accepted = sum(r["drafted"] for r in spec), sum(r["accepted"] for r in spec)
    assert row["acceptance_rate"] == pytest.approx(accepted / drafted)
    # the decode speedup: per prompt and turn, over the `ar` server's, geometric mean
    ar = {
        (r["prompt_id"], r["turn"]): r["decode_tokens_per_s"]
        for r in records
        if r["setting"] == "ar"
    }
    pairs = [(r["decode_tokens_per_s"], ar[(r["prompt_id"], r["turn"])]) for r in spec]
    ratios = [ours / theirs for ours, theirs in pairs if ours and theirs]  # one-token answers: none
    assert ratios
    assert row["speedup"] == pytest.approx(math.prod(ratios) ** (1 / len(ratios)))
    report = (out / "report.md").read_text()
    assert f"`spec` = {spec[0]['server']}" in report and "speculative counters read" in report
    assert (out / "acceptance_by_category.png").exists()
    # a saved run re-renders without the servers
    assert main(["report", str(out)]) == 0


# -- stubs ---------------------------------------------------------------------------------------


class Stub(BaseHTTPRequestHandler):
    """Answers every request with two chunks ("hi" twice); `/metrics` per `counters`."""

    counters: str = "none"  # none: 404 | lagging: counts published one scrape late
    lock = threading.Lock()

    def log_message(self, *args) -> None:  # quiet
        pass

    def reply(self, status: int, body: str, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.end_headers()
        self.wfile.write(body.encode())

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            return self.reply(200, json.dumps({"object": "list", "data": [{"id": "stub"}]}))
        if self.path != "/metrics" or self.counters == "none":
            return self.reply(404, json.dumps({"detail": "Not Found"}))
        with self.lock:  # what the last scrape missed shows now (a server counting late)
            state = type(self).state
            shown = dict(state["published"])
            state["published"] = dict(state["pending"])
        text = "".join(
            f'vllm:spec_decode_num_{name}_total{{model_name="stub"}} {value}\n'
            for name, value in shown.items()
        )
        self.reply(200, text, "text/plain")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        with self.lock:
            pending = type(self).state["pending"]
            pending["drafts"] += 2
            pending["draft_tokens"] += 8
            pending["accepted_tokens"] += 5
        chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
        events = [f"data: {json.dumps(c)}\n\n" for c in (chunk, chunk, usage)]
        self.reply(200, "".join([*events, "data: [DONE]\n\n"]), "text/event-stream")


def stub_server(counters: str) -> contextlib.AbstractContextManager[str]:
    zero = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    state = {"pending": dict(zero), "published": dict(zero)}
    return http_stub(type("StubHandler", (Stub,), {"counters": counters, "state": state}))


def test_counters_that_arrive_late_still_sum_per_category(prompts_file, tmp_path):
    out = tmp_path / "lagging"
    with stub_server("lagging") as lagging, stub_server("none") as plain:
        argv = ["--server", f"late={lagging}", "--server", f"plain={plain}"]
        assert bench(*argv, "--prompts", str(prompts_file), "--out", str(out)) == 0
    records, summary = read_run(out)
    late = [r for r in records if r["setting"] == "late"]
    for category, n in (("alpha", 2), ("beta", 1)):
        mine = [r for r in late if r["category"] == category]
        assert len(mine) == n
        # each request drafted 8 and accepted 5 in 2 steps: whichever record they landed on,
        # the category's sums are exact
        assert sum(r["drafted"] for r in mine) == 8 * n
        assert sum(r["accepted"] for r in mine) == 5 * n
        assert sum(r["steps"] for r in mine) == 2 * n
    assert overall(summary, "late")["acceptance_rate"] == pytest.approx(5 / 8)
    assert overall(summary, "late")["mean_acceptance_length"] == pytest.approx(1 + 5 / 2)
    # a server without counters: speed alone, said so; no `ar` server: no speedups
    plain_row = overall(summary, "plain")
    assert plain_row.get("acceptance_rate") is None and plain_row["speedup"] is None
    plain = [r["decode_tokens_per_s"] for r in records if r["setting"] == "plain"]
    assert plain_row["decode_tokens_per_s"] == pytest.approx(sum(plain) / len(plain))
    assert all(
        r["drafted"] is None and r["new_tokens"] == 2 for r in records if r["setting"] == "plain"
    )
    assert "no speculative counters: speed only" in (out / "report.md").read_text()


def test_bad_input_is_one_clear_line(prompts_file, tmp_path, capsys):
    with stub_server("none") as base:
        cases = [
            (["--server", base, "--target", "tiny"], "--target configures our engine"),
            (["--server", f"a={base}", "--server", f"a={base}"], "label 'a' is given twice"),
            (["--server", "ftp://x"], "expected a base URL"),
            (["--server", base, "--model", "other"], "does not serve model 'other'"),
        ]
        for argv, message in cases:
            out = tmp_path / "bad"
            assert bench(*argv, "--prompts", str(prompts_file), "--out", str(out)) == 2
            assert message in capsys.readouterr().err
    # a server that is not there
    assert bench("--server", base, "--prompts", str(prompts_file), "--out", str(out)) == 2
    assert "cannot reach" in capsys.readouterr().err


VLLM_METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="qwen"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="qwen"} 1.7e9
vllm:spec_decode_num_drafts_total{engine="0",model_name="other"} 99.0
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="qwen"} 30.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="qwen"} 21.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="qwen",position="0"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="qwen",position="2"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="qwen",position="1"} 7.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} 0.0
"""


def test_counters_parse_as_vllm_writes_them():
    counters = parse_counters(VLLM_METRICS, "qwen")
    assert counters == Counters(10.0, 30.0, 21.0, (9.0, 7.0, 5.0), None)
    later = Counters(12.0, 36.0, 25.0, (11.0, 8.0, 6.0, 1.0), None)
    assert later.minus(counters) == Counters(2.0, 6.0, 4.0, (2.0, 1.0, 1.0, 1.0), None)
    assert parse_counters(VLLM_METRICS, None).drafts == 109.0  # every model
    assert parse_counters("# nothing here\nup 1\n") is None


def test_positions_unknown_for_some_requests_are_left_out_of_the_pooled_rate():
    from specdecode.bench.aggregate import OVERALL, summarize
    from specdecode.bench.records import Record

    def record(setting: str, drafted_at: list[int] | None) -> Record:
        drafted = 5 if drafted_at is None else sum(drafted_at)
        return Record(prompt_id="p", category="c", method="server", setting=setting,
                      steps=2, drafted=drafted, accepted=3, emitted=5,
                      accepted_at=[2, 1], drafted_at=drafted_at)  # fmt: skip

    records = [record("a", [2, 2]), record("a", None)]
    for r, prompt in zip(records, ("p1", "p2"), strict=True):
        r.prompt_id = prompt
    row = next(r for r in summarize(records)["rows"] if r["category"] == OVERALL)
    # a fixed k would have said [2, 2]; a step that drafted fewer leaves the positions unknown
    assert row["per_position_acceptance"] == [1.0, 0.5]
    assert row["acceptance_rate"] == pytest.approx(6 / 9)
