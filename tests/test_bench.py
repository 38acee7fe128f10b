"""The benchmark lab: settings, records, aggregates against hand-made records, report, CLI."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from specdecode.bench.aggregate import row_for, summarize
from specdecode.bench.methods import plan_settings
from specdecode.bench.records import Record, first_divergence, make_record, mark_identity
from specdecode.bench.runner import BenchConfig, load_results, rerender, run_bench
from specdecode.cli import main
from specdecode.core import metrics
from specdecode.models.loading import LoadedModel

from conftest import load_benchmark

RECORD_FIELDS = {
    "prompt_id",
    "category",
    "method",
    "k",
    "draft",
    "k_policy",
    "new_tokens",
    "wall_time_s",
    "prefill_s",
    "ttft_s",
    "tokens_per_s",
    "decode_tokens_per_s",
    "steps",
    "drafted",
    "accepted",
    "acceptance_rate",
    "mean_acceptance_length",
    "per_position_acceptance",
    "identical_to_ar",
    "first_divergence",
    "dtype",
    "peak_memory_bytes",
    "memory_source",
    "token_ids",
}
PNGS = [
    "acceptance_by_category.png",
    "speedup_vs_k.png",
    "per_position_acceptance.png",
    "measured_vs_ideal.png",
]


# -- settings and records ---------------------------------------------------------------------


def test_plan_settings_applies_methods_to_drafts_they_fit():
    drafts = {"m": LoadedModel(model=None, name="m"), "ngram": object()}
    settings = plan_settings(
        ["ar", "spec", "hf-ar", "hf-assisted", "hf-prompt-lookup"], drafts, [2, 4], ["fixed"]
    )
    labels = [s.label for s in settings]
    assert labels == [
        "ar",
        "spec[m] k=2",
        "spec[m] k=4",
        "spec[ngram] k=2",
        "spec[ngram] k=4",
        "hf-ar",
        "hf-assisted[m] default",
        "hf-assisted[m] k=2",
        "hf-assisted[m] k=4",
        "hf-prompt-lookup k=2",
        "hf-prompt-lookup k=4",
    ]  # hf-assisted only for the draft model, never for the n-gram drafter
    with pytest.raises(ValueError, match="unknown method 'fast'"):
        plan_settings(["ar", "fast"], drafts, [2], ["fixed"])


def test_first_divergence_and_identity_marks():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # an early stop is a divergence too
    ar = Record(token_ids=[7, 8, 9])
    same, other = Record(token_ids=[7, 8, 9]), Record(token_ids=[7, 4, 9])
    mark_identity(ar, same, margin=lambda p: 1 / 0)  # never asked for identical outputs
    assert same.identical_to_ar is True and same.first_divergence is None
    mark_identity(ar, other, margin=lambda p: 0.25 * p)
    assert other.identical_to_ar is False
    assert other.first_divergence == {
        "position": 1,
        "ar_token": 8,
        "spec_token": 4,
        "top2_margin": 0.25,
    }


# keys of a record in results.jsonl, in order, as every saved run has them
RECORD_KEYS = [
    *("prompt_id", "category", "turn", "repeat", "method", "setting", "draft", "k", "k_policy"),
    *("tree", "dtype", "temperature", "prompt_tokens", "new_tokens", "wall_time_s", "prefill_s"),
    *("shared_prefill_s", "ttft_s", "decode_s", "first_chunk", "tokens_per_s"),
    *("decode_tokens_per_s", "peak_memory_bytes", "memory_source", "identical_to_ar"),
    *("first_divergence", "token_ids", "steps", "drafted", "accepted", "emitted"),
    *("acceptance_rate", "mean_acceptance_length", "drafted_at", "accepted_at"),
    *("per_position_acceptance", "target_forwards", "target_forward_s", "draft_forwards"),
    "draft_forward_s",
]
SAVED_RUN = Path(__file__).parent / "data" / "saved_run"  # written by the code before `Record`


def test_record_keeps_the_json_keys_and_round_trips():
    from specdecode.bench.methods import RunOutput, Setting
    from specdecode.core.types import Stats
    from specdecode.data.suites import BenchPrompt

    stats = Stats(k_max=2, steps=3, drafted=6, accepted=4, drafted_at=[3, 3], accepted_at=[3, 1])
    stats.meter.calls.update(target=4, draft=6)
    out = RunOutput([1, 2, 3], wall_time_s=0.5, ttft_s=0.25, first_chunk=2, stats=stats)
    prompt = BenchPrompt("p", "code", ["hi"])
    record = make_record(
        prompt,
        0,
        0,
        Setting("spec", "d", 2),
        [9, 9],
        out,
        dtype="float32",
        temperature=0.0,
        memory_bytes=1,
        memory_source="computed",
    )
    line = record.to_dict()
    # k_max is the setting's k under its Stats name: the record's own `k` holds it
    not_carried = ("forward_s", "k_max")
    stats_only = [k for k in stats.to_dict() if k not in RECORD_KEYS and k not in not_carried]
    assert list(line) == RECORD_KEYS + stats_only  # Stats' other fields ride along, at the end
    assert (record.target_forwards, record.draft_forward_s) == (4, 0.0)
    assert Record.from_dict(json.loads(json.dumps(line))).to_dict() == json.loads(json.dumps(line))
    # HF's methods have no Stats: the same keys, None
    hf = make_record(
        prompt,
        0,
        0,
        Setting("hf-ar"),
        [9, 9],
        RunOutput([1], 0.5, 0.25, 1),
        dtype="float32",
        temperature=0.0,
        memory_bytes=1,
        memory_source="computed",
    )
    assert list(hf.to_dict()) == RECORD_KEYS and hf.steps is None
    # a tuned config's record alone carries `tuned` and `ran`, last
    record.setting, record.tuned, record.ran = "spec[tuned]", True, "spec[d] k=2"
    assert list(record.to_dict())[-2:] == ["tuned", "ran"]
    assert Record.from_dict(record.to_dict()) == record


def test_a_saved_run_loads_and_renders_as_before(tmp_path):
    # results.jsonl, report.md and summary.json as the code before `Record` wrote them
    run = tmp_path / "run"
    shutil.copytree(SAVED_RUN, run)
    lines = (SAVED_RUN / "results.jsonl").read_text().splitlines()
    records = load_results(run)
    assert [json.dumps(r.to_dict()) for r in records] == lines  # byte for byte
    assert [r.tuned for r in records].count(True) == 2
    (run / "report.md").unlink()
    (run / "summary.json").unlink()
    rerender(run)
    assert (run / "report.md").read_text() == (SAVED_RUN / "report.md").read_text()
    assert json.loads((run / "summary.json").read_text()) == json.loads(
        (SAVED_RUN / "summary.json").read_text()
    )


# -- aggregates from hand-made records ----------------------------------------------------------


def _record(prompt, category, setting, method, decode_rate, **extra):
    base = {
        "prompt_id": prompt,
        "category": category,
        "turn": 0,
        "repeat": 0,
        "method": method,
        "setting": setting,
        "draft": extra.pop("draft", None),
        "k": extra.pop("k", 0),
        "k_policy": extra.pop("k_policy", "fixed"),
        "new_tokens": 10,
        "tokens_per_s": decode_rate / 2,
        "decode_tokens_per_s": decode_rate,
        "ttft_s": 1.0,
        "peak_memory_bytes": extra.pop("memory", 100),
        "identical_to_ar": extra.pop("identical", True),
        "first_divergence": extra.pop("divergence", None),
    }
    for field in (
        "steps",
        "drafted",
        "accepted",
        "emitted",
        "target_forwards",
        "target_forward_s",
        "draft_forwards",
        "draft_forward_s",
    ):
        base[field] = extra.pop(field, None)
    base["drafted_at"] = extra.pop("drafted_at", None)
    base["accepted_at"] = extra.pop("accepted_at", None)
    assert not extra
    return Record.from_dict(base)


def _hand_made_records():
    ar = dict(target_forwards=10, target_forward_s=1.0, steps=10, emitted=10, drafted=0, accepted=0)
    spec = dict(draft="d", k=2, draft_forwards=10, draft_forward_s=0.2, memory=150)
    hf = dict(draft="d")
    divergence = {"position": 3, "ar_token": 5, "spec_token": 6, "top2_margin": 0.01}
    return [
        _record("a", "code", "ar", "ar", 10.0, **ar),
        _record("b", "chat", "ar", "ar", 20.0, **ar),
        _record(
            "a",
            "code",
            "spec[d] k=2",
            "spec",
            20.0,
            **spec,
            steps=5,
            emitted=10,
            drafted=10,
            accepted=5,
            target_forwards=5,
            target_forward_s=0.6,
            drafted_at=[5, 5],
            accepted_at=[4, 1],
        ),
        _record(
            "b",
            "chat",
            "spec[d] k=2",
            "spec",
            20.0,
            **spec,
            steps=15,
            emitted=30,
            drafted=30,
            accepted=15,
            target_forwards=5,
            target_forward_s=0.6,
            drafted_at=[15, 15],
            accepted_at=[10, 5],
            identical=False,
            divergence=divergence,
        ),
        _record("a", "code", "hf-assisted[d] default", "hf-assisted", 8.0, **hf),
        _record("b", "chat", "hf-assisted[d] default", "hf-assisted", 20.0, **hf),
        _record("a", "code", "hf-assisted[d] k=2", "hf-assisted", 16.0, **hf, k=2),
        _record("b", "chat", "hf-assisted[d] k=2", "hf-assisted", 16.0, **hf, k=2),
    ]


def test_aggregates_match_hand_computation():
    summary = summarize(_hand_made_records())
    spec = row_for(summary, "spec[d] k=2")
    # speedup: geometric mean of the per-prompt ratios 20/10 and 20/20
    assert spec["speedup"] == pytest.approx(math.sqrt(2.0))
    assert spec["e2e_speedup"] == pytest.approx(math.sqrt(2.0))
    assert spec["acceptance_rate"] == pytest.approx(20 / 40)
    assert spec["mean_acceptance_length"] == pytest.approx(40 / 20)
    assert spec["per_position_acceptance"] == pytest.approx([14 / 20, 6 / 20])
    # c: 0.02 s per draft forward / 0.1 s per ar target forward; v: 0.12 s / 0.1 s
    assert spec["c"] == pytest.approx(0.2)
    assert spec["v"] == pytest.approx(1.2)
    ideal = (1 - 0.5**3) / (1 - 0.5) / (2 * 0.2 + 1.2)
    assert spec["ideal_speedup"] == pytest.approx(ideal)
    assert spec["efficiency"] == pytest.approx(math.sqrt(2.0) / ideal)
    assert spec["memory_overhead"] == pytest.approx(1.5)
    # how steady the machine ran: the target alone's forwards, 0.1 s each on both prompts
    assert summary["one_token_ms"] == {
        "records": 2,
        "min": pytest.approx(100),
        "median": pytest.approx(100),
        "max": pytest.approx(100),
    }
    assert (spec["identical"], spec["compared"]) == (1, 2)
    # HF's constant-k setting is its fastest overall (sqrt(1.6 * 0.8) > sqrt(0.8 * 1.0))
    assert summary["best_hf_assisted"] == "hf-assisted[d] k=2"
    assert spec["vs_hf_assisted"] == pytest.approx(math.sqrt(20 / 16 * 20 / 16))
    # per category: one prompt each
    assert row_for(summary, "spec[d] k=2", "code")["speedup"] == pytest.approx(2.0)
    assert row_for(summary, "spec[d] k=2", "chat")["speedup"] == pytest.approx(1.0)
    assert summary["best_k"]["code"]["d (fixed)"] == {"k": 2, "speedup": pytest.approx(2.0)}
    assert summary["divergences"] == [
        {
            "prompt_id": "b",
            "category": "chat",
            "turn": 0,
            "setting": "spec[d] k=2",
            "position": 3,
            "ar_token": 5,
            "spec_token": 6,
            "top2_margin": 0.01,
        }
    ]


def test_theory_against_known_values():
    assert metrics.expected_emitted_per_step(0.0, 4) == 1.0
    assert metrics.expected_emitted_per_step(1.0, 4) == 5.0
    assert metrics.expected_emitted_per_step(0.5, 2) == pytest.approx(1.75)
    assert metrics.ideal_speedup(0.8, 4, 0.0, 1.0) == pytest.approx((1 - 0.8**5) / 0.2)
    assert metrics.geometric_mean([2.0, 8.0]) == pytest.approx(4.0)
    assert metrics.geometric_mean([]) is None
    with pytest.raises(ValueError):
        metrics.geometric_mean([1.0, 0.0])


def test_intervals_of_a_mean_of_ratios():
    interval = metrics.geometric_mean_interval
    assert interval([[2.0, 2.0]]) is None  # one prompt: nothing to resample
    assert interval([]) is None
    # every prompt the same: nothing to be unsure of
    low, high = interval([[1.5], [1.5], [1.5]])
    assert low == pytest.approx(1.5) and high == pytest.approx(1.5)
    groups = [[1.0, 1.1], [1.3], [0.9, 0.95], [1.6], [1.2]]
    low, high = interval(groups)
    mean = metrics.geometric_mean([r for g in groups for r in g])
    assert 0.9 < low < mean < high < 1.6
    assert interval(groups) == (low, high)  # seeded: a report renders the same every time
    # a wider spread of the same mean gives a wider interval
    wide = interval([[r**3 for r in g] for g in groups])
    assert math.log(wide[1]) - math.log(wide[0]) > math.log(high) - math.log(low)
    # a prompt's repeats are drawn together: two prompts of two repeats each, not four prompts
    assert interval([[1.0, 1.0], [2.0, 2.0]]) == (pytest.approx(1.0), pytest.approx(2.0))
    with pytest.raises(ValueError):
        interval(groups, level=1.0)


def test_every_setting_is_paired_with_the_fastest_of_each_category():
    summary = summarize(_hand_made_records())
    against = summary["against_fastest"]
    # overall the spec setting is the fastest (sqrt 2); per category HF's k=2 loses to it in
    # code (16 against 20) and wins nowhere
    assert against["all"]["fastest"] == "spec[d] k=2"
    assert against["code"]["fastest"] == "spec[d] k=2"
    code = against["code"]["ratios"]
    assert code["hf-assisted[d] k=2"]["ratio"] == pytest.approx(16 / 20)
    assert code["ar"]["ratio"] == pytest.approx(10 / 20)
    assert code["ar"]["interval"] is None  # one prompt a category here
    # chat: spec and ar tie at 20 tok/s, HF's default too; the first of them counts as fastest
    assert against["chat"]["fastest"] == "ar"
    overall = against["all"]["ratios"]["hf-assisted[d] k=2"]
    assert overall["ratio"] == pytest.approx(math.sqrt(16 / 20 * 16 / 20))
    low, high = overall["interval"]
    assert low == pytest.approx(0.8) and high == pytest.approx(0.8)
    # the speedup's own interval, over the two prompts (2x and 1x)
    low, high = row_for(summary, "spec[d] k=2")["speedup_interval"]
    assert low == pytest.approx(1.0) and high == pytest.approx(2.0)
    assert row_for(summary, "ar")["speedup_interval"] is None


def test_summarize_needs_the_baseline():
    records = [r for r in _hand_made_records() if r.method != "ar"]
    with pytest.raises(ValueError, match="no `ar` baseline"):
        summarize(records)


def test_bench_config_rejects_bad_options():
    cases = [
        (dict(turns="some"), "--turns"),
        (dict(turns="all", chat=False), "needs --chat"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(ks=[0, 2]), "--k"),
        (dict(methods=["spec"], drafts=["ngram"]), "include `ar`"),
        (dict(methods=["ar", "spec"]), "needs at least one --draft"),
        (dict(methods=["ar", "magic"]), "unknown method"),
        (dict(policies=["fast"]), "unknown k policy"),
        (dict(trees=["static:0"]), "tree"),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            BenchConfig(target="t", **overrides).validate()


# -- the whole harness on tiny models ----------------------------------------------------------


def test_bench_end_to_end_on_tiny_models(tiny_folders, tmp_path):
    out = tmp_path / "run"
    config = BenchConfig(
        target=str(tiny_folders / "target"),
        drafts=[str(tiny_folders / "draft"), "ngram"],
        ks=[1, 3],
        policies=["fixed", "cost"],
        trees=["static:2,1"],
        max_new_tokens=12,
        prompts_file=str(tiny_folders / "prompts.jsonl"),
        turns="all",
        dtype="float32",
        out=str(out),
        share_prefill=True,
    )
    summary = run_bench(config, progress=False)

    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    settings = summary["settings"]
    # ar; spec: 2 drafts x 2 policies x 2 k + 1 tree (model draft only); hf-ar; hf-assisted
    # (model draft: default + 2 k); prompt lookup x 2 k
    assert len(settings) == 1 + 8 + 1 + 1 + 3 + 2
    assert f"spec[{tiny_folders / 'draft'}] tree=static:2,1" in settings
    assert len(records) == 5 * len(settings)  # 5 turns in all, every setting on each
    for record in records:
        assert record.keys() >= RECORD_FIELDS, RECORD_FIELDS - record.keys()
        assert record["new_tokens"] == len(record["token_ids"]) > 0
        # timings are recorded and consistent with each other (their values are not tested)
        assert record["decode_s"] == pytest.approx(record["wall_time_s"] - record["ttft_s"])
        # float32: every method, ours and Hugging Face's, reproduces greedy AR exactly
        assert record["identical_to_ar"] is True, record["setting"]
        if record["method"] == "spec":
            assert 0 <= record["accepted"] <= record["drafted"]
            assert record["steps"] >= 1
            # the cost policy may find drafting does not pay (k = 0 steps): no rate then
            assert (record["acceptance_rate"] is None) == (record["drafted"] == 0)
    # one prefill per prompt, shared by the methods that can start from a cache
    shared = {r["method"] for r in records if r["shared_prefill_s"] is not None}
    assert shared == {"ar", "spec", "hf-ar"}
    by_turn = {(r["prompt_id"], r["turn"]) for r in records}
    assert by_turn == {("1", 0), ("1", 1), ("2", 0), ("3", 0), ("4", 0)}

    assert {r["category"] for r in summary["rows"]} == {"all", "writing", "qa"}
    spec_all = row_for(summary, f"spec[{tiny_folders / 'draft'}] k=3")
    # the theory columns are computed for a chain with a model draft (values are timings)
    assert None not in (spec_all["ideal_speedup"], spec_all["c"], spec_all["v"])
    tree_row = row_for(summary, f"spec[{tiny_folders / 'draft'}] tree=static:2,1")
    assert tree_row["tree"] == "static:2,1" and tree_row["ideal_speedup"] is None
    assert all(v["k"] > 0 for per in summary["best_k"].values() for v in per.values())
    assert summary["divergences"] == []
    report = (out / "report.md").read_text()
    assert "## Speedup by category" in report and "## Best k per category" in report
    assert "Every greedy output was identical" in report
    for name in PNGS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run_info = json.loads((out / "run.json").read_text())
    assert run_info["config"]["target"] == str(tiny_folders / "target")

    # `specdecode report DIR` re-renders from the saved records alone
    (out / "report.md").unlink()
    (out / "summary.json").unlink()
    assert main(["report", str(out)]) == 0
    assert (out / "report.md").read_text() == report
    assert json.loads((out / "summary.json").read_text())["settings"] == settings


def test_bench_runs_a_tuned_config_per_category(tiny_folders, tmp_path):
    from specdecode.config import RunConfig, save_config

    draft = str(tiny_folders / "draft")
    config = RunConfig(
        target=str(tiny_folders / "target"),
        draft=draft,
        k=2,
        k_policy="fixed",
        dtype="float32",
        per_category={"qa": {"draft": "ngram", "k": 3}, "writing": {"tree": "static:2,1"}},
    )
    save_config(config, tmp_path / "tuned.json")
    out = tmp_path / "run"
    argv = ["bench", "--config", str(tmp_path / "tuned.json"), "--max-new-tokens", "8"]
    argv += ["--prompts", str(tiny_folders / "prompts.jsonl"), "--out", str(out)]
    assert main(argv) == 0  # target and dtype from the config; methods: ar and the config

    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["setting"] for r in records} == {"ar", "spec[tuned]"}
    tuned = [r for r in records if r["setting"] == "spec[tuned]"]
    ran = {r["category"]: (r["draft"], r["k"], r["tree"]) for r in tuned}
    assert ran == {"qa": ("ngram", 3, None), "writing": (draft, 0, "static:2,1")}  # a tree: no k
    assert all(r["tuned"] and r["identical_to_ar"] for r in tuned)
    summary = json.loads((out / "summary.json").read_text())
    overall = row_for(summary, "spec[tuned]")
    assert (overall["draft"], overall["k_policy"], overall["ideal_speedup"]) == (
        "per category",
        "tuned",
        None,
    )
    assert row_for(summary, "spec[tuned]", "qa")["ran"] == "spec[ngram] k=3"
    assert "[spec[ngram] k=3]" in (out / "report.md").read_text()
    run_info = json.loads((out / "run.json").read_text())
    assert run_info["tuned"]["writing"] == f"spec[{draft}] tree=static:2,1"
    assert summary["best_k"] == {}  # a tuned config is not a chain at one k


def test_bench_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "results.jsonl does not exist" in capsys.readouterr().err
    assert main(["bench", "--k", "0"]) == 2  # no target and no --quick
    assert main(["bench", "--target", "t", "--methods", "spec", "--draft", "ngram"]) == 2
    assert "include `ar`" in capsys.readouterr().err
    assert main(["bench", "--target", "t", "--temperature", "-1"]) == 2
    (tmp_path / "ar.json").write_text('{"target": "t"}')
    assert main(["bench", "--config", str(tmp_path / "ar.json")]) == 2
    assert "needs a draft overall" in capsys.readouterr().err


def test_identity_is_not_judged_between_different_conversations():
    from specdecode.bench.methods import Setting
    from specdecode.bench.runner import _check_identity

    from conftest import tiny_llama

    ar, same, other = Setting("ar"), Setting("spec", "d", 2), Setting("spec", "d", 4)
    done = {
        ar: Record(token_ids=[1, 2]),
        same: Record(token_ids=[1, 3]),  # identical_to_ar and first_divergence: None
        other: Record(token_ids=[1, 3]),
    }
    # `other` answered an earlier turn differently, so its prompt here is not ar's
    target = LoadedModel(model=tiny_llama(0))  # gives the top-2 margin of the divergence
    _check_identity(target, done, {ar: [5, 6], same: [5, 6], other: [5, 7]})
    assert done[same].identical_to_ar is False
    assert done[same].first_divergence["position"] == 1
    assert done[same].first_divergence["top2_margin"] >= 0
    assert done[other].identical_to_ar is None and done[other].first_divergence is None


@pytest.mark.parametrize("batch", [0, 3])
def test_the_suffix_pool_benchmark_runs_one_by_one_and_batched(tiny_folders, tmp_path, batch):
    pool_bench = load_benchmark("suffix_pool")
    target = tmp_path / "target"  # the task's records are about 300 characters: a longer context
    shutil.copytree(tiny_folders / "target", target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    args = ["--target", str(target), "--requests", "6", "--batch", str(batch)]
    assert pool_bench.main([*args, "--max-new-tokens", "12", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "pool.json").read_text())
    assert [row["request"] for row in record["rows"]] == list(range(6))
    for row in record["rows"]:  # every output the target's own, with the pool or without
        assert row["pool"]["identical"] and row["alone"]["identical"]
    assert record["pool"]["outputs"] == 6 and bool(record["jobs"]) == bool(batch)
    assert "(last)" in (tmp_path / "pool.md").read_text()
