"""The run config file: load/save, clear errors, the vLLM export, and `generate --config`."""

from __future__ import annotations

import json

import pytest

from specdecode.cli import main
from specdecode.config import RunConfig, load_config, save_config, to_vllm_speculative_config

from conftest import noisy_copy, tiny_llama


def test_save_and_load_roundtrip(tmp_path):
    config = RunConfig(
        target="t",
        draft="early-exit:2",
        k=6,
        k_policy="cost",
        confidence=0.4,
        dtype="float32",
        device="cpu",
        per_category={
            "code": {"k": 8},
            "chat": {"draft": "ngram:1-3", "k_policy": "heuristic"},
            "qa": {"tree": "dynamic:8", "confidence": None},
        },
    )
    save_config(config, tmp_path / "run.json")
    assert load_config(tmp_path / "run.json") == config
    assert json.loads((tmp_path / "run.json").read_text())["k_policy"] == "cost"
    (tmp_path / "empty.json").write_text("{}")
    assert load_config(tmp_path / "empty.json") == RunConfig()  # every key is optional


def test_per_category_overrides():
    config = RunConfig(
        target="t", draft="d", k=4, per_category={"code": {"k": 8, "confidence": 0.3}}
    )
    code = config.for_category("code")
    assert (code.k, code.confidence, code.draft, code.target) == (8, 0.3, "d", "t")
    overall = RunConfig(target="t", draft="d", k=4)
    assert config.for_category("chat") == config.for_category(None) == overall


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"traget": "x"}', "unknown key.*traget.*allowed: target"),
        ('{"k": "4"}', "k must be an integer"),
        ('{"k": 0}', "k must be an integer >= 1"),
        ('{"k": 2.0}', "k must be an integer"),
        ('{"k": true}', "k must be an integer"),
        ('{"k_policy": "adaptive"}', "fixed, heuristic, cost"),
        ('{"confidence": 1.5}', "confidence"),
        ('{"confidence": "high"}', "confidence"),
        ('{"target": 3}', "target must be a string"),
        ('{"dtype": null}', "dtype must be a string"),
        ('{"per_category": []}', "per_category"),
        ('{"per_category": {"code": 4}}', "per_category\\['code'\\] must be an object"),
        ('{"per_category": {"code": {"dtype": "float32"}}}', "unknown key.*dtype"),
        ('{"per_category": {"code": {"k": -1}}}', "per_category\\['code'\\]\\.k must be"),
        ('{"draft": "d", "tree": "static:0"}', "bad tree"),
        ('{"draft": "d", "tree": 3}', "tree must be a string"),
        ('{"tree": "static:2"}', "tree needs a model draft"),
        ('{"draft": "ngram", "tree": "dynamic:8"}', "tree needs a model draft"),
        ('{"draft": "d", "tree": "dynamic:8", "confidence": 0.5}', "confidence applies to chains"),
        (
            '{"draft": "d", "per_category": {"code": {"draft": "ngram", "tree": "static:2"}}}',
            "per_category\\['code'\\]\\.tree needs a model draft",
        ),
    ],
)
def test_bad_files_say_what_is_wrong(tmp_path, text, message):
    path = tmp_path / "run.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(path)


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_config(tmp_path / "nope.json")


def test_vllm_speculative_config(tmp_path, monkeypatch):
    model = RunConfig(target="Qwen/Qwen3-8B", draft="Qwen/Qwen3-0.6B", k=5, k_policy="cost")
    assert to_vllm_speculative_config(model) == {
        "method": "draft_model",
        "model": "Qwen/Qwen3-0.6B",
        "num_speculative_tokens": 5,
    }
    int8 = RunConfig(target="Qwen/Qwen3-8B", draft="Qwen/Qwen3-0.6B:int8", k=5)
    assert to_vllm_speculative_config(int8)["model"] == "Qwen/Qwen3-0.6B"  # vLLM quantizes its own
    assert to_vllm_speculative_config(RunConfig(draft="ngram:2-4", k=3)) == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    ngram = to_vllm_speculative_config(RunConfig(draft="ngram"))
    assert (ngram["prompt_lookup_min"], ngram["prompt_lookup_max"]) == (1, 3)
    json.dumps(ngram)  # plain JSON for --speculative-config
    with pytest.raises(ValueError, match="early-exit"):
        to_vllm_speculative_config(RunConfig(draft="early-exit:8"))
    with pytest.raises(ValueError, match="no draft"):
        to_vllm_speculative_config(RunConfig(target="t"))
    with pytest.raises(ValueError, match="not a token tree"):
        to_vllm_speculative_config(RunConfig(draft="d", tree="static:2,1"))
    with pytest.raises(ValueError, match="ngram:MIN-MAX"):
        to_vllm_speculative_config(RunConfig(draft="ngram:x"))
    # a preset is exported as the folder it was converted to, once fetched
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="models fetch smollm2-135m-instruct"):
        to_vllm_speculative_config(RunConfig(draft="smollm2-135m-instruct"))


