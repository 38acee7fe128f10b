"""Tiny randomly initialised models (float32, seeded) and a tiny tokenizer, built in the tests."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import settings

# tiny models gain nothing from threads, and threads oversubscribe a shared 2-core machine
torch.set_num_threads(1)

# property tests draw the same examples on every run, so CI is deterministic (a failure found
# once is pinned with @example); HYPOTHESIS_PROFILE=explore draws new ones each run
settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

# a prefill's linears stay on the kernel unless a test asks otherwise: where PyTorch's product
# is measured faster (AMX) a long prefill would leave the fused path, and the tests' exact
# expectations (prefix reuse, which path a forward takes) would depend on the machine
os.environ.setdefault("SPECDECODE_PREFILL_LINEARS", "kernel")

VOCAB = 96


def needs_kernel():
    """A skip marker for tests of specdecode's CPU kernels, with the reason they cannot run."""
    from specdecode.kernels import unavailable_reason

    reason = unavailable_reason()
    return pytest.mark.skipif(reason is not None, reason=f"kernel unavailable: {reason}")


def _llama_like(config_cls, model_cls, seed: int, vocab: int, layers: int, **overrides):
    """A tiny Llama-family model (Llama, Qwen2 share these config fields), seeded."""
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=None,
        initializer_range=0.2,  # a wider init than the default: less flat next-token distributions
    )
    config = config_cls(**{**fields, **overrides})
    return model_cls(config).eval()


def tiny_llama(seed: int = 0, vocab: int = VOCAB, layers: int = 2, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    return _llama_like(LlamaConfig, LlamaForCausalLM, seed, vocab, layers, **overrides)


def tiny_qwen2(seed: int = 0, vocab: int = VOCAB, layers: int = 2):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _llama_like(Qwen2Config, Qwen2ForCausalLM, seed, vocab, layers)


def tiny_gpt2(seed: int = 0, vocab: int = VOCAB, layers: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab,
        n_embd=32,
        n_layer=layers,
        n_head=4,
        n_positions=256,
        eos_token_id=None,
        bos_token_id=None,
        initializer_range=0.2,
    )
    return GPT2LMHeadModel(config).eval()


def noisy_copy(model, noise: float, seed: int = 123):
    """A draft that agrees with `model` often but not always: its weights plus Gaussian noise
    of `noise` times each tensor's spread."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(
                torch.randn(param.shape, generator=gen) * noise * param.std().nan_to_num(1.0)
            )
    return draft


ARCHS = {"llama": tiny_llama, "gpt2": tiny_gpt2, "qwen2": tiny_qwen2}


def linear_case(m: int, k: int, n: int, seed: int, bias: bool):
    """bfloat16 x [m, k], weight [n, k] (scaled to keep outputs O(1)) and bias [n] or None."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    return x, w, b


def char_tokenizer(extra: str = ""):
    """A character-level fast tokenizer over a small alphabet (ids fit the tiny models' vocab)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list("abcdefghijklmnopqrstuvwxyz .,!?\n" + extra)
    vocab = {"<unk>": 0, "<eos>": 1}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


@pytest.fixture(scope="session")
def llama_pair():
    """A tiny target and a draft that agrees with it on roughly half of the tokens."""
    target = tiny_llama(0)
    return target, noisy_copy(target, 0.05)


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory):
    """A tiny target and draft saved with a chat-template tokenizer, and a small prompt file."""
    import json

    root = tmp_path_factory.mktemp("bench-models")
    tokenizer = char_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}a: {% endif %}"
    )
    target = tiny_llama(seed=0, vocab=len(tokenizer))
    for name, model in (("target", target), ("draft", noisy_copy(target, 0.05))):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    prompts = root / "prompts.jsonl"
    lines = [
        {"question_id": 1, "category": "writing", "turns": ["tell me a story.", "shorter!"]},
        {"question_id": 2, "category": "writing", "turns": ["a poem about the sea."]},
        {"question_id": 3, "category": "qa", "turns": ["why is the sky blue?"]},
        {"question_id": 4, "category": "qa", "turns": ["what is a lighthouse?"]},
    ]
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return root


def load_benchmark(name: str):
    """A tool of the `benchmarks` package (the repository root is on pytest's `pythonpath`)."""
    import importlib

    return importlib.import_module(f"benchmarks.{name}")


def load_probe(name: str):
    """A one-off probe of lab/probes/ as a module (they are scripts, not a package)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "lab" / "probes" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


WIDE = {"hidden_size": 64, "intermediate_size": 128}  # K a multiple of 32: 4-bit linears too


def on_kernel(model, bits: int | None = None):
    """`model` in bfloat16 on specdecode's kernels (bits: 8 or 4 for quantized linears)."""
    from specdecode.kernels import quantize_linears, swap_linears

    model = model.to(torch.bfloat16)
    swap_linears(model)
    if bits is not None:
        quantize_linears(model, bits=bits)
    return model
