"""Drafts of another tokenizer (drafters/cross_tokenizer.py, models/tokenizer_bridge.py): greedy
through text stays the target's output token for token, sampling through the shared tokens keeps
the target's distribution, and the committed text reaches the draft whole."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from specdecode import SpeculativeDecoder
from specdecode.core.sampling import SamplingParams
from specdecode.drafters.cross_tokenizer import CommittedText, CrossTokenizerDrafter, decode
from specdecode.models.loading import wrap_model
from specdecode.models.tokenizer_bridge import shared_tokens, token_keys
from test_sampling_lossless import chi_square, chi_square_limit, exact_step_joint, first_step_draws

from conftest import tiny_llama

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "for i in range(10):\n    print(i * i)\n",
    "Speculative decoding drafts tokens and the target verifies them.",
    "naïve café déjà vu: ünïcödé — 中文 😀",
]


def bpe_tokenizer(
    vocab_size: int, spelling: str = "byte-level", corpus=CORPUS, every_byte: bool = True
):
    """A byte-pair tokenizer trained here on `corpus` (deterministic): byte-level (GPT-2's
    spelling) or metaspace ("▁" for a space, raw bytes as <0xNN>); `every_byte=False` leaves
    a byte-level one only the corpus's characters (every token then decodes to whole text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<eos>"]
    if spelling == "byte-level":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet() if every_byte else []
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
        tok.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
        specials += [f"<0x{b:02X}>" for b in range(256)]
        alphabet = []
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(corpus * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


@pytest.fixture(scope="module")
def tokenizers():
    """The target's (byte-level, 330 tokens) and a draft's (byte-level, 300 other merges)."""
    return bpe_tokenizer(330), bpe_tokenizer(300, corpus=[*CORPUS[::-1], "return return"])


PROMPTS = ["def add(a, b):", "The quick brown", "naïve café", "for i in"]


def test_greedy_through_text_is_the_targets_output(tokenizers):
    t_tok, d_tok = tokenizers
    target = wrap_model(tiny_llama(seed=0, vocab=len(t_tok)), t_tok)
    draft = wrap_model(tiny_llama(seed=1, vocab=len(d_tok)), d_tok, name="other")
    alone = SpeculativeDecoder(target)
    engine = SpeculativeDecoder(target, draft, k=4, k_policy="fixed")
    assert isinstance(engine.drafter, CrossTokenizerDrafter)
    assert "greedy drafts through text" in engine.drafter.describe()
    drafted = 0
    for prompt in PROMPTS:
        want = alone.generate(prompt, max_new_tokens=40)
        got = engine.generate(prompt, max_new_tokens=40)
        assert got.token_ids == want.token_ids, prompt
        drafted += got.stats.drafted
    assert drafted > 0
    assert engine.drafter.route == "text"


def test_a_draft_that_is_the_target_under_other_ids_is_accepted_through_text():
    """The target's own weights over a tokenizer with the same tokens numbered otherwise: it
    predicts what the target does wherever the text is split alike, so drafts are kept (the
    cache's common prefix survives the steps), and the output is still the target's."""
    # ASCII only, so that the random target never writes half a character
    t_tok = bpe_tokenizer(200, corpus=CORPUS[:4], every_byte=False)
    vocab = t_tok.get_vocab()
    # the same tokens and merges, the ids reversed
    reversed_ids = {token: len(vocab) - 1 - index for token, index in vocab.items()}
    target_model = tiny_llama(seed=2, vocab=len(t_tok))
    target = wrap_model(target_model, t_tok)
    d_model = tiny_llama(seed=2, vocab=len(t_tok))
    order = torch.tensor([vocab[t] for t, _ in sorted(reversed_ids.items(), key=lambda x: x[1])])
    with torch.no_grad():
        d_model.get_input_embeddings().weight.copy_(
            target_model.get_input_embeddings().weight[order]
        )
        d_model.get_output_embeddings().weight.copy_(
            target_model.get_output_embeddings().weight[order]
        )
    renamed = _renumbered(t_tok, reversed_ids)
    draft = wrap_model(d_model, renamed, name="renamed")
    engine = SpeculativeDecoder(target, draft, k=4, k_policy="fixed")
    alone = SpeculativeDecoder(target)
    accepted = 0
    for prompt in PROMPTS:
        got = engine.generate(prompt, max_new_tokens=40)
        assert got.token_ids == alone.generate(prompt, max_new_tokens=40).token_ids
        accepted += got.stats.accepted
    assert accepted > 60


def _renumbered(tokenizer, ids: dict[str, int]):
    """`tokenizer` with its tokens given the ids `ids` (same merges)."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    state["model"]["vocab"] = ids
    for added in state["added_tokens"]:
        added["id"] = ids[added["content"]]
    tok = Tokenizer.from_str(json.dumps(state))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def test_shared_tokens_match_bytes_across_spellings():
    byte_level, metaspace = bpe_tokenizer(330), bpe_tokenizer(330 + 256, spelling="metaspace")
    keys = token_keys(metaspace)
    assert keys[b"\n"] == metaspace.get_vocab()["<0x0A>"]  # a raw byte
    assert keys[b" b\n"] == metaspace.get_vocab()["\u2581b\n"]
    shared = shared_tokens(byte_level, metaspace, len(metaspace), len(byte_level))
    pairs = dict(zip(shared.draft_ids.tolist(), shared.target_ids.tolist(), strict=True))
    spaced = 0
    for token, d in metaspace.get_vocab().items():
        if token.startswith("\u2581") and d in pairs:
            # a SentencePiece "▁the" is the byte-level "Ġthe"
            assert decode(byte_level, [pairs[d]]) == token.replace("\u2581", " ")
            spaced += 1
    assert spaced >= 5
    assert len(shared) > 100
    assert shared.to_target[shared.draft_ids].tolist() == shared.target_ids.tolist()
    outside = torch.ones(len(metaspace), dtype=torch.bool)
    outside[shared.draft_ids] = False
    assert (shared.to_target[outside] == -1).all()
    # special tokens match by their text
    eos = metaspace.convert_tokens_to_ids("<eos>")
    assert pairs[eos] == byte_level.convert_tokens_to_ids("<eos>")


def test_greedy_through_text_with_a_metaspace_draft_is_the_targets_output(tokenizers):
    t_tok, _ = tokenizers
    d_tok = bpe_tokenizer(330 + 256, spelling="metaspace")
    target = wrap_model(tiny_llama(seed=3, vocab=len(t_tok)), t_tok)
    draft = wrap_model(tiny_llama(seed=4, vocab=len(d_tok)), d_tok, name="sp")
    engine = SpeculativeDecoder(target, draft, k=3, k_policy="fixed")
    alone = SpeculativeDecoder(target)
    for prompt in PROMPTS:
        got = engine.generate(prompt, max_new_tokens=30)
        assert got.token_ids == alone.generate(prompt, max_new_tokens=30).token_ids


@given(
    st.lists(st.integers(0, 329), min_size=1, max_size=160),
    st.lists(st.integers(1, 12), min_size=1, max_size=40),
)
def test_committed_text_reaches_the_draft_whole(ids, chunks):
    """Fed in any chunks, the draft's ids spell the committed text (to its last whole
    character), however the target split it; the kept ids never change once kept."""
    t_tok, d_tok = _TOKS
    committed = CommittedText(t_tok, d_tok)
    seen, kept = 0, []
    for size in chunks * 20:
        if seen >= len(ids):
            break
        seen = min(len(ids), seen + size)
        draft_ids = committed.update(ids[:seen])
        assert draft_ids[: len(kept)] == kept
        kept = list(committed.kept)
        text = decode(t_tok, ids[: committed.synced])
        assert decode(d_tok, draft_ids) == text
        assert seen - committed.synced <= 3  # at most a character's bytes wait
    whole = decode(t_tok, ids)
    if not whole.endswith("\ufffd"):
        assert decode(d_tok, committed.update(ids)) == whole


_TOKS = (bpe_tokenizer(330), bpe_tokenizer(300, corpus=CORPUS[::-1]))


def char_pair():
    """A target tokenizer of 6 tokens (one, "ab", the draft lacks) and a draft's of 6, numbered
    otherwise (one, "x", the target lacks): the shared tokens are <unk>, a, b, c, d. No EOS:
    every generation runs its whole budget."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def make(tokens):
        tok = Tokenizer(
            models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token="<unk>")
        )
        tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
        tok.decoder = decoders.Fuse()
        return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")

    return make(["<unk>", "d", "a", "b", "c", "ab"]), make(["<unk>", "d", "c", "x", "b", "a"])


