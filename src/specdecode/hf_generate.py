"""A drop-in for Hugging Face users: `model.generate(...)` running specdecode's speculative loop.

transformers (>= 4.56, 5.x) lets `generate(custom_generate=...)` replace its decoding loop, with a
callable or with a folder ("repo") holding `custom_generate/generate.py`. Both are offered:

    from specdecode.hf_generate import CUSTOM_GENERATE, speculative

    # the assistant_model spelling of HF's own assisted generation (a local "repo": transformers
    # asks for trust_remote_code, as for any custom_generate folder)
    out = model.generate(**inputs, assistant_model=draft, custom_generate=CUSTOM_GENERATE,
                         trust_remote_code=True, max_new_tokens=64)

    # a callable: no trust_remote_code, the draft is bound to it
    out = model.generate(**inputs, custom_generate=speculative(draft, k=4), max_new_tokens=64)

`out` is what `generate` returns: the prompt and new ids as a [1, n] LongTensor, or a
`GenerateDecoderOnlyOutput` whose `sequences` they are (`return_dict_in_generate=True`). Greedy
(`do_sample=False`) output equals the target's own greedy `generate`, token for token (lossless,
docs/architecture.md, Invariants 1); sampling (`do_sample=True`) draws from the same distribution,
with `temperature`, `top_k` and `top_p` from the generation config (HF's default top_k of 50
included) and a seed drawn from torch's global generator, so `torch.manual_seed` reproduces a run.

Batch size 1 only. The generation config's EOS ids and max_length/max_new_tokens are honoured;
what would change the target's distribution or needs per-token data (other logits processors,
stopping criteria other than length and EOS, beams, several sequences, scores, attentions, hidden
states) is refused with a ValueError that names it, never silently ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from specdecode.models.loading import LoadedModel
from specdecode.runtime.engine import SpeculativeDecoder

#: The folder to pass as `custom_generate=` with `assistant_model=` (transformers' "repo" form)
CUSTOM_GENERATE = str(Path(__file__).resolve().parent / "hf_custom_generate")

# what specdecode reproduces itself: the sampling warpers (SamplingParams) and the stops
_WARPERS = {"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"}
_CRITERIA = {"MaxLengthCriteria", "EosTokenCriteria"}
_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


class SpeculativeGenerate:
    """A `custom_generate` callable: speculative decoding of the model `generate` is called on,
    drafted by `draft` (a transformers model, a loaded model, any Drafter; None: the target
    alone), `k` tokens a step. `streamer` (e.g. a TextStreamer) gets each step's new ids."""

    def __init__(self, draft: Any = None, k: int = 4, streamer: Any = None) -> None:
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an integer >= 1 (got {k!r})")
        self.draft, self.k, self.streamer = draft, k, streamer

    def __call__(
        self,
        model: Any,
        input_ids: torch.Tensor,
        logits_processor: Any,
        stopping_criteria: Any,
        generation_config: Any,
        **model_kwargs: Any,
    ) -> Any:
        """What transformers calls in place of its decoding loop, after preparing the inputs
        and the generation config (input_ids: [1, n_prompt])."""
        _check_request(input_ids, model_kwargs.get("attention_mask"), generation_config)
        _check_supported(logits_processor, stopping_criteria)
        max_new = generation_config.max_length - input_ids.shape[1]
        new_ids = self._generate(model, input_ids[0].tolist(), max_new, generation_config)
        tail = torch.tensor([new_ids], dtype=input_ids.dtype, device=input_ids.device)
        sequences = torch.cat([input_ids, tail], dim=1)  # [1, n_prompt + n_new]
        if generation_config.return_dict_in_generate:
            return GenerateDecoderOnlyOutput(sequences=sequences)
        return sequences

    def _generate(self, model: Any, prompt: list[int], max_new: int, config: Any) -> list[int]:
        if max_new < 1:
            return []
        # LoadedModel as is: the models keep their train/eval mode, as with HF's own generate
        target = LoadedModel(model, name=type(model).__name__)
        draft = self.draft
        if draft is not None and hasattr(draft, "generation_config"):  # a transformers model
            draft = LoadedModel(draft, name=type(draft).__name__)
        # "none": `config` is transformers' prepared one, the model's generation config merged
        # in already, and its None values mean "off" (e.g. no top-k), not "the model's"
        engine = SpeculativeDecoder(
            target, draft, k=self.k, k_policy="fixed", generation_config="none"
        )
        sampling = _sampling(config)
        seed = None
        if sampling["temperature"] > 0:  # HF samples from torch's global generator: so do we
            seed = int(torch.randint(0, 2**62, (1,)).item())
        args = dict(max_new_tokens=max_new, seed=seed, eos_token_ids=_eos_ids(config), **sampling)
        if self.streamer is None:
            return engine.generate(prompt, **args).token_ids
        new_ids: list[int] = []
        # the prompt first, as transformers does (TextStreamer(skip_prompt=True) skips this put)
        self.streamer.put(torch.tensor([prompt], dtype=torch.long))
        for committed in engine.stream(prompt, **args):
            new_ids.extend(committed)
            self.streamer.put(torch.tensor(committed, dtype=torch.long))
        self.streamer.end()
        return new_ids


