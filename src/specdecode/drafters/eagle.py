"""Drafting chains with an EAGLE-style head (models/eagle_head.py) over the target's features.

The head keeps its own cache, one position per target position: head position j read the target's
feature f_j and the token t_{j+1}. Between steps the target's cache covers the committed tokens
but the last (docs/architecture.md, Invariants 2) and, on a target that keeps features
(cache.keep_features), holds f_j for each of them. `propose` first feeds the head every position
the target's cache gained since (the prompt's at the first step; then the last step's accepted
tokens, whose features the verification computed: no extra target forward), rolling back the
positions it drafted on its own predicted features. Its last output predicts the feature after
the last committed token, and through the target's output layer the first drafted token; each
further token feeds the head its own prediction. The target verifies every token, as for any
drafter: the output stays the target's.
"""

from __future__ import annotations

from typing import Any

import torch

from specdecode.core.cache import Cache, keep_features
from specdecode.core.policies import compute_params
from specdecode.core.protocols import Drafter
from specdecode.core.sampling import SamplingParams, greedy_tokens, logits_to_probs, sample
from specdecode.core.types import Draft, ForwardMeter
from specdecode.models.eagle_head import EagleHead


class EagleDrafter(Drafter):
    """A Drafter over `head` for `target` (the model, whose caches must keep features: made so
    here). `follow(cache)` hands it a sequence's target cache before `begin`."""

    def __init__(
        self, head: EagleHead, target: Any, vocab_size: int | None = None, name: str = "eagle"
    ) -> None:
        keep_features(target)
        self.head = head
        self.name = name
        self.vocab_size = vocab_size  # tokens at or above it are never drafted
        self.embed = target.get_input_embeddings()
        self.target_cache: Cache | None = None
        self.cache: Any = None
        # (not the head's first parameter: a quantized layer's weight is freed, on meta)
        self.device, self.dtype = self.embed.weight.device, head.body.norm.weight.dtype
        # the cost policy's clock-free prior: the head's weights against the target's
        self.cost_ratio = sum(p.numel() for p in head.parameters()) / compute_params(target)

    def follow(self, cache: Cache) -> None:
        """The target's cache of the sequence about to begin: the features come from it."""
        self.target_cache = cache

    def begin(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        generator: torch.Generator | None,
        meter: ForwardMeter,
    ) -> None:
        # slow import (transformers, ~1 s): drafters are imported by the command line's parser
        from transformers import DynamicCache

        if self.target_cache is None:
            raise ValueError("an EAGLE head drafts from its target's cache: follow(cache) first")
        self.params, self.generator, self.meter = params, generator, meter
        self.cache = DynamicCache()
        self.fed = 0  # head positions fed with the target's own features
        self.last: torch.Tensor | None = None  # [1, D]: the head's output at position fed - 1
        with meter.forward("draft_prefill", len(prompt_ids) - 1):
            self._catch_up(prompt_ids)

    def end(self) -> None:
        self.cache, self.target_cache = None, None

    def _catch_up(self, context: list[int]) -> torch.Tensor:
        """Feed the head the positions the target's cache gained; its output at the last."""
        assert self.target_cache is not None
        features = self.target_cache.features()  # [L, D], L = len(context) - 1
        length = features.shape[0]
        if length != len(context) - 1:
            raise ValueError(
                f"the target's cache holds {length} features for {len(context)} committed "
                "tokens: an EAGLE head needs it to cover them all but the last"
            )
        held = self.cache.get_seq_length()
        if held > self.fed:  # drop what was drafted on predicted features
            self.cache.crop(self.fed - held)
        if length > self.fed:
            ids = torch.tensor(context[self.fed + 1 : length + 1], device=self.device)
            out = self.head(
                self.embed(ids).to(self.dtype),
                features[self.fed : length].to(self.device, self.dtype),
                torch.arange(self.fed, length, device=self.device),
                self.cache,
            )  # [n, D]
            self.fed, self.last = length, out[-1:]
        assert self.last is not None, "a sequence starts with at least two committed tokens"
        return self.last

    @torch.inference_mode()
    def propose(self, context: list[int], k: int) -> Draft:
        """k tokens after `context`: one head forward per token (the first also feeds what the
        target's cache gained), each timed as a draft forward."""
        if k < 1:
            raise ValueError(f"a draft needs k >= 1 (got {k})")
        tokens: list[torch.Tensor] = []
        qs: list[torch.Tensor] = []
        position = len(context) - 1  # the head position the first drafted token is fed at
        with self.meter.forward("draft", max(1, len(context) - 1 - self.fed)):
            predicted = self._catch_up(context)  # [1, D]
            tokens.append(self._choose(predicted, qs))
        for depth in range(1, k):
            with self.meter.forward("draft", 1):
                predicted = self.head(
                    self.embed(tokens[-1].view(1)).to(self.dtype),
                    predicted,
                    torch.tensor([position + depth - 1], device=self.device),
                    self.cache,
                )
                tokens.append(self._choose(predicted, qs))
        return Draft(torch.stack(tokens), torch.stack(qs) if qs else None)

    def _choose(self, predicted: torch.Tensor, qs: list[torch.Tensor]) -> torch.Tensor:
        """The next drafted token from a predicted feature [1, D]: the argmax, or a sample
        (its distribution appended to `qs`)."""
        logits = self.head.logits(predicted)[0, : self.vocab_size].float()  # [V]
        if self.params.greedy:
            return greedy_tokens(logits)
        q = logits_to_probs(logits, self.params)
        qs.append(q)
        return sample(q, self.generator)

    def observe(self, n_accepted: int) -> None:
        """Nothing to do now: the next `propose` drops the drafted positions and feeds the
        accepted ones with the target's own features."""
