"""One generation's text, a step at a time, in time linear in its length.

`IncrementalDecoder` turns ids into text decoding only a small window of ids per step: the ids of
the last settled piece of text (context for tokenizers whose pieces depend on what precedes them,
such as SentencePiece's leading space) and the ids after it, as vLLM's and TGI's detokenizers do.
Text is *settled* once the window's text does not end in U+FFFD: an id sequence that ends inside a
multi-byte character (byte-level BPE splits characters across tokens) waits for the ids that
complete it, so no U+FFFD is ever sent for an incomplete character; `flush` gives what is still
pending when the generation ends (a character that was never completed stays U+FFFD, as in the
full decode). The pieces join to `tokenizer.decode(ids, skip_special_tokens=True)` for decoding
that is prefix-stable, which byte-level BPE, SentencePiece and the character tokenizers of the
tests are (tests/test_textstream.py checks it on SmolLM2's tokenizer); a tokenizer that cleans up
spaces after the fact (`clean_up_tokenization_spaces=True`) is not.

`TextStream` adds stop strings (OpenAI semantics: the output ends before the earliest one) and
what may be sent so far. A stop string that appears in a step must overlap that step's new text,
so it is searched for only in the new text and the longest stop string's length minus one
characters before it. The engine feeds one `TextStream` per generation with each step's ids (its
stop check) and the server takes the text to stream from the same object, so each step's ids are
decoded once (docs/server.md, "Streaming").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDecoder:
    """Ids in, settled text out: `push` returns the text the new ids settle (maybe "")."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # the window starts here: the ids of the last settled piece
        self._read = 0  # ids before this are settled
        self._prefix_text = ""  # decode(ids[_prefix:_read])
        self.pending = ""  # the text of ids[_read:] so far; may end in U+FFFD

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        text = self._decode(self.ids[self._prefix :])
        new = text[len(self._prefix_text) :]
        # a window grows only while its ids add no settled text: an unfinished character, or
        # ids that decode to nothing (special tokens)
        if new and not text.endswith(REPLACEMENT_CHAR):
            self._prefix, self._read = self._read, len(self.ids)
            self._prefix_text = self._decode(self.ids[self._prefix : self._read])
            self.pending = ""
            return new
        self.pending = new
        return ""

    def flush(self) -> str:
        """The pending text, settled as it is (the generation has ended)."""
        rest, self.pending = self.pending, ""
        self._prefix = self._read = len(self.ids)
        self._prefix_text = ""
        return rest

    def state(self) -> tuple[int, int, int, str, str]:
        return len(self.ids), self._prefix, self._read, self._prefix_text, self.pending

    def restore(self, state: tuple[int, int, int, str, str]) -> None:
        n, self._prefix, self._read, self._prefix_text, self.pending = state
        del self.ids[n:]


class TextStream:
    """The text of one generation as its ids arrive: where a stop string ends it (`feed`, the
    engine's stop check) and what may be sent so far (`take`, the server's stream).

    Text that could still become part of a stop string is held back from `take`: if the stop
    string completes, that text must never have been sent. The concatenation of everything
    `take` and `finish` return equals `final_text`: the decoded ids cut before the earliest stop
    string, what `SpeculativeDecoder.generate` returns for the same ids.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()) -> None:
        self.stops = tuple(s for s in stops if s)
        # a new stop occurrence may begin this many characters before the new text
        self._overlap = max((len(s) for s in self.stops), default=1) - 1
        self.decoder = IncrementalDecoder(tokenizer)
        self._parts: list[str] = []  # the settled text, in pieces
        self._settled = 0  # its length
        self._tail = ""  # its last `_overlap` characters
        self._fresh: list[str] = []  # settled pieces not yet looked at by `take`
        self._held = ""  # settled text `take` held back (it may begin a stop string)
        self._final: str | None = None  # the text before the stop string, once one appeared
        self._sent = 0  # characters returned by take / finish
        self.stopped = False  # a stop string appeared
        self.finished = False

    @property
    def ids(self) -> list[int]:
        """Every id fed (up to the one that completed a stop string)."""
        return self.decoder.ids

    # -- the engine's side: ids in, where the output stops -----------------------------------

    def feed(self, committed: Sequence[int]) -> list[int]:
        """Add one step's ids; return the ids to keep: all of them, or, when a stop string
        appeared (`stopped`), those up to the one that completes the earliest stop string."""
        if self.stopped or self.finished:
            raise RuntimeError("this generation's text has ended")
        committed = list(committed)
        if not self.stops:
            self._push(committed)
            return committed
        saved = self._save()
        cut = self._push(committed)
        if cut is None:  # the usual step: one decode of the window
            return committed
        # a stop string appeared in this block: find the token that completed it
        self._restore(saved)
        for n in range(1, len(committed) + 1):
            cut_here = self._push(committed[n - 1 : n])
            if cut_here is not None:
                self._stop(cut_here)
                return committed[:n]
        self._stop(cut)  # the block's text held it but none of its prefixes' did: keep the block
        return committed

    def _push(self, ids: list[int]) -> int | None:
        """Decode `ids` after the others; where the earliest stop string starts in the text if
        one appeared (the settled text before these ids held none)."""
        tail, start = self._tail, self._settled - len(self._tail)
        new = self.decoder.push(ids)
        if new:
            self._parts.append(new)
            self._fresh.append(new)
            self._settled += len(new)
            self._tail = (tail + new)[-self._overlap :] if self._overlap else ""
        if not self.stops:
            return None
        window = tail + new + self.decoder.pending  # the text from `start` to the end
        found = [i for i in (window.find(s) for s in self.stops) if i >= 0]
        return start + min(found) if found else None

    def _stop(self, cut: int) -> None:
        self.stopped = True
        self._final = ("".join(self._parts) + self.decoder.pending)[:cut]

    def _save(self) -> tuple[Any, ...]:
        return (
            self.decoder.state(),
            len(self._parts),
            len(self._fresh),
            self._settled,
            self._tail,
        )

    def _restore(self, saved: tuple[Any, ...]) -> None:
        decoder, parts, fresh, self._settled, self._tail = saved
        self.decoder.restore(decoder)
        del self._parts[parts:]
        del self._fresh[fresh:]

    # -- the server's side: what may be sent -------------------------------------------------

    def take(self) -> str:
        """The text that is safe to send now and was not taken yet (may be empty)."""
        if self._final is not None:
            return self._rest_of(self._final)
        text = self._held + "".join(self._fresh)
        self._fresh.clear()
        hold = min(self._held_back(), len(text))
        self._held = text[len(text) - hold :] if hold else ""
        out = text[: len(text) - hold]
        self._sent += len(out)
        return out

    def _held_back(self) -> int:
        """How many trailing characters of the settled text might begin a stop string."""
        tail, longest = self._tail, 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(tail)), longest, -1):
                if tail.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def finish(self) -> str:
        """The rest of the text once the generation has ended (nothing is held back any more)."""
        if not self.finished and self._final is None:
            rest = self.decoder.flush()
            if rest:
                self._parts.append(rest)
                self._settled += len(rest)
        self.finished = True
        return self._rest_of(self.final_text)

    def _rest_of(self, final: str) -> str:
        out = final[self._sent :]
        self._sent = len(final)
        return out

    @property
    def final_text(self) -> str:
        """The text so far (pending text included), cut before the stop string if one
        appeared."""
        if self._final is not None:
            return self._final
        return "".join(self._parts) + self.decoder.pending
