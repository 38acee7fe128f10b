"""`specdecode tune --engine vllm` against the stand-in for vLLM (tests/fake_vllm.py): every
candidate started on a server of its own and stopped, measured through `bench --server`, the
fastest recommended, its serving forms written; a candidate vLLM refuses is skipped with vLLM's
own line; bad options are one line each.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import fake_vllm
from specdecode.bench.tune_vllm import candidates
from specdecode.cli import main

PROMPTS = [
    {"id": "a1", "category": "alpha", "prompt": "the cat sat on"},
    {"id": "b1", "category": "beta", "prompt": "why is the sky blue?"},
]


@pytest.fixture
def prompts_file(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def test_candidates_in_the_forms_vllm_takes(tmp_path):
    found = candidates(["ngram:2-3", "suffix:pool=off", str(tmp_path)], [2])
    by_label = {c.label: c for c in found}
    assert list(by_label) == [
        "ar",
        "vllm ngram:2-3 k=2",
        "ours ngram:2-3 k=2",
        "ours suffix:pool=off k=2",
        f"vllm {tmp_path} k=2",
    ]
    assert by_label["ar"].speculative_config is None
    assert by_label["vllm ngram:2-3 k=2"].speculative_config == {
        "method": "ngram",
        "num_speculative_tokens": 2,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 3,
    }
    ours = by_label["ours suffix:pool=off k=2"]
    assert ours.speculative_config["model"] == "specdecode.integrations.vllm.SuffixProposer"
    assert ours.env == {"SPECDECODE_VLLM_DRAFT": "suffix:pool=off"}
    assert by_label[f"vllm {tmp_path} k=2"].speculative_config["method"] == "draft_model"
    with pytest.raises(ValueError, match="no early-exit"):
        candidates(["early-exit:2"], [2])


def test_tune_vllm_measures_every_candidate_and_recommends(
    tmp_path, prompts_file, monkeypatch, capsys
):
    root = fake_vllm.install(tmp_path / "fake")
    monkeypatch.setenv("PYTHONPATH", str(root))  # the servers' environment inherits ours
    # a proposer class vLLM refuses: skipped, with vLLM's line
    monkeypatch.setattr("specdecode.bench.tune_vllm.PROPOSERS", "specdecode.Refused")
    out = tmp_path / "tune"
    argv = ["tune", "--engine", "vllm", "--vllm-python", sys.executable, "--target", str(root)]
    argv += ["--draft", "ngram:1-2", "--draft", "suffix", "--vllm-k", "2"]
    argv += ["--prompts", str(prompts_file), "--limit", "1", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads((out / "tune-vllm.json").read_text())
    assert result["candidates"] == [
        "ar",
        "vllm ngram:1-2 k=2",
        "ours ngram:1-2 k=2",
        "ours suffix k=2",
    ]
    assert set(result["failed"]) == {"ours ngram:1-2 k=2", "ours suffix k=2"}
    assert "ValueError: this speculative config is refused" in result["failed"]["ours suffix k=2"]
    # the stand-in's n-gram method answers faster than it does alone: recommended everywhere
    for row in result["recommended"].values():
        assert row["setting"] == "vllm ngram:1-2 k=2" and row["speedup"] > 1
        # the stand-in drafts 2 x k and accepts 3 per request
        assert row["acceptance_rate"] == pytest.approx(3 / 4)
    assert result["speculative_config"]["method"] == "ngram"
    forms = result["forms"]
    assert forms["vllm_serve"].startswith(f"vllm serve {root} --served-model-name target")
    assert forms["tensor_parallel"].endswith("--tensor-parallel-size 2")
    assert '"tensor_parallel_size": 2' in forms["ray_serve_llm"]
    # the stand-in has no vLLM classes to read the forms with: said, not hidden
    assert result["forms_checked"] is None and result["forms_refused"]
    report = capsys.readouterr().out
    assert "| all | vllm ngram:1-2 k=2 |" in report and "Not measured: `ours suffix k=2`" in report
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["setting"] for r in records} == {"ar", "vllm ngram:1-2 k=2", "ar again"}
    # vLLM alone once more at the end: the stand-in's speed holds, so about 1
    assert result["drift"] == pytest.approx(1.0, abs=0.5)
    assert "measured again after the last candidate" in report
    assert all(r["identical_to_ar"] for r in records if r["setting"] != "ar")


def test_bad_options_are_one_line(tmp_path, capsys):
    base = ["tune", "--target", str(tmp_path), "--draft", "ngram"]
    cases = [
        (["--engine", "vllm"], "needs --vllm-python"),
        (["--vllm-python", sys.executable], "go with --engine vllm"),
        (
            ["--engine", "vllm", "--vllm-python", sys.executable, "--tree", "chain:3"],
            "vLLM drafts fixed-k chains",
        ),
    ]
    for extra, message in cases:
        assert main([*base, *extra, "--out", str(tmp_path / "x")]) == 2
        assert message in capsys.readouterr().err
    quantized = ["tune", "--engine", "vllm", "--vllm-python", sys.executable]
    quantized += ["--target", "qwen2.5-coder-1.5b-instruct:int4", "--draft", "ngram"]
    assert main(quantized) == 2
    assert "drop the suffix" in capsys.readouterr().err
