"""A second, smaller model as drafter, with its own KV cache."""

from __future__ import annotations

from typing import Any

import torch

from specdecode.cache import KVCache
from specdecode.sampling import SamplingParams, logits_to_probs, sample
from specdecode.types import Draft, ForwardMeter


class ModelDrafter:
    """Drafts k tokens autoregressively with a small causal LM.

    Cache bookkeeping per step: `propose` feeds the committed tokens not yet cached (one token, or
    two when the previous draft was fully accepted — the catch-up, which never recomputes the
    prefix) and then k-1 drafted tokens, so it costs exactly k forwards and leaves the cache
    covering context + d_1..d_{k-1}. `observe(n)` rolls it back to context + d_1..d_min(n, k-1).
    """

    def __init__(self, model: Any, vocab_size: int | None = None, name: str = "draft") -> None:
        self.model = model
        self.name = name
        # tokens at or above vocab_size are never drafted (the target's and draft's common vocab)
        self.vocab_size = vocab_size
        self.cache: KVCache | None = None
        # ids the draft cannot embed (a larger target's padding rows, never real tokens, but a
        # random or sampled target may emit them) are fed as id 0; verification keeps output exact
        self.embed_size = model.get_input_embeddings().num_embeddings
        self._context_len = 0
        self._k = 0

    def begin(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        generator: torch.Generator | None,
        meter: ForwardMeter,
    ) -> None:
        self.params, self.generator, self.meter = params, generator, meter
        self.cache = KVCache(self.model)
        self.device = next(self.model.parameters()).device
        if len(prompt_ids) > 1:
            with meter.forward("draft_prefill", len(prompt_ids) - 1):
                self.cache.forward(self._ids(prompt_ids[:-1]), last_only=True)

    def _ids(self, ids: list[int]) -> torch.Tensor:
        tensor = torch.tensor(ids, device=self.device)
        return tensor.masked_fill(tensor >= self.embed_size, 0)

    @torch.inference_mode()
    def propose(self, context: list[int], k: int) -> Draft:
        assert self.cache is not None, "begin() first"
        inputs = self._ids(context[len(self.cache) :])  # [1 or 2]
        tokens, qs = [], []
        for _ in range(k):
            with self.meter.forward("draft", inputs.shape[0]):
                logits = self.cache.forward(inputs, last_only=True)[0]  # [V_draft]
            logits = logits[: self.vocab_size]  # [V_common]
            if self.params.greedy:
                token = logits.argmax()
            else:
                q = logits_to_probs(logits, self.params)  # [V_common]
                token = sample(q, self.generator)
                qs.append(q)
            tokens.append(token)
            inputs = token.view(1)
        self._context_len, self._k = len(context), k
        return Draft(torch.stack(tokens), torch.stack(qs) if qs else None)

    def observe(self, n_accepted: int) -> None:
        assert self.cache is not None
        self.cache.rollback(self._context_len + min(n_accepted, self._k - 1))
