"""`specdecode run-batch`: a JSONL file of requests answered as the server answers each body,
resumable after any interruption (server/batch_file.py, server/run_batch.py)."""

from __future__ import annotations

import json
import os
import random
import signal
import typing

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient

from specdecode import SpeculativeDecoder
from specdecode.cli import main
from specdecode.models.loading import wrap_model
from specdecode.server import batch_file
from specdecode.server import run_batch as run_batch_module
from specdecode.server.app import create_app
from specdecode.server.batch_file import BatchFileError, parse_line, read_requests
from specdecode.server.run_batch import run_batch

from conftest import char_tokenizer, noisy_copy, tiny_llama

MODEL = "tiny"
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# fields that differ between any two answers of the same body: its ids and its time
PER_CALL = ("id", "created", "request_id")


@pytest.fixture(scope="module")
def models():
    tokenizer = char_tokenizer(":")
    tokenizer.chat_template = TEMPLATE
    target = tiny_llama(seed=0, vocab=len(tokenizer))
    return wrap_model(target, tokenizer, name=MODEL), noisy_copy(target, 0.05)


def engine_of(models, **options) -> SpeculativeDecoder:
    target, draft = models
    # a fixed k: the speculative counters in `usage` are then the same at any batch size
    return SpeculativeDecoder(target, draft, **{"k": 3, "k_policy": "fixed", **options})


def requests(n: int = 14) -> list[dict]:
    """Mixed lines: Batch API chat and completions requests, plain prompts and messages,
    greedy and seeded sampling, a stop string."""
    rng = random.Random(0)
    words = ["the sea", "a cat", "why is it so", "hello there", "one two three", "stars"]
    lines: list[dict] = []
    for i in range(n):
        text = f"{rng.choice(words)} {i}"
        options = {"max_tokens": rng.randint(4, 24), "temperature": rng.choice([0, 0.8])}
        if options["temperature"]:
            options["seed"] = i
        if i % 4 == 0:
            body = {"model": MODEL, "messages": [{"role": "user", "content": text}], **options}
            lines.append(
                {
                    "custom_id": f"r{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": body,
                }
            )
        elif i % 4 == 1:
            body = {"model": MODEL, "prompt": text, **options, "stop": ["e"]}
            lines.append(
                {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
            )
        elif i % 4 == 2:
            lines.append({"prompt": text, **options})
        else:
            lines.append({"messages": [{"role": "user", "content": text}], **options})
    return lines


def write_jsonl(path, lines) -> None:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def stable(value):
    """`value` without the per-call ids and times."""
    if isinstance(value, dict):
        return {k: stable(v) for k, v in value.items() if k not in PER_CALL}
    if isinstance(value, list):
        return [stable(v) for v in value]
    return value


def test_each_line_is_answered_as_the_server_answers_its_body(models, tmp_path):
    lines = requests()
    lines.insert(5, "{not json")
    lines.insert(7, {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}})
    lines.append({"custom_id": "other", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "gpt-4o", "prompt": "hi"}})  # fmt: skip
    lines.append({"prompt": "a" * 300, "max_tokens": 4})  # past the tiny model's 256 positions
    lines.append({"prompt": "hi", "stream": True})
    write_jsonl(tmp_path / "in.jsonl", lines)
    summary = run_batch(
        engine_of(models), tmp_path / "in.jsonl", tmp_path / "out.jsonl", model_name=MODEL,
        max_batch=4, progress=False,
    )  # fmt: skip
    out = read_jsonl(tmp_path / "out.jsonl")
    parsed = read_requests(tmp_path / "in.jsonl", MODEL)
    assert [r["custom_id"] for r in out] == [p.custom_id for p in parsed]  # the input's order
    with TestClient(create_app(engine_of(models), MODEL)) as client:
        for request, record in zip(parsed, out, strict=True):
            if request.error is not None:  # not a request: the line's own error
                assert record["response"] is None and record["error"] == request.error
                continue
            assert record["error"] is None and record["id"].startswith("batch_req_")
            alone = client.post(request.url, json=request.body)
            response = record["response"]
            assert response["status_code"] == alone.status_code, request.custom_id
            assert stable(response["body"]) == stable(alone.json()), request.custom_id
    codes = dict(summary.failures)
    assert codes == {
        "line-6": "invalid_json",
        "bad-url": "invalid_url",
        "other": "404 model_not_found",
        "line-18": "400 context_length_exceeded",
        "line-19": "invalid_request",
    }
    assert summary.complete and not summary.interrupted and summary.earlier == 0
    assert summary.answered == len(lines) and summary.completion_tokens > 0
    assert summary.drafted > 0 and summary.accepted > 0
    assert summary.speedup is None  # a fixed policy measures no costs to estimate from
    assert any("5 answered with an error" in line for line in summary.report())


