"""The methods a benchmark compares, each run the same way: ids in, ids and timings out.

- `ar`: our target alone (the baseline); `spec`: our speculative decoding, one setting per
  (draft, k, k policy);
- `hf-ar`: Hugging Face `generate` alone (the peer's own baseline); `hf-assisted`: `generate(
  assistant_model=draft)` with HF's default schedule or a constant k; `hf-prompt-lookup`:
  `generate(prompt_lookup_num_tokens=k)`.

Every method gets the same prompt ids, the same end-of-sequence ids and the same sampling
parameters; new tokens are counted from the returned ids. Time to first token is taken where the
first generated tokens appear (our step loop, HF's streamer), so prefill is kept apart from decode.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from specdecode.config import RunConfig
from specdecode.core.cache import Cache, KVCache
from specdecode.core.measure import clock_for
from specdecode.core.request import GenerationRequest
from specdecode.core.sampling import SamplingParams
from specdecode.core.types import Stats
from specdecode.drafters.eagle import EagleDrafter
from specdecode.drafters.model import ModelDrafter
from specdecode.drafters.suffix import SuffixDrafter, pool_of
from specdecode.models.compat import tokenizer_difference
from specdecode.models.lean import target_cache
from specdecode.models.loading import LoadedModel
from specdecode.runtime.engine import SpeculativeDecoder

OUR_METHODS = ("ar", "spec")
HF_METHODS = ("hf-ar", "hf-assisted", "hf-prompt-lookup")
ALL_METHODS = OUR_METHODS + HF_METHODS
# HF's prompt lookup matches up to this many trailing tokens (its default, made explicit)
HF_PROMPT_LOOKUP_NGRAM = 2


@dataclass(frozen=True)
class Setting:
    """One column of the comparison: a method and its parameters."""

    method: str  # one of ALL_METHODS
    draft: str | None = None  # draft label for spec / hf-assisted
    k: int = 0  # look-ahead (0 for ar / hf-ar and for HF's default schedule)
    policy: str = "fixed"  # spec: k policy; hf-assisted: "default" or "constant"
    tree: str | None = None  # spec: a token-tree shape ("static:3,2,1" / "dynamic:16"), k unused
    # a tuned config (`bench --config`): the setting each prompt category runs instead of this one
    per_category: tuple[tuple[str, Setting], ...] = ()

    @property
    def label(self) -> str:
        if self.method in ("ar", "hf-ar"):
            return self.method
        if self.per_category:
            return "spec[tuned]"
        if self.tree is not None:
            return f"{self.method}[{self.draft}] tree={self.tree}"
        if self.method == "hf-prompt-lookup":
            return f"hf-prompt-lookup k={self.k}"
        if self.method == "hf-assisted" and self.policy == "default":
            return f"hf-assisted[{self.draft}] default"
        policy = "" if self.policy in ("fixed", "constant") else f" {self.policy}"
        return f"{self.method}[{self.draft}] k={self.k}{policy}"

    def for_category(self, category: str) -> Setting:
        """What runs on a prompt of `category`: its tuned override, else this setting's own."""
        return dict(self.per_category).get(category) or replace(self, per_category=())


def tuned_setting(run: RunConfig) -> Setting:
    """`bench --config`: the config's drafting as one setting, per category where it says so."""

    def setting(values: RunConfig, where: str) -> Setting:
        if values.draft is None:
            raise ValueError(f"bench --config needs a draft {where}: the config is autoregressive")
        if values.tree:  # as plan_settings makes a tree: no k, no k policy
            return Setting("spec", values.draft, 0, "fixed", values.tree)
        return Setting("spec", values.draft, values.k, values.k_policy)

    base = setting(run, "overall")
    overrides = tuple(
        (name, setting(run.for_category(name), f"for {name!r}")) for name in run.per_category
    )
    return replace(base, per_category=overrides)


def config_drafts(run: RunConfig, categories: list[str]) -> list[str]:
    """The drafts a run config uses on prompts of `categories`."""
    drafts = [run.for_category(name).draft for name in categories]
    return [d for d in dict.fromkeys(drafts) if d is not None]


@dataclass
class RunOutput:
    """What one generation produced and how long it took (seconds from the call)."""

    token_ids: list[int]
    wall_time_s: float
    ttft_s: float  # until the first generated tokens were available
    first_chunk: int  # tokens available at ttft (1 where the prefill gives the first token)
    stats: Stats | None = None  # our methods only: the core's counters
    prefill_s: float | None = None  # our methods only: time in the prompt prefill forwards


