"""Request bodies of the OpenAI endpoints, validated strictly (pydantic v2).

Strict types (no "5" for 5, no true for 1), OpenAI's ranges, and a clear 400 for parameters OpenAI
knows but this server does not implement (n > 1, echo, penalties, tools, ...). Parameters
nobody here knows are ignored, as OpenAI clients expect. Every text that reaches the tokenizer
(the prompt, the messages' content, the stop strings) must be valid Unicode: JSON can spell a lone
UTF-16 surrogate ("\ud800"), which no tokenizer takes (400 `invalid_unicode`, naming the field).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from specdecode.server.limits import MAX_STOP_CHARS, MAX_STOPS
from specdecode.server.logprobs import MAX_TOP_CHAT, MAX_TOP_COMPLETIONS

# torch.Generator.manual_seed accepts [-2**63, 2**64)
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


def _unsupported(name: str, what: str) -> ValueError:
    return ValueError(f"{name} is not supported by this server ({what})")


def check_unicode(text: str, where: str) -> str:
    """`text`, or a validation error (`invalid_unicode`) naming `where` (e.g. "messages[0].content")
    if it holds a lone UTF-16 surrogate: valid in a JSON string's escapes and a Python str, but no
    Unicode character, so no tokenizer can take it (the client's error, not the server's)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        message = (
            f"{where}: the text holds a lone UTF-16 surrogate (U+{code:04X}) at character "
            f"{err.start}, which is no Unicode character: send the text as UTF-8, or a character "
            "beyond U+FFFF as a surrogate pair"
        )
        raise PydanticCustomError("invalid_unicode", message) from None
    return text


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _GenerationBody(BaseModel):
    """The parameters both endpoints share."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    # OpenAI's ranges; unset (or null): the model's generation config where it sets a value,
    # else OpenAI's defaults, temperature 1 and top_p 1 (worker.OPENAI_SAMPLING); 0 = greedy
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)  # an extension (vLLM and others accept it too)
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    # known to OpenAI clients, accepted only at their neutral values
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise _unsupported("n", "one choice per request: send n=1")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None, info: Any) -> float | None:
        if value:
            raise _unsupported(info.field_name, "penalties would change the target's distribution")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:
            raise _unsupported("logit_bias", "it would change the target's distribution")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > MAX_STOPS:
            raise ValueError(f"stop: at most {MAX_STOPS} stop strings (got {len(stops)})")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(
                f"stop: a stop string has at most {MAX_STOP_CHARS} characters (got {longest})"
            )
        for i, stop in enumerate(stops):
            check_unicode(stop, "stop" if isinstance(value, str) else f"stop[{i}]")
        return value

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionBody(_GenerationBody):
    """`POST /v1/completions`."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    # each token's log-probability and its `logprobs` likeliest alternatives (0: none)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_COMPLETIONS)

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise _unsupported("echo", "the prompt is not returned")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise _unsupported("suffix", "no insertion mode")
        return value

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise _unsupported("best_of", "one candidate per request: send best_of=1")
        return value

    @property
    def logprob_count(self) -> int | None:
        """The alternatives per token to return with its logprob; None: no logprobs."""
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        """A string or token ids; a batch of one is unwrapped, larger batches are refused."""
        where = "prompt"
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            prompt, where = prompt[0], "prompt[0]"
        if not prompt:
            raise ValueError("must not be empty")
        if isinstance(prompt, str):
            check_unicode(prompt, where)
        return prompt


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_message(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        # chat templates know "system"; "developer" is OpenAI's newer name for it
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionBody(_GenerationBody):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None  # each token's log-probability
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_CHAT)  # and its likeliest alternatives
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _unicode(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        for i, message in enumerate(messages):
            if isinstance(message.content, str):
                check_unicode(message.content, f"messages[{i}].content")
            for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
                check_unicode(part.text, f"messages[{i}].content[{j}].text")
        return messages

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: Any) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @property
    def logprob_count(self) -> int | None:
        """The alternatives per token to return with its logprob; None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value: list[Any] | None, info: Any) -> list[Any] | None:
        if value:
            raise _unsupported(info.field_name, "no tool calling")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "text") != "text":
            raise _unsupported("response_format", "only plain text output")
        return value

    def template_messages(self) -> list[dict[str, str]]:
        return [m.as_template_message() for m in self.messages]

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
