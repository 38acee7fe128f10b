"""The order `run-batch` takes a batch file's requests in: the longest shared prompt first.

A row that ends leaves its keys and values in its store row, and the next request to join takes
the free row sharing the longest prefix with its prompt (the kept prefix, docs/architecture.md
"Prefix reuse"): only the rest is prefilled. A server answers requests as they come; a batch job
holds them all, so it can choose. With exactly `max_batch` requests in flight the row a finished
request frees is the one the next joins, so `PrefixOrder.after` hands out the pending request
whose prompt shares the most tokens with the one that finished (a shared instruction, the same
document under another question, a repeated request). The first requests are spread over the
prompts' sorted order, so that rows beginning together share as little as possible.

Only the order changes: each answer is the one its body gets alone, in any order (kept prefixes
are bit for bit what a fresh prefill computes), and the output is rewritten in the input's order.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError

from specdecode.server.batch_file import CHAT, BatchRequest
from specdecode.server.schemas import ChatCompletionBody, CompletionBody

# a prompt's token ids, 4 bytes each, big-endian: bytes order as the ids' tuples do, in a
# fraction of the memory (a batch file's prompts are all held at once)
Key = bytes
ID_BYTES = 4


def key_of(ids: Sequence[int]) -> Key:
    return struct.pack(f">{len(ids)}I", *ids)


def prompt_key(encode: Callable[[Any, bool], list[int]], request: BatchRequest) -> Key:
    """The token ids the server will prefill for `request` (`encode`: the engine's
    `encode_prompt`); empty for a line whose body the server will refuse (it ends at once)."""
    if request.error is not None or request.body is None:
        return b""
    try:
        if request.url == CHAT:
            chat = ChatCompletionBody.model_validate(request.body)
            return key_of(encode(chat.template_messages(), True))
        completion = CompletionBody.model_validate(request.body)
        return key_of(encode(completion.prompt, False))
    except (ValidationError, ValueError, TypeError, struct.error):
        return b""


def shared(a: Key, b: Key) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i // ID_BYTES


class PrefixOrder:
    """The pending requests sorted by their prompts' token ids: `first(n)` to begin, then
    `after(key)` each time a request of prompt `key` ends. Not thread safe (one event loop)."""

    def __init__(self, requests: list[BatchRequest], keys: list[Key]) -> None:
        # (key, input position): equal prompts keep the input's order
        self._items = sorted(zip(keys, range(len(keys)), strict=True))
        self._requests = requests

    def __len__(self) -> int:
        return len(self._items)

    def _take(self, index: int) -> tuple[BatchRequest, Key]:
        key, position = self._items.pop(index)
        return self._requests[position], key

    def first(self, n: int) -> list[tuple[BatchRequest, Key]]:
        """`n` requests (fewer if fewer wait) spread evenly over the sorted prompts."""
        n = min(n, len(self._items))
        picks = sorted({i * len(self._items) // n for i in range(n)}, reverse=True)
        return [self._take(i) for i in picks][::-1]  # popped from the back: indices stay valid

    def after(self, key: Key) -> tuple[BatchRequest, Key] | None:
        """The waiting request whose prompt shares the longest prefix with `key` (None when
        none waits): it is one of the two beside `key` in the sorted order."""
        if not self._items:
            return None
        at = bisect.bisect_left(self._items, (key, -1))
        beside = [i for i in (at - 1, at) if 0 <= i < len(self._items)]
        best = max(beside, key=lambda i: (shared(self._items[i][0], key), -i))
        return self._take(best)
