"""A second, smaller model as drafter, with its own KV cache."""

from __future__ import annotations

from typing import Any

import torch

from specdecode.cache import KVCache
from specdecode.lean import LeanCache, draft_cache
from specdecode.sampling import SamplingParams, logits_to_probs, sample
from specdecode.types import Draft, ForwardMeter


class DraftModelState:
    """What every drafter built on a draft model shares: the model, its own cache over the
    committed tokens (prefilled over prompt_ids[:-1] by `begin`), and the id mapping."""

    def __init__(self, model: Any, vocab_size: int | None = None) -> None:
        self.model = model
        # tokens at or above vocab_size are never drafted (the target's and draft's common vocab)
        self.vocab_size = vocab_size
        self.cache: KVCache | LeanCache | None = None
        # ids the draft cannot embed (a larger target's padding rows, never real tokens, but a
        # random or sampled target may emit them) are fed as id 0; verification keeps output exact
        self.embed_size = model.get_input_embeddings().num_embeddings

    def begin(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        generator: torch.Generator | None,
        meter: ForwardMeter,
    ) -> None:
        self.params, self.generator, self.meter = params, generator, meter
        self.cache = draft_cache(self.model)  # the lean forward where it knows the model
        parameter = next(self.model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        if len(prompt_ids) > 1:
            with meter.forward("draft_prefill", len(prompt_ids) - 1):
                self.cache.forward(self._ids(prompt_ids[:-1]), last_only=True)

    def _ids(self, ids: list[int]) -> torch.Tensor:
        tensor = torch.tensor(ids, dtype=torch.long, device=self.device)
        return tensor.masked_fill(tensor >= self.embed_size, 0)


class ModelDrafter(DraftModelState):
    """Drafts k tokens autoregressively with a small causal LM.

    Cache bookkeeping per step: `propose` feeds the committed tokens not yet cached (one token, or
    two when the previous draft was fully accepted — the catch-up, which never recomputes the
    prefix) and then k-1 drafted tokens, so it costs exactly k forwards and leaves the cache
    covering context + d_1..d_{k-1}. `observe(n)` rolls it back to context + d_1..d_min(n, k-1).

    `confidence`: stop drafting before a token whose draft distribution's top probability is
    below it (always at least one token). The forward that found the low top probability was
    fed d_k', so the cache then covers context + d_1..d_k' and a fully accepted draft needs no
    catch-up. The stop depends only on the draft, never on the target: still lossless.
    """

    def __init__(
        self,
        model: Any,
        vocab_size: int | None = None,
        name: str = "draft",
        confidence: float | None = None,
    ) -> None:
        super().__init__(model, vocab_size)
        self.name = name
        self.confidence = check_confidence(confidence)
        self._context_len = 0
        self._cached_drafts = 0  # drafted tokens the cache holds after propose()

    @torch.inference_mode()
    def propose(self, context: list[int], k: int) -> Draft:
        assert self.cache is not None, "begin() first"
        inputs = self._ids(context[len(self.cache) :])  # [1 or 2]
        tokens, qs = [], []
        self._context_len, self._cached_drafts = len(context), k - 1
        for i in range(k):
            with self.meter.forward("draft", inputs.shape[0]):
                logits = self.cache.forward(inputs, last_only=True)[0]  # [V_draft]
            logits = logits[: self.vocab_size]  # [V_common]
            # greedy drafts judge their confidence on the plain softmax
            q = logits_to_probs(logits, self.params) if not self.params.greedy else None
            if self.confidence is not None and i > 0:
                top = (q if q is not None else logits.softmax(-1)).max()
                if top < self.confidence:  # unsure: stop before this token
                    self._cached_drafts = i
                    break
            if q is None:
                token = logits.argmax()
            else:
                token = sample(q, self.generator)  # q: [V_common]
                qs.append(q)
            tokens.append(token)
            inputs = token.view(1)
        return Draft(torch.stack(tokens), torch.stack(qs) if qs else None)

    def observe(self, n_accepted: int) -> None:
        assert self.cache is not None
        self.cache.rollback(self._context_len + min(n_accepted, self._cached_drafts))


def check_confidence(confidence: float | None) -> float | None:
    """None, or a probability threshold strictly between 0 and 1 (ValueError otherwise)."""
    if confidence is None:
        return None
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)):
        raise ValueError(f"confidence must be a number in (0, 1) (got {confidence!r})")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1) (got {confidence})")
    return float(confidence)
