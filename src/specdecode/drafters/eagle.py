"""Drafting chains and trees with an EAGLE-3 head (models/eagle_head.py) over the target's
features.

The head keeps its own cache, one position per target position: head position j read the target's
features at j (three of its hidden states, cache.FeatureTaps) and the token t_{j+1}. Between
steps the target's cache covers the committed tokens but the last (docs/architecture.md,
Invariants 2) and, on a target that keeps features (cache.keep_features), holds them for each
position. `propose` first feeds the head every position the target's cache gained since (the
prompt's at the first step; then the last step's accepted tokens, whose features the
verification computed: no extra target forward), rolling back the positions it drafted on its
own outputs. Its last output gives the first drafted token; each further token feeds the head
its own output in place of the target's features. The target verifies every token, as for any
drafter: the output stays the target's.
"""

from __future__ import annotations

from typing import Any

import torch

from specdecode.core.cache import Cache, keep_features
from specdecode.core.policies import compute_params
from specdecode.core.protocols import Drafter
from specdecode.core.sampling import SamplingParams, greedy_tokens, logits_to_probs, sample
from specdecode.core.tree import TreeDrafter
from specdecode.core.types import Draft, ForwardMeter
from specdecode.drafters.tree_model import TreeGrowth
from specdecode.drafters.tree_shape import TreeShape
from specdecode.models.eagle_head import Eagle3Head


class EagleDrafter(Drafter):
    """A Drafter over `head` for `target` (the model, whose caches must keep the features the
    head reads: made so here). `follow(cache)` hands it a sequence's target cache before
    `begin`."""

    def __init__(
        self, head: Eagle3Head, target: Any, vocab_size: int | None = None, name: str = "eagle"
    ) -> None:
        keep_features(target, head.aux_layers)
        self.head = head
        self.name = name
        own = head.embed_tokens
        self.embed = own if own is not None else target.get_input_embeddings()
        # the target's logits' width: drafted tokens are target ids below it
        self.vocab_size = vocab_size or head.shape.target_vocab
        self.target_ids = head.target_ids()  # [draft vocabulary] int64
        self.target_cache: Cache | None = None
        self.cache: Any = None
        self.device, self.dtype = self.embed.weight.device, head.dtype
        # the cost policy's clock-free prior: the head's weights (its lookup table aside)
        # against the target's
        weights = sum(p.numel() for n, p in head.named_parameters() if "embed_tokens" not in n)
        self.cost_ratio = weights / compute_params(target)

    def describe(self) -> str:
        """What the head is, for the command line."""
        shape = self.head.shape
        made_for = f", made for {shape.verifier}" if shape.verifier else ""
        return (
            f"an EAGLE-3 head over the target's hidden states {list(self.head.aux_layers)}, "
            f"drafting {shape.draft_vocab} of its {shape.target_vocab} tokens{made_for}"
        )

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
        self.last: torch.Tensor | None = None  # [1, H]: the head's output at position fed - 1
        with meter.forward("draft_prefill", len(prompt_ids) - 1):
            self._catch_up(prompt_ids)

    def end(self) -> None:
        self.cache, self.target_cache = None, None

    def _catch_up(self, context: list[int]) -> torch.Tensor:
        """Feed the head the positions the target's cache gained; its output at the last."""
        assert self.target_cache is not None
        features = self.target_cache.features()  # [L, 3T], L = len(context) - 1
        length = features.shape[0]
        if length != len(context) - 1:
            raise ValueError(
                f"the target's cache holds {length} features for {len(context)} committed "
                "tokens: an EAGLE head needs it to cover them all but the last"
            )
        held = self.cache.get_seq_length()
        if held > self.fed:  # drop what was drafted on the head's own outputs
            self.cache.crop(self.fed - held)
        if length > self.fed:
            ids = torch.tensor(context[self.fed + 1 : length + 1], device=self.device)
            out = self.head(
                self.embed(ids),
                features[self.fed : length].to(self.device),
                torch.arange(self.fed, length, device=self.device),
                self.cache,
                from_target=True,
            )  # [n, H]
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
            h = self._catch_up(context)  # [1, H]
            tokens.append(self._choose(h, qs))
        for depth in range(1, k):
            with self.meter.forward("draft", 1):
                h = self.head(
                    self.embed(tokens[-1].view(1)),
                    h,
                    torch.tensor([position + depth - 1], device=self.device),
                    self.cache,
                    from_target=False,
                )
                tokens.append(self._choose(h, qs))
        return Draft(torch.stack(tokens), torch.stack(qs) if qs else None)

    def _choose(self, h: torch.Tensor, qs: list[torch.Tensor]) -> torch.Tensor:
        """The next drafted token (a target id) from the head's output [1, H]: the argmax, or
        a sample (its distribution over the target's ids appended to `qs`)."""
        logits = self.head.draft_logits(h)[0]  # [draft vocabulary]
        if self.params.greedy:
            return self.target_ids[greedy_tokens(logits)]
        q = logits_to_probs(self._target_logits(logits[None])[0], self.params)
        qs.append(q)
        return sample(q, self.generator)

    def _target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[m, draft vocabulary] -> [m, V] over the target's ids, -inf where the head cannot
        draft."""
        full = logits.new_full((logits.shape[0], self.vocab_size), -torch.inf)
        full[:, self.target_ids] = logits
        return full

    def observe(self, n_accepted: int) -> None:
        """Nothing to do now: the next `propose` drops the drafted positions and feeds the
        accepted ones with the target's own features."""


class TreeEagleDrafter(TreeGrowth, EagleDrafter, TreeDrafter):
    """An EAGLE-3 head growing a token tree (drafters/tree_model.py's TreeGrowth), one head
    forward per depth: a node is fed at the head position after its parent's, reading its
    parent's output and its own token, and attends to the positions fed with the target's
    features and to its ancestors (a tree mask over the head's cache). The next `propose_tree`
    drops every node from the head's cache, as a chain's drafted positions are."""

    def __init__(
        self,
        head: Eagle3Head,
        target: Any,
        shape: TreeShape,
        vocab_size: int | None = None,
        name: str = "eagle",
    ) -> None:
        EagleDrafter.__init__(self, head, target, vocab_size, name)
        self._start_tree(shape, name)
        self._out: dict[int, torch.Tensor] = {}  # pool id (-1: the root) -> its output [1, H]

    def _root(self, context: list[int]) -> torch.Tensor:
        """Feed what the target's cache gained; the logits at the root [1, V]."""
        with self.meter.forward("draft", max(1, len(context) - 1 - self.fed)):
            self._out = {-1: self._catch_up(context)}
            return self._target_logits(self.head.draft_logits(self._out[-1]))

    def _feed(self, nodes: list[int]) -> torch.Tensor:
        """One head forward over `nodes` with a tree mask; their logits [m, V]."""
        pool = self._pool
        allowed, depth = self._node_mask(nodes, self.cache.get_seq_length(), self.fed)
        tokens = torch.tensor([pool.tokens[n] for n in nodes], device=self.device)
        with self.meter.forward("draft", len(nodes)):
            h = self.head(
                self.embed(tokens),
                torch.cat([self._out[pool.parents[n]] for n in nodes]),  # [m, H]
                self.fed - 1 + depth,  # a depth-1 node sits right after the fed positions
                self.cache,
                from_target=False,
                allowed=allowed,
            )
            for r, node in enumerate(nodes):
                self._out[node] = h[r : r + 1]
            return self._target_logits(self.head.draft_logits(h))

    def observe_path(self, path: list[int]) -> None:
        """Nothing to do now: the next `propose_tree` drops the nodes and feeds the accepted
        tokens with the target's own features."""
