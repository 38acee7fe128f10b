"""Rates and theory (metrics.py) against hand-computed values."""

from __future__ import annotations

import pytest

from specdecode.core import metrics
from specdecode.core.types import Stats


def test_expected_emitted_per_step():
    assert metrics.expected_emitted_per_step(0.0, 4) == 1.0
    assert metrics.expected_emitted_per_step(1.0, 4) == 5.0
    assert metrics.expected_emitted_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert metrics.expected_emitted_per_step(0.8, 4) == pytest.approx(sum(0.8**i for i in range(5)))
    with pytest.raises(ValueError):
        metrics.expected_emitted_per_step(1.5, 2)


def test_ideal_speedup_and_efficiency():
    # α = 0.8, k = 4, c = 0.1, v = 1.0: 3.3616 / 1.4
    assert metrics.ideal_speedup(0.8, 4, 0.1, 1.0) == pytest.approx(3.3616 / 1.4)
    assert metrics.efficiency(1.2, 2.4) == 0.5
    assert metrics.efficiency(1.0, 0.0) is None


def test_stats_counters_and_rates():
    stats = Stats()
    stats.record_step(4, 4, 5)
    stats.record_step(4, 1, 2)
    stats.record_step(2, 0, 1)
    assert (stats.steps, stats.drafted, stats.accepted, stats.emitted) == (3, 10, 5, 8)
    assert stats.acceptance_rate == 0.5
    assert stats.mean_acceptance_length == pytest.approx(8 / 3)
    assert stats.per_position_acceptance == [2 / 3, 1 / 3, 1 / 2, 1 / 2]
    empty = Stats()
    assert empty.acceptance_rate is None and empty.mean_acceptance_length is None
    assert set(empty.to_dict()) >= {"steps", "acceptance_rate", "tokens_per_s"}


def test_stats_read_by_key_as_to_dict_gives_them():
    import json

    stats = Stats(new_tokens=12, wall_time_s=2.0)
    stats.record_step(4, 3, 4)
    assert stats["tokens_per_s"] == stats.tokens_per_s == 6.0
    assert stats["acceptance_rate"] == stats.acceptance_rate == 0.75
    assert stats["cached_tokens"] == 0
    assert json.loads(json.dumps(stats.to_dict())) == stats.to_dict()  # JSON-ready
    with pytest.raises(KeyError, match="no 'tokens_per_second'; it has k_max"):
        stats["tokens_per_second"]
