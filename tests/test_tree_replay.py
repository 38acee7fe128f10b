"""benchmarks/tree_replay.py: replaying a greedy drafter on the target's answer counts exactly
the steps, draft forwards and verified rows a real greedy generation has."""

from __future__ import annotations

import importlib.util
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
    engine = SpeculativeDecoder(target, draft, k=setting.get("k", 1), tree=setting.get("tree"))
    stats = engine.generate(prompt, max_new_tokens=n).stats

    steps = tree_replay.replay(engine, prompt, answer, setting.get("k", 1))
    assert sum(emitted for emitted, _, _ in steps) == n
    assert len(steps) == stats.steps
    assert sum(forwards for _, forwards, _ in steps) == stats.draft_forwards
    rows = sum(rows for _, _, rows in steps)
    if "tree" in setting:
        assert rows - len(steps) == stats.nodes_verified
    else:
        assert rows - len(steps) == stats.drafted
    assert 1 < len(steps) < n  # some steps accepted drafts, not all of them
