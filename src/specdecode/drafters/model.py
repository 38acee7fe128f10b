"""A second, smaller model as drafter, with its own KV cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specdecode.core.cache import KVCache, forward_rows
from specdecode.core.protocols import Drafter
from specdecode.core.sampling import SamplingParams, greedy_tokens, logits_to_probs, sample
from specdecode.core.types import Draft, ForwardMeter
from specdecode.models.lean import LeanCache, PrefixPool, draft_cache


class DraftModelState:
    """What every drafter built on a draft model shares: the model, its own cache over the
    committed tokens (prefilled over prompt_ids[:-1] by `begin`), and the id mapping.

    `prefixes`: a PrefixPool to start from and give the cache back to (`end`); None (the
    default) makes a new cache per sequence."""

    def __init__(self, model: Any, vocab_size: int | None = None) -> None:
        self.model = model
        # tokens at or above vocab_size are never drafted (the target's and draft's common vocab)
        self.vocab_size = vocab_size
        self.cache: KVCache | LeanCache | None = None
        self.prefixes: PrefixPool | None = None
        # a cache over a prefix of the next prompt already (a server's prefill in parts,
        # runtime/session.py): `begin` takes it and prefills only the rest
        self.prefilled: KVCache | LeanCache | None = None
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
        kept, self.prefilled = self.prefilled, None
        if kept is None and self.prefixes is not None:
            kept = self.prefixes.take(prompt_ids[:-1])
        # the lean forward where it knows the model
        self.cache = kept if kept is not None else draft_cache(self.model)
        parameter = next(self.model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        start = len(self.cache)
        if len(prompt_ids) - 1 > start:
            with meter.forward("draft_prefill", len(prompt_ids) - 1 - start):
                self.cache.forward(self._ids(prompt_ids[start:-1]), last_only=True)

    def prefill_positions(self, prompt_ids: list[int]) -> int:
        """What `begin(prompt_ids, ...)` would prefill: the prompt past the cache it was handed
        (`prefilled`) or would take from `prefixes`."""
        if self.prefilled is not None:
            held = len(self.prefilled)
        else:
            held = self.prefixes.longest(prompt_ids[:-1]) if self.prefixes is not None else 0
        return max(0, len(prompt_ids) - 1 - held)

    def end(self) -> None:
        """The sequence is over: its cache goes to `prefixes`, if any, for the next ones."""
        if self.prefixes is not None and self.cache is not None:
            self.prefixes.put(self.cache)
        self.cache = None

    def _ids(self, ids: list[int]) -> torch.Tensor:
        tensor = torch.tensor(ids, dtype=torch.long, device=self.device)
        return tensor.masked_fill(tensor >= self.embed_size, 0)


class ModelDrafter(DraftModelState, Drafter):
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

    def propose(self, context: list[int], k: int) -> Draft:
        return type(self).propose_many([self], [context], [k])[0]

    @classmethod
    @torch.inference_mode()
    def propose_many(
        cls, drafters: Sequence[ModelDrafter], contexts: Sequence[list[int]], ks: Sequence[int]
    ) -> list[Draft]:
        """Each drafter's `propose(context, k)`, with the drafts of one depth in one forward of
        the draft model over all of them (cache.forward_rows): a batch's drafting costs about
        one row's. Row for row the same tokens as drafting alone (the lean forward's rows are
        batch invariant; on Hugging Face's forward, up to rounding)."""
        tokens: list[list[torch.Tensor]] = [[] for _ in drafters]
        qs: list[list[torch.Tensor]] = [[] for _ in drafters]
        inputs = []
        for drafter, context, k in zip(drafters, contexts, ks, strict=True):
            assert drafter.cache is not None, "begin() first"
            if k < 1:
                raise ValueError(f"a draft needs k >= 1 (got {k})")
            inputs.append(drafter._ids(context[len(drafter.cache) :]))  # [1 or 2]
            drafter._context_len, drafter._cached_drafts = len(context), k - 1
        active = list(range(len(drafters)))
        for depth in range(max(ks)):
            with drafters[active[0]].meter.forward("draft", sum(len(inputs[i]) for i in active)):
                logits = forward_rows(
                    [drafters[i].cache for i in active],
                    [inputs[i] for i in active],
                    last_only=True,
                )
            still = []
            for i, row_logits in zip(active, logits, strict=True):
                drafter = drafters[i]
                row_logits = row_logits[0, : drafter.vocab_size]  # [V_common]
                # greedy drafts judge their confidence on the plain softmax
                q = None if drafter.params.greedy else logits_to_probs(row_logits, drafter.params)
                if drafter.confidence is not None and depth > 0:
                    top = (q if q is not None else row_logits.softmax(-1)).max()
                    if top < drafter.confidence:  # unsure: stop before this token
                        drafter._cached_drafts = depth
                        continue
                if q is None:
                    token = greedy_tokens(row_logits)
                else:
                    token = sample(q, drafter.generator)  # q: [V_common]
                    qs[i].append(q)
                tokens[i].append(token)
                inputs[i] = token.view(1)
                if depth + 1 < ks[i]:
                    still.append(i)
            active = still
            if not active:
                break
        return [
            Draft(torch.stack(t), torch.stack(q) if q else None)
            for t, q in zip(tokens, qs, strict=True)
        ]

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
