"""The draft vocabulary (models/draft_vocab.py): a draft's output layer over the first N ids and
the special ones. The kept ids' logits are the full layer's, the others -inf; speculation over
such a draft stays lossless, greedy (token for token) and sampled (the target's distribution)."""

from __future__ import annotations

import types

import pytest
import torch

from specdecode import SpeculativeDecoder
from specdecode.core.draft_spec import DRAFT_VOCAB_ENV, resolve_draft_vocab
from specdecode.core.sampling import SamplingParams
from specdecode.models.draft_vocab import DraftVocabHead, kept_count, kept_ids, restrict_draft_vocab
from specdecode.models.lean import LeanCache
from test_sampling_lossless import chi_square, chi_square_limit, exact_step_joint, first_step_draws

from conftest import WIDE, char_tokenizer, needs_kernel, noisy_copy, on_kernel, tiny_llama


def restricted(model, size: int, tokenizer=None):
    """`model` (changed in place) with a draft vocabulary of `size` ids."""
    loaded = types.SimpleNamespace(model=model, tokenizer=tokenizer, name="draft")
    assert restrict_draft_vocab(loaded, size) == kept_count(model)
    return model


def test_the_size_comes_from_the_argument_then_the_environment(monkeypatch):
    monkeypatch.delenv(DRAFT_VOCAB_ENV, raising=False)
    assert resolve_draft_vocab(None) == 65536
    assert resolve_draft_vocab(1000) == 1000
    assert resolve_draft_vocab("2048") == 2048
    for every in ("all", "ALL", "none", "0", 0):
        assert resolve_draft_vocab(every) is None
    monkeypatch.setenv(DRAFT_VOCAB_ENV, "all")
    assert resolve_draft_vocab(None) is None
    monkeypatch.setenv(DRAFT_VOCAB_ENV, "4096")
    assert resolve_draft_vocab(None) == 4096
    for bad in ("-5", "1e4", "lots", "٣", -1, 2.5, True):
        with pytest.raises(ValueError, match="draft vocabulary"):
            resolve_draft_vocab(bad)


def test_the_kept_ids_are_the_prefix_and_the_special_tokens():
    tokenizer = char_tokenizer()  # <unk> 0, <eos> 1: special, inside any prefix
    config = types.SimpleNamespace(eos_token_id=3, bos_token_id=None, pad_token_id=95)
    generation = types.SimpleNamespace(eos_token_id=[90, 3])
    keep = kept_ids(96, 10, tokenizer, [config, generation, None])
    assert keep.tolist() == [*range(10), 90, 95]
    assert kept_ids(96, 200).tolist() == list(range(96))


def test_the_kept_logits_are_the_full_layers_and_the_rest_is_minus_infinity(capsys):
    model = tiny_llama(seed=1, vocab=96)
    torch.manual_seed(0)
    full = torch.nn.Linear(32, 96, bias=True)
    head = DraftVocabHead(full, torch.tensor([0, 1, 2, 7, 50]))
    h = torch.randn(3, 5, 32)
    logits = head(h)  # [3, 5, 96]
    assert logits.shape == (3, 5, 96)
    expected = full(h)  # (PyTorch's float32 matmul over fewer rows may round differently)
    torch.testing.assert_close(logits[..., [0, 1, 2, 7, 50]], expected[..., [0, 1, 2, 7, 50]])
    others = torch.ones(96, dtype=torch.bool)
    others[[0, 1, 2, 7, 50]] = False
    assert torch.isneginf(logits[..., others]).all()
    # a model's tied output layer: the embedding keeps its own rows
    embed = model.get_input_embeddings().weight.clone()
    restricted(model, 40)
    assert (
        "draft: the draft vocabulary, its output layer on 40 of 96 ids" in capsys.readouterr().err
    )
    assert torch.equal(model.get_input_embeddings().weight, embed)
    assert kept_count(model) == 40
    assert kept_count(tiny_llama(seed=1)) is None