def plan_settings(
    methods: list[str],
    drafts: dict[str, Any],
    ks: list[int],
    policies: list[str],
    trees: list[str] = (),  # type: ignore[assignment]
    hf_ks: list[int] | None = None,
    target: LoadedModel | None = None,
) -> list[Setting]:
    """Every setting the requested methods imply; methods that do not apply are left out.

    `drafts` maps a draft label to what `resolve_draft` made of it: hf-assisted applies only to
    draft models (a `LoadedModel`), token trees to those, early exit and EAGLE-3 heads,
    hf-prompt-lookup needs
    none; a draft model of another tokenizer than `target`'s drafts chains only, so it gets no
    tree (said on stderr). HF's constant-k settings use `hf_ks` (default: the same ks as ours).
    """
    hf_ks = ks if hf_ks is None else hf_ks
    unknown = [m for m in methods if m not in ALL_METHODS]
    if unknown:
        raise ValueError(f"unknown method {unknown[0]!r}: choose from {', '.join(ALL_METHODS)}")
    settings: list[Setting] = []
    for method in methods:
        if method in ("ar", "hf-ar"):
            settings.append(Setting(method))
        elif method == "spec":
            settings += [
                # a suffix draft sizes its own trees: no k to vary
                Setting("spec", label, 0 if isinstance(drafts[label], SuffixDrafter) else k, policy)
                for label in drafts
                for policy in policies
                for k in (ks[:1] if isinstance(drafts[label], SuffixDrafter) else ks)
            ]
            growing = [
                label
                for label, draft in drafts.items()
                # a model, early exit or an EAGLE-3 head
                if isinstance(draft, (LoadedModel, ModelDrafter, EagleDrafter))
            ]
            if trees and target is not None:
                other = [
                    label
                    for label in growing
                    if isinstance(drafts[label], LoadedModel)
                    and tokenizer_difference(target, drafts[label]) is not None
                ]
                if other:
                    print(
                        f"note: no --tree for {', '.join(other)}: a draft of another tokenizer "
                        "drafts chains",
                        file=sys.stderr,
                    )
                growing = [label for label in growing if label not in other]
            settings += [
                Setting("spec", label, 0, "fixed", tree) for label in growing for tree in trees
            ]
        elif method == "hf-assisted":
            for label, draft in drafts.items():
                if isinstance(draft, LoadedModel):
                    settings.append(Setting("hf-assisted", label, 0, "default"))
                    settings += [Setting("hf-assisted", label, k, "constant") for k in hf_ks]
        elif method == "hf-prompt-lookup":
            settings += [Setting("hf-prompt-lookup", None, k) for k in hf_ks]
    return settings


