"""`SpeculativeDecoder`: the public API around the decoding core.

Validates input, turns prompts into ids, fills unset sampling options from the model's generation
config, applies stop strings, times the run and decodes text. The algorithm itself lives in
decode.py; this module only prepares its input and reads its output. One generation's options
travel as one `GenerationRequest` (request.py); its text as one `TextStream` (textstream.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from specdecode.core.cache import Cache
from specdecode.core.decode import decode
from specdecode.core.measure import clock_for
from specdecode.core.policies import KPolicy, make_k_policy, prior_cost_ratio
from specdecode.core.protocols import Drafter
from specdecode.core.request import GREEDY, GenerationRequest, RowStart, SamplingDefaults
from specdecode.core.sampling import SamplingParams, make_generator
from specdecode.core.tree import TreeDrafter
from specdecode.core.types import ForwardMeter, GenerationResult, Stats
from specdecode.drafters.factory import make_drafter
from specdecode.drafters.model import ModelDrafter
from specdecode.drafters.tree_model import TreeModelDrafter
from specdecode.models.compat import (
    context_length,
    generation_defaults,
    logits_size,
)
from specdecode.models.lean import target_cache
from specdecode.models.loading import LoadedModel, wrap_model
from specdecode.runtime.session import DEFAULT_PREFIX_CACHE_MB, BatchSession, feed_text
from specdecode.runtime.textstream import TextStream

Prompt = str | Sequence[int] | Sequence[dict[str, str]]
GENERATION_CONFIG_MODES = ("auto", "none")


def _eos_ids(loaded: LoadedModel) -> set[int]:
    """Every id the target treats as end of sequence (generation config, config, tokenizer)."""
    ids: set[int] = set()
    sources = [
        getattr(getattr(loaded.model, "generation_config", None), "eos_token_id", None),
        getattr(loaded.model.config, "eos_token_id", None),
        getattr(loaded.tokenizer, "eos_token_id", None) if loaded.tokenizer is not None else None,
    ]
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


class SpeculativeDecoder:
    """Generate with `target`, drafted by `draft`; `draft=None` is the autoregressive baseline.

    `draft` is a loaded model (`load_model`), a transformers model, or any `Drafter`.
    `k_policy` chooses each step's look-ahead (policies.py): "cost" (the default) picks from
    0..k (k is k_max) what its measured costs say pays, drafting nothing where nothing does;
    "fixed" drafts `k` every step, "heuristic" starts at `k` and moves between 1 and 2k; or
    pass any `KPolicy`. `confidence` stops a model draft early when the draft's top
    probability falls below it. `time_forwards=False` skips per-forward timing (on CUDA each
    timed forward synchronises); the cost policy then decides from priors only.
    `tree` ("static:3,2,2,1,1" or "dynamic:16", see drafters/tree_shape.py) drafts a token tree
    with the draft model each step and verifies it in one target forward (k is then unused).
    `generation_config="auto"` fills the temperature, top-k and top-p a call leaves unset from
    the target's generation config, where its authors set them (`models.compat.
    generation_defaults`; `self.generation_defaults`); "none" ignores it: unset means greedy.
    """

    def __init__(
        self,
        target: LoadedModel | Any,
        draft: LoadedModel | Drafter | Any | None = None,
        k: int = 4,
        *,
        k_policy: str | KPolicy = "cost",
        confidence: float | None = None,
        time_forwards: bool = True,
        tree: str | None = None,
        generation_config: str = "auto",
    ) -> None:
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an integer >= 1 (got {k!r})")
        if generation_config not in GENERATION_CONFIG_MODES:
            raise ValueError(
                f"generation_config must be 'auto' or 'none' (got {generation_config!r})"
            )
        self.target = wrap_model(target)
        self.generation_defaults = (
            generation_defaults(self.target.model)
            if generation_config == "auto"
            else SamplingDefaults()
        )
        self.k = k
        self.time_forwards = time_forwards
        self.drafter: Drafter | TreeDrafter | None = make_drafter(
            draft, self.target, tree=tree, confidence=confidence
        )
        if isinstance(k_policy, str):
            prior = (
                prior_cost_ratio(self.target.model, self.drafter)
                if k_policy == "cost" and self.drafter is not None
                else None
            )
            k_policy = make_k_policy(k_policy, k, cost_ratio=prior)
        self.k_policy: KPolicy = k_policy
        self.tokenizer = self.target.tokenizer
        self.eos_token_ids = _eos_ids(self.target)
        self.last_stats: Stats | None = None

    # -- input -------------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """A string (tokenized), a list of token ids (used as is) or chat messages -> ids."""
        if isinstance(prompt, str) or chat:
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass the prompt as token ids")
            ids = self._apply_chat_template(prompt) if chat else self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt ids must be integers")
            vocab = logits_size(self.target.model)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt id {bad[0]} is outside the vocabulary [0, {vocab})")
        if not ids:
            raise ValueError("the prompt is empty")
        return [int(t) for t in ids]

    def _apply_chat_template(self, prompt: Prompt) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template")
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif all(isinstance(m, dict) for m in prompt):
            messages = list(prompt)  # type: ignore[arg-type]
        else:
            raise ValueError("a chat prompt is a string or a list of {'role', 'content'} messages")
        if not messages or not any(m.get("content") for m in messages):
            raise ValueError("the prompt is empty")
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def context_models(self) -> list[tuple[str, Any]]:
        """(role, model) for every model whose context bounds a generation: the target and a
        model drafter (chain or tree)."""
        models = [("target", self.target.model)]
        if isinstance(self.drafter, (ModelDrafter, TreeModelDrafter)):
            models.append(("draft", self.drafter.model))
        return models

    def context_limit(self) -> int | None:
        """The smallest context of the target and a model drafter, when their configs say."""
        limits = [n for n in (context_length(m) for _, m in self.context_models()) if n]
        return min(limits) if limits else None

    def _check_length(self, n_prompt: int, max_new_tokens: int) -> None:
        for role, model in self.context_models():
            limit = context_length(model)
            if limit is not None and n_prompt + max_new_tokens > limit:
                raise ValueError(
                    f"prompt ({n_prompt} tokens) + max_new_tokens ({max_new_tokens}) = "
                    f"{n_prompt + max_new_tokens} exceeds the {role}'s context of {limit} tokens"
                )

    # -- generation --------------------------------------------------------------------------

    def resolve(
        self,
        prompt_ids: list[int],
        request: GenerationRequest,
        clock: Callable[[], float],
        stats: Stats | None = None,
    ) -> RowStart:
        """`request` checked against the models for `prompt_ids` (ValueError before anything
        runs: longer than a model's context, stop strings without a tokenizer), and resolved
        into what its row runs with: the sampling (the model's defaults where the request
        leaves it), the seeded generator, the EOS ids, and `stats` (fresh where None) whose
        meter times the row's forwards on `clock` where this engine times forwards. `generate`
        and `BatchSession.add` both start a row from it."""
        self._check_length(len(prompt_ids), request.max_new_tokens)
        if request.stops and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        params = request.params if request.params is not None else self.sampling_params()
        generator = None if params.greedy else make_generator(self.target.device, request.seed)
        eos = self.eos_token_ids if request.eos_token_ids is None else request.eos_token_ids
        stats = stats if stats is not None else Stats()
        if self.time_forwards:
            stats.meter = ForwardMeter(clock)
        return RowStart(params, generator, eos, stats)

    def sampling_params(
        self,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        *,
        fallback: SamplingParams = GREEDY,
    ) -> SamplingParams:
        """The sampling a call runs: each option as given, else the model's default
        (`generation_defaults`), else `fallback`'s (greedy; the server passes OpenAI's)."""
        return self.generation_defaults.resolve(temperature, top_k, top_p, fallback=fallback)

    def text_stream(self, request: GenerationRequest) -> TextStream:
        """A `TextStream` for `request` to pass to `stream_request(..., text=...)`: the engine
        feeds it each step (its stop check) and the caller reads the text from it."""
        if self.tokenizer is None:
            raise ValueError("text needs a tokenizer: this model has none")
        return TextStream(self.tokenizer, request.stops)

    def stream(
        self,
        prompt: Prompt,
        max_new_tokens: int = 64,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = 0,
        stop: str | Sequence[str] | None = None,
        eos_token_ids: Sequence[int] | None = None,
        chat: bool = False,
        stats: Stats | None = None,
        prefilled: Cache | None = None,
    ) -> Iterator[list[int]]:
        """Yield each step's committed new token ids; `self.last_stats` holds the counters.

        The options are `GenerationRequest`'s (`stream_request` takes one whole); temperature,
        top-k and top-p left None come from the model's generation config where it sets them,
        else greedy (`sampling_params`). Input is validated here, before the first token
        (ValueError on bad input).
        `prefilled`: the target's cache over the prompt ids but the last, computed once
        elsewhere (a `.copy()` of it per run; `lean.target_cache(model)` makes the empty cache
        the target runs on); the run then skips the target's prefill.
        """
        params = self.sampling_params(temperature, top_k, top_p)
        request = GenerationRequest(max_new_tokens, params, seed, stop, eos_token_ids, chat)
        return self.stream_request(prompt, request, stats=stats, prefilled=prefilled)

    def stream_request(
        self,
        prompt: Prompt,
        request: GenerationRequest,
        *,
        stats: Stats | None = None,
        prefilled: Cache | None = None,
        text: TextStream | None = None,
    ) -> Iterator[list[int]]:
        """`stream` with its options as one `GenerationRequest`: yield each step's committed new
        token ids, validated before the first token; `self.last_stats` holds the counters.

        `text` (from `text_stream(request)`): fed each step's ids before they are yielded, so
        that the caller reads the step's text from it (`take`) without decoding again; the
        request's stop strings are checked on it. None: the engine makes one where the request
        has stop strings.
        """
        prompt_ids = self.encode_prompt(prompt, chat=request.chat)
        return self._start(prompt_ids, request, stats, prefilled, text)

    def _start(
        self,
        prompt_ids: list[int],
        request: GenerationRequest,
        stats: Stats | None,
        prefilled: Cache | None = None,
        text: TextStream | None = None,
    ) -> Iterator[list[int]]:
        """Resolve the request against the models (eagerly: bad input fails here, before the
        first token), then start the run."""
        clock = clock_for(self.target.device)
        row = self.resolve(prompt_ids, request, clock, stats)
        if text is None and request.stops:
            text = self.text_stream(request)
        if text is not None and (text.stops != request.stops or text.ids):
            raise ValueError("text must be a fresh text_stream(request) of this request")
        self.last_stats = row.stats
        return self._run(prompt_ids, request.max_new_tokens, row, clock, prefilled, text)

    def _run(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        row: RowStart,
        clock: Callable[[], float],
        prefilled: Cache | None,
        text: TextStream | None,
    ) -> Iterator[list[int]]:
        stats = row.stats
        start = clock()
        steps = decode(
            self.target.model,
            prompt_ids,
            max_new_tokens,
            drafter=self.drafter,
            k=self.k,
            k_policy=self.k_policy,
            params=row.params,
            generator=row.generator,
            eos_token_ids=row.eos_token_ids,
            stats=stats,
            prefilled=prefilled,
            new_cache=target_cache,
        )
        try:
            for committed in steps:
                if not stats.ttft_s:
                    stats.ttft_s = clock() - start
                if text is not None:
                    kept = feed_text(text, committed, stats)
                    if text.stopped:  # a stop string ended the output inside this block
                        if kept:
                            yield kept
                        return
                yield committed
        finally:
            steps.close()
            stats.wall_time_s = clock() - start

    def generate(
        self,
        prompt: Prompt,
        max_new_tokens: int = 64,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = 0,
        stop: str | Sequence[str] | None = None,
        eos_token_ids: Sequence[int] | None = None,
        chat: bool = False,
    ) -> GenerationResult:
        """Generate and return the new token ids, their text and the stats of the run (the
        options are `GenerationRequest`'s; `generate_request` takes one whole). Temperature,
        top-k and top-p left None come from the model's generation config where it sets them,
        else greedy (`sampling_params`)."""
        params = self.sampling_params(temperature, top_k, top_p)
        request = GenerationRequest(max_new_tokens, params, seed, stop, eos_token_ids, chat)
        return self.generate_request(prompt, request)

    def generate_request(self, prompt: Prompt, request: GenerationRequest) -> GenerationResult:
        """`generate` with its options as one `GenerationRequest`: the new token ids, their
        text and the stats of the run."""
        stats = Stats()
        prompt_ids = self.encode_prompt(prompt, chat=request.chat)
        chunks = self._start(prompt_ids, request, stats)
        token_ids = [t for chunk in chunks for t in chunk]
        return self._result(prompt_ids, token_ids, stats, request)

    def _result(
        self, prompt_ids: list[int], token_ids: list[int], stats: Stats, request: GenerationRequest
    ) -> GenerationResult:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
            if stats.stop_reason == "stop":
                text = _cut_at_stop(text, request.stops)
        return GenerationResult(token_ids, text, stats, prompt_ids)

    # -- many at once --------------------------------------------------------------------------

    def batch_session(
        self,
        max_rows: int = 8,
        max_len: int | None = None,
        prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
    ) -> BatchSession:
        """A `BatchSession` over this decoder: up to `max_rows` generations decoding together,
        each of up to `max_len` positions (prompt + new tokens), keeping what freed rows held
        in up to `prefix_cache_mb` of host memory; what a server drives."""
        return BatchSession(self, max_rows, max_len, prefix_cache_mb)

    def generate_batch(
        self,
        prompts: Sequence[Prompt],
        max_new_tokens: int = 64,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = 0,
        stop: str | Sequence[str] | None = None,
        eos_token_ids: Sequence[int] | None = None,
        chat: bool = False,
        *,
        max_batch: int | None = None,
    ) -> list[GenerationResult]:
        """`generate` for every prompt, decoded together (batch.py): one `GenerationResult`
        per prompt, in order, each with its own stats. `max_batch` rows at a time (default: all
        of them); every row uses the same options (the seed seeds each row's generator, so a
        sampled row draws what it would alone with that seed and a fixed k). All prompts are
        validated before any runs."""
        if isinstance(prompts, str) or not len(prompts):
            raise ValueError("generate_batch takes a non-empty list of prompts")
        params = self.sampling_params(temperature, top_k, top_p)
        request = GenerationRequest(max_new_tokens, params, seed, stop, eos_token_ids, chat)
        lengths = [len(self.encode_prompt(prompt, chat=chat)) for prompt in prompts]
        for n in lengths:  # validate all first: a bad prompt must not cost the others
            self._check_length(n, max_new_tokens)
        rows = max_batch if max_batch is not None else len(prompts)
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"max_batch must be an integer >= 1 (got {max_batch!r})")
        # the store holds what these prompts need, no more
        session = self.batch_session(min(rows, len(prompts)), max(lengths) + max_new_tokens)
        done = session.generate_all(prompts, request)
        return [self._result(g.prompt_ids, g.token_ids, g.stats, request) for g in done]


def _cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """The text before the earliest stop string (OpenAI semantics: the stop is not returned)."""
    cuts = [text.find(s) for s in stops if s in text]
    return text[: min(cuts)] if cuts else text