# -- the command line ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = tiny_llama(seed=0)
    target.save_pretrained(root / "target")
    noisy_copy(target, 0.05).save_pretrained(root / "draft")
    return root


def _generate(capsys, *argv: str) -> dict:
    args = ["generate", "--prompt-ids", "1,2,3", "--max-new-tokens", "20", "--json", *argv]
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_with_k_policy_and_confidence(saved, capsys):
    models = ["--target", str(saved / "target"), "--dtype", "float32"]
    ar = _generate(capsys, *models)
    cost = _generate(capsys, *models, "--draft", str(saved / "draft"), "--k-policy", "cost")
    assert cost["token_ids"] == ar["token_ids"]
    assert cost["stats"]["k_policy"] == "cost" and cost["stats"]["k_max"] == 4
    assert sum(cost["stats"]["k_hist"].values()) == cost["stats"]["steps"]
    cut = _generate(
        capsys, *models, "--draft", str(saved / "draft"), "--k", "6", "--confidence", "0.1"
    )
    assert cut["token_ids"] == ar["token_ids"]
    assert cut["stats"]["drafted"] < 6 * cut["stats"]["steps"]


def test_generate_with_config_file(saved, tmp_path, capsys):
    config = RunConfig(
        target=str(saved / "target"),
        draft=str(saved / "draft"),
        k=3,
        k_policy="heuristic",
        dtype="float32",
    )
    save_config(config, tmp_path / "run.json")
    ar = _generate(capsys, "--target", str(saved / "target"), "--dtype", "float32")
    from_file = _generate(capsys, "--config", str(tmp_path / "run.json"))
    assert from_file["token_ids"] == ar["token_ids"]
    assert from_file["stats"]["k_policy"] == "heuristic" and from_file["stats"]["k_max"] == 6
    # explicit flags win over the file
    flags = _generate(capsys, "--config", str(tmp_path / "run.json"), "--k-policy", "fixed")
    assert flags["stats"]["k_policy"] == "fixed" and flags["stats"]["k_max"] == 3
    assert flags["token_ids"] == ar["token_ids"]


def test_generate_with_a_category_of_a_tuned_config(saved, tmp_path, capsys):
    config = RunConfig(
        target=str(saved / "target"),
        draft=str(saved / "draft"),
        k=3,
        dtype="float32",
        per_category={"chat": {"tree": "static:2,1"}, "code": {"draft": "ngram", "k": 5}},
    )
    save_config(config, tmp_path / "run.json")
    ar = _generate(capsys, "--target", str(saved / "target"), "--dtype", "float32")
    chat = _generate(capsys, "--config", str(tmp_path / "run.json"), "--category", "chat")
    code = _generate(capsys, "--config", str(tmp_path / "run.json"), "--category", "code")
    assert chat["token_ids"] == code["token_ids"] == ar["token_ids"]
    assert chat["stats"]["nodes_verified"] > 0  # drafted a tree
    assert code["stats"]["k_max"] == 5 and not code["stats"]["nodes_verified"]
    chain = _generate(
        capsys, "--config", str(tmp_path / "run.json"), "--category", "chat", "--tree", "none"
    )  # a flag drops the file's tree
    assert chain["token_ids"] == ar["token_ids"] and not chain["stats"]["nodes_verified"]
    unknown = ["--config", str(tmp_path / "run.json"), "--category", "poetry"]
    assert main(["generate", "--prompt-ids", "1", *unknown]) == 2
    assert "known: chat, code" in capsys.readouterr().err
    assert main(["generate", "--prompt-ids", "1", "--target", "t", "--category", "chat"]) == 2
    assert "no --config" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--config", "missing.json"], "not found"),
        ([], "a target is needed"),
        (["--target", "x", "--draft", "ngram", "--confidence", "0.5"], "model draft"),
        (["--target", "x", "--k-policy", "cost", "--k", "0"], "k must be"),
    ],
)
def test_generate_errors_are_one_line(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "--prompt-ids", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_bad_k_policy_flag_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--target", "x", "--prompt-ids", "1", "--k-policy", "adaptive"])
    assert "fixed" in capsys.readouterr().err


def test_serve_reads_the_same_config_and_fails_early(tmp_path, capsys):
    from specdecode.cli import main

    assert main(["serve", "--config", str(tmp_path / "missing.json")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["serve"]) == 2  # no target from flags or a file
    assert "a target is needed" in capsys.readouterr().err
    assert main(["serve", "--target", "t", "--draft", "ngram", "--tree", "static:2"]) == 2
    assert "tree needs a model draft" in capsys.readouterr().err