class Crash(Exception):
    pass


def test_killed_at_random_points_and_resumed_it_ends_as_one_run(models, tmp_path, monkeypatch):
    write_jsonl(tmp_path / "in.jsonl", requests(16))
    run_batch(engine_of(models), tmp_path / "in.jsonl", tmp_path / "once.jsonl",
              model_name=MODEL, max_batch=3, progress=False)  # fmt: skip
    once = read_jsonl(tmp_path / "once.jsonl")

    out = tmp_path / "out.jsonl"
    written = batch_file.ResumableOutput.write
    asked: list[str] = []
    answer = run_batch_module._answer

    async def counted(client, request):
        asked.append(request.custom_id)
        return await answer(client, request)

    monkeypatch.setattr(run_batch_module, "_answer", counted)
    rng = random.Random(1)
    for attempt in range(3):
        budget = rng.randint(1, 4)

        def crash_after(self, record, budget=[budget]):  # noqa: B006 - a counter per attempt
            if budget[0] == 0:
                raise Crash("the process dies here")
            budget[0] -= 1
            written(self, record)

        monkeypatch.setattr(batch_file.ResumableOutput, "write", crash_after)
        before = out.read_bytes().count(b"\n") if out.exists() else 0  # whole lines
        asked.clear()
        with pytest.raises(Crash):
            run_batch(engine_of(models), tmp_path / "in.jsonl", out, model_name=MODEL,
                      max_batch=3, progress=False)  # fmt: skip
        ids = [r["custom_id"] for r in read_jsonl(out)]
        assert len(ids) == len(set(ids)) and len(ids) > before  # whole lines, none twice
        assert not set(asked) & set(ids[:before])  # nothing answered before is asked again
        if attempt == 1:  # the process died inside a write: half a line at the end
            with out.open("ab") as f:
                f.write(b'{"id": "batch_req_x", "custom_id": "r')
    monkeypatch.setattr(batch_file.ResumableOutput, "write", written)
    summary = run_batch(engine_of(models), tmp_path / "in.jsonl", out, model_name=MODEL,
                        max_batch=3, progress=False)  # fmt: skip
    assert summary.complete and summary.earlier + summary.answered == 16
    assert [stable(r) for r in read_jsonl(out)] == [stable(r) for r in once]
    again = run_batch(engine_of(models), tmp_path / "in.jsonl", out, model_name=MODEL,
                      progress=False)  # fmt: skip
    assert again.answered == 0 and again.earlier == 16 and again.complete


def test_sigterm_stops_it_and_the_same_command_goes_on(models, tmp_path, monkeypatch):
    write_jsonl(tmp_path / "in.jsonl", requests(12))
    out = tmp_path / "out.jsonl"
    written = batch_file.ResumableOutput.write
    count = [0]

    def signal_after_three(self, record):
        written(self, record)
        count[0] += 1
        if count[0] == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # as `kill` or a scheduler would

    monkeypatch.setattr(batch_file.ResumableOutput, "write", signal_after_three)
    first = run_batch(engine_of(models), tmp_path / "in.jsonl", out, model_name=MODEL,
                      max_batch=2, progress=False)  # fmt: skip
    assert first.interrupted and not first.complete
    assert 3 <= first.answered < 12 and len(read_jsonl(out)) == first.answered
    assert any("run the same command again" in line for line in first.report())
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # its handler is gone again
    monkeypatch.setattr(batch_file.ResumableOutput, "write", written)
    second = run_batch(engine_of(models), tmp_path / "in.jsonl", out, model_name=MODEL,
                       progress=False)  # fmt: skip
    assert second.complete and second.earlier == first.answered
    assert second.earlier + second.answered == 12
    assert [r["custom_id"] for r in read_jsonl(out)] == [
        p.custom_id for p in read_requests(tmp_path / "in.jsonl", MODEL)
    ]


def test_the_measured_policy_estimates_the_speedup(models, tmp_path):
    write_jsonl(tmp_path / "in.jsonl", requests(12))
    target, draft = models
    summary = run_batch(SpeculativeDecoder(target, draft), tmp_path / "in.jsonl",
                        tmp_path / "out.jsonl", model_name=MODEL, max_batch=3,
                        progress=False)  # fmt: skip
    # the estimate is printed only when the policy measured what it needs
    assert any("the target alone" in line for line in summary.report())


