"""`specdecode tune`: the prediction model on hand-made numbers, and the whole loop on tiny models."""

from __future__ import annotations

import json

import pytest

from specdecode.bench.aggregate import row_for as cal_row
from specdecode.bench.methods import tuned_setting
from specdecode.bench.records import Record
from specdecode.bench.runner import BenchConfig
from specdecode.bench.tune import (
    predict_speedup,
    predictions,
    run_tune,
    split_prompts,
    step_profile,
)
from specdecode.cli import main
from specdecode.config import load_config
from specdecode.data.suites import BenchPrompt


def test_prediction_for_a_model_drafter():
    profile = {"p_accepted_ge": [0.8, 0.6], "p_drafted_ge": [1.0, 1.0]}
    v = {1: 1.0, 2: 1.1, 3: 1.2}
    # tokens 1 + 0.8 + 0.6; step: 2 draft forwards of 0.2, verify v(3) = 1.2, overhead 0.1
    expected = 2.4 / (2 * 0.2 + 1.2 + 0.1) * (1.0 + 0.05)
    got = predict_speedup(profile, 2, v, t_draft=0.2, t_1=1.0, o_step=0.1, o_ar=0.05)
    assert got == pytest.approx(expected)
    # k = 1 ignores what lies beyond the first position
    got = predict_speedup(profile, 1, v, t_draft=0.2, t_1=1.0, o_step=0.0, o_ar=0.0)
    assert got == pytest.approx(1.8 / (0.2 + 1.1))


def test_prediction_for_a_drafter_that_sometimes_proposes_nothing():
    # an n-gram drafter: half the steps find no match (D = 0), a quarter propose 2 tokens
    profile = {"p_accepted_ge": [0.4, 0.2], "p_drafted_ge": [0.5, 0.25]}
    v = {1: 1.0, 2: 2.0, 3: 3.0}
    verify = 0.5 * 1.0 + 0.25 * 2.0 + 0.25 * 3.0  # P(D_2 = 0, 1, 2) times v(D_2 + 1)
    got = predict_speedup(profile, 2, v, t_draft=0.0, t_1=1.0, o_step=0.0, o_ar=0.0)
    assert got == pytest.approx(1.6 / verify)


def test_step_profile_pools_steps():
    records = [
        Record(steps=4, accepted_at=[3, 1], drafted_at=[4, 4]),
        Record(steps=6, accepted_at=[2], drafted_at=[6]),
    ]
    profile = step_profile(records, 3)
    assert profile["p_accepted_ge"] == pytest.approx([0.5, 0.1, 0.0])
    assert profile["p_drafted_ge"] == pytest.approx([1.0, 0.4, 0.0])


def _record(method, category, **fields):
    base = {"method": method, "category": category, "draft": None, "k": 0, "k_policy": "fixed"}
    return Record.from_dict(
        {**base, "tree": None, "prefill_s": 0.0, "draft_forward_s": 0.0, **fields}
    )


def test_chain_predictions_are_anchored_on_the_chain_measured_at_k_max():
    ar = [
        _record("ar", c, steps=10, wall_time_s=10.0, target_forwards=10, target_forward_s=10.0)
        for c in ("a", "b")
    ]
    spec = [
        _record(
            "spec",
            c,
            draft="d",
            k=2,
            steps=5,
            wall_time_s=6.0,
            target_forwards=5,
            target_forward_s=5.5,
            draft_forwards=10,
            draft_forward_s=0.5,
            accepted_at=[4, 2],
            drafted_at=[5, 5],
        )
        for c in ("a", "b")
    ]
    v = {1: 1.0, 2: 1.05, 3: 1.1}
    label = {k: f"spec[d] k={k}" for k in (1, 2)}
    plain = {(r["k"], r["category"]): r["predicted"] for r in predictions(ar + spec, ["d"], 2, v)}
    summary = {
        "rows": [
            {"setting": label[2], "category": "a", "speedup": 1.5},
            {"setting": label[2], "category": "b", "speedup": None},  # no decode rate there
        ]
    }
    rows = predictions(ar + spec, ["d"], 2, v, summary)
    got = {(r["k"], r["category"]): r["predicted"] for r in rows}
    assert got[2, "a"] == pytest.approx(1.5)  # k_max: what the chain measured
    assert got[1, "a"] == pytest.approx(plain[1, "a"] * 1.5 / plain[2, "a"])  # same scale
    assert got[1, "b"] == plain[1, "b"] and got[2, "b"] == plain[2, "b"]  # nothing to anchor on
    assert got[2, "all"] == pytest.approx((1.5 * plain[2, "b"]) ** 0.5)  # over categories
    how = {(r["k"], r["category"]): r["how"] for r in rows}
    assert how[2, "a"] == "calibration" and how[1, "a"] == "anchored"  # what the report says
    assert how[1, "b"] == how[2, "b"] == "model"
    assert how[1, "all"] == how[2, "all"] == "anchored"  # partly measured


