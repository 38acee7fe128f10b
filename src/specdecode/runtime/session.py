"""`BatchSession`: many generations at once over one `SpeculativeDecoder` (continuous batching).

The object a server drives: `add(prompt, request)` validates a request and prefills it into a
free row of the target's static key/value store, `step()` advances every running generation by
one batched step (batch.py) and says what each one produced, `cancel(generation)` takes one out
at once. Each generation keeps its own sampling parameters, seed, stop strings, EOS ids,
`max_new_tokens` and exact counters (`Stats`); a stop string ends its row only.

A joining row starts from what ended rows left behind: the free store row, and the draft
cache, holding the longest prefix of its prompt (a shared system prompt, the same prompt
again) keep it, bit for bit what its prefill would compute, so only the rest is prefilled
(`LeanStore`, `PrefixPool`; `Stats.cached_tokens` counts the prompt positions kept).

The store is made once, for `max_rows` sequences of up to `max_len` positions each (`LeanStore`
where the target runs the lean forward, else `store.StaticStore` over the model's own forward);
`store_bytes` says its size. A full store refuses a new row (`StoreFull`) rather than evicting
a running one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from specdecode.core.batch import Batch, Row, fork_drafter
from specdecode.core.measure import clock_for
from specdecode.core.request import GenerationRequest
from specdecode.core.store import StaticStore, StoreFull
from specdecode.core.types import ForwardMeter, GenerationResult, Stats
from specdecode.models.lean import (
    FUSED_TOKENS,
    VERIFY_TOKENS,
    LeanCache,
    LeanStore,
    PrefixPool,
    draft_cache,
    position_bytes,
    target_cache,
    unsupported_reason,
)
from specdecode.models.prefix_cache import PrefixCache
from specdecode.runtime.textstream import TextStream

DEFAULT_MAX_LEN = 4096  # positions per row when the model's context is longer or unknown
# host memory for the prefixes freed rows held (LeanStore.kept): in a float32 cache a
# 1.5B Qwen2.5's position takes 56 KiB, so this keeps about 18,000 positions of it
DEFAULT_PREFIX_CACHE_MB = 1024


def make_store(
    target: Any, rows: int, max_len: int, kept_bytes: int = 0
) -> LeanStore | StaticStore:
    """The target's static key/value store: the lean forward's where the target runs on it
    (`lean.target_cache`; what freed rows held kept in up to `kept_bytes` more), else one over
    the model's own forward (ValueError for attention it cannot feed a 4D mask)."""
    if isinstance(target_cache(target), LeanCache):
        return LeanStore(target, rows, max_len, kept_bytes=kept_bytes)
    return StaticStore(target, rows, max_len)


def prefix_budgets(decoder: Any, kept: int) -> tuple[int, int]:
    """`kept` bytes of kept prefixes split between the target's (`LeanStore.kept`) and a draft
    model's caches (`PrefixPool`) in proportion to what a position takes in each, so that both
    keep about as many positions; all of it the target's without a draft model, or with one
    off the CPU (its caches stay where it runs: host memory is what the budget is for)."""
    drafter = decoder.drafter
    draft = getattr(drafter, "model", None)
    if draft is None or not hasattr(drafter, "prefixes") or unsupported_reason(draft) is not None:
        return kept, 0
    if next(draft.parameters()).device.type != "cpu":
        return kept, 0
    target, per_draft = position_bytes(decoder.target.model), position_bytes(draft)
    draft_kept = kept * per_draft // (target + per_draft)
    return kept - draft_kept, draft_kept


