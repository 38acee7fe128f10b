"""The early-exit drafter: the target's first n layers, sharing its weights, output unchanged."""

from __future__ import annotations

import pytest
import torch

from specdecode import SpeculativeDecoder
from specdecode.drafters import resolve_draft
from specdecode.drafters.early_exit import EarlyExitDrafter, early_exit_model
from specdecode.models.loading import wrap_model

from conftest import ARCHS


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_early_exit_is_lossless_and_shares_weights(arch):
    target = ARCHS[arch](seed=0, layers=4)
    n_params = sum(p.numel() for p in target.parameters())
    expected = SpeculativeDecoder(target).generate([1, 2, 3], 30).token_ids
    for depth in (1, 2, 3):
        drafter = EarlyExitDrafter(target, depth)
        for temperature in (0.0,):
            result = SpeculativeDecoder(target, drafter, k=3, k_policy="fixed").generate(
                [1, 2, 3], 30, temperature=temperature
            )
            assert result.token_ids == expected
        view_ptrs = {p.data_ptr() for p in drafter.model.parameters()}
        assert view_ptrs <= {p.data_ptr() for p in target.parameters()}  # nothing copied
        assert drafter.model.config.num_hidden_layers in (depth, None) or arch == "gpt2"
    # the target itself is untouched
    assert sum(p.numel() for p in target.parameters()) == n_params
    assert SpeculativeDecoder(target).generate([1, 2, 3], 30).token_ids == expected


def test_early_exit_logits_equal_a_truncated_forward():
    target = ARCHS["llama"](seed=0, layers=4)
    view = early_exit_model(target, 2)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        hidden = target.model(ids, output_hidden_states=True).hidden_states[2]  # after 2 layers
        expected = target.lm_head(target.model.norm(hidden))
        torch.testing.assert_close(view(ids).logits, expected)


def test_early_exit_refuses_bad_depths_and_specs():
    target = ARCHS["qwen2"](seed=0, layers=4)
    for depth in (0, 4, 9):
        with pytest.raises(ValueError, match="between 1 and 3"):
            EarlyExitDrafter(target, depth)
    with pytest.raises(ValueError, match="needs a depth"):
        resolve_draft("early-exit", wrap_model(target))
    assert isinstance(resolve_draft("early-exit:2", wrap_model(target)), EarlyExitDrafter)


def test_early_exit_refuses_unsupported_models():
    class NotAnLM(torch.nn.Module):
        base_model_prefix = "body"

        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(2, 2)

    with pytest.raises(ValueError, match="Llama/Qwen2/Mistral/GPT-2-style"):
        early_exit_model(NotAnLM(), 1)
