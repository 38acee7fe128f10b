"""`specdecode generate --json` on folders saved with save_pretrained; the shared arguments and
which module imports which."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from specdecode import SpeculativeDecoder, load_model
from specdecode.cli import build_parser, main

from conftest import char_tokenizer, noisy_copy, tiny_llama

STATS = {
    "steps",
    "drafted",
    "accepted",
    "emitted",
    "new_tokens",
    "acceptance_rate",
    "mean_acceptance_length",
    "per_position_acceptance",
    "wall_time_s",
    "tokens_per_s",
}


def test_generate_json_on_saved_folders(tmp_path, capsys):
    target = tiny_llama(seed=0)
    target.save_pretrained(tmp_path / "target")
    noisy_copy(target, 0.05).save_pretrained(tmp_path / "draft")
    argv = ["generate", "--target", str(tmp_path / "target"), "--prompt-ids", "1,2,3"]
    argv += ["--dtype", "float32", "--max-new-tokens", "20", "--json"]
    assert main([*argv, "--draft", str(tmp_path / "draft"), "--k", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    ar = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == ar["token_ids"]
    assert len(spec["token_ids"]) == 20
    assert spec["text"] is None  # saved without a tokenizer
    assert set(spec["stats"]) >= STATS
    assert spec["stats"]["drafted"] > 0 and ar["stats"]["drafted"] == 0
    assert ar["stats"]["acceptance_rate"] is None
    # and the same through the Python API
    engine = SpeculativeDecoder(load_model(tmp_path / "target", dtype="float32"))
    assert engine.generate([1, 2, 3], max_new_tokens=20).token_ids == ar["token_ids"]


def test_generate_text_with_tokenizer(tmp_path, capsys):
    tokenizer = char_tokenizer()
    tiny_llama(seed=0, vocab=len(tokenizer)).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    argv = ["generate", "--target", str(tmp_path / "m"), "--draft", str(tmp_path / "m")]
    argv += ["--dtype", "float32"]  # in bfloat16 batched and one-token forwards may differ
    argv += ["--k-policy", "fixed"]  # a draft as large as its target: the cost policy would not
    assert main([*argv, "--prompt", "hello", "--max-new-tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out["text"], str)
    assert out["stats"]["acceptance_rate"] == 1.0
    assert main([*argv, "--prompt", "hello", "--max-new-tokens", "8"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == out["text"].strip()
    assert "tokens/s" in captured.err


def test_nothing_but_the_entry_point_imports_the_root_command():
    # the subcommands' parsers share cli_args.py; the root command imports them, never back
    src = Path(__file__).resolve().parents[1] / "src" / "specdecode"
    imports = (
        "from specdecode.cli import",
        "from specdecode import cli",
        "import specdecode.cli\n",
    )
    importers = [
        path.relative_to(src)
        for path in src.rglob("*.py")
        if path.name != "cli.py" and any(line in path.read_text() for line in imports)
    ]
    assert importers == []


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_generate_and_serve_take_the_same_drafting_arguments(command):
    given = {"draft": "ngram", "k": 3, "tree": "none", "k_policy": "cost", "kernel": "off"}
    argv = [command, "--target", "t", *(["--prompt", "hi"] if command == "generate" else [])]
    for key, value in given.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    args = build_parser().parse_args(argv)
    assert {key: getattr(args, key) for key in given} == given


def test_the_kernel_help_names_both_instruction_sets():
    from specdecode.cli_args import add_kernel_arg

    parser = argparse.ArgumentParser()
    add_kernel_arg(parser)
    assert "AVX2, or AVX-512 where the CPU has it" in " ".join(parser.format_help().split())


def test_generate_takes_a_draft_vocabulary(tmp_path, capsys, monkeypatch):
    from specdecode.core.draft_spec import DRAFT_VOCAB_ENV

    monkeypatch.setenv(DRAFT_VOCAB_ENV, "all")  # restored after the test: main() sets it
    target = tiny_llama(seed=0)
    target.save_pretrained(tmp_path / "target")
    noisy_copy(target, 0.05).save_pretrained(tmp_path / "draft")
    argv = ["generate", "--target", str(tmp_path / "target"), "--prompt-ids", "1,2,3"]
    argv += ["--dtype", "float32", "--max-new-tokens", "20", "--json"]
    assert main(argv) == 0
    ar = json.loads(capsys.readouterr().out)
    draft = ["--draft", str(tmp_path / "draft"), "--k", "3", "--draft-vocab", "40"]
    assert main([*argv, *draft]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == ar["token_ids"] and spec["stats"]["accepted"] > 0
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--draft-vocab", "many"])
    assert exit_info.value.code == 2
    assert "draft vocabulary 'many'" in capsys.readouterr().err
