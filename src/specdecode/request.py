"""One generation's options as one object: how many tokens, how to sample, when to stop."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from specdecode.sampling import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    """What one generation asks for, checked once here (ValueError on bad input).

    What depends on the model (the prompt, the context length, a tokenizer for stop strings) is
    checked by `SpeculativeDecoder` when the request runs.
    """

    max_new_tokens: int = 64
    params: SamplingParams = field(default_factory=SamplingParams)  # temperature, top-k, top-p
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