@dataclass(eq=False)
class PartialPrefill:
    """A prompt's target prefill in parts, before its row joins the batch
    (`BatchSession.open_prefill`, `advance_prefill`, then `add(..., prefilled=it)`): a server
    interleaves the parts with the running rows' steps, so a long prompt does not stall their
    next tokens. `cache`: the row's store row, covering the first len(cache) prompt positions;
    `kept` of them a kept prefix covered (not computed). Never the prompt's last token: `add`
    computes it, and the first token from its logits."""

    prompt_ids: list[int]
    cache: Any  # the store row (LeanCache / StoreRow)
    kept: int
    started: float  # the session's clock when it was opened
    parts: list[tuple[int, float]] = field(default_factory=list)  # each forward: tokens, seconds
    # a draft model's cache, filled with the same parts (its drafter's `begin` takes it), or None
    draft: Any = None
    new_tokens: int = 0  # the most tokens the request may generate
    # the most positions one forward of it takes (advance_prefill's parts, and add's last one
    # with the prompt's last token), as open_prefill was promised; None: no limit
    part_limit: int | None = None
    # the draft's share waits for the first token: `step` prefills it in parts after `add`
    draft_later: bool = False

    @property
    def remaining(self) -> int:
        """Prompt positions left before the last token (which `add` computes)."""
        return len(self.prompt_ids) - 1 - len(self.cache)

    def close(self) -> None:
        """Give the row back (a prefill abandoned: cancelled, expired, failed)."""
        self.cache.close()


class JobError(ValueError):
    """A job of `BatchSession.generate_each` that could not start: its `index`, and why."""

    def __init__(self, index: int, err: ValueError) -> None:
        super().__init__(str(err))
        self.index = index


@dataclass(eq=False)
class Generation:
    """One request running in a BatchSession. After each `step()`: `new_ids` (and `new_text`,
    when the model has a tokenizer) are what that step added; `finished` once it is over, with
    `finish_reason` "length", "stop" (EOS or a stop string) or the reason it was cancelled."""

    prompt_ids: list[int]
    request: GenerationRequest
    stats: Stats
    text: TextStream | None
    row: Row
    started: float
    token_ids: list[int] = field(default_factory=list)
    new_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str = ""

    @property
    def error(self) -> BaseException | None:
        """Why it ended with finish_reason "error" (its row's draft prefill failed)."""
        return self.row.error

    def result(self) -> GenerationResult:
        """The generation as `SpeculativeDecoder.generate` returns it."""
        text = self.text.final_text if self.text is not None else None
        return GenerationResult(list(self.token_ids), text, self.stats, self.prompt_ids)


def feed_text(text: TextStream, committed: list[int], stats: Stats) -> list[int]:
    """Feed a step's tokens to the generation's text (the step's one decode, and its stop
    check); returns the tokens kept: all, or those before a stop string, with the counters
    cut back to them (stop_reason "stop")."""
    kept = text.feed(committed)
    if text.stopped:  # a stop string ended the output inside this block
        cut = len(committed) - len(kept)
        # a step's tokens are in `emitted`; the prefill's first token (the block before any
        # step, emitted still 0) is not
        stats.emitted -= min(cut, stats.emitted)
        stats.new_tokens -= cut
        stats.stop_reason = "stop"
    return kept


