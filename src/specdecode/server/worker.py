"""Continuous batching on one thread: the queue in front of the model, and the running batch.

Every call into the engine, the tokenizer included, runs on the worker's single thread. Up to
`max_batch` generations decode together in one `BatchSession` (runtime/session.py): between two
steps, waiting requests join the batch (each validated before it joins, so a bad request never
touches the running ones) and finished, cancelled or expired ones leave it. Beyond the batch,
requests wait in a bounded FIFO; a full queue refuses at once (429). Cancellation (client gone,
or the server's drain at shutdown) and the per-request deadline are checked between steps.
`max_batch=1` is one generation at a time. A prompt longer than `prefill_chunk` tokens is
prefilled in parts of at most that many (`BatchSession.open_prefill`; later parts smaller as the
prompt's positions make each token dearer, `part_size`), one part between two steps of the
running rows while any run (all at once while none does), so one long prompt does not stall
every stream's next token for its whole prefill; parts of at most VERIFY_TOKENS (the default)
keep the bits of a whole prefill on the kernels' fused path, and the prompt's prefix for the
next request. A draft model's share of such a prompt follows its first token, one part before
each step, the row decoding without drafting until its draft is level.

Results go back as events through each job's `deliver` callback (the app posts them to its event
loop): `Started`, any number of `Delta`, then exactly one of `Finished` or `Failed`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from jinja2 import TemplateError

from specdecode.core.request import GenerationRequest
from specdecode.core.sampling import SamplingParams
from specdecode.core.store import StoreFull
from specdecode.core.types import Stats
from specdecode.kernels.openmp import release_pool
from specdecode.runtime.engine import SpeculativeDecoder
from specdecode.runtime.session import DEFAULT_PREFIX_CACHE_MB, Generation, PartialPrefill
from specdecode.server.errors import APIError, shutting_down
from specdecode.server.limits import PREFILL_CHUNK
from specdecode.server.logprobs import LogprobCollector, TokenLogprob
from specdecode.server.telemetry import ServerMetrics

log = logging.getLogger("specdecode.server")

# max_tokens when neither the request nor the model's config bounds the generation
FALLBACK_MAX_TOKENS = 256
# OpenAI's defaults, where neither the request nor the model's generation config sets a value
OPENAI_SAMPLING = SamplingParams(temperature=1.0)  # top_p 1.0 and no top-k: no filtering


@dataclass(frozen=True)
class GenerationParams:
    prompt: str | list[int] | list[dict[str, str]]
    chat: bool
    max_tokens: int | None  # None: up to the end of the model's context
    # None: the model's generation config, else OpenAI's default (`OPENAI_SAMPLING`)
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stops: list[str]
    prompt_param: str = "prompt"  # how the request names the prompt ("prompt" or "messages")
    logprobs: int | None = None  # None: none returned; n: each token's, and its n likeliest

    def request(self, engine: SpeculativeDecoder, max_new_tokens: int) -> GenerationRequest:
        """The engine's request for the encoded prompt (the chat template is applied already),
        unset sampling options filled in; ValueError on bad sampling settings."""
        sampling = engine.sampling_params(
            self.temperature, self.top_k, self.top_p, fallback=OPENAI_SAMPLING
        )
        return GenerationRequest(max_new_tokens, sampling, self.seed, self.stops)


@dataclass
class Outcome:
    text: str
    token_ids: list[int]
    # "stop" (EOS or stop string), "length", "timeout", "cancelled" (client gone) or "shutdown"
    finish_reason: str
    stats: Stats
    logprobs: list[TokenLogprob] | None = None  # where asked for (server/logprobs.py)


@dataclass
class Started:
    prompt_tokens: int


@dataclass
class Delta:
    text: str
    logprobs: list[TokenLogprob] | None = None  # the tokens behind it, where asked for


@dataclass
class Finished:
    outcome: Outcome


@dataclass
class Failed:
    error: APIError


Event = Started | Delta | Finished | Failed


@dataclass(eq=False)
class Running:
    """A job's generation in the batch, and when its first token came."""

    generation: Generation
    ttft: float | None = None
    logprobs: LogprobCollector | None = None  # where the request asked for them
    entries: list[TokenLogprob] = field(default_factory=list)  # those sent, in order
    held: list[TokenLogprob] = field(default_factory=list)  # tokens whose text is held back
    text_chars: int = 0  # characters of text sent
    entry_chars: int = 0  # characters of the tokens in `entries`

    def release(self, final: bool = False, fit: bool = False) -> list[TokenLogprob] | None:
        """The held entries whose text has gone out (all of them at the end; with `fit`, a stop
        string ended the text: only those within it), or None where none were asked for. A
        token's entry goes with the chunk that carries its text, as far as its decoded text
        tells (a token may decode to part of a character)."""
        if self.logprobs is None:
            return None
        n = 0
        chars = self.entry_chars
        for entry in self.held:
            if (not final or fit) and chars + len(entry.token) > self.text_chars:
                break
            chars += len(entry.token)
            n += 1
        out, self.held = self.held[:n], (self.held[n:] if not final else [])
        self.entry_chars = chars
        self.entries.extend(out)
        return out