def test_the_official_clients_batch_lines_are_taken(models, tmp_path):
    from openai.types import Completion, batch_create_params
    from openai.types.chat import ChatCompletion
    from openai.types.chat.completion_create_params import (
        CompletionCreateParamsNonStreaming as ChatParams,
    )
    from openai.types.completion_create_params import (
        CompletionCreateParamsNonStreaming as CompletionParams,
    )

    endpoints = typing.get_args(
        typing.get_type_hints(batch_create_params.BatchCreateParams)["endpoint"]
    )
    chat: ChatParams = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello there"}]},
        ],
        "max_completion_tokens": 8,
        "temperature": 0,
        "stop": ["x"],
    }
    completion: CompletionParams = {"model": MODEL, "prompt": "the sea", "max_tokens": 8, "seed": 3}
    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "text", "method": "POST", "url": "/v1/completions", "body": completion},
    ]
    assert {line["url"] for line in lines} <= set(endpoints)
    write_jsonl(tmp_path / "in.jsonl", lines)
    run_batch(engine_of(models), tmp_path / "in.jsonl", tmp_path / "out.jsonl",
              model_name=MODEL, progress=False)  # fmt: skip
    chat_out, text_out = read_jsonl(tmp_path / "out.jsonl")
    assert chat_out["response"]["status_code"] == 200 == text_out["response"]["status_code"]
    reply = ChatCompletion.model_validate(chat_out["response"]["body"])
    assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens <= 8
    assert Completion.model_validate(text_out["response"]["body"]).choices[0].text


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "holds no requests"),
        (b"\n\n", "holds no requests"),
        (b"[1, 2]\n", "line 1 is not a JSON"),
        (b"this is a text file\n", "is not JSON Lines: line 1"),
        (b'{"prompt": "a"}\n\xff\xfe\n', "not UTF-8"),
        (
            b'{"prompt": "a", "custom_id": "a"}\n{"prompt": "b", "custom_id": "a"}\n',
            "lines 1 and 2",
        ),
    ],
)
def test_a_file_that_is_not_a_batch_is_refused_whole(tmp_path, capsys, content, message):
    path = tmp_path / "in.jsonl"
    path.write_bytes(content)
    if message == "line 1 is not a JSON":  # JSON, but not an object: that line's error
        assert read_requests(path, MODEL)[0].error["code"] == "invalid_request"
        return
    with pytest.raises(BatchFileError, match=message):
        read_requests(path, MODEL)
    # the command: one line, exit status 2, before any model is loaded
    code = main(["run-batch", "--input", str(path), "--output", str(tmp_path / "o.jsonl"),
                 "--target", "no/such-model"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "error:" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o.jsonl").exists()


def test_an_output_of_another_input_is_refused(tmp_path, capsys):
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a", "custom_id": "a"}])
    write_jsonl(tmp_path / "out.jsonl", [{"custom_id": "zzz", "response": None, "error": None}])
    args = ["run-batch", "--input", str(tmp_path / "in.jsonl"), "--target", "no/such-model"]
    assert main([*args, "--output", str(tmp_path / "out.jsonl")]) == 2
    assert "belongs to another input" in capsys.readouterr().err
    write_jsonl(tmp_path / "junk.jsonl", ["not an output line"])
    assert main([*args, "--output", str(tmp_path / "junk.jsonl")]) == 2
    assert "not a run-batch output line" in capsys.readouterr().err
    assert main([*args, "--output", str(tmp_path / "in.jsonl")]) == 2
    assert main([*args, "--output", str(tmp_path / "no" / "such" / "out.jsonl")]) == 2
    assert "folder does not exist" in capsys.readouterr().err
    assert main([*args[:2], str(tmp_path / "missing.jsonl"), *args[3:], "--output", "o"]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_a_line_separator_inside_a_json_string_is_text(tmp_path):
    # JSON may hold U+2028 and U+0085 raw in a string: only "\n" ends a line of JSON Lines
    prompt = "one\u2028two\u0085three\x0cfour"
    write_jsonl(tmp_path / "in.jsonl", [json.dumps({"prompt": prompt}, ensure_ascii=False)])
    (request,) = read_requests(tmp_path / "in.jsonl", MODEL)
    assert request.error is None and request.body["prompt"] == prompt


def test_lines_parse_as_the_batch_api_or_plain_bodies():
    chat = parse_line(3, json.dumps({"messages": [{"role": "user", "content": "hi"}]}), "m")
    assert (chat.custom_id, chat.url, chat.body["model"]) == ("line-3", "/v1/chat/completions", "m")
    text = parse_line(1, json.dumps({"prompt": "hi", "model": "own", "custom_id": "k"}), "m")
    assert (text.custom_id, text.url, text.body) == (
        "k",
        "/v1/completions",
        {"prompt": "hi", "model": "own"},
    )
    api = {"custom_id": "q", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    assert parse_line(1, json.dumps(api), "m").body == {"prompt": "x"}  # as given: no model added
    for broken, code in [
        ({**api, "method": "GET"}, "invalid_request"),
        ({key: value for key, value in api.items() if key != "body"}, "invalid_request"),
        ({**api, "body": [1]}, "invalid_request"),
        ({**api, "url": "/v1/responses"}, "invalid_url"),
        ({"custom_id": 7, "prompt": "x"}, "invalid_request"),
        ({"text": "x"}, "invalid_request"),
    ]:
        request = parse_line(2, json.dumps(broken), "m")
        assert request.error["code"] == code and request.error["message"].startswith("line 2:")


def test_the_command_answers_a_file_and_prints_a_summary(tiny_folders, tmp_path, capsys):
    lines = [{"prompt": "tell me a story.", "max_tokens": 12, "temperature": 0}]
    lines += [{"messages": [{"role": "user", "content": "why is the sky blue?"}], "max_tokens": 9}]
    write_jsonl(tmp_path / "in.jsonl", [*lines, "{broken"])
    folders = ["--target", str(tiny_folders / "target"), "--draft", str(tiny_folders / "draft")]
    files = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    assert main(["run-batch", *files, *folders, "--dtype", "float32", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "run-batch: 3 of 3 requests answered." in err
    assert "1 answered with an error: line-3 (invalid_json)" in err
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [r["response"]["status_code"] for r in out[:2]] == [200, 200]
    assert out[0]["response"]["body"]["model"] == "target"  # served under the target's name
    # a second run finds everything answered: nothing runs, the file is unchanged
    before = (tmp_path / "out.jsonl").read_bytes()
    assert main(["run-batch", *files, *folders, "--dtype", "float32", "--quiet"]) == 0
    assert "3 of 3 requests answered (3 by an earlier run)" in capsys.readouterr().err
    assert (tmp_path / "out.jsonl").read_bytes() == before


def test_a_process_killed_outright_goes_on_where_it_stopped(tiny_folders, tmp_path):
    # SIGKILL: no handler runs, nothing is flushed after the fact; the same command then
    # answers the rest, and the file ends as one run's (in the input's order, no line twice)
    import subprocess
    import sys
    import time

    lines = [
        {"prompt": f"tell me a story {i}.", "max_tokens": 30, "temperature": 0} for i in range(80)
    ]
    write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    command = [
        sys.executable,
        "-c",
        "import sys; from specdecode.cli import main; sys.exit(main())",
    ]
    command += ["run-batch", "--input", str(tmp_path / "in.jsonl"), "--output", str(out)]
    command += ["--target", str(tiny_folders / "target"), "--dtype", "float32", "--quiet"]
    command += ["--draft", str(tiny_folders / "draft"), "--max-batch", "1", "--k-policy", "fixed"]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_bytes().count(b"\n") >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
        time.sleep(0.005)
    proc.kill()
    proc.wait()
    kept = out.read_bytes().count(b"\n")
    assert 3 <= kept < 80  # killed mid-run
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert f"80 of 80 requests answered ({kept} by an earlier run)" in done.stderr
    ids = [r["custom_id"] for r in read_jsonl(out)]
    assert ids == [f"line-{i}" for i in range(1, 81)]


def test_similar_requests_draft_from_each_others_answers(models, tmp_path):
    # the suffix pool is the engine's: every row of the job drafts from the answers before it
    from specdecode.drafters import SuffixDrafter

    target, _ = models
    line = {"prompt": "hello there", "max_tokens": 24, "temperature": 0}
    write_jsonl(tmp_path / "in.jsonl", [{**line, "custom_id": f"same-{i}"} for i in range(4)])
    engine = SpeculativeDecoder(target, SuffixDrafter(), k_policy="fixed")
    summary = run_batch(engine, tmp_path / "in.jsonl", tmp_path / "out.jsonl", model_name=MODEL,
                        max_batch=1, progress=False)  # fmt: skip
    usage = [r["response"]["body"]["usage"] for r in read_jsonl(tmp_path / "out.jsonl")]
    texts = {
        r["response"]["body"]["choices"][0]["text"] for r in read_jsonl(tmp_path / "out.jsonl")
    }
    assert len(texts) == 1 and usage[0]["completion_tokens"] > 8  # greedy: one answer, 4 times
    accepted = [u["completion_tokens_details"]["accepted_prediction_tokens"] for u in usage]
    assert accepted[-1] > accepted[0] + 5  # the later ones draft the first one's answer
    assert engine.drafter.pool.report()["outputs"] == 4 and summary.accepted == sum(accepted)
