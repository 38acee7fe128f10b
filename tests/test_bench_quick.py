"""`specdecode bench --quick` end to end on the real SmolLM2-135M preset (the CI smoke test)."""

from __future__ import annotations

import json

import pytest

from specdecode.cli import main
from specdecode.data.suites import CATEGORIES

pytestmark = pytest.mark.real_model


def test_bench_quick_end_to_end(tmp_path, capsys):
    out = tmp_path / "quick"
    assert main(["bench", "--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| spec[ngram] k=2 cost |" in printed  # the default policy and "report.md" in printed

    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"] == [
        "ar",
        "spec[ngram] k=2 cost",
        "spec[ngram] k=4 cost",
        "hf-ar",
        "hf-prompt-lookup k=2",
        "hf-prompt-lookup k=4",
    ]
    assert len(records) == len(CATEGORIES) * len(summary["settings"])
    assert {r["category"] for r in records} == set(CATEGORIES)
    # float32: speculation (ours and HF's) reproduces greedy decoding token for token
    assert all(r["identical_to_ar"] for r in records)
    spec = [r for r in records if r["method"] == "spec"]
    assert all(r["drafted"] >= r["accepted"] >= 0 for r in spec)
    assert sum(r["accepted"] for r in spec) > 0  # prompt lookup finds something somewhere
    for name in ("report.md", "acceptance_by_category.png", "speedup_vs_k.png"):
        assert (out / name).stat().st_size > 0
