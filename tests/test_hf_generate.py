"""transformers' `generate(custom_generate=...)` running specdecode (specdecode/hf_generate.py):
greedy output equals the target's own greedy `generate`, token for token, on tiny float32 models.
"""

from __future__ import annotations

import pytest
import torch

from specdecode.hf_generate import CUSTOM_GENERATE, speculative

PROMPT = torch.tensor([[3, 14, 15, 9, 26, 5]])  # [1, 6]


# the config's default max_length is exercised on purpose (the last case): HF warns about it
@pytest.mark.filterwarnings("ignore:Using the model-agnostic default `max_length`:UserWarning")
def test_callable_equals_greedy_generate(llama_pair):
    target, draft = llama_pair
    for max_new in (1, 7, 40):
        expected = target.generate(PROMPT, max_new_tokens=max_new, do_sample=False)
        for k in (1, 3):
            out = target.generate(
                PROMPT,
                max_new_tokens=max_new,
                do_sample=False,
                custom_generate=speculative(draft, k),
            )
            assert torch.equal(out, expected), (max_new, k)
    alone = target.generate(PROMPT, max_new_tokens=12, custom_generate=speculative(None))
    assert torch.equal(alone, target.generate(PROMPT, max_new_tokens=12))
    # max_length (the config's default of 20 included) instead of max_new_tokens
    for kwargs in ({"max_length": 15}, {}):
        out = target.generate(PROMPT, custom_generate=speculative(draft), **kwargs)
        assert torch.equal(out, target.generate(PROMPT, **kwargs)), kwargs


def test_assistant_model_through_the_repo_folder(llama_pair):
    target, draft = llama_pair
    mask = torch.ones_like(PROMPT)
    expected = target.generate(PROMPT, attention_mask=mask, max_new_tokens=25, do_sample=False)
    out = target.generate(
        PROMPT,
        attention_mask=mask,
        max_new_tokens=25,
        do_sample=False,
        assistant_model=draft,
        custom_generate=CUSTOM_GENERATE,
        trust_remote_code=True,
        return_dict_in_generate=True,
        k=2,
    )
    assert type(out).__name__ == "GenerateDecoderOnlyOutput"
    assert torch.equal(out.sequences, expected)


def test_eos_ends_both_at_the_same_token(llama_pair):
    target, draft = llama_pair
    free = target.generate(PROMPT, max_new_tokens=30, do_sample=False)[0, PROMPT.shape[1] :]
    eos = int(free[10])  # a token greedy decoding reaches: both must stop right after it
    expected = target.generate(PROMPT, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    out = target.generate(
        PROMPT, max_new_tokens=30, eos_token_id=eos, custom_generate=speculative(draft, 3)
    )
    assert torch.equal(out, expected)
    assert out.shape[1] <= PROMPT.shape[1] + 11 and int(out[0, -1]) == eos


def test_sampling_follows_torch_seed_and_config(llama_pair):
    target, draft = llama_pair
    args = dict(max_new_tokens=20, do_sample=True, custom_generate=speculative(draft, 3))
    torch.manual_seed(0)
    first = target.generate(PROMPT, **args)
    torch.manual_seed(0)
    assert torch.equal(target.generate(PROMPT, **args), first)
    assert first.shape == (1, PROMPT.shape[1] + 20)
    assert torch.equal(first[:, : PROMPT.shape[1]], PROMPT)
    # top_k=1 leaves one token a step: sampling then equals greedy
    torch.manual_seed(1)
    one = target.generate(PROMPT, max_new_tokens=15, do_sample=True, top_k=1,
                          custom_generate=speculative(draft, 3))  # fmt: skip
    assert torch.equal(one, target.generate(PROMPT, max_new_tokens=15, do_sample=False))


class Collect:
    """A streamer: records what generate puts, and whether it ended."""

    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.flatten().tolist())

    def end(self) -> None:
        self.ended = True


def test_streamer_gets_each_steps_ids(llama_pair):
    target, draft = llama_pair
    streamer = Collect()
    out = target.generate(
        PROMPT, max_new_tokens=16, custom_generate=speculative(draft, 3, streamer=streamer)
    )
    assert streamer.ended and len(streamer.puts) > 2
    assert streamer.puts[0] == PROMPT[0].tolist()  # the prompt first, as transformers does
    assert [t for ids in streamer.puts[1:] for t in ids] == out[0, PROMPT.shape[1] :].tolist()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"input_ids": PROMPT.repeat(2, 1)}, "batch size 1"),
        ({"repetition_penalty": 1.3}, "RepetitionPenaltyLogitsProcessor"),
        ({"num_beams": 2}, "num_beams"),
        ({"return_dict_in_generate": True, "output_scores": True}, "output_scores"),
        ({"attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1]])}, "padding"),
    ],
)
def test_what_it_cannot_reproduce_is_refused(llama_pair, kwargs, match):
    target, draft = llama_pair
    args = {"input_ids": PROMPT, "max_new_tokens": 5, **kwargs}
    with pytest.raises(ValueError, match=match):
        target.generate(**args, custom_generate=speculative(draft))


def test_k_must_be_positive():
    with pytest.raises(ValueError, match="k must be"):
        speculative(None, k=0)