def test_a_draft_at_or_under_the_size_is_left_as_it_is():
    model = tiny_llama(seed=1, vocab=96)
    loaded = types.SimpleNamespace(model=model, tokenizer=None, name="draft")
    assert restrict_draft_vocab(loaded, 96) is None
    assert restrict_draft_vocab(loaded, None) is None
    assert type(model.lm_head) is torch.nn.Linear and kept_count(model) is None


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_output_is_the_targets_with_a_draft_vocabulary(k):
    target = tiny_llama(seed=0)
    draft = restricted(noisy_copy(target, 0.05), 48)
    plain = SpeculativeDecoder(target, None)
    engine = SpeculativeDecoder(target, draft, k=k, k_policy="fixed")
    for prompt in ([4, 5, 6], [60, 70, 80, 90]):
        expected = plain.generate(prompt, 40).token_ids
        result = engine.generate(prompt, 40)
        assert result.token_ids == expected
        assert result.stats.accepted > 0
        # ids the draft cannot say are never drafted, and still emitted where the target says them
        assert any(t >= 48 for t in expected)


def test_sampling_keeps_the_targets_distribution_with_a_draft_vocabulary():
    vocab = 6
    params = SamplingParams(temperature=1.0)
    target = tiny_llama(seed=3, vocab=vocab)
    draft = restricted(noisy_copy(target, 0.3), 3)  # ids 3, 4, 5 never drafted
    exact = exact_step_joint(target, params)
    engine = SpeculativeDecoder(target, draft, k=4, k_policy="fixed")
    n = 2000
    counts, results = first_step_draws(engine, params, n)
    assert sum(r.stats.drafted for r in results) >= 2 * n
    assert chi_square(counts, exact) < chi_square_limit(int((exact > 0).sum()))
    # the tokens outside the draft vocabulary were reached (by the target's own corrections)
    assert counts.view(vocab, vocab)[3:].sum() > 0.2 * n


@needs_kernel()
@pytest.mark.parametrize("bits", [None, 4])
def test_the_lean_forward_gives_the_kept_ids_the_full_layers_logits(bits):
    """On the kernel (bfloat16 panels, or 4-bit weights), each kept id's logit is its row of the
    full output layer's, bit for bit: the kernel computes every output row on its own. (The
    tiny models' output layers are not tied, so both are 4-bit alike.)"""
    base = tiny_llama(seed=2, vocab=160, **WIDE)
    full = on_kernel(base, bits)
    draft = on_kernel(restricted(tiny_llama(seed=2, vocab=160, **WIDE), 64), bits)
    ids = torch.tensor([5, 9, 100, 42, 7])
    with torch.inference_mode():
        a = LeanCache(full).forward(ids)  # [5, 160]
        b = LeanCache(draft).forward(ids)
    assert torch.equal(a[:, :64], b[:, :64])  # 4-bit: each row quantized on its own, alike
    assert torch.isneginf(b[:, 64:]).all()
    assert b.shape == a.shape


def test_the_benchmark_runs_on_tiny_models(tiny_folders, tmp_path):
    import json

    from conftest import load_probe

    bench = load_probe("draft_vocab")
    argv = ["--target", str(tiny_folders / "target"), "--draft", str(tiny_folders / "draft")]
    argv += [
        "--prompts",
        str(tiny_folders / "prompts.jsonl"),
        "--sizes",
        "all,20",
        "--limit",
        "1",
        "--max-new-tokens",
        "8",
        "--repeats",
        "2",
    ]
    argv += ["--tree", "dynamic:4,3,2", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    prompts = len(results["rates"]["target alone"])
    assert set(results["rows"]) == {
        "target alone",
        *(f"vocab {s}, {how}" for s in ("all", "20") for how in ("k=2", "tree dynamic:4,3,2")),
    }
    assert all(row["identical"] == prompts for row in results["rows"].values())
    assert results["coverage"]["all"]["all"] == 1.0
    assert 0.0 <= results["coverage"]["20"]["all"] <= 1.0
    assert "| 20 | " in (tmp_path / "report.md").read_text()