def test_sampling_through_the_shared_tokens_keeps_the_targets_distribution():
    t_tok, d_tok = char_pair()
    params = SamplingParams(temperature=1.0)
    target_model = tiny_llama(seed=3, vocab=6)
    target = wrap_model(target_model, t_tok)
    draft = wrap_model(tiny_llama(seed=4, vocab=6), d_tok, name="other")
    engine = SpeculativeDecoder(target, draft, k=4, k_policy="fixed")
    assert len(engine.drafter.shared) == 5
    n = 3000
    counts, results = first_step_draws(engine, params, n)
    assert engine.drafter.route == "shared tokens"
    assert sum(r.stats.drafted for r in results) >= 2 * n  # the first step really drafts
    assert sum(r.stats.accepted for r in results) > n // 4
    exact = exact_step_joint(target_model, params)
    limit = chi_square_limit(int((exact > 0).sum()))
    assert chi_square(counts, exact) < limit
    # power: "ab" (id 5) is never drafted, yet the target's mass there is emitted
    second = counts.view(6, 6).sum(1)
    assert second[5] > 0
    # the proposals' q_draft is zero off the shared target ids
    engine.drafter.begin(
        [1, 2, 3], params, torch.Generator().manual_seed(0), results[0].stats.meter
    )
    proposal = engine.drafter.propose([1, 2, 3], 3)
    assert proposal.q_draft.shape == (3, 6)
    assert (proposal.q_draft[:, 5] == 0).all()
    assert torch.allclose(proposal.q_draft.sum(-1), torch.ones(3))
    assert set(proposal.tokens.tolist()) <= {0, 1, 2, 3, 4}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_batch_answers_each_prompt_as_alone(tokenizers, temperature):
    """Rows of one batch each draft with their own copy (their own committed text and cache):
    greedy or sampled, every answer is the one `generate` gives alone."""
    t_tok, d_tok = tokenizers
    target = wrap_model(tiny_llama(seed=0, vocab=len(t_tok)), t_tok)
    draft = wrap_model(tiny_llama(seed=1, vocab=len(d_tok)), d_tok, name="other")
    engine = SpeculativeDecoder(target, draft, k=3, k_policy="fixed")
    batch = engine.generate_batch(PROMPTS, 16, temperature=temperature, seed=3, max_batch=3)
    for prompt, got in zip(PROMPTS, batch, strict=True):
        alone = engine.generate(prompt, 16, temperature=temperature, seed=3)
        assert got.token_ids == alone.token_ids, prompt
    assert sum(r.stats.drafted for r in batch) > 0


