"""Incremental detokenization for streaming: new text only, never past a stop string.

Each step decodes all ids generated so far and emits the part of the text not yet sent. Two kinds of
text are held back until a later step settles them:

- a trailing U+FFFD: the ids so far end inside a multi-byte character (byte-level BPE), and the
  next token completes it;
- a suffix that is the beginning of a stop string: if the stop string completes, that text must
  never have been sent (OpenAI semantics: the output ends before the stop string).

The concatenation of the deltas equals `final_text`, which is what `SpeculativeDecoder.generate`
returns for the same ids: the decoded text cut before the earliest stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class IncrementalText:
    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.ids: list[int] = []
        self.sent = ""  # text already emitted
        self.stopped = False  # a stop string has appeared

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _stop_at(self, text: str) -> int | None:
        """Where the earliest stop string starts in `text`, if one occurs."""
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _held_back(self, text: str) -> int:
        """How many trailing characters of `text` might still become part of a stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _advance(self, text: str, end: int) -> str:
        # decoding is prefix-stable for the tokenizers we serve; if it ever is not, wait rather
        # than send text that contradicts what was already sent
        if end <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta = text[len(self.sent) : end]
        self.sent += delta
        return delta

    def push(self, new_ids: Sequence[int]) -> str:
        """Add one step's ids; return the text that is now safe to send (may be empty)."""
        self.ids.extend(new_ids)
        text = self._decode()
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            return self._advance(text, cut)
        settled = text.rstrip(REPLACEMENT_CHAR)
        return self._advance(text, len(settled) - self._held_back(settled))

    @property
    def final_text(self) -> str:
        text = self._decode()
        cut = self._stop_at(text)
        return text if cut is None else text[:cut]

    def finish(self) -> str:
        """The rest of the text once generation has ended (nothing is held back any more)."""
        final = self.final_text
        return self._advance(final, len(final))
