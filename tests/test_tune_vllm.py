"""`specdecode tune --engine vllm` against the stand-in for vLLM (tests/fake_vllm.py): every
candidate started on a server of its own and stopped, measured through `bench --server` beside
one `ar` server kept up for the run (each candidate's speedup paired with the `ar` requests of
its own minutes), the fastest recommended, its serving forms written; a candidate vLLM refuses
is skipped with vLLM's own line; bad options are one line each.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import fake_vllm
from specdecode.bench.tune_vllm import candidates, recommend
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
    argv += ["--draft", "ngram:1-2", "--draft", "suffix", "--vllm-k", "2,3"]
    argv += ["--prompts", str(prompts_file), "--limit", "1", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads((out / "tune-vllm.json").read_text())
    assert result["candidates"] == [
        "ar",
        "vllm ngram:1-2 k=2",
        "ours ngram:1-2 k=2",
        "vllm ngram:1-2 k=3",
        "ours ngram:1-2 k=3",
        "ours suffix k=2",
        "ours suffix k=3",
    ]
    assert set(result["failed"]) == {
        "ours ngram:1-2 k=2",
        "ours ngram:1-2 k=3",
        "ours suffix k=2",
        "ours suffix k=3",
    }
    assert "ValueError: this speculative config is refused" in result["failed"]["ours suffix k=2"]
    # the recommendation is a measured candidate (which one wins is the stand-in's timing:
    # `recommend` itself is tested on fixed numbers below); its config is the winner's
    measured = {
        "ar": None,
        "vllm ngram:1-2 k=2": candidates(["ngram:1-2"], [2])[1],
        "vllm ngram:1-2 k=3": candidates(["ngram:1-2"], [3])[1],
    }
    for row in result["recommended"].values():
        assert row["setting"] in measured
    winner = measured[result["recommended"]["all"]["setting"]]
    assert result["speculative_config"] == (winner and winner.speculative_config)
    summary = json.loads((out / "summary.json").read_text())
    ngram = next(
        r
        for r in summary["rows"]
        if r["setting"] == "vllm ngram:1-2 k=2" and r["category"] == "all"
    )
    assert ngram["acceptance_rate"] == pytest.approx(3 / 4)  # 2 steps of k = 2, 3 accepted
    ar_row = next(r for r in summary["rows"] if r["setting"] == "ar" and r["category"] == "all")
    assert ar_row["prompts"] == 2 * len(PROMPTS[:2])  # measured beside each candidate
    forms = result["forms"]
    assert forms["vllm_serve"].startswith(f"vllm serve {root} --served-model-name target")
    assert forms["tensor_parallel"].endswith("--tensor-parallel-size 2")
    assert '"tensor_parallel_size": 2' in forms["ray_serve_llm"]
    # the stand-in has no vLLM classes to read the forms with: said, not hidden
    assert result["forms_checked"] is None and result["forms_refused"]
    report = capsys.readouterr().out
    assert "| all | " in report and "Not measured: `ours suffix k=2`" in report
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["setting"] for r in records} == {"ar", "vllm ngram:1-2 k=2", "vllm ngram:1-2 k=3"}
    # each candidate's records pair with the `ar` requests beside it: one repeat number each
    repeats = {}
    for r in records:
        repeats.setdefault(r["setting"], set()).add(r["repeat"])
    assert repeats == {"ar": {0, 1}, "vllm ngram:1-2 k=2": {0}, "vllm ngram:1-2 k=3": {1}}
    # one `ar` server for the whole run, none of its own folder; the drift: `ar` beside the
    # last candidate over beside the first
    candidates_dir = out / "candidates"
    assert (candidates_dir / "ar-vllm.log").is_file() and not (candidates_dir / "ar").exists()
    rates = [
        next(
            r["decode_tokens_per_s"]
            for r in json.loads((candidates_dir / name / "summary.json").read_text())["rows"]
            if r["setting"] == "ar" and r["category"] == "all"
        )
        for name in ("vllm_ngram_1-2_k=2", "vllm_ngram_1-2_k=3")
    ]
    assert result["drift"] == pytest.approx(rates[1] / rates[0])
    assert "beside the last candidate as beside the first" in report
    assert all(r["identical_to_ar"] for r in records if r["setting"] != "ar")
    assert [s["label"] for s in json.loads((out / "run.json").read_text())["servers"]] == [
        "ar",
        "vllm ngram:1-2 k=2",
        "vllm ngram:1-2 k=3",
    ]


def test_recommend_picks_the_fastest_or_the_target_alone():
    def row(setting: str, category: str, speedup: float) -> dict:
        return {"setting": setting, "category": category, "speedup": speedup,
                "acceptance_rate": None, "decode_tokens_per_s": speedup, "identical": 1,
                "compared": 1}  # fmt: skip

    summary = {
        "categories": ["code", "chat"],
        "rows": [
            *(row("ar", c, 1.0) for c in ("all", "code", "chat")),
            row("a", "all", 1.4), row("a", "code", 1.9), row("a", "chat", 0.9),
            row("b", "all", 1.5), row("b", "code", 1.2), row("b", "chat", 0.8),
        ],
    }  # fmt: skip
    best = recommend(summary)
    assert {c: r["setting"] for c, r in best.items()} == {"all": "b", "code": "a", "chat": "ar"}
    assert best["chat"]["speedup"] == 1.0 and best["chat"]["ar_decode_tokens_per_s"] == 1.0


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
