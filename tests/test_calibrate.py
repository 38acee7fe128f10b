"""The calibration (auto/calibrate.py, auto/calibration.py): the measurement gives a well-formed
record, the cache gives it back and ignores a file from another machine or version and a corrupt
one, `auto` picks deterministically from given numbers, and the command line parses."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest

from specdecode import cli_args
from specdecode.auto import calibrate
from specdecode.auto.calibration import (
    MAX_ROWS,
    Calibration,
    ChainRun,
    MachineKey,
    TreeRun,
    auto_setting,
)
from specdecode.models.loading import wrap_model

from conftest import noisy_copy, tiny_llama

KEY = MachineKey(
    cpu="Test CPU", cpu_family="25", cpu_model="97", cpu_stepping="2", flags=("avx2", "fma"),
    threads=2, device="cpu", torch="2.0", transformers="5.0", specdecode="0.1.0",
    target_kernel="bf16-avx2", draft_kernel="int4-avx2", draft_forward="lean",
)  # fmt: skip


def hand_made(machine: MachineKey = KEY, accepted=(80, 60, 20), **overrides) -> Calibration:
    """t_1 = 0.1 s, v(n) = 1 + 0.1 (n - 1), d(n) = 0.02 s, no step overhead; a chain run at k = 3
    over 100 steps, and two trees."""
    fields = dict(
        machine=machine,
        target="target",
        draft="draft:int4",
        dtype="bfloat16",
        target_forward_s={n: 0.1 * (1 + 0.1 * (n - 1)) for n in range(1, MAX_ROWS + 1)},
        draft_forward_s={n: 0.02 for n in range(1, MAX_ROWS + 1)},
        chain=ChainRun(
            k=3,
            prompts=("p1", "p2"),
            new_tokens=240,
            steps=100,
            accepted_at=accepted,
            drafted_at=(100, 100, 100),
            step_overhead_s=0.0,
        ),
        trees=(
            # 30 tokens in 10 steps: 30 draft forwards (0.6 s) + 10 verifications of 6 rows (1.5 s)
            TreeRun("dynamic:5,6,2", 10, 30, {1: 10, 2: 20}, {6: 10}),
            # 32 tokens in 10 steps: 40 draft forwards (0.8 s) + 10 of 9 rows (1.8 s)
            TreeRun("dynamic:8,6,2", 10, 32, {1: 10, 3: 30}, {9: 10}),
        ),
        prefix=128,
        repeats=3,
        measured_at="2026-12-01T00:00:00",
        seconds=1.0,
    )
    return Calibration(**{**fields, **overrides})


# -- choosing from given numbers -------------------------------------------------------------


def test_the_choice_follows_expected_tokens_per_second():
    c = hand_made()
    rates = {cand.label: cand.tokens_per_s for cand in [*c.chains(), *c.tree_candidates()]}
    # chain k: 1 + sum P(L >= i) tokens over k * 0.02 + v(k + 1) * 0.1 seconds
    assert rates["chain k=1"] == pytest.approx(1.8 / 0.13)
    assert rates["chain k=2"] == pytest.approx(2.4 / 0.16)
    assert rates["chain k=3"] == pytest.approx(2.6 / 0.19)
    assert rates["tree dynamic:5,6,2"] == pytest.approx(30 / 2.1)
    assert rates["tree dynamic:8,6,2"] == pytest.approx(32 / 2.6)
    assert c.best_chain().k == 2
    assert c.best_tree().tree == "dynamic:5,6,2"
    assert c.best().label == "chain k=2"  # 15.0 tokens/s against the tree's 14.3
    assert auto_setting(c, k_auto=True, tree_auto=True, k=4, tree=None) == (2, None)
    assert auto_setting(c, k_auto=False, tree_auto=True, k=4, tree=None) == (4, "dynamic:5,6,2")
    assert auto_setting(c, k_auto=True, tree_auto=False, k=4, tree=None) == (2, None)
    # k auto beside a given tree: the tree leaves k unused
    assert auto_setting(c, True, False, 4, "static:2,1") == (4, "static:2,1")
    assert c.to_dict()["chosen"] == {"k": 2, "tree": "dynamic:5,6,2", "best": "chain k=2"}


def test_a_worse_chain_hands_the_choice_to_the_tree():
    c = hand_made(accepted=(50, 10, 0))  # k = 1: 1.5 tokens in 0.13 s, under the tree's rate
    assert c.best().tree == "dynamic:5,6,2"
    assert auto_setting(c, True, True, 4, None) == (4, "dynamic:5,6,2")


def test_the_step_overhead_and_a_model_free_draft_count():
    c = hand_made(draft_forward_s={}, trees=(), chain=dataclasses.replace(
        hand_made().chain, step_overhead_s=0.01))  # fmt: skip
    k1 = c.chains()[0]
    assert k1.seconds_per_step == pytest.approx(0.11 + 0.01)  # no draft cost, the overhead
    assert c.best_tree() is None
    with pytest.raises(ValueError, match="has no tree"):
        auto_setting(c, k_auto=False, tree_auto=True, k=4, tree=None)
    assert auto_setting(c, True, True, 4, None)[1] is None  # both auto: the best chain


# -- the record ------------------------------------------------------------------------------


def test_the_record_round_trips_through_json():
    c = hand_made()
    back = Calibration.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back == c


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.pop("chain"),
        lambda d: d["target_forward_s"].pop("16"),
        lambda d: d["target_forward_s"].update({"3": -1.0}),
        lambda d: d["target_forward_s"].update({"3": "fast"}),
        lambda d: d["draft_forward_s"].update({"x": 1.0}),
        lambda d: d["chain"].update({"accepted_at": [101, 0, 0]}),
        lambda d: d["chain"].update({"steps": 0}),
        lambda d: d["trees"][0].update({"shape": "bushy:3"}),
        lambda d: d["trees"][0].update({"verify_rows": {"40": 10}}),
        lambda d: d["machine"].update({"threads": "two"}),
        lambda d: d["machine"].update({"colour": "blue"}),
    ],
)
def test_a_malformed_record_is_refused(change):
    data = json.loads(json.dumps(hand_made().to_dict()))
    change(data)
    with pytest.raises(ValueError):
        Calibration.from_dict(data)


def test_cpu_identity_reads_the_first_processor(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 97\n"
        "model name\t: AMD Ryzen 9 7950X\nstepping\t: 2\nflags\t\t: fpu avx2\n\n"
        "processor\t: 1\ncpu family\t: 99\nmodel name\t: other\n"
    )
    assert calibrate.cpu_identity(str(info)) == {
        "model name": "AMD Ryzen 9 7950X", "cpu family": "25", "model": "97", "stepping": "2",
    }  # fmt: skip


# -- measuring (tiny models: fast; no timing is asserted) -------------------------------------


@pytest.fixture(scope="module")
def tiny_pair():
    target = tiny_llama(seed=0)
    return wrap_model(target, name="tiny-target"), noisy_copy(target, 0.05)


PROMPTS = [("p1", [1, 2, 3, 4, 5, 6]), ("p2", [9, 8, 7])]


def test_the_measurement_gives_a_well_formed_record(tiny_pair):
    target, draft = tiny_pair
    trees = ("dynamic:4,3,2", "static:2,1")
    c = calibrate.measure(
        target, draft, "tiny-target", "tiny-draft", prompts=PROMPTS, trees=trees,
        max_new_tokens=12, repeats=1, progress=False,
    )  # fmt: skip
    assert sorted(c.target_forward_s) == sorted(c.draft_forward_s) == list(range(1, 17))
    assert c.v[1] == 1.0 and all(v > 0 for v in c.v.values())
    assert c.machine == calibrate.machine_key(target, draft)
    assert c.dtype == "float32" and (c.target, c.draft) == ("tiny-target", "tiny-draft")
    chain = c.chain
    assert chain.k == calibrate.CHAIN_K and chain.prompts == ("p1", "p2")
    assert chain.new_tokens == 24 and 1 <= chain.steps <= 24
    assert len(chain.per_position_acceptance) == chain.k
    assert [t.shape for t in c.trees] == list(trees)
    for tree in c.trees:  # replayed on the chain run's answers: the same tokens but each
        assert tree.emitted == chain.new_tokens - len(PROMPTS)  # answer's first (the prefill's)
        assert sum(tree.verify_rows.values()) == tree.steps
    assert 1 <= c.best_chain().k <= chain.k and c.best_tree().tree in trees
    assert Calibration.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_a_model_free_draft_is_calibrated_for_chains(tiny_pair):
    from specdecode.drafters.ngram import NgramDrafter

    target, _ = tiny_pair
    c = calibrate.measure(
        target, NgramDrafter(1, 3), "tiny-target", "ngram:1-3", prompts=PROMPTS,
        max_new_tokens=8, repeats=1, progress=False,
    )  # fmt: skip
    assert c.draft_forward_s == {} and c.trees == ()
    assert c.machine.draft_forward == "none" and c.machine.draft_kernel == "none"
    assert c.best().tree is None


def test_a_candidate_tree_must_fit_the_measured_sizes():
    with pytest.raises(ValueError, match="at most 15 nodes"):
        calibrate._check_candidate("dynamic:33,8,4")
    with pytest.raises(ValueError, match="at most 15 nodes"):
        calibrate._check_candidate("static:4,4")  # 4 + 16 nodes
    assert calibrate._check_candidate("static:3,2,1") == "static:3,2,1"


# -- the cache -------------------------------------------------------------------------------


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache dir and a `measure` that counts its calls and returns `hand_made` under
    this process's key."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(calibrate, "_NOTED", set())
    calls = []

    def fake_measure(target, draft, target_name, draft_name, **_):
        calls.append(target_name)
        key = calibrate.machine_key(target, draft)
        return hand_made(key, target=target_name, draft=draft_name, dtype="float32")

    monkeypatch.setattr(calibrate, "measure", fake_measure)
    return tmp_path, calls


def test_the_cache_gives_the_record_back(tiny_pair, cache):
    root, calls = cache
    target, draft = tiny_pair
    first, path = calibrate.calibrated(target, draft, "tiny-target", "tiny-draft")
    assert (
        path.parent == root / calibrate.CACHE_FOLDER and path.is_file() and calls == ["tiny-target"]
    )
    again, same = calibrate.calibrated(target, draft, "tiny-target", "tiny-draft")
    assert (again, same) == (first, path) and len(calls) == 1  # read, not measured
    calibrate.calibrated(target, draft, "tiny-target", "tiny-draft", force=True)
    assert len(calls) == 2
    other, elsewhere = calibrate.calibrated(target, draft, "tiny-target", "ngram")
    assert elsewhere != path and other.draft == "ngram:1-3"  # another pair, another file


@pytest.mark.parametrize(
    "change, why",
    [
        (dict(cpu="Other CPU"), "differs in cpu"),
        (dict(torch="1.0"), "differs in torch"),
        (dict(specdecode="0.0.1"), "differs in specdecode"),
        (dict(threads=64), "differs in threads"),
        (dict(format=2), "differs in format"),
        (dict(kernels="0" * 16), "differs in kernels"),  # the kernels' code changed
    ],
)
def test_a_record_from_another_machine_or_version_is_ignored(tiny_pair, cache, capsys, change, why):
    _, calls = cache
    target, draft = tiny_pair
    key = calibrate.machine_key(target, draft)
    names = ("tiny-target", "tiny-draft")
    path = calibrate.cache_path(key, *names, "float32")
    foreign = hand_made(
        dataclasses.replace(key, **change), target=names[0], draft=names[1], dtype="float32"
    )
    calibrate.save_calibration(foreign, path)
    assert calibrate.load_calibration(path, key, *names, "float32") is None
    assert calibrate.load_calibration(path, key, *names, "float32") is None
    err = capsys.readouterr().err
    assert err.count("ignoring the calibration") == 1 and why in err  # said once
    fresh, _ = calibrate.calibrated(target, draft, *names)
    assert calls == ["tiny-target"] and fresh.machine == key  # measured again and replaced
    assert calibrate.load_calibration(path, key, *names, "float32") == fresh


@pytest.mark.parametrize("text", ["{not json", "[]", '{"format": 1}', ""])
def test_a_corrupt_file_is_ignored(tiny_pair, cache, capsys, text):
    _, calls = cache
    target, draft = tiny_pair
    key = calibrate.machine_key(target, draft)
    path = calibrate.cache_path(key, "tiny-target", "tiny-draft", "float32")
    path.parent.mkdir(parents=True)
    path.write_text(text)
    assert calibrate.load_calibration(path, key, "tiny-target", "tiny-draft", "float32") is None
    assert "not a valid calibration record" in capsys.readouterr().err
    calibrate.calibrated(target, draft, "tiny-target", "tiny-draft")
    assert calls == ["tiny-target"]


def test_a_record_of_another_pair_in_the_file_is_ignored(tiny_pair, cache, capsys):
    target, draft = tiny_pair
    key = calibrate.machine_key(target, draft)
    path = calibrate.cache_path(key, "tiny-target", "tiny-draft", "float32")
    calibrate.save_calibration(hand_made(key, dtype="float32"), path)  # target "target"
    assert calibrate.load_calibration(path, key, "tiny-target", "tiny-draft", "float32") is None
    assert "it calibrates target/draft:int4/float32" in capsys.readouterr().err


def test_names_are_keyed_canonically(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    assert calibrate.canonical_target(str(folder)) == str(folder.resolve())
    assert calibrate.canonical_draft(f"{folder}:int4") == f"{folder.resolve()}:int4"
    assert calibrate.canonical_draft("ngram") == "ngram:1-3"
    assert calibrate.canonical_target("some-preset") == "some-preset"


# -- the command line ------------------------------------------------------------------------


def test_calibrate_and_auto_parse():
    from specdecode import cli

    parser = cli.build_parser()
    args = parser.parse_args(["calibrate", "--target", "T", "--draft", "D:int4", "--force"])
    assert (args.target, args.draft, args.dtype, args.force, args.json) == (
        "T", "D:int4", "bfloat16", True, False,
    )  # fmt: skip
    args = parser.parse_args(
        ["generate", "--target", "T", "--draft", "D", "--k", "auto", "--tree", "auto",
         "--prompt", "hi"]
    )  # fmt: skip
    assert (args.k, args.tree) == ("auto", "auto")
    assert parser.parse_args(["serve", "--target", "T", "--k", "auto"]).k == "auto"
    assert parser.parse_args(["generate", "--target", "T", "--k", "3", "--prompt", "x"]).k == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--target", "T", "--k", "many", "--prompt", "x"])
    with pytest.raises(SystemExit):
        parser.parse_args(["calibrate", "--target", "T"])  # a draft is required


def test_auto_is_left_out_of_the_run_config_and_refused_where_it_cannot_apply():
    from specdecode import cli
    from specdecode.cli_args import run_config_from_args

    parser = cli.build_parser()

    def run(*flags):
        args = parser.parse_args(["generate", "--target", "T", *flags, "--prompt", "x"])
        return run_config_from_args(args)

    config = run("--draft", "D", "--k", "auto", "--tree", "auto")
    assert (config.k, config.tree) == (4, None)  # defaults until the calibration resolves them
    with pytest.raises(ValueError, match="needs a --draft"):
        cli_args.check_auto({"k"}, run())
    with pytest.raises(ValueError, match="needs a model draft"):
        cli_args.check_auto({"tree"}, run("--draft", "ngram"))
    with pytest.raises(ValueError, match="--confidence applies to chains"):
        cli_args.check_auto({"tree"}, run("--draft", "D", "--confidence", "0.5"))
    cli_args.check_auto({"k"}, run("--draft", "ngram"))  # a chain's k: fine


def test_generate_resolves_auto_from_the_calibration(tiny_folders, monkeypatch, capsys):
    from specdecode import cli
    from specdecode.cli_args import engine_from_args
    from specdecode.drafters.tree_model import TreeModelDrafter

    fake = hand_made(dtype="float32")
    monkeypatch.setattr(calibrate, "calibrated", lambda *a, **kw: (fake, Path("cal.json")))
    target, draft = str(tiny_folders / "target"), str(tiny_folders / "draft")

    def engine(*flags):
        argv = ["generate", "--target", target, "--draft", draft, "--dtype", "float32", *flags]
        return engine_from_args(cli.build_parser().parse_args([*argv, "--prompt", "x"]))

    assert engine("--k", "auto").k == 2  # the best chain
    assert "auto: chain k=2" in capsys.readouterr().err
    tree = engine("--tree", "auto").drafter
    assert isinstance(tree, TreeModelDrafter) and str(tree.shape) == "dynamic:5,6,2"
    both = engine("--k", "auto", "--tree", "auto")
    assert both.k == 2 and not isinstance(both.drafter, TreeModelDrafter)  # the chain is faster
    given = engine("--k", "auto", "--tree", "static:2,1").drafter  # k unused: no calibration
    assert str(given.shape) == "static:2,1"


def test_the_calibrate_command_prints_the_record(tiny_folders, monkeypatch, capsys):
    from specdecode import cli

    fake = hand_made(dtype="float32")
    seen = {}

    def fake_calibrated(target, draft, target_name, draft_name, force=False):
        seen.update(target=target_name, draft=draft_name, force=force)
        return fake, Path("cal.json")

    monkeypatch.setattr(calibrate, "calibrated", fake_calibrated)
    argv = ["calibrate", "--target", str(tiny_folders / "target"), "--draft",
            str(tiny_folders / "draft"), "--dtype", "float32"]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "| 16 | 250.0 | 2.50 | 20.0 |" in out  # t(16), v(16), d(16)
    assert "| chain k=2 | 2.40 | 2.00 | 3.00 | 160.0 | 15.0 |" in out
    assert "--k auto -> k = 2; --tree auto -> dynamic:5,6,2" in out and "cal.json" in out
    assert seen["force"] is False
    assert cli.main([*argv, "--json", "--force"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["chosen"]["best"] == "chain k=2" and seen["force"] is True
    assert cli.main(["calibrate", "--target", "T", "--draft", "early-exit"]) == 2  # bad draft


def test_the_demo_drafts_what_the_calibration_picks(tiny_folders, monkeypatch, capsys):
    from specdecode import demo

    fake = hand_made(dtype="float32", accepted=(50, 10, 0))  # the tree wins
    monkeypatch.setattr(calibrate, "calibrated", lambda *a, **kw: (fake, Path("cal.json")))
    rows = demo.main_demo(
        str(tiny_folders / "target"), str(tiny_folders / "draft"), k=4, max_new_tokens=8,
        dtype="float32", device="cpu", limit=1, out=io.StringIO(), tree=demo.AUTO,
    )  # fmt: skip
    assert rows[0].identical and rows[0].spec.stats.nodes_verified > 0  # a tree ran
    assert "calibration (cal.json): tree dynamic:5,6,2" in capsys.readouterr().err


def test_forward_seconds_times_rounds_over_every_size_after_a_warm_up_round():
    # a machine that speeds up while it measures shifts every size alike: the sizes are timed
    # in rounds (warm-up round first, untimed), not one size's repeats after another's
    from specdecode.auto.costs import forward_seconds

    order: list[int] = []

    class Recording:
        def __init__(self, model) -> None:
            pass

        def forward(self, ids, last_only: bool = False) -> None:
            if not last_only:
                order.append(len(ids))

        def rollback(self, length: int) -> None:
            pass

    ticks = iter(range(10_000))  # each forward "takes" one tick more than the one before
    seen: list[int] = []
    model = tiny_llama(seed=0)
    seconds = forward_seconds(
        model, [1, 2, 3], prefix=4, repeats=2, clock=lambda: next(ticks) ** 2,
        cache_type=Recording, done=seen.append,
    )  # fmt: skip
    assert order == [1, 2, 3] * 3 and seen == order
    # forward i reads the clock at ticks 2i and 2i + 1: it "takes" 4i + 1; the warm-up round is
    # forwards 0-2, the timed rounds 3-5 and 6-8, and the median of two is the upper one
    assert seconds == {1: 25, 2: 29, 3: 33}


def test_a_draft_vocabulary_is_part_of_the_key(tiny_pair):
    """Its draft forwards cost less: a calibration of the whole draft is not reused for it."""
    import types

    from specdecode.models.draft_vocab import restrict_draft_vocab

    target, draft = tiny_pair
    smaller = noisy_copy(target.model, 0.05)
    loaded = types.SimpleNamespace(model=smaller, tokenizer=None, name="draft")
    restrict_draft_vocab(loaded, 40)
    whole, part = calibrate.machine_key(target, draft), calibrate.machine_key(target, smaller)
    assert (whole.draft_vocab, part.draft_vocab) == (0, 40)
    assert whole.differences(part) == ["draft_vocab"]