class BatchSession:
    """Up to `max_rows` generations of `decoder` decoding together (see the module docstring).

    `max_len`: positions per row (prompt + new tokens); default the model's context, at most
    DEFAULT_MAX_LEN. The decoder's k policy is the batch's: with `k_policy="cost"` it chooses
    each step's k for the batch size it runs at, 0 included. `prefix_cache_mb`: host memory for
    the prefixes freed rows held beyond the store's rows (`LeanStore.kept`; 0: only the rows').
    """

    def __init__(
        self,
        decoder: Any,
        max_rows: int = 8,
        max_len: int | None = None,
        prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
    ) -> None:
        self.decoder = decoder
        target = decoder.target.model
        if max_len is None:
            max_len = min(DEFAULT_MAX_LEN, decoder.context_limit() or DEFAULT_MAX_LEN)
        self.max_len = max_len
        # a token tree's nodes sit in the cache until the step compacts it to the accepted path
        shape = getattr(decoder.drafter, "shape", None)
        slack = getattr(shape, "nodes", 0) + 1
        if not prefix_cache_mb >= 0:
            raise ValueError(f"prefix_cache_mb must be >= 0 (got {prefix_cache_mb!r})")
        kept, draft_kept = prefix_budgets(decoder, int(prefix_cache_mb * 2**20))
        self.store = make_store(target, max_rows, max_len + slack, kept)
        self.clock = clock_for(decoder.target.device)
        meter = ForwardMeter(self.clock if decoder.time_forwards else None)
        self.batch = Batch(
            target,
            policy=decoder.k_policy,
            meter=meter,
            new_cache=lambda model: self.store.open_row(),  # rows made without a prompt
        )
        self.generations: list[Generation] = []
        # rows whose draft (their drafter's `prefilled` cache) `step` prefills in parts
        # (`open_prefill(..., draft_later=True)`), the oldest first, each with its parts' size
        self._drafts_in_parts: list[tuple[Generation, int]] = []
        # the draft caches of ended rows, for the next rows' prompts (as the store keeps the
        # target's): one per row of the store, and more within their share of the budget
        self.draft_prefixes = PrefixPool(max_rows, draft_kept)

    @property
    def max_rows(self) -> int:
        return self.store.rows

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """Where the prefixes freed rows held are kept beyond the rows (the lean store's)."""
        return self.store.kept if isinstance(self.store, LeanStore) else None

    @property
    def store_bytes(self) -> int:
        """The preallocated key/value store's size in bytes."""
        return self.store.nbytes

    @property
    def free_rows(self) -> int:
        return self.store.free_rows

    def __len__(self) -> int:
        return len(self.generations)

    def add(
        self,
        prompt: Any,
        request: GenerationRequest,
        begin_draft: bool = True,
        on_logits: Callable[[torch.Tensor], None] | None = None,
        prefilled: PartialPrefill | None = None,
    ) -> Generation:
        """Validate `request` for `prompt` (ValueError on bad input, before anything runs),
        then prefill it into a free row (StoreFull when none is free): its first token is in
        `new_ids` / `new_text` already (it may be finished then: one token asked for, an EOS);
        it takes part from the next `step()`. `begin_draft=False` leaves the draft's prefill to
        the first step that drafts (`Batch.step`): the first token can go out first, and a row
        that never drafts never pays for it. `on_logits`: the target's logits before each token
        it commits (`Batch.add`; a stop string may cut the last tokens after). `prefilled`: the
        prompt's `PartialPrefill` (`open_prefill`), whose row it takes; only the rest is
        prefilled here."""
        decoder = self.decoder
        try:
            prompt_ids = decoder.encode_prompt(prompt, chat=request.chat)
            start = decoder.resolve(prompt_ids, request, self.clock)
            if prefilled is None:
                self._check_room(prompt_ids, request)
            elif prefilled.prompt_ids != prompt_ids:
                raise ValueError("a partial prefill continues its own prompt only")
            elif prefilled.part_limit is not None:  # the last forward (the rest and the last
                while prefilled.remaining >= prefilled.part_limit:  # token) within the limit
                    self.advance_prefill(prefilled, prefilled.part_limit)
        except BaseException:  # a partial prefill's row is add's: given back, not lost
            if prefilled is not None:
                prefilled.close()
            raise
        started = self.clock() if prefilled is None else prefilled.started
        drafter = fork_drafter(decoder.drafter)
        if hasattr(drafter, "prefixes"):
            drafter.prefixes = self.draft_prefixes
        if prefilled is not None and prefilled.draft is not None:
            drafter.prefilled = prefilled.draft  # type: ignore[union-attr]
        row = self.batch.add(
            prompt_ids,
            request.max_new_tokens,
            drafter=drafter,
            params=start.params,
            generator=start.generator,
            eos_token_ids=start.eos_token_ids,
            stats=start.stats,
            # a free row holding a prefix of this prompt (a system prompt, the same prompt
            # again) keeps it: only the rest is prefilled, to the same bits (LeanStore)
            prefilled=self.store.open_row(prompt_ids[:-1])
            if prefilled is None
            else prefilled.cache,
            begin_draft=begin_draft,
            on_logits=on_logits,
        )
        if prefilled is not None:  # its parts: the prefill's forwards, and what was kept
            start.stats.cached_tokens = prefilled.kept
            for n, seconds in prefilled.parts:
                start.stats.meter.add("prefill", n, seconds)
        text = decoder.text_stream(request) if decoder.tokenizer is not None else None
        generation = Generation(prompt_ids, request, start.stats, text, row, started)
        self.generations.append(generation)
        if prefilled is not None and prefilled.draft_later:
            self._hold_draft(generation, prefilled)
        self._take(generation, self.clock())
        return generation

    def _hold_draft(self, generation: Generation, partial: PartialPrefill) -> None:
        """A row whose draft lacks a part or more of its prompt, where drafting will pay for
        that prefill: `step` prefills it in parts, the row drafting nothing until it is level
        (`Row.waits_for_draft`). Otherwise the row's first drafting step prefills what its
        draft lacks, if it ever drafts."""
        draft, row = partial.draft, generation.row
        if draft is None or row.drafting or row.done:
            return
        lacking = len(partial.prompt_ids) - 1 - len(draft)
        limit = partial.part_limit or lacking
        if lacking < limit or not self.batch.draft_pays(lacking, partial.new_tokens, joined=True):
            return
        row.waits_for_draft = True
        self._drafts_in_parts.append((generation, limit))

    @torch.inference_mode()
    def _advance_draft(self) -> None:
        """One part of the oldest held draft's prefill, over its row's committed tokens (the
        prompt's, then those generated since: one a step); once level, the row drafts (its
        drafter's `begin` takes the cache as it is)."""
        if not self._drafts_in_parts:
            return
        generation, limit = self._drafts_in_parts[0]
        row = generation.row
        draft = row.drafter.prefilled  # type: ignore[union-attr]
        tokens = row.state.tokens  # a draft level with them covers tokens[:-1]
        end = min(len(tokens) - 1, len(draft) + limit)
        try:
            if end > len(draft):
                self._draft_forward(draft, tokens[len(draft) : end])
        except Exception:  # a half-filled cache is never handed on: `begin` starts afresh,
            row.drafter.prefilled = None  # and ends the row with its error should it fail too
            end = len(tokens)
        if end >= len(tokens) - 1:  # level: the row drafts from this step on
            row.waits_for_draft = False
            self._drafts_in_parts.pop(0)

    def open_prefill(
        self,
        prompt: Any,
        request: GenerationRequest,
        parts: int | None = None,
        draft_later: bool = False,
    ) -> PartialPrefill:
        """Validate `request` for `prompt` as `add` does and take a free row for its prefill in
        parts (`advance_prefill`), keeping the longest prefix of the prompt a free row holds;
        `add(prompt, request, prefilled=...)` then finishes it. A prompt split into parts of at
        most VERIFY_TOKENS (lean.py) positions gets the keys and values of one whole prefill on
        the kernels' fused path, bit for bit (the fused path's rows do not depend on the split).
        `parts`: the most positions any part (the last, `add`'s, included) will take; at most
        VERIFY_TOKENS, it lets a prompt of any length keep a prefix (`LeanCache.keeps_prefix`),
        and `advance_prefill` never takes more.
        A draft model's cache is filled in the same parts (its drafter's `begin` then takes it)
        where the batch's policy says the row's drafting will pay for that prefill
        (`Batch.draft_pays`): the draft's prefill of a long prompt never stalls the running
        rows either. `draft_later`: the draft's parts wait for the first token instead (the
        row decodes without drafting meanwhile; `step` runs one part before each step, each
        of at most `parts`, then the row drafts): the first token waits for the target's
        prefill alone."""
        prompt_ids = self.decoder.encode_prompt(prompt, chat=request.chat)
        self.decoder.resolve(prompt_ids, request, self.clock)  # validates the request
        self._check_room(prompt_ids, request)
        started = self.clock()
        cache = self.store.open_row(prompt_ids[:-1], parts)
        draft = None
        drafter = self.decoder.drafter
        if hasattr(drafter, "prefilled"):  # a draft model: its prefill goes in the same parts
            # (fused at their size, so that a later prompt may keep its prefix too)
            fused = max(FUSED_TOKENS, min(parts or 0, VERIFY_TOKENS))
            draft = self.draft_prefixes.take(prompt_ids[:-1], parts)
            draft = draft or draft_cache(drafter.model, fused_tokens=fused)
        return PartialPrefill(
            prompt_ids,
            cache,
            len(cache),
            started,
            draft=draft,
            new_tokens=request.max_new_tokens,
            part_limit=parts,
            draft_later=draft_later,
        )

    @torch.inference_mode()
    def advance_prefill(self, partial: PartialPrefill, tokens: int) -> None:
        """Forward up to `tokens` more of the prompt's positions (never its last token; never
        more than the `parts` it was opened with)."""
        if partial.part_limit is not None:
            tokens = min(tokens, partial.part_limit)
        begin = len(partial.cache)
        end = begin + max(0, min(tokens, partial.remaining))
        if end == begin:
            return
        device = next(self.batch.target.parameters()).device
        ids = torch.tensor(partial.prompt_ids[begin:end], device=device)
        before = self.clock()
        partial.cache.forward(ids, last_only=True)
        partial.parts.append((end - begin, self.clock() - before))
        draft = partial.draft
        # the draft's share, the same positions (in forwards within the parts' limit), where
        # the row would begin drafting at all (a row that would not is spared its draft's
        # prefill; should it draft later, `begin` prefills what its cache lacks)
        if draft is None or partial.draft_later or len(draft) >= end:
            return
        if not self.batch.draft_pays(len(partial.prompt_ids) - 1 - len(draft), partial.new_tokens):
            return
        size = partial.part_limit or end
        for at in range(len(draft), end, size):
            self._draft_forward(draft, partial.prompt_ids[at : min(at + size, end)])

    def _draft_forward(self, draft: Any, ids: list[int]) -> None:
        """A draft cache over `ids` more positions, counted as the draft's prefill (ids the
        draft cannot embed go in as 0, as its drafter's `begin` feeds them)."""
        tensor = torch.tensor(ids, device=next(self.batch.target.parameters()).device)
        tensor = tensor.masked_fill(tensor >= self.decoder.drafter.embed_size, 0)
        with self.batch.meter.forward("draft_prefill", len(ids)):
            draft.forward(tensor, last_only=True)

    def _check_room(self, prompt_ids: list[int], request: GenerationRequest) -> None:
        if len(prompt_ids) + request.max_new_tokens > self.max_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({request.max_new_tokens}) "
                f"exceeds the batch's {self.max_len} positions per sequence"
            )
        if not self.store.free_rows:
            raise StoreFull(f"all {self.max_rows} rows of the batch are in use")

    def step(self) -> list[Generation]:
        """One batched step of every running generation; returns them with this step's
        `new_ids` / `new_text`. Finished ones leave the batch (their row is freed). Before it,
        one part of a draft prefilled after its row's first token (`open_prefill(...,
        draft_later=True)`)."""
        self._advance_draft()
        stepped = {id(row) for row in self.batch.step()}
        now = self.clock()
        out = []
        for generation in list(self.generations):
            if id(generation.row) not in stepped:
                continue
            if generation.error is not None:  # its draft's prefill failed: it alone ends
                self._finish(generation, "error")
            else:
                self._take(generation, now)
            out.append(generation)
        return out

    def cancel(self, generation: Generation, reason: str = "cancelled") -> None:
        """End a generation now (its row leaves the batch before the next step)."""
        if not generation.finished:
            self._finish(generation, reason)

    def generate_all(self, prompts: Sequence[Any], request: GenerationRequest) -> list[Generation]:
        """Every prompt with the same request, `max_rows` at a time, in order."""
        done = dict(self.generate_each([(prompt, request) for prompt in prompts]))
        return [done[index] for index in range(len(prompts))]

    def generate_each(
        self,
        jobs: Sequence[tuple[Any, GenerationRequest]],
        on_logits: Callable[[int, torch.Tensor], None] | None = None,
    ) -> Iterator[tuple[int, Generation]]:
        """Each job (a prompt, its request), `max_rows` at a time (a finished row's place goes
        to the next job), as (its index in `jobs`, its finished generation) in the order they
        finish. `JobError` names a job `add` refuses; a row whose draft failed raises its
        error. Left early, the jobs still running are cancelled. `on_logits(index, logits)`:
        the target's logits before each token a job commits (`add`)."""
        pending = list(enumerate(jobs))
        running: dict[int, tuple[int, Generation]] = {}  # id(generation) -> (index, generation)
        try:
            while pending or running:
                while pending and self.store.free_rows:
                    index, (prompt, request) = pending.pop(0)
                    try:
                        keep = None if on_logits is None else partial(on_logits, index)
                        generation = self.add(prompt, request, on_logits=keep)
                    except ValueError as err:
                        raise JobError(index, err) from None
                    if generation.finished:  # one token was all it could take (an EOS first)
                        yield index, generation
                    else:
                        running[id(generation)] = (index, generation)
                for generation in self.step():
                    if generation.error is not None:
                        raise generation.error
                    if generation.finished and id(generation) in running:
                        yield running.pop(id(generation))
        finally:
            for _, generation in running.values():
                self.cancel(generation)

    # -- inside a step ------------------------------------------------------------------------

    def _take(self, generation: Generation, now: float) -> None:
        row, stats, text = generation.row, generation.stats, generation.text
        committed = row.committed
        if not stats.ttft_s:
            stats.ttft_s = now - generation.started
        if text is not None:
            committed = feed_text(text, committed, stats)
            generation.new_text = text.take()
        generation.new_ids = list(committed)
        generation.token_ids.extend(committed)
        stats.wall_time_s = now - generation.started
        if text is not None and text.stopped:
            self._finish(generation, "stop")
        elif row.done:
            self._finish(generation, "length" if stats.stop_reason == "length" else "stop")

    def _finish(self, generation: Generation, reason: str) -> None:
        generation.finished, generation.finish_reason = True, reason
        if generation.text is not None:
            generation.new_text += generation.text.finish()
        if reason not in ("length", "stop"):
            generation.stats.stop_reason = reason
        generation.stats.wall_time_s = self.clock() - generation.started
        self.generations.remove(generation)
        row = generation.row
        self._drafts_in_parts = [d for d in self._drafts_in_parts if d[0] is not generation]
        held = getattr(row.drafter, "prefilled", None)
        if held is not None and not row.drafting:  # a draft never begun: its prefix may serve
            self.draft_prefixes.put(held)  # the next prompts
            row.drafter.prefilled = None  # type: ignore[union-attr]
        self.batch.remove(row)


def generate_each(
    engine: Any,
    jobs: Sequence[tuple[list[int], GenerationRequest]],
    rows: int,
    on_logits: Callable[[int, torch.Tensor], None] | None = None,
) -> Iterator[tuple[int, GenerationResult]]:
    """Each job's generation (prompt ids, request) as (its index in `jobs`, the result), in the
    order they finish, `rows` at a time through `engine` (a SpeculativeDecoder: its drafter, if
    any, drafts for each row): `BatchSession.generate_each`, with its `on_logits`. `JobError`
    (a ValueError) names the index of a job that cannot run (a prompt too long for the
    context)."""
    # a row holds the longest prompt and its answer, no more (the store is rows x max_len); a
    # job longer than the model's context is refused by `add`
    longest = max((len(ids) + r.max_new_tokens for ids, r in jobs), default=1)
    session = BatchSession(engine, max_rows=rows, max_len=min(longest, DEFAULT_MAX_LEN))
    for index, generation in session.generate_each(jobs, on_logits):
        yield index, generation.result()
