"""Many sequences decoding together: the core's unit of work.

A `Batch` holds rows, one per sequence (`Row`: its committed tokens and target cache, its own
drafter, sampling parameters, generator, EOS ids, `max_new_tokens` and counters). One `step()`
advances every running row: each drafts (the model drafters of all rows in one forward per
depth where they can, `propose_chains`), then one target forward verifies every row's last
committed token and drafts together (`step.verify_rows` over `cache.forward_rows`), then each row
accepts, commits and rolls back on its own (ragged acceptance). Rows join (`add`) and leave
(`remove`, or by finishing) between steps: continuous batching. The one-sequence loop
(decode.py) is a batch of one.

How many tokens the rows draft is one decision per step for the whole batch, made by the
batch's `KPolicy` from measured costs at this batch size (policies.CostK: k = 0, plain batched
decoding, when speculation no longer pays). Pure data in, data out: no printing, no clock
(docs/architecture.md, Invariants 4); forward times only through the caller's `ForwardMeter`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdecode.core.cache import Cache, KVCache, NewCache
from specdecode.core.policies import (
    FixedK,
    KPolicy,
    forward_seconds,
    seconds_since,
    size_trees,
)
from specdecode.core.protocols import Drafter, implements
from specdecode.core.sampling import SamplingParams
from specdecode.core.step import (
    DecodeState,
    Verification,
    chain_verification,
    prefill,
    verify_rows,
)
from specdecode.core.tree import SizedTreeDrafter, TokenTree, TreeDrafter
from specdecode.core.tree_decode import tree_verification
from specdecode.core.types import Draft, ForwardMeter, Stats, StepResult


@dataclass(eq=False)
class Row:
    """One sequence of a batch. `committed` holds what the last step (or, after `add`, the
    prefill) added, after stops, for the caller to read; `done` is set once it hit
    `max_new_tokens` or an EOS. `drafting`: its drafter has begun (prefilled its draft).
    `error`: why its drafter could not begin, when a step began it and that failed (the row is
    then done, the others go on)."""

    state: DecodeState
    drafter: Drafter | TreeDrafter | None
    params: SamplingParams
    generator: torch.Generator | None
    max_new_tokens: int
    eos_token_ids: Collection[int]
    stats: Stats
    produced: int = 0
    done: bool = False
    committed: list[int] = field(default_factory=list)
    drafting: bool = False
    # its draft is still being prefilled by the caller (a server's, in parts after the first
    # token: runtime/session.py): until cleared the row drafts nothing, as a row not begun
    waits_for_draft: bool = False
    error: BaseException | None = None
    # called with the target's logits before each token the row commits ([n, V], raw), the
    # prefill's first token included (`Batch.add`)
    on_logits: Callable[[torch.Tensor], None] | None = None

    @property
    def allowed(self) -> int:
        """The most tokens the next step may draft: it emits up to that many + 1."""
        return self.max_new_tokens - self.produced - 1


def fork_drafter(drafter: Drafter | TreeDrafter | None) -> Drafter | TreeDrafter | None:
    """A drafter for one more row: the same model and settings, its own per-sequence state
    (`begin` gives it a fresh cache)."""
    return copy.copy(drafter) if drafter is not None else None


def propose_chains(
    drafters: Sequence[Drafter], contexts: Sequence[list[int]], k: int
) -> list[Draft]:
    """Each drafter's chain of up to k tokens after its context: several drafters of one class
    through its `propose_many` (model drafters: one forward per depth for all of them), else one
    by one (one row's drafter proposes alone, as before batching)."""
    kind = type(drafters[0])
    if len(drafters) > 1 and all(type(d) is kind for d in drafters):
        return kind.propose_many(drafters, contexts, [k] * len(drafters))
    return [d.propose(ctx, k) for d, ctx in zip(drafters, contexts, strict=True)]


def is_chain(tree: TokenTree) -> bool:
    """A deterministic tree of one branch (each node below the one before), which verifies as
    the chain it is: the same acceptance rule (one candidate per position; with i.i.d. draws,
    `tree.draws`, a repeat is a second candidate, so such a tree stays a tree)."""
    n = len(tree)
    expected = torch.arange(-1, n - 1, device=tree.parents.device)
    return tree.draws is None and bool((tree.parents == expected).all())


class _PathOf:
    """A tree drafter's chain-shaped tree verified as a chain: the tokens accepted, told to it
    as the path they are (nodes 0..n-1), as a chain drafter is told their count."""

    def __init__(self, drafter: TreeDrafter) -> None:
        self.drafter = drafter

    def observe(self, n_accepted: int) -> None:
        self.drafter.observe_path(list(range(n_accepted)))


class Batch:
    """Rows decoding together over one target (see the module docstring).

    `policy` chooses each step's k for the whole batch (default FixedK(4)); `meter` counts and
    times the batch's forwards (each row's `Stats.meter` also gets its share of the target's).
    `new_cache(target)` makes a joining row's cache (a store's `open_row` for a static store).
    """

    def __init__(
        self,
        target: Any,
        *,
        policy: KPolicy | None = None,
        meter: ForwardMeter | None = None,
        new_cache: NewCache = KVCache,
    ) -> None:
        self.target = target
        self.policy = policy if policy is not None else FixedK(4)
        self.meter = meter if meter is not None else ForwardMeter()
        self.new_cache = new_cache
        self.rows: list[Row] = []
        self.last_k = 0  # the k the last step asked every row to draft (0: no drafting)
        self._policy_started = False

    def __len__(self) -> int:
        return len(self.rows)

    def add(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        drafter: Drafter | TreeDrafter | None = None,
        params: SamplingParams | None = None,
        generator: torch.Generator | None = None,
        eos_token_ids: Collection[int] = (),
        stats: Stats | None = None,
        prefilled: Cache | None = None,
        begin_draft: bool = True,
        on_logits: Callable[[torch.Tensor], None] | None = None,
    ) -> Row:
        """Prefill a new row and add it: its first token is in `row.committed` already (from
        the prefill's logits, step.prefill); it takes part from the next step.

        `drafter` is the row's own (`fork_drafter` of a shared one); every row of a batch drafts
        with the same kind of drafter, or none. `begin_draft=False` leaves the drafter's prefill
        to the first step that drafts (`step`): a server sends the first token first, and a row
        that never drafts (k = 0 at its batch size) never pays for it.
        `prefilled`: the row's target cache, holding a prefix of the prompt already
        (step.prefill); else `new_cache` makes one. Should the prefill fail, the cache is
        closed (a store row goes back to its store).
        `on_logits(logits)`: called at each commit with the target's logits [n, V] (raw) before
        each of the n tokens committed (after EOS and `max_new_tokens` cut them; stop strings are
        the caller's): what the target thought of every token of the output, from the forwards
        that made it (distillation's data, without a second forward).
        """
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0 (got {max_new_tokens!r})")
        params = params or SamplingParams()
        stats = stats if stats is not None else Stats()
        stats.k_max = self.policy.k_max if drafter is not None else 0
        stats.k_policy = self.policy.name if drafter is not None else ""
        stats.prompt_tokens = len(prompt_ids)
        cache = prefilled if prefilled is not None else self.new_cache(self.target)
        try:
            state, first = prefill(self.target, prompt_ids, params, generator, stats, cache)
            row = Row(
                state,
                drafter,
                params,
                generator,
                max_new_tokens,
                eos_token_ids,
                stats,
                on_logits=on_logits,
            )
            if max_new_tokens == 0:
                stats.stop_reason, row.done = "length", True
            else:
                self._commit(row, first, None)
            if begin_draft and not row.done:
                self.begin_draft(row)
        except BaseException:  # a store row is given back, not lost with the failed row
            cache.close()
            raise
        self.rows.append(row)
        return row

    def begin_draft(self, row: Row, deferred: bool = False) -> None:
        """The row's drafter begins its sequence (a model draft prefills its cache over the
        committed tokens); once per row, before it first drafts. `deferred`: at the row's first
        drafting step rather than with its prefill, which the drafter is told first
        (`defer_prefill`). Should it fail, the row keeps no drafter (a half-filled draft cache
        is never handed on) and the error is raised."""
        if row.drafter is None or row.drafting:
            return
        try:
            if deferred:
                row.drafter.defer_prefill()
            row.drafter.follow(row.state.target_cache)
            row.drafter.share_costs(self.policy)
            with torch.inference_mode():  # the draft's prefill: no autograd graph
                row.drafter.begin(row.state.tokens, row.params, row.generator, self.meter)
        except BaseException:
            row.drafter = None
            raise
        row.drafting = True
        if not self._policy_started:
            self.policy.begin()
            self._policy_started = True

    def remove(self, row: Row) -> None:
        """Take a row out (finished, cancelled or failed); its store row, if any, is freed,
        and its drafter, if it began, ends its sequence (`end`, where it has one)."""
        self.rows.remove(row)
        row.state.target_cache.close()
        if row.drafting:
            row.drafter.end()  # type: ignore[union-attr]

    def running(self) -> list[Row]:
        return [row for row in self.rows if not row.done]

    @torch.inference_mode()
    def step(self) -> list[Row]:
        """One step of every running row; returns them, each with its `committed` tokens (a
        row whose drafter failed to begin is done, with its `error`, and took no part)."""
        stepped = self.running()
        if not stepped:
            return []
        spent = forward_seconds(self.meter), self.meter.tokens.get("draft", 0)
        k = self.last_k = self._next_k(stepped)
        # False for a cost policy's exploration: only rows already drafting draft in it
        rows = self._begin_drafts(stepped, k, self.policy.begins_drafts())
        if not rows:
            return stepped
        verifications = self._verifications(rows, k)
        results = verify_rows([r.state.target_cache for r in rows], verifications, self.meter)
        self._observe(rows, results, spent)
        for row, result in zip(rows, results, strict=True):
            # what the step asked of the row: a chain's k, a tree's own depth (trees take no k)
            chain_k = k if row.drafting else 0  # a row an exploration did not begin: none
            asked = result.depth if implements(row.drafter, TreeDrafter) else chain_k
            self._commit(row, result, min(asked, max(row.allowed, 0)) if row.drafter else 0)
        return stepped

    def _begin_drafts(self, rows: list[Row], k: int, begin: bool = True) -> list[Row]:
        """Begin the drafters of rows about to draft for the first time (a chain's when k > 0
        and `begin`, a tree's always; neither while the row `waits_for_draft`); returns the rows
        that go on (a row not begun drafts nothing this step). A row whose drafter fails to
        begin is done, with its `error`: a fault of one row, not the batch's. (The policy's
        draft time counts draft forwards only: a prefill is paid once per row, not per step.)"""
        going = []
        for row in rows:
            if row.waits_for_draft:
                going.append(row)
                continue
            tree = implements(row.drafter, TreeDrafter)
            drafts = tree or (k > 0 and begin and (row.drafting or self._pays(row, k, len(rows))))
            try:
                if drafts and row.allowed > 0:
                    self.begin_draft(row, deferred=True)
            except Exception as err:
                row.error, row.committed, row.done = err, [], True
                row.stats.stop_reason = "error"
                continue
            going.append(row)
        return going

    def _pays(self, row: Row, k: int, rows: int) -> bool:
        """Whether `row`'s draft prefill (of what its draft lacks: `prefill_positions`) pays for
        itself (`KPolicy.pays_to_begin`)."""
        drafter = row.drafter
        lacking = drafter.prefill_positions(row.state.tokens) if drafter is not None else 0
        prefill_s = self.meter.seconds_for("draft_prefill", lacking)
        return self.policy.pays_to_begin(k, rows, row.allowed + 1, prefill_s)

    def draft_pays(self, prompt_tokens: int, new_tokens: int, joined: bool = False) -> bool:
        """Whether a row about to join (`joined`: that joined already) is worth its draft's
        prefill at the best k for the batch it joins: its draft lacking `prompt_tokens`
        positions of the prompt, up to `new_tokens` to generate."""
        prefill_s = self.meter.seconds_for("draft_prefill", prompt_tokens)
        rows = len(self.running()) + (0 if joined else 1)
        return self.policy.pays_to_begin(None, rows, new_tokens, prefill_s)

    # -- one step, in parts -----------------------------------------------------------------

    def _next_k(self, rows: list[Row]) -> int:
        drafting = [r for r in rows if r.drafter is not None and r.allowed > 0]
        if not drafting:
            return 0
        allowed = max(r.allowed for r in drafting)
        k = self.policy.next_batch_k(allowed, len(rows)) if len(rows) > 1 else None
        k = self.policy.next_k(allowed) if k is None else k
        return max(0, min(k, allowed))

    def _verifications(self, rows: list[Row], k: int) -> list[Verification]:
        """Draft for every row (k tokens at most, never past a row's `max_new_tokens`; trees
        their own shape) and turn each draft into its row's share of the target forward."""
        drafts: dict[int, Any] = {}
        chains = [
            i
            for i, r in enumerate(rows)
            if implements(r.drafter, Drafter) and r.drafting and min(k, r.allowed) > 0
        ]
        # rows with less room draft alone, so that no row drafts past its end
        for depth in sorted({min(k, rows[i].allowed) for i in chains}):
            group = [i for i in chains if min(k, rows[i].allowed) == depth]
            proposed = propose_chains(
                [rows[i].drafter for i in group], [rows[i].state.tokens for i in group], depth
            )
            drafts.update(zip(group, proposed, strict=True))
        trees = self._trees(rows, drafts)
        out = []
        for i, r in enumerate(rows):
            tree = trees.get(i)
            if tree is not None:
                if not len(tree):  # nothing worth drafting: a plain step, without a tree mask
                    r.drafter.observe_path([])
                    tree = None
                elif is_chain(tree):  # one branch: a chain's causal forward, no tree mask
                    draft = Draft(tree.tokens, tree.q_draft)
                    path = _PathOf(r.drafter)
                    r.stats.nodes_verified += len(tree)  # still a tree's nodes, as counted
                    out.append(
                        chain_verification(r.state, path, draft, r.params, r.generator)  # type: ignore[arg-type]
                    )
                    continue
            if tree is not None:
                out.append(
                    tree_verification(r.state, r.drafter, tree, r.params, r.generator, r.stats)
                )
            else:
                drafter = r.drafter if i in drafts else None
                out.append(
                    chain_verification(r.state, drafter, drafts.get(i), r.params, r.generator)
                )
        return out

    def _trees(self, rows: list[Row], drafts: dict[int, Any]) -> dict[int, TokenTree]:
        """Each tree row's tree for this step. Trees whose nodes come with their expected
        acceptance (`SizedTreeDrafter`: suffix trees) are sized together, against what the
        whole forward costs with every other row and chain in it (`policies.size_trees`):
        in a batch, a node pays only where it adds more than its share of the larger forward."""
        trees: dict[int, TokenTree] = {}
        sized: dict[int, list[float]] = {}
        proposing: list[int] = []  # the other tree rows: their drafters' `propose_trees`
        for i, r in enumerate(rows):
            if not implements(r.drafter, TreeDrafter) or not r.drafting or r.allowed <= 0:
                continue
            if implements(r.drafter, SizedTreeDrafter):
                sized[i] = r.drafter.candidates(r.state.tokens, r.allowed)
            else:
                proposing.append(i)
        for kind in dict.fromkeys(type(rows[i].drafter) for i in proposing):  # in row order
            group = [i for i in proposing if type(rows[i].drafter) is kind]
            proposed = kind.propose_trees(  # type: ignore[union-attr]
                [rows[i].drafter for i in group],
                [rows[i].state.tokens for i in group],
                [rows[i].allowed for i in group],
                rows=len(rows),
            )
            trees.update(zip(group, proposed, strict=True))
        if sized:
            # the other rows' chains and trees count as rows verified; what they emit, as one
            # token a row (their accepted drafts unknown yet)
            others = sum(len(d.tokens) for d in drafts.values()) + sum(map(len, trees.values()))
            counts, _ = size_trees(list(sized.values()), len(rows) + others, len(rows), self.policy)
            for i, n in zip(sized, counts, strict=True):
                trees[i] = rows[i].drafter.take_candidates(n)  # type: ignore[union-attr]
        return trees

    def _observe(self, rows: list[Row], results: list[StepResult], spent: Any) -> None:
        """The policy learns the step: each row's acceptance, the batch's forward times. A
        step whose draft forwards also caught up on tokens committed while their rows did not
        draft (steps at k = 0 before it) is not timed for the draft: a drafted depth costs one
        token a row where drafting goes on, and a catch-up of many, charged to the depths of
        one exploration, made a draft that would pay look too dear to try again."""
        times, draft_tokens = spent
        draft_s, target_s = seconds_since(self.meter, times)
        # a chain's depth feeds one token a row, the first up to two (the last draft fully
        # accepted), and a confidence stop one forward more than it drafted (a tree's depths
        # feed its nodes: not judged)
        if not any(implements(r.drafter, TreeDrafter) for r in rows):
            usual = sum(r.depth + 2 for r in results if r.depth)
            if self.meter.tokens.get("draft", 0) - draft_tokens > usual:
                draft_s = None
        verified = sum(r.nodes + 1 for r in results)
        for row, result in zip(rows, results, strict=True):
            if row.stats.meter is not self.meter:  # the row's share of the batch's forward
                row.stats.meter.add("target", result.nodes + 1, target_s)
        if not any(r.drafter is not None for r in rows):
            return
        steps = [(r.depth, r.accepted) for r in results]
        self.policy.observe_step(steps, draft_s, target_s, verified)

    @staticmethod
    def _commit(row: Row, result: StepResult, k: int | None) -> None:
        """Exact stops (docs/architecture.md, Invariants 3): the first EOS ends the row's
        output (the EOS is its last token); never more than max_new_tokens. `k`: what the step
        asked for; None for the prefill's first token, which is no step."""
        stats = row.stats
        committed, n_accepted = result.committed, result.accepted
        eos_at = next((i for i, t in enumerate(committed) if t in row.eos_token_ids), None)
        if eos_at is not None:
            committed = committed[: eos_at + 1]
            n_accepted = min(n_accepted, eos_at + 1)  # an accepted EOS counts
        if k is not None:
            stats.k_hist[k] = stats.k_hist.get(k, 0) + 1
            stats.record_step(result.depth, n_accepted, len(committed))
        row.produced += len(committed)
        stats.new_tokens = row.produced
        row.committed = committed
        if row.on_logits is not None and committed:
            row.on_logits(result.committed_logits()[: len(committed)])  # type: ignore[index]
        if eos_at is not None:
            stats.stop_reason, row.done = "eos", True
        elif row.produced >= row.max_new_tokens:
            stats.stop_reason, row.done = "length", True