class MethodRunner:
    """Runs any `Setting` on prompt ids with one target and its drafts, engines built once."""

    def __init__(
        self,
        target: LoadedModel,
        drafts: dict[str, Any],
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
    ) -> None:
        self.target = target
        self.drafts = drafts
        self.params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        self.seed = seed
        self._engines: dict[Setting, SpeculativeDecoder] = {}
        self.ar_engine = SpeculativeDecoder(target)
        self.eos_token_ids = sorted(self.ar_engine.eos_token_ids)
        self.clock: Callable[[], float] = clock_for(target.device)

    def engine(self, setting: Setting) -> SpeculativeDecoder:
        if setting.method == "ar":
            return self.ar_engine
        if setting not in self._engines:
            options: dict[str, Any] = {"k_policy": setting.policy}
            if setting.tree is not None:
                options["tree"] = setting.tree
            self._engines[setting] = SpeculativeDecoder(
                self.target, self.drafts[setting.draft], k=max(setting.k, 1), **options
            )
        return self._engines[setting]

    def run(
        self,
        setting: Setting,
        prompt_ids: list[int],
        max_new_tokens: int,
        prefilled: Cache | None = None,
    ) -> RunOutput:
        """One generation. `prefilled` (the target's cache over prompt_ids[:-1]) is copied and
        reused by the methods that can take it (`takes_prefill`); the others prefill. HF's
        `generate` takes only a Hugging Face cache: where our target runs lean, it prefills."""
        if not takes_prefill(setting) or (
            setting.method in HF_METHODS and not isinstance(prefilled, KVCache)
        ):
            prefilled = None
        if setting.method in OUR_METHODS:
            return self._run_ours(setting, prompt_ids, max_new_tokens, prefilled)
        return self._run_hf(setting, prompt_ids, max_new_tokens, prefilled)

    def prefill(self, prompt_ids: list[int]) -> tuple[Cache, float]:
        """The target's cache over prompt_ids[:-1] (the one our methods run on:
        `lean.target_cache`), and the seconds it took."""
        cache = target_cache(self.target.model)
        start = self.clock()
        with torch.inference_mode():
            if len(prompt_ids) > 1:
                ids = torch.tensor(prompt_ids[:-1], device=self.target.device)
                cache.forward(ids, last_only=True)
        return cache, self.clock() - start

    def _run_ours(
        self, setting: Setting, ids: list[int], max_new_tokens: int, prefilled: Cache | None
    ) -> RunOutput:
        engine = self.engine(setting)
        pool = pool_of(engine.drafter)
        if pool is not None:  # each generation drafts from itself alone: prompts and repeats
            pool.clear()  # would otherwise find each other's outputs (docs/usage.md)
        stats = Stats()
        request = GenerationRequest(max_new_tokens, self.params, self.seed)
        prefilled = prefilled.copy() if prefilled is not None else None
        chunks = engine.stream_request(ids, request, stats=stats, prefilled=prefilled)
        blocks = list(chunks)
        tokens = [t for block in blocks for t in block]
        first = len(blocks[0]) if blocks else 0
        return RunOutput(tokens, stats.wall_time_s, stats.ttft_s, first, stats, stats.prefill_s)

    def _run_hf(
        self, setting: Setting, ids: list[int], max_new_tokens: int, prefilled: KVCache | None
    ) -> RunOutput:
        # slow import (transformers, ~1 s): bench.methods is imported by the command line's
        # parser; transformers only when the HF baseline runs
        from transformers import GenerationConfig

        model = self.target.model
        greedy = self.params.greedy
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else self.params.temperature,
            top_k=None if greedy else (self.params.top_k or 0),
            top_p=None if greedy else self.params.top_p,
            eos_token_id=self.eos_token_ids or None,
            pad_token_id=self.eos_token_ids[0] if self.eos_token_ids else 0,
        )
        extra: dict[str, Any] = {}
        if setting.method == "hf-assisted":
            draft = self.drafts[setting.draft]
            assistant = draft.model
            _set_assistant_schedule(assistant, setting)
            extra["assistant_model"] = assistant
            if tokenizer_difference(self.target, draft) is not None:
                # another tokenizer: HF's universal assisted generation drafts through text
                extra["tokenizer"] = self.target.tokenizer
                extra["assistant_tokenizer"] = draft.tokenizer
        elif setting.method == "hf-prompt-lookup":
            config.prompt_lookup_num_tokens = setting.k
            config.max_matching_ngram_size = HF_PROMPT_LOOKUP_NGRAM
        if prefilled is not None:  # generate() runs only the prompt tokens the cache lacks
            extra[prefilled.cache_kwarg] = prefilled.copy().hf
        inputs = torch.tensor([ids], device=self.target.device)
        timer = _FirstTokens(self.clock)
        if not greedy:
            torch.manual_seed(self.seed)
        # generate() fills every field `config` leaves unset from the model's own generation
        # config (a hub model's repetition penalty, top-p, ...): run against a neutral one
        saved = model.generation_config
        model.generation_config = GenerationConfig(
            eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
        )
        try:
            timer.start = self.clock()
            with torch.inference_mode():
                out = model.generate(
                    inputs,
                    attention_mask=torch.ones_like(inputs),
                    generation_config=config,
                    streamer=timer,
                    **extra,
                )
            wall = self.clock() - timer.start
        finally:
            model.generation_config = saved
        tokens = out[0, len(ids) :].tolist()
        ttft = timer.ttft if timer.ttft is not None else wall
        return RunOutput(tokens, wall, ttft, timer.first_chunk or len(tokens))


def takes_prefill(setting: Setting) -> bool:
    """Whether a method can start from a pre-filled target cache with unchanged output.

    Ours and plain HF generate can. HF's assisted generation and prompt lookup cannot: in
    transformers 5.24 their greedy output changes when generate() gets a pre-filled cache.
    """
    return setting.method in ("ar", "spec", "hf-ar")


def _set_assistant_schedule(assistant: Any, setting: Setting) -> None:
    """HF reads the assisted schedule from the assistant's generation config."""
    config = assistant.generation_config
    if setting.policy == "default":  # None: HF's own defaults apply
        config.num_assistant_tokens = None
        config.num_assistant_tokens_schedule = None
        config.assistant_confidence_threshold = None
    else:
        config.num_assistant_tokens = setting.k
        config.num_assistant_tokens_schedule = "constant"
        config.assistant_confidence_threshold = 0.0  # no early stop: exactly k drafts


class _FirstTokens:
    """A `generate` streamer that notes when the first generated tokens arrive."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.start = 0.0
        self.ttft: float | None = None
        self.first_chunk = 0
        self._puts = 0

    def put(self, value: torch.Tensor) -> None:
        self._puts += 1
        if self._puts == 1:  # HF first puts the prompt itself
            return
        if self.ttft is None:
            self.ttft = self.clock() - self.start
            self.first_chunk = int(value.numel())

    def end(self) -> None:
        pass