def speculative(draft: Any = None, k: int = 4, *, streamer: Any = None) -> SpeculativeGenerate:
    """The callable to pass as `model.generate(..., custom_generate=speculative(draft, k))`."""
    return SpeculativeGenerate(draft, k, streamer)


def generate_with_assistant(
    model: Any, *, assistant_model: Any = None, streamer: Any = None, k: int = 4, **arguments: Any
) -> Any:
    """What transformers calls for `custom_generate=CUSTOM_GENERATE`: `generate`'s own arguments,
    unprepared. The assistant (and a streamer) are bound to a `SpeculativeGenerate` and `generate`
    runs again with it, so that transformers prepares the inputs and the config as usual."""
    arguments.pop("custom_generate", None)
    return model.generate(
        **arguments, custom_generate=SpeculativeGenerate(assistant_model, k, streamer)
    )


# -- checks and config ------------------------------------------------------------------------


def _check_request(input_ids: torch.Tensor, attention_mask: Any, config: Any) -> None:
    # first: transformers has already repeated the prompt num_beams times
    if (config.num_beams or 1) > 1 or (config.num_return_sequences or 1) > 1:
        raise ValueError(
            "specdecode's custom_generate draws one sequence: num_beams and "
            "num_return_sequences must be 1"
        )
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(
            f"specdecode's custom_generate runs one sequence at a time (batch size 1); got "
            f"input_ids of shape {tuple(input_ids.shape)}: call generate once per prompt"
        )
    if attention_mask is not None and not bool((attention_mask == 1).all()):
        raise ValueError("specdecode's custom_generate takes no padding (an all-ones mask)")
    asked = [name for name in _OUTPUTS if getattr(config, name, False)]
    if asked:
        raise ValueError(f"specdecode's custom_generate returns sequences only, not {asked}")


def _check_supported(logits_processor: Any, stopping_criteria: Any) -> None:
    """Refuse what specdecode does not reproduce: it would change the output silently."""
    processors = [type(p).__name__ for p in logits_processor or []]
    criteria = [type(c).__name__ for c in stopping_criteria or []]
    other = [n for n in processors if n not in _WARPERS] + [
        n for n in criteria if n not in _CRITERIA
    ]
    if other:
        raise ValueError(
            f"specdecode's custom_generate supports temperature, top_k, top_p, EOS and the "
            f"length limits only; this call also uses {', '.join(other)}"
        )


def _sampling(config: Any) -> dict[str, Any]:
    """SamplingParams' fields from the prepared generation config (greedy unless do_sample)."""
    if not config.do_sample:
        return {"temperature": 0.0, "top_k": None, "top_p": None}
    top_k = config.top_k if config.top_k else None  # HF: 0 or None = no top-k
    top_p = config.top_p if config.top_p is not None and config.top_p < 1.0 else None
    temperature = 1.0 if config.temperature is None else float(config.temperature)
    return {"temperature": temperature, "top_k": top_k, "top_p": top_p}


def _eos_ids(config: Any) -> list[int]:
    eos = config.eos_token_id
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]
