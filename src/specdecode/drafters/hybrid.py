"""Hybrid drafting (`MODEL+suffix`): each step, for each row, the suffix tree or the model's
chain, whichever promises more tokens per unit of time, or neither.

The choice is measured, not guessed: the suffix tree's promise is its nodes' calibrated
acceptance (drafters/suffix.py) over the verification cost v(n) of its nodes; the model's is the
expected accepted tokens of a chain of k (its acceptance per position, learnt from the steps it
drafted) over k·c + v(k + 1), with c the model's own forward time (timed here) over the target's
single-row forward and v measured by the batch's cost policy (`policies.verify_cost`; priors
until measured). A step where neither beats one plain target forward drafts nothing.

In a batch the rows that choose the model draft their chains together, one forward of the
draft model per depth for all of them (`propose_trees`), and each row prices its draft as its
share of that forward and its verified rows against the batch's larger forward
(`policies.batch_rate`: as if every row drafted alike, as the cost policy prices a batch's k).

Where a batch begins the row's drafter at its first drafting step (a server's rows:
`defer_prefill`), the model begins (prefills its cache) at the first step where drafting with it
pays for that prefill, as the batch prices a model-draft row's (`KPolicy.pays_to_begin`); until
then the row drafts suffix trees or nothing, so a short answer behind a long prompt, or a row of
a large batch over an arithmetic-bound target, does not pay a draft prefill it would not use.

The model's draft cache sits still while the suffix drafts: its next chain first feeds the tokens
committed since, in one forward (`ModelDrafter.propose`'s catch-up), so sitting out costs
nothing but that catch-up. The model's chain goes to the target as a one-branch tree carrying
the draft's probabilities, which tree verification treats exactly as chain verification does:
greedy output is the target's, sampling stays lossless.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from specdecode.core.policies import TRUSTED_SAMPLES, CostK, batch_rate
from specdecode.core.sampling import SamplingParams
from specdecode.core.tree import TokenTree, TreeDrafter
from specdecode.core.types import ForwardMeter
from specdecode.drafters.model import ModelDrafter
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.models.lean import PrefixPool

PRIOR_ACCEPTANCE = 0.6  # a model chain's acceptance per position before any is measured
PRIOR_WEIGHT = 2.0  # in steps: how soon measured acceptance outweighs the prior
MEMORY = 32  # steps after which old acceptance fades
# a row drafts one model token after this many steps without the model, so that an acceptance
# learnt low (a passage the model could not guess) is measured again; rare enough that a model
# that never pays costs little (one draft forward and its catch-up per EXPLORE_EVERY steps)
EXPLORE_EVERY = 64
# ... and after this many while its acceptance on the row rests on fewer than TRUSTED_SAMPLES
# chains: one rejected first chain must not rule the model out of a whole (short) answer
EXPLORE_UNSURE = 8
# every this many model chains of a row, one a token longer than the best k: a position seldom
# drafted keeps the estimate of its few samples (one rejection can hold a row at k = 1), as the
# cost policy explores a neighbouring k (`policies.CostK`)
EXPLORE_DEEPER = 8
_METER_FIELDS = ("seconds", "calls", "tokens")  # what a chain's draft forwards add to the meter


class _Acceptance:
    """a_j per chain position (P(accepted | the ones before were)), a running mean that
    fades after MEMORY samples, shrunk towards a prior: the first position's is given (default
    PRIOR_ACCEPTANCE), each deeper one's is the estimate of the position before, as the cost
    policy's (`policies.CostK`): a position seldom drafted inherits the one above it instead of
    a prior that, never tested, would keep it from being drafted (a row whose chains of 3 are
    always kept must come to try a 4th). The drafter keeps one over every row it drafted (the
    pair's) and one per row (the prompt's), whose first position's prior is the pair's."""

    def __init__(self, positions: int) -> None:
        self.n = [0] * positions
        self.mean = [0.0] * positions

    def grow(self, positions: int) -> None:
        extra = positions - len(self.n)
        if extra > 0:
            self.n += [0] * extra
            self.mean += [0.0] * extra

    def add(self, drafted: int, accepted: int) -> None:
        for j in range(min(accepted + 1, drafted, len(self.n))):
            self.n[j] = min(self.n[j] + 1, MEMORY)
            self.mean[j] += ((1.0 if j < accepted else 0.0) - self.mean[j]) / self.n[j]

    def estimate(self, first: float = PRIOR_ACCEPTANCE) -> list[float]:
        out, prior = [], first
        for n, mean in zip(self.n, self.mean, strict=True):
            prior = (n * mean + PRIOR_WEIGHT * prior) / (n + PRIOR_WEIGHT)
            out.append(prior)
        return out


class HybridDrafter(TreeDrafter):
    """`model` (a chain drafter) and `suffix` drafting in turns, chosen per step and row (the
    module docstring). `k_max`: the longest chain the model drafts (the batch's policy's
    k_max once shared). Forks share the learnt acceptance and timings; each row has its own
    draft cache and suffix index."""

    cost_ratio = None  # the model's: `prior_cost_ratio` reads `self.model`

    def __init__(
        self,
        model: ModelDrafter,
        suffix: SuffixDrafter,
        k_max: int = 4,
        prior_cost: float = 0.25,
    ) -> None:
        self.drafter, self.suffix = model, suffix
        self.model = model.model  # what context limits and cost priors read
        self.name = f"{model.name}+{suffix.name}"
        self.k_max = k_max
        self.prior_cost = prior_cost  # c before the forwards are timed (policies.prior_cost_ratio)
        self.costs: Any = None
        self.acceptance = _Acceptance(k_max)  # every row's: the pair's, shared by the forks
        self.row_acceptance = _Acceptance(k_max)  # this row's (`begin` starts it anew)
        self.row_prior: float | None = None  # the pair's first-position estimate as the row began
        # the model's seconds per drafted depth, recent ones (shared by the rows)
        self.draft_seconds: deque[float] = deque(maxlen=MEMORY)
        self.chosen = {"suffix": 0, "model": 0, "none": 0}  # steps each way, every row
        self._used: tuple[str, int] | None = None
        self._deferred = False  # `defer_prefill` was called: the next `begin` defers the model
        self._model_ready = False  # the model's cache begun (`_begin_model`) for this row

    def __copy__(self) -> HybridDrafter:
        # a row's own model cache and suffix index; the learnt estimates stay shared
        new = object.__new__(HybridDrafter)
        new.__dict__.update(self.__dict__)
        new.drafter = copy.copy(self.drafter)
        new.suffix = copy.copy(self.suffix)
        return new

    def share_costs(self, policy: object) -> None:
        self.costs = policy
        self.suffix.share_costs(policy)
        self.k_max = max(1, int(getattr(policy, "k_max", self.k_max)))  # every KPolicy's
        self.acceptance.grow(self.k_max)
        self.row_acceptance.grow(self.k_max)

    def begin(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        generator: object,
        meter: ForwardMeter,
    ) -> None:
        self.meter = meter
        self.suffix.begin(prompt_ids, params, generator, meter)
        # begun with its row's prefill, the model begins now; begun at the row's first
        # drafting step (`defer_prefill`), at the first step where drafting with it pays for
        # its prefill (`_model_begun`), or now where the cache it was handed is level
        self._start = (params, generator)
        self._model_ready = False
        deferred, self._deferred = self._deferred, False
        if not deferred or self.drafter.prefill_positions(prompt_ids) == 0:
            self._begin_model(prompt_ids)
        self._used = None
        self._since_model = 0
        self._model_chains = 0  # this row's
        self.row_acceptance = _Acceptance(self.k_max)
        # the row's prior: the pair's estimate as the row begins (the pair's goes on learning
        # from this row too, and a prior that holds the row's own evidence counts it twice)
        self.row_prior = self.acceptance.estimate()[0]

    def defer_prefill(self) -> None:
        self._deferred = True  # for the next `begin` only

    def end(self) -> None:
        self.suffix.end()
        held, pool = self.drafter.prefilled, self.drafter.prefixes
        if not self._model_ready and held is not None and pool is not None:
            pool.put(held)  # a cache handed on and never begun: its prefix may serve the next
            self.drafter.prefilled = None
        self.drafter.end()

    def _begin_model(self, context: list[int]) -> None:
        params, generator = self._start
        self.drafter.begin(context, params, generator, self.meter)  # type: ignore[arg-type]
        self._model_ready = True

    def _model_begun(self, context: list[int], remaining: int, rows: int) -> bool:
        """Whether the model drafts for this row: begun already, or its prefill (over what its
        cache lacks of `context`) pays for itself over the `remaining` tokens at this batch
        size (the batch's policy's `pays_to_begin`, as a model-draft row's prefill is priced:
        `Batch._pays`), and is begun now. Until then the row drafts suffix trees or nothing: a
        short answer behind a long prompt, or a row of a large batch over an arithmetic-bound
        target, never pays the model's prefill."""
        if self._model_ready:
            return True
        lacking = self.drafter.prefill_positions(context)
        prefill_s = self.meter.seconds_for("draft_prefill", lacking)
        pays = getattr(self.costs, "pays_to_begin", None)
        if pays is not None and not pays(None, rows, remaining, prefill_s):
            return False
        self._begin_model(context)
        return True

    # the model's cache as a draft model's (drafters/model.py), so that a batch session hands
    # it a kept prefix and prefills it in the target's parts (runtime/session.py)
    @property
    def prefixes(self) -> PrefixPool | None:
        return self.drafter.prefixes

    @prefixes.setter
    def prefixes(self, pool: PrefixPool | None) -> None:
        self.drafter.prefixes = pool

    @property
    def prefilled(self) -> Any:
        return self.drafter.prefilled

    @prefilled.setter
    def prefilled(self, cache: Any) -> None:
        self.drafter.prefilled = cache

    @property
    def embed_size(self) -> int:
        return self.drafter.embed_size

    def prefill_positions(self, prompt_ids: list[int]) -> int:
        return self.drafter.prefill_positions(prompt_ids)

    def _draft_cost(self) -> float:
        """c: the model's forward over the target's, measured where both are, from the median of
        at least `TRUSTED_SAMPLES` chains' times per depth (as the cost policy trusts its own):
        one slow forward (a process's first pays one-time set-up) would otherwise price the
        model out of every step after it, and the model, no longer chosen, never be timed
        again. The prior until then."""
        recent = sorted(self.draft_seconds)
        if isinstance(self.costs, CostK) and len(recent) >= TRUSTED_SAMPLES:
            return self.costs.draft_cost(recent[len(recent) // 2])
        return self.prior_cost

    def row_estimate(self) -> list[float]:
        """The model's acceptance per chain position on this row: the row's own evidence
        (acceptance depends on the prompt), the pair's before it."""
        first = self.acceptance.estimate()[0] if self.row_prior is None else self.row_prior
        return self.row_acceptance.estimate(first)

    def model_rate(self, limit: int, rows: int = 1) -> tuple[int, float]:
        """(k, rate): the model chain's best length up to `limit` and its expected tokens per
        single-row target time, on a row alone or in a batch of `rows` rows drafting alike
        (`policies.batch_rate`; c is a row's share of the draft's forward, `_draft_cost`)."""
        c = self._draft_cost()
        best, best_rate, emitted, reach = 0, 0.0, 1.0, 1.0
        for k, a in enumerate(self.row_estimate()[:limit], start=1):
            reach *= a
            emitted += reach
            rate = batch_rate(self.costs, rows, emitted, k + 1, k * c)
            if rate > best_rate:
                best, best_rate = k, rate
        return best, best_rate

    def propose_tree(self, context: list[int], max_depth: int) -> TokenTree:
        return self.propose_trees([self], [context], [max_depth])[0]

    @classmethod
    def propose_trees(
        cls,
        drafters: Sequence[HybridDrafter],  # type: ignore[override]
        contexts: Sequence[list[int]],
        max_depths: Sequence[int],
        rows: int = 1,
    ) -> list[TokenTree]:
        """Each row's choice (`_choose`) and tree; the rows that chose the model draft their
        chains together, one forward of the draft model per depth for all of them
        (`ModelDrafter.propose_many`), as a batch of model-draft rows does."""
        trees: list[TokenTree | None] = []
        chains: list[int] = []
        ks: list[int] = []
        for i, (hybrid, context, depth) in enumerate(
            zip(drafters, contexts, max_depths, strict=True)
        ):
            choice = hybrid._choose(context, depth, rows)
            trees.append(choice if isinstance(choice, TokenTree) else None)
            if not isinstance(choice, TokenTree):
                chains.append(i)
                ks.append(choice)
        if chains:
            made = cls._model_trees(
                [drafters[i] for i in chains], [contexts[i] for i in chains], ks
            )
            for i, tree in zip(chains, made, strict=True):
                trees[i] = tree
        return trees  # type: ignore[return-value]

    def _choose(self, context: list[int], max_depth: int, rows: int) -> TokenTree | int:
        """This step's draft for the row: the suffix's tree (or an empty one: no draft), or
        the length of the model's chain to draft."""
        proposal = self.suffix.suggest(context, max_depth)
        n, suffix_rate = proposal.best_size(self.costs, rows)
        k, model_rate = 0, 0.0
        plain = batch_rate(self.costs, rows, 1.0, 1)
        if self._model_begun(context, max_depth + 1, rows):  # as `Batch._pays` counts
            k, model_rate = self.model_rate(min(self.k_max, max_depth), rows)
            self._since_model += 1
            unsure = self.row_acceptance.n[0] < TRUSTED_SAMPLES
            if self._since_model >= (EXPLORE_UNSURE if unsure else EXPLORE_EVERY):  # again
                k, model_rate = max(k, 1), float("inf")
        if n and suffix_rate >= model_rate and suffix_rate > plain:
            self._count("suffix")
            return self.suffix.take(proposal, n)
        if k and model_rate > plain:
            self._count("model")
            self._model_chains += 1
            if self._model_chains % EXPLORE_DEEPER == 0:
                k = min(k + 1, self.k_max, max_depth)
            return k
        self._count("none")
        return self.suffix.take(proposal, 0)

    def _count(self, way: str) -> None:
        self.chosen[way] += 1
        self._used = (way, 0)

    def _model_tree(self, context: list[int], k: int) -> TokenTree:
        return self._model_trees([self], [context], [k])[0]

    @staticmethod
    def _model_trees(
        hybrids: Sequence[HybridDrafter], contexts: Sequence[list[int]], ks: Sequence[int]
    ) -> list[TokenTree]:
        """The rows' model chains, drafted together, each as a one-branch tree; the forwards
        timed per depth, a row's share of them (the rows share one meter: the batch's)."""
        meter = hybrids[0].meter
        seconds, calls, tokens = (getattr(meter, f).get("draft", 0) for f in _METER_FIELDS)
        models = [hybrid.drafter for hybrid in hybrids]
        drafts = type(models[0]).propose_many(models, contexts, ks)
        calls = meter.calls.get("draft", 0) - calls
        tokens = meter.tokens.get("draft", 0) - tokens
        # a chain's time per depth, where each row's first forward fed at most the two tokens
        # of a step (the last one committed and the one before): after the suffix's steps that
        # forward catches up on every token committed since, which is not a depth's cost.
        # Untimed forwards: the prior stands.
        if meter.clock is not None and calls and tokens <= sum(ks) + len(ks):
            share = (meter.seconds.get("draft", 0) - seconds) / calls / len(hybrids)
            hybrids[0].draft_seconds.append(share)  # shared by the rows
        trees = []
        for hybrid, draft in zip(hybrids, drafts, strict=True):
            drafted = int(draft.tokens.shape[0])
            hybrid._used = ("model", drafted)
            # a chain: each node below the one before
            parents = torch.arange(-1, drafted - 1, dtype=torch.long)
            trees.append(TokenTree(draft.tokens, parents, q_draft=draft.q_draft))
        return trees

    def observe_path(self, path: list[int]) -> None:
        way, drafted = self._used or ("none", 0)
        if way == "model":
            self._since_model = 0
            self.acceptance.add(drafted, len(path))
            self.row_acceptance.add(drafted, len(path))
            self.drafter.observe(len(path))
        else:
            self.suffix.observe_path(path)
        self._used = None