def test_split_prompts_keeps_calibration_and_validation_apart():
    prompts = [BenchPrompt(f"{c}{i}", c, ["x"]) for c in "ab" for i in range(3)]
    calibration, validation = split_prompts(prompts, 1)
    assert [p.id for p in calibration] == ["a0", "b0"]
    assert [p.id for p in validation] == ["a1", "b1"]  # the rest is not used


def test_tune_end_to_end_on_tiny_models(tiny_folders, tmp_path):
    config = BenchConfig(
        target=str(tiny_folders / "target"),
        drafts=[str(tiny_folders / "draft"), "ngram"],
        policies=["fixed"],  # tune's own default: chains at each k (cost: `--k-policy`)
        max_new_tokens=10,
        prompts_file=str(tiny_folders / "prompts.jsonl"),
        limit=1,
        dtype="float32",
        out=str(tmp_path / "tune"),
        command="specdecode tune ...",
    )
    result = run_tune(config, k_max=3, progress=False)
    assert len(result["predictions"]) == 2 * 3 * 3  # drafters x k x (2 categories + overall)
    # fixed-k chains only: k_max measured in calibration, the k below scaled to it (a category
    # where a chain has no decode rate keeps the model's figures)
    per_category = [r for r in result["predictions"] if r["category"] != "all"]
    at_k_max = {r["how"] for r in per_category if r["k"] == 3}
    assert "calibration" in at_k_max and at_k_max <= {"calibration", "model"}
    assert {r["how"] for r in per_category if r["k"] < 3} <= {"anchored", "model"}
    assert set(result["v"]) == {1, 2, 3, 4} and result["v"][1] == 1.0
    best = result["recommended"]
    assert set(best) == {"writing", "qa", "all"}
    validation = result["validation"]["per_category"]
    assert set(validation) == {"writing", "qa", "all"}
    assert all(row["measured"] is not None for row in validation.values())
    # one validation prompt a category: no interval there; over both prompts, one
    assert validation["qa"]["interval"] is None
    low, high = validation["all"]["interval"]
    assert low <= high

    out = tmp_path / "tune"
    saved = load_config(out / "config.json")  # what --config reads
    assert (saved.draft, saved.k) == (best["all"]["draft"], best["all"]["k"])
    assert set(saved.per_category) == {"writing", "qa"}
    assert "Validation of" in (out / "tune.md").read_text()
    assert json.loads((out / "tune.json").read_text())["k_max"] == 3
    assert (out / "calibration" / "results.jsonl").exists()
    assert (out / "validation" / "report.md").exists()


def test_tune_tries_k_policies_and_trees(tiny_folders, tmp_path):
    draft = str(tiny_folders / "draft")
    config = BenchConfig(
        target=str(tiny_folders / "target"),
        drafts=[draft, "ngram"],
        policies=["cost"],
        trees=["static:2,1"],
        max_new_tokens=10,
        prompts_file=str(tiny_folders / "prompts.jsonl"),
        limit=1,
        dtype="float32",
        out=str(tmp_path / "tune"),
    )
    result = run_tune(config, k_max=2, validate=False, progress=False)
    rows = result["predictions"]
    # chains: 2 drafters x 2 k; the cost policy for both drafters; the tree for the model draft
    assert len(rows) == (2 * 2 + 2 + 1) * 3
    measured = {r["setting"] for r in rows if r["how"] == "calibration"}
    assert measured == {
        f"spec[{draft}] k=2",  # k_max: the chains' calibration run
        "spec[ngram] k=2",
        f"spec[{draft}] k=2 cost",
        "spec[ngram] k=2 cost",
        f"spec[{draft}] tree=static:2,1",
    }
    cal = json.loads((tmp_path / "tune" / "calibration" / "summary.json").read_text())
    tree = f"spec[{draft}] tree=static:2,1"
    chain = f"spec[{draft}] k=2"
    for row in rows:  # what a calibrated candidate expects is what it measured there
        if row["setting"] in (tree, chain) and row["category"] == "qa":
            assert row["predicted"] == pytest.approx(cal_row(cal, row["setting"], "qa")["speedup"])
    # the config says everything each category needs, so a category override is complete
    saved = load_config(tmp_path / "tune" / "config.json")
    for category, row in result["recommended"].items():
        chosen = saved.for_category(None if category == "all" else category)
        assert tuned_setting(chosen).label == row["setting"]
    text = (tmp_path / "tune" / "tune.md").read_text()
    assert "Every candidate over all categories" in text and "measured in calibration" in text


def test_tune_cli_rejects_bad_input(tmp_path, capsys):
    assert main(["tune", "--target", "t", "--draft", "ngram", "--k-max", "0"]) == 2
    assert "--k-max" in capsys.readouterr().err
