"""Bad input gets one clear line: ValueError from the API, exit status 2 from the CLI."""

from __future__ import annotations

import pytest

from specdecode import SpeculativeDecoder
from specdecode.cli import main
from specdecode.models.loading import load_model, wrap_model

from conftest import char_tokenizer, tiny_llama


@pytest.fixture(scope="module")
def engine():
    target = tiny_llama(seed=0)
    return SpeculativeDecoder(target, tiny_llama(seed=1), k=2, k_policy="fixed")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": 0}, "top_k must be >= 1"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        ({"max_new_tokens": 300}, "exceeds the target's context of 256 tokens"),
    ],
)
def test_api_rejects_bad_settings(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.generate([1, 2, 3], **kwargs)
    with pytest.raises(ValueError, match=message):
        engine.stream([1, 2, 3], **kwargs)  # checked before the first token, not lazily


@pytest.mark.parametrize("k", [0, -1, 2.5])
def test_api_rejects_bad_k(k):
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        SpeculativeDecoder(tiny_llama(), tiny_llama(seed=1), k=k, k_policy="fixed")


def test_api_rejects_empty_and_invalid_prompts(engine):
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.generate([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([1, 500])
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.generate("text without a tokenizer")


def test_api_rejects_empty_text_prompt():
    tokenizer = char_tokenizer()
    engine = SpeculativeDecoder(wrap_model(tiny_llama(vocab=len(tokenizer)), tokenizer))
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.generate("")


def test_missing_model_path():
    with pytest.raises(ValueError, match="does not exist"):
        load_model("/no/such/folder", dtype="float32")
    with pytest.raises(ValueError, match="does not exist"):
        load_model("./missing-model", dtype="float32")
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model("/no/such/folder", dtype="float8")


def test_a_draft_that_cannot_write_the_targets_text_is_refused():
    t_tok, d_tok = char_tokenizer(extra="é"), char_tokenizer()  # the draft has no é
    target = wrap_model(tiny_llama(vocab=40), t_tok)
    draft = wrap_model(tiny_llama(seed=1, vocab=40), d_tok)
    with pytest.raises(
        ValueError,
        match="another tokenizer \\(the target's tokenizer has 35 tokens, the draft's 34\\) and "
        "cannot write the target's text: it writes 'é' of the target's text and reads back "
        "'<unk>'",
    ):
        SpeculativeDecoder(target, draft)


def test_differently_padded_vocabularies_use_the_common_vocabulary():
    tok = char_tokenizer()
    target = tiny_llama(seed=0, vocab=48)
    draft = tiny_llama(seed=1, vocab=40)  # a smaller padded embedding, same tokenizer
    engine = SpeculativeDecoder(
        wrap_model(target, tok), wrap_model(draft, tok), k=3, k_policy="fixed"
    )
    expected = SpeculativeDecoder(wrap_model(target, tok)).generate([1, 2, 3], 30).token_ids
    assert engine.generate([1, 2, 3], 30).token_ids == expected
    sampled = engine.generate([1, 2, 3], 30, temperature=1.0, seed=1).token_ids
    assert all(0 <= t < 48 for t in sampled)
    too_small = wrap_model(tiny_llama(seed=1, vocab=20), tok)
    with pytest.raises(ValueError, match="incompatible vocabularies"):
        SpeculativeDecoder(wrap_model(target, tok), too_small)


# -- the CLI: one line on stderr, exit status 2, no traceback ------------------------------------


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    tiny_llama(seed=0).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--k", "0"], "k must be an integer >= 1"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--top-k", "0"], "top_k must be >= 1"),
        (["--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1"),
        (["--max-new-tokens", "1000"], "exceeds the target's context of 256 tokens"),
    ],
)
def test_cli_bad_settings(saved_model, capsys, args, message):
    code = main(["generate", "--target", saved_model, "--prompt-ids", "1,2", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    # one error line (weight-loading progress may come before it)
    assert [line for line in err.splitlines() if "error" in line] == [err.strip().splitlines()[-1]]


def test_cli_missing_model_and_incompatible_tokenizers(tmp_path, capsys):
    assert main(["generate", "--target", str(tmp_path / "nope"), "--prompt", "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err
    for name, tok in (("a", char_tokenizer()), ("b", char_tokenizer(extra="é"))):
        tiny_llama(vocab=40).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    code = main(
        [
            "generate",
            "--target",
            str(tmp_path / "b"),
            "--draft",
            str(tmp_path / "a"),
            "--prompt",
            "hi",
        ]
    )
    assert code == 2
    assert "cannot write the target's text" in capsys.readouterr().err


def test_cli_empty_prompt(saved_model, capsys):
    assert main(["generate", "--target", saved_model, "--prompt", ""]) == 2
    assert "the prompt is empty" in capsys.readouterr().err


def test_hub_id_without_the_hub_suggests_the_presets(tmp_path):
    import os
    import subprocess
    import sys

    code = "from specdecode.cli import main; raise SystemExit(main())"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    argv = ["generate", "--target", "someorg/some-model", "--prompt", "hi"]
    done = subprocess.run(
        [sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    error = done.stderr.strip().splitlines()[-1]
    assert "could not load 'someorg/some-model'" in error
    assert "smollm2-135m-instruct" in error


def test_a_hub_id_the_hub_cannot_serve_fails_on_one_probe(monkeypatch):
    """Without the hub, one connection attempt says so; the hub client (and its minute of
    retries) never runs."""
    from huggingface_hub import constants

    from specdecode.models import loading

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setattr(loading, "_load_folder", lambda *a, **k: pytest.fail("the hub client ran"))
    with pytest.raises(ValueError, match=r"cannot reach 127\.0\.0\.1:9") as caught:
        loading.load_model("someorg/some-model")
    assert "use a preset: smollm2-135m-instruct" in str(caught.value)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="offline mode: HF_HUB_OFFLINE is set"):
        loading.load_model("someorg/some-model")


def test_a_hub_id_in_the_local_cache_needs_no_probe(monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants

    from specdecode.models import loading

    cached = lambda repo, name: f"/hub-cache/{repo}/{name}"  # noqa: E731
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", cached)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert loading.hub_problem("someorg/some-model") is None  # transformers reads the cache