def test_the_bench_plans_no_tree_for_a_draft_of_another_tokenizer(tokenizers, capsys):
    from specdecode.bench.methods import plan_settings

    t_tok, d_tok = tokenizers
    target = wrap_model(tiny_llama(seed=0, vocab=len(t_tok)), t_tok)
    drafts = {
        "other": wrap_model(tiny_llama(seed=1, vocab=len(d_tok)), d_tok, name="other"),
        "same": wrap_model(tiny_llama(seed=2, vocab=len(t_tok)), t_tok, name="same"),
    }
    planned = plan_settings(["spec"], drafts, [2], ["fixed"], ["static:2,1"], target=target)
    assert [(s.draft, s.tree) for s in planned if s.tree] == [("same", "static:2,1")]
    assert (
        "no --tree for other: a draft of another tokenizer drafts chains" in capsys.readouterr().err
    )


def test_trees_and_hybrids_need_the_targets_tokenizer(tokenizers):
    from specdecode.drafters import hybrid_drafter

    t_tok, d_tok = tokenizers
    target = wrap_model(tiny_llama(seed=0, vocab=len(t_tok)), t_tok)
    draft = wrap_model(tiny_llama(seed=1, vocab=len(d_tok)), d_tok, name="other")
    with pytest.raises(ValueError, match="tree='static:2,1' needs a draft of the target's tok"):
        SpeculativeDecoder(target, draft, tree="static:2,1")
    with pytest.raises(ValueError, match="other\\+suffix needs a draft of the target's tokenizer"):
        hybrid_drafter(draft, target)
    with pytest.raises(ValueError, match="confidence needs a draft of the target's tokenizer"):
        SpeculativeDecoder(target, draft, confidence=0.5)


def test_the_command_line_says_which_way_it_drafts(tokenizers, tmp_path, capsys):
    from specdecode.cli import main

    for name, tok, seed in (("target", tokenizers[0], 0), ("draft", tokenizers[1], 1)):
        tiny_llama(seed=seed, vocab=len(tok)).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    argv = ["generate", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft")]
    assert main([*argv, "--dtype", "float32", "--prompt", "def add", "--max-new-tokens", "8"]) == 0
    err = capsys.readouterr().err
    assert "a draft of another tokenizer (300 tokens, the target's 330): greedy drafts " in err
