"""benchmarks/tree_replay.py: replaying a greedy drafter on the target's answer counts exactly
the steps, draft forwards and verified rows a real greedy generation has."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from specdecode import SpeculativeDecoder

from conftest import noisy_copy, tiny_llama

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "tree_replay.py"
_SPEC = importlib.util.spec_from_file_location("tree_replay", _PATH)
tree_replay = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(tree_replay)


@pytest.mark.parametrize(
    "setting", [{"k": 1}, {"k": 3}, {"tree": "static:3,2,1"}, {"tree": "dynamic:5,6,2,0.2"}]
)
def test_replay_counts_what_a_real_generation_does(setting):
    target = tiny_llama(seed=0)
    draft = noisy_copy(target, 0.05, seed=7)  # accepts some, rejects some
    prompt, n = [1, 2, 3], 24
    answer = SpeculativeDecoder(target).generate(prompt, max_new_tokens=n).token_ids
    engine = SpeculativeDecoder(
        target, draft, k=setting.get("k", 1), tree=setting.get("tree"), k_policy="fixed"
    )
    stats = engine.generate(prompt, max_new_tokens=n).stats

    steps = tree_replay.replay(engine, prompt, answer, setting.get("k", 1))
    assert sum(emitted for emitted, _, _ in steps) == n - 1  # the first is the prefill's
    assert len(steps) == stats.steps
    assert sum(len(rows) for _, rows, _ in steps) == stats.draft_forwards
    assert all(n >= 1 for _, rows, _ in steps for n in rows)
    rows = sum(rows for _, _, rows in steps)
    if "tree" in setting:
        assert rows - len(steps) == stats.nodes_verified
    else:
        assert rows - len(steps) == stats.drafted
    assert 1 < len(steps) < n  # some steps accepted drafts, not all of them


def test_recorded_answers_reads_greedy_ar_records_and_refuses_sampled_runs(tmp_path):
    def write(temperature, records):
        (tmp_path / "run.json").write_text(json.dumps({"config": {"temperature": temperature}}))
        (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    ar = {"method": "ar", "turn": 0, "prompt_id": "p1", "prompt_tokens": 3, "token_ids": [4, 5]}
    spec = {**ar, "method": "spec", "token_ids": [9]}
    later_turn = {**ar, "turn": 1, "token_ids": [7]}
    write(0.0, [ar, spec, later_turn])
    config, answers = tree_replay.recorded_answers(tmp_path)
    assert answers == {"p1": (3, [4, 5])} and config["temperature"] == 0.0
    write(0.7, [ar])
    with pytest.raises(SystemExit, match="greedy runs only"):
        tree_replay.recorded_answers(tmp_path)
    write(0.0, [spec])
    with pytest.raises(SystemExit, match="no `ar` record"):
        tree_replay.recorded_answers(tmp_path)


def test_cost_scenarios_are_named_or_numbered_and_bad_numbers_are_refused():
    assert tree_replay.parse_costs("roofline=1,1,1.1", 0) == ("roofline", [1.0, 1.0, 1.1])
    assert tree_replay.parse_costs("1,1.13", 1) == ("v2", [1.0, 1.13])
    with pytest.raises(SystemExit, match="comma-separated numbers"):
        tree_replay.parse_costs("fast=1,x", 0)
