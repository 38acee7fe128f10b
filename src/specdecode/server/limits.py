"""Limits checked before work is spent on a request: body size, stop strings, prompt length.

The order is the cost order: the body's size while it is read (middleware.py), the stop list when
the body is validated (schemas.py), the prompt's characters on the event loop before anything is
tokenized (here), the prompt's tokens on the worker (worker.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specdecode.server.errors import APIError

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # 4 MiB: a full 128k-token context is ~0.5 MiB of text
# a prompt longer than this is prefilled in parts between the running rows' steps (worker.py):
# lean.VERIFY_TOKENS, so that every part takes the fused path, whose keys and values do not
# depend on the split
PREFILL_CHUNK = 128
# runtime/session.py's DEFAULT_PREFIX_CACHE_MB, repeated so that the CLI starts without torch
DEFAULT_PREFIX_CACHE_MB = 1024
MAX_STOPS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256  # per stop string; each one is searched for after every step


def longest_token_chars(tokenizer: Any) -> int | None:
    """The longest vocabulary entry, in characters of the tokenizer's own alphabet.

    One token covers at most that many characters of a prompt for the BPE, byte-level and
    SentencePiece tokenizers served here (their entries spell the bytes or characters they stand
    for), so a prompt of more than `tokens * longest` characters cannot fit in `tokens` tokens.
    None when the tokenizer does not list its vocabulary.
    """
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError, TypeError):
        return None
    return max((len(entry) for entry in vocab), default=None)


def prompt_char_limit(token_limit: int | None, tokenizer: Any) -> int | None:
    """The characters above which a prompt cannot fit in `token_limit` tokens (None: unknown)."""
    longest = longest_token_chars(tokenizer) if token_limit is not None else None
    return None if token_limit is None or longest is None else token_limit * max(longest, 1)


def prompt_size(prompt: str | Sequence[int] | Sequence[dict[str, str]]) -> tuple[int, str]:
    """(size, unit): characters of a text or chat prompt, or tokens of a prompt given as ids."""
    if isinstance(prompt, str):
        return len(prompt), "characters"
    if prompt and isinstance(prompt[0], dict):
        return sum(len(m.get("content") or "") for m in prompt), "characters"  # type: ignore[union-attr]
    return len(prompt), "tokens"


def check_prompt_size(
    prompt: Any, param: str, *, max_chars: int | None, max_tokens: int | None
) -> None:
    """APIError 400 for a prompt that surely does not fit, found without tokenizing it."""
    size, unit = prompt_size(prompt)
    limit = max_chars if unit == "characters" else max_tokens
    if limit is not None and size > limit:
        raise APIError(
            400,
            f"the prompt has {size} {unit}, more than this server accepts ({limit} {unit})",
            param=param,
            code="context_length_exceeded",
        )
