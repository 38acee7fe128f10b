"""One generation's options as one object: how many tokens, how to sample, when to stop; and
the one place where sampling options a caller leaves unset get their values (`SamplingDefaults`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

from specdecode.core.sampling import SamplingParams
from specdecode.core.types import Stats

GREEDY = SamplingParams()  # the Python API's and the CLI's last resort: temperature 0


@dataclass(frozen=True)
class SamplingDefaults:
    """The sampling values used where a call leaves temperature, top-k or top-p unset: the
    model's generation config's (`models.compat.generation_defaults`), or none
    (`generation_config="none"`). None = the model does not say."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None

    def resolve(
        self,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        *,
        fallback: SamplingParams = GREEDY,
    ) -> SamplingParams:
        """Each option: the caller's value, else this default, else `fallback`'s (ValueError on
        bad values). top_p 1.0 means no top-p, as None does."""

        def pick(asked: Any, default: Any, last: Any) -> Any:
            return asked if asked is not None else default if default is not None else last

        params = SamplingParams(
            temperature=pick(temperature, self.temperature, fallback.temperature),
            top_k=pick(top_k, self.top_k, fallback.top_k),
            top_p=pick(top_p, self.top_p, fallback.top_p),
        )  # checks the values
        return replace(params, top_p=None) if params.top_p == 1.0 else params

    def as_dict(self) -> dict[str, float | int]:
        """The values the model sets, by name (what `/v1/models` reports)."""
        values = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}
        return {name: value for name, value in values.items() if value is not None}


@dataclass
class RowStart:
    """One request resolved against its models: what its row runs with
    (`SpeculativeDecoder.resolve`, the one place a request becomes a row's inputs)."""

    params: SamplingParams  # the request's sampling, the model's defaults where it left them
    generator: Any  # torch.Generator seeded by the request; None for greedy
    eos_token_ids: Collection[int]  # the request's, else the model's
    stats: Stats  # the row's counters; its meter times the row's forwards where timed


@dataclass(frozen=True)
class GenerationRequest:
    """What one generation asks for, checked once here (ValueError on bad input).

    What depends on the model (the prompt, the context length, a tokenizer for stop strings) is
    checked by `SpeculativeDecoder` when the request runs.
    """

    max_new_tokens: int = 64
    # temperature, top-k, top-p; None = the model's defaults (its generation config) where it
    # sets them, else greedy (resolved by the engine: `SpeculativeDecoder.sampling_params`)
    params: SamplingParams | None = None
    seed: int | None = 0  # the sampling generator's seed; None = a random one (greedy: unused)
    # the output ends before the first of these strings (OpenAI semantics); a str is one stop
    stop: str | Sequence[str] | None = ()
    eos_token_ids: Collection[int] | None = None  # ids ending the output; None = the model's
    chat: bool = False  # the prompt goes through the tokenizer's chat template

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(
                f"max_new_tokens must be an integer >= 1 (got {self.max_new_tokens!r})"
            )
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        # frozen: normalise through object.__setattr__ (stop -> a tuple, EOS ids -> a frozenset)
        object.__setattr__(self, "stop", stops)
        if self.eos_token_ids is not None:
            object.__setattr__(self, "eos_token_ids", frozenset(self.eos_token_ids))

    @property
    def stops(self) -> tuple[str, ...]:
        """The stop strings, as a tuple."""
        return self.stop  # type: ignore[return-value]  # normalised in __post_init__
