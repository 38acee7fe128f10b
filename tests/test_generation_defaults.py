"""The model's own sampling defaults: where a call or a request leaves temperature, top-k or
top-p unset, the values its authors set in its generation config apply (as vLLM does);
`generation_config="none"` (`--generation-config none`) restores greedy for the Python API and
the CLI, OpenAI's defaults for the server."""

from __future__ import annotations

import json

import pytest
from transformers import GenerationConfig

from specdecode import GenerationRequest, SamplingParams, SpeculativeDecoder
from specdecode.core.request import SamplingDefaults
from specdecode.models.compat import generation_defaults
from specdecode.models.loading import wrap_model

from conftest import ARCHS, char_tokenizer, noisy_copy, tiny_llama

QWEN_LIKE = dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20)  # Qwen2.5's file
PROMPT = [1, 2, 3]


def with_config(model, **values):
    model.generation_config = GenerationConfig(**values)
    return model


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_the_tiny_test_models_set_no_sampling_defaults(arch):
    """So every test that leaves temperature unset still decodes greedily."""
    assert generation_defaults(ARCHS[arch](seed=0)) == SamplingDefaults()
    assert SpeculativeDecoder(ARCHS[arch](seed=0)).sampling_params() == SamplingParams()


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (QWEN_LIKE, SamplingDefaults(0.7, 20, 0.8)),
        (dict(do_sample=True, top_k=40), SamplingDefaults(1.0, 40, None)),  # HF's temperature 1
        (dict(do_sample=True, top_p=1.0, top_k=0), SamplingDefaults(1.0, None, None)),  # "off"
        # without do_sample=True transformers' generate decodes greedily: so does the default
        (dict(temperature=0.7, top_p=0.9), SamplingDefaults(temperature=0.0)),
        (dict(do_sample=False, temperature=0.7), SamplingDefaults(temperature=0.0)),
        (dict(eos_token_id=5, max_length=99), SamplingDefaults()),  # nothing about sampling
    ],
)
def test_defaults_read_from_the_generation_config(config, expected):
    assert generation_defaults(with_config(tiny_llama(0), **config)) == expected


def test_resolve_each_option_from_the_call_then_the_model_then_the_fallback():
    model = SamplingDefaults(0.7, 20, 0.8)
    assert model.resolve() == SamplingParams(0.7, 20, 0.8)
    assert model.resolve(temperature=0.0) == SamplingParams(0.0, 20, 0.8)
    assert model.resolve(0.9, 5, 1.0) == SamplingParams(0.9, 5, None)  # top_p 1 = off
    assert SamplingDefaults().resolve() == SamplingParams()  # greedy
    openai = SamplingParams(temperature=1.0)
    assert SamplingDefaults().resolve(top_k=3, fallback=openai) == SamplingParams(1.0, 3, None)
    assert SamplingDefaults(top_k=20).resolve(fallback=openai) == SamplingParams(1.0, 20, None)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        model.resolve(temperature=-1.0)


def test_unset_options_take_the_model_defaults():
    target = with_config(tiny_llama(0), **QWEN_LIKE)
    engine = SpeculativeDecoder(target, noisy_copy(target, 0.05), k=3, k_policy="fixed")
    assert engine.generation_defaults == SamplingDefaults(0.7, 20, 0.8)
    options = dict(max_new_tokens=24, seed=5, eos_token_ids=[])
    explicit = engine.generate(PROMPT, temperature=0.7, top_k=20, top_p=0.8, **options)
    assert engine.generate(PROMPT, **options).token_ids == explicit.token_ids
    streamed = [t for chunk in engine.stream(PROMPT, **options) for t in chunk]
    assert streamed == explicit.token_ids
    # a request without sampling parameters is resolved the same way
    request = GenerationRequest(24, seed=5, eos_token_ids=[])
    assert engine.generate_request(PROMPT, request).token_ids == explicit.token_ids
    # only the options left unset come from the model
    hotter = engine.generate(PROMPT, temperature=1.5, top_k=20, top_p=0.8, **options)
    assert engine.generate(PROMPT, temperature=1.5, **options).token_ids == hotter.token_ids
    greedy = SpeculativeDecoder(tiny_llama(0)).generate(PROMPT, **options).token_ids
    assert engine.generate(PROMPT, temperature=0.0, **options).token_ids == greedy


def test_generation_config_none_means_greedy():
    target = with_config(tiny_llama(0), **QWEN_LIKE)
    engine = SpeculativeDecoder(target, generation_config="none")
    assert engine.generation_defaults == SamplingDefaults()
    greedy = SpeculativeDecoder(tiny_llama(0)).generate(PROMPT, 24, eos_token_ids=[]).token_ids
    assert engine.generate(PROMPT, 24, eos_token_ids=[]).token_ids == greedy
    with pytest.raises(ValueError, match="generation_config must be 'auto' or 'none'"):
        SpeculativeDecoder(target, generation_config="vllm")


def test_a_saved_model_folder_brings_its_generation_config(tmp_path):
    from specdecode import load_model

    with_config(tiny_llama(0), **QWEN_LIKE).save_pretrained(tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"), dtype="float32", device="cpu")
    assert SpeculativeDecoder(loaded).generation_defaults == SamplingDefaults(0.7, 20, 0.8)


def test_cli_generate_default_and_none(tmp_path, capsys):
    from specdecode.cli import main

    folder = tmp_path / "m"
    with_config(tiny_llama(0), **QWEN_LIKE).save_pretrained(folder)

    def run(*flags: str) -> list[int]:
        argv = ["generate", "--target", str(folder), "--prompt-ids", "1,2,3", "--json"]
        assert main([*argv, "--dtype", "float32", "--max-new-tokens", "16", *flags]) == 0
        return json.loads(capsys.readouterr().out)["token_ids"]

    greedy = run("--temperature", "0")
    assert run("--generation-config", "none") == greedy
    assert run("--seed", "3") == run(
        "--seed", "3", "--temperature", "0.7", "--top-k", "20", "--top-p", "0.8"
    )


def test_demo_stays_greedy_whatever_the_model_says():
    from specdecode.demo import run_demo

    tokenizer = char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    target = wrap_model(with_config(tiny_llama(2, vocab=len(tokenizer)), **QWEN_LIKE), tokenizer)
    ar = SpeculativeDecoder(target)
    spec = SpeculativeDecoder(target, target.model, k=3, k_policy="fixed")
    (row,) = run_demo(ar, spec, [("chat", "hello")], max_new_tokens=12, progress=False)
    plain = wrap_model(tiny_llama(2, vocab=len(tokenizer)), tokenizer)
    greedy = SpeculativeDecoder(plain).generate("hello", 12, chat=True).token_ids
    assert row.ar.token_ids == row.spec.token_ids == greedy