@dataclass(eq=False)
class Job:
    params: GenerationParams
    endpoint: str
    deliver: Callable[[Event], None]  # must be callable from the worker thread
    timeout_s: float | None = None
    arrival: float = field(default_factory=time.monotonic)
    started: float | None = None  # when the worker took it (time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)
    interrupt: str | None = None  # why it was cancelled: "cancelled", "timeout" or "shutdown"
    # a long prompt's prefill in parts: its row, and what `add` needs once the parts are done
    partial: PartialPrefill | None = None
    plan: tuple[list[int], GenerationRequest, LogprobCollector | None] | None = None

    def expired(self) -> bool:
        return self.timeout_s is not None and time.monotonic() - self.arrival > self.timeout_s


class GenerationWorker:
    def __init__(
        self,
        engine: SpeculativeDecoder,
        queue_size: int = 16,
        max_prompt_tokens: int | None = None,
        metrics: ServerMetrics | None = None,
        max_batch: int = 8,
        max_len: int | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
    ) -> None:
        if engine.tokenizer is None:
            raise ValueError("serving needs a model with a tokenizer")
        if not isinstance(prefill_chunk, int) or prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be an integer >= 0 (got {prefill_chunk!r})")
        self.prefill_chunk = prefill_chunk  # 0: every prompt prefilled at once
        self.engine = engine
        self.queue_size = queue_size
        self.max_prompt_tokens = max_prompt_tokens
        self.metrics = metrics
        # the key/value store is made here, once: its size is known (and printed) at start
        self.session = engine.batch_session(max_batch, max_len, prefix_cache_mb)
        self.max_batch = max_batch
        # positions a sequence may fill: the models' context and the store's rows
        limits = [n for n in (engine.context_limit(), self.session.max_len) if n is not None]
        self.position_limit = min(limits)
        self._waiting: deque[Job] = deque()
        self._joining: list[Job] = []  # taken from the queue, being prefilled into the batch
        self._running: dict[Job, Running] = {}
        self._closed = False
        self._draining = False  # the server is shutting down: no new jobs
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    # -- the event loop's side ---------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return len(self._waiting)

    @property
    def running(self) -> int:
        with self._cond:
            return len(self._running)

    @property
    def idle(self) -> bool:
        """No job waits, joins the batch (its prefill) or runs."""
        with self._cond:
            return not self._running and not self._waiting and not self._joining

    def start(self) -> None:
        """Start the worker thread. The calling thread (the one that loaded the models and made
        the store) lets go of its OpenMP threads first: two pools on the same CPUs slow every
        parallel region of the worker's forwards (kernels/openmp.py)."""
        release_pool()
        self._thread = threading.Thread(target=self._loop, name="specdecode-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            waiting, self._waiting = list(self._waiting), deque()
            for job in [*self._joining, *self._running]:
                self._interrupt(job, "shutdown")
            self._cond.notify_all()
        for job in waiting:
            self._end_unstarted(job, "shutdown")
        if self._thread is not None:
            self._thread.join(timeout_s)

    def drain(self) -> None:
        """Take no new jobs (503) and end the queued ones ("shutdown"); the running one goes on."""
        with self._cond:
            self._draining = True
            waiting, self._waiting = list(self._waiting), deque()
        for job in waiting:
            self._end_unstarted(job, "shutdown")

    def interrupt_running(self, outcome: str = "shutdown") -> None:
        """Stop the running jobs (and those joining the batch) at their next step; each ends
        normally, finished by `outcome`."""
        with self._cond:
            for job in [*self._joining, *self._running]:
                self._interrupt(job, outcome)

    def check_room(self) -> None:
        """APIError 503 when shutting down, 429 when `queue_size` requests already wait: called
        before a request's body is read, and again when its job is queued."""
        with self._cond:
            self._check_room()

    def _check_room(self) -> None:
        if self._closed or self._draining:
            raise shutting_down()
        taken = len(self._running) + len(self._joining) + len(self._waiting)
        room = taken < self.max_batch  # joins at once
        if not room and len(self._waiting) >= self.queue_size:
            raise APIError(
                429,
                f"the server is busy ({len(self._waiting)} requests waiting): retry later",
                type="rate_limit_exceeded",
                code="queue_full",
                headers={"Retry-After": "1"},
            )

    def submit(self, job: Job) -> None:
        """Queue `job`, or raise APIError 429 (queue full) or 503 (shutting down)."""
        with self._cond:
            self._check_room()
            self._waiting.append(job)
            self._cond.notify()

    def cancel(self, job: Job, outcome: str = "cancelled") -> None:
        """Drop the job from the queue (counted as `outcome`), or stop it at the next step."""
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                self._interrupt(job, outcome)  # running (stops between steps) or already over
                return
        self._end_unstarted(job, outcome)

    @staticmethod
    def _interrupt(job: Job, outcome: str) -> None:
        if job.interrupt is None:  # the first reason wins (a drain, then the client leaving)
            job.interrupt = outcome
        job.cancelled.set()

    # -- the worker thread -------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while (
                    not self._waiting
                    and not self._running
                    and not self._joining
                    and not self._closed
                ):
                    self._cond.wait()
                if self._closed and not self._running and not self._joining:
                    return
                while self._waiting and len(self._running) + len(self._joining) < self.max_batch:
                    job = self._waiting.popleft()
                    job.started = time.monotonic()
                    self._joining.append(job)  # not idle: the drain waits for (and ends) it
                joining = list(self._joining)
            # with rows running, one part of one long prompt between two of their steps
            budget = 1 if self.session.generations else None
            for job in joining:
                more = False
                try:
                    more, budget = self._join(job, budget)
                finally:  # ended in its join, running (_join moved it), or prefilling on
                    with self._cond:
                        if job in self._joining and not more:
                            self._joining.remove(job)
            if self.session.generations:
                self._step()

    def _join(self, job: Job, budget: int | None) -> tuple[bool, int | None]:
        """Validate `job`, prefill it into the batch and send its first token; a bad request
        ends here, alone. The draft's prefill waits for the first token: for a prompt of up to
        `prefill_chunk` tokens, the row's first drafting step; a longer prompt goes in parts,
        as many as `budget` allows (None: all), each taking one from it, the last one `add`'s,
        and its draft's in parts of the same size after its first token, one before each
        step, where drafting would pay for it (`BatchSession.open_prefill(...,
        draft_later=True)`, `Batch.draft_pays`). Returns whether the job is still
        prefilling, and what is left of the budget."""
        if job.cancelled.is_set() or job.expired():
            cancelled = job.cancelled.is_set()
            if job.partial is not None:
                job.partial.close()
            self._end_unstarted(job, (job.interrupt or "cancelled") if cancelled else "timeout")
            return False, budget
        try:
            if job.plan is None:
                prompt_ids, max_new = self._plan(job.params)
                request = job.params.request(self.engine, max_new)
                job.plan = (prompt_ids, request, self._collector(job.params))
                if self.prefill_chunk and len(prompt_ids) - 1 > self.prefill_chunk:
                    # no part longer than prefill_chunk: at most VERIFY_TOKENS (the default),
                    # a prompt of any length then keeps a prefix for the next (lean.py)
                    job.partial = self.session.open_prefill(
                        prompt_ids, request, parts=self.prefill_chunk, draft_later=True
                    )
            prompt_ids, request, collector = job.plan
            partial = job.partial
            while partial is not None:
                if budget == 0:  # the next part (the last one too: add's) after a step
                    return True, budget
                budget = None if budget is None else budget - 1
                size = self.part_size(partial)
                if partial.remaining <= size:
                    break  # the last part: add prefills it with the prompt's last token
                self.session.advance_prefill(partial, size)
            job.partial = None  # the row is add's now, whatever happens to it
            generation = self.session.add(
                prompt_ids, request, begin_draft=False, on_logits=collector, prefilled=partial
            )
        except Exception as err:
            if job.partial is not None:  # its row goes back to the store
                job.partial.close()
                job.partial = None
            if isinstance(err, APIError):
                job.deliver(Failed(err))
            elif isinstance(err, StoreFull):  # not expected (rows are counted): never evict
                job.deliver(Failed(APIError(429, str(err), type="rate_limit_exceeded")))
            elif isinstance(err, ValueError):
                job.deliver(Failed(APIError(400, str(err))))
            else:  # never let one request kill the worker
                log.exception("prefill failed")
                self._fail(job, None)
            return False, budget
        running = Running(generation, logprobs=collector)
        with self._cond:
            self._running[job] = running
            self._joining.remove(job)  # from joining to running at once: never idle between
        job.deliver(Started(len(prompt_ids)))
        self._news(job, running)
        return False, budget

    def part_size(self, partial: PartialPrefill) -> int:
        """Tokens in a long prompt's next part: `prefill_chunk` at first, then fewer as its
        positions make each token dearer (attention over the ones before it), so that every
        part costs the running rows about what the first one did: the first part's seconds
        over the last part's seconds per token (both measured), at most `prefill_chunk` and at
        least a quarter of it (a slow part on a busy machine does not make the rest crawl)."""
        chunk = self.prefill_chunk
        if not partial.parts:
            return chunk
        first_s = partial.parts[0][1]
        n, seconds = partial.parts[-1]
        if first_s <= 0 or seconds <= 0:  # untimed: parts of the same size
            return chunk
        return max(max(1, chunk // 4), min(chunk, int(first_s * n / seconds)))

    def _fail(self, job: Job, running: Running | None) -> None:
        """End `job` with a 500 (the server's fault); its row, if any, leaves."""
        if running is not None and not running.generation.finished:
            self.session.cancel(running.generation, "error")
        self._count(job, "error", None)
        self._leave(job)
        job.deliver(Failed(APIError(500, "generation failed", type="server_error")))

    def _step(self) -> None:
        """One batched step; then every row's news, and the rows that leave."""
        if self.metrics is not None:
            self.metrics.batch_size.observe(len(self.session.generations))
        try:
            self.session.step()
        except Exception:  # the batch's forward failed: every row in it ends with an error
            log.exception("generation failed")
            for job, running in list(self._running.items()):
                self._fail(job, running)
            return
        if self.metrics is not None:
            self.metrics.step_k.observe(self.session.batch.last_k)
        for job, running in list(self._running.items()):
            self._news(job, running)

    def _news(self, job: Job, running: Running) -> None:
        """What the row's prefill or last step produced goes to its client; then a cancelled
        or expired row leaves, and a finished one ends."""
        generation = running.generation
        if generation.error is not None:  # its row failed alone (its draft's prefill)
            log.error("a row failed", exc_info=generation.error)
            self._fail(job, running)
            return
        if generation.new_ids and running.ttft is None:
            running.ttft = time.monotonic() - job.arrival
        if running.logprobs is not None:
            running.held.extend(running.logprobs.take(generation.new_ids))
        running.text_chars += len(generation.new_text)
        entries = running.release()
        if generation.new_text or entries:
            job.deliver(Delta(generation.new_text, entries))
            generation.new_text = ""
        if not generation.finished:
            if job.cancelled.is_set():
                self.session.cancel(generation, job.interrupt or "cancelled")
            elif job.expired():
                self.session.cancel(generation, "timeout")
        if generation.finished:
            self._end(job, running)

    def _end(self, job: Job, running: Running) -> None:
        generation = running.generation
        text = generation.text
        assert text is not None  # serving needs a tokenizer
        running.text_chars += len(generation.new_text)
        entries = running.release(final=True, fit=text.stopped)
        if generation.new_text or entries:  # the rest a finished stream held back
            job.deliver(Delta(generation.new_text, entries))
        finish = generation.finish_reason
        self._count(job, finish, generation.stats, running.ttft)
        self._leave(job)
        every = running.entries if running.logprobs is not None else None
        job.deliver(Finished(Outcome(text.final_text, text.ids, finish, generation.stats, every)))

    def _collector(self, params: GenerationParams) -> LogprobCollector | None:
        if params.logprobs is None:
            return None
        skip = frozenset(self.engine.eos_token_ids or ())
        return LogprobCollector(self.engine.tokenizer, params.logprobs, skip)

    def _leave(self, job: Job) -> None:
        with self._cond:
            self._running.pop(job, None)

    def _end_unstarted(self, job: Job, outcome: str = "cancelled") -> None:
        stats = Stats()
        stats.stop_reason = outcome
        self._count(job, outcome, None)  # counted before the client can hear of it
        job.deliver(Finished(Outcome("", [], outcome, stats)))

    def _count(
        self, job: Job, outcome: str, stats: Stats | None, ttft: float | None = None
    ) -> None:
        if self.metrics is None:
            return
        duration = queued = None
        if stats is not None:
            duration = time.monotonic() - job.arrival
            queued = None if job.started is None else job.started - job.arrival
        self.metrics.count_generation(job.endpoint, outcome, stats, duration, ttft, queued)

    def _plan(self, params: GenerationParams) -> tuple[list[int], int]:
        """Prompt ids and max_new_tokens, or APIError 400 for a prompt that does not fit."""
        try:
            ids = self.engine.encode_prompt(params.prompt, chat=params.chat)
        except (ValueError, TemplateError) as err:  # a chat template may refuse the messages
            raise APIError(400, str(err), param=params.prompt_param) from None
        n, where = len(ids), params.prompt_param
        if self.max_prompt_tokens is not None and n > self.max_prompt_tokens:
            raise APIError(
                400,
                f"the prompt has {n} tokens, more than this server accepts "
                f"({self.max_prompt_tokens}, --max-prompt-tokens)",
                param=where,
                code="context_length_exceeded",
            )
        limit = self.position_limit
        room = limit - n
        if room < 1:
            raise APIError(
                400,
                f"the prompt has {n} tokens and fills the {limit} positions a sequence may "
                "use (the model's context, or the server's --max-len)",
                param=where,
                code="context_length_exceeded",
            )
        max_new = params.max_tokens
        if max_new is None:
            max_new = room if room is not None else FALLBACK_MAX_TOKENS
        elif max_new > room:
            raise APIError(
                400,
                f"prompt ({n} tokens) + max_tokens ({max_new}) exceeds the {limit} positions a "
                "sequence may use (the model's context, or the server's --max-len)",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return ids, max_new
