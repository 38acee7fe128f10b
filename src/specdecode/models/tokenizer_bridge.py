"""Two tokenizers side by side: which tokens they share, and whether one can write the other's text.

A draft of another tokenizer (drafters/cross_tokenizer.py) reads and writes text the target's
tokenizer made. Two things decide what it can do:

- the **shared tokens** (the vocabularies' intersection): draft and target ids that stand for the
  same bytes. Sampled drafting proposes only those, so that the draft's distribution over them is
  a distribution over target ids and rejection sampling keeps the target's own (token-level
  intersection, TLI: Timor et al., "Lossless Speculative Decoding Algorithms for Heterogeneous
  Vocabularies", ICML 2025). Tokens are compared by their bytes, not by how a tokenizer spells
  them: a byte-level vocabulary ("Ġthe", GPT-2's table) and a SentencePiece one ("▁the",
  "<0x0A>") share " the" and "\\n". Special and added tokens are compared by their text.
- the **round trip**: every piece of the target's vocabulary, written in the draft's tokens and
  read back, must be the same text; a draft tokenizer that maps what it does not know to an
  unknown token would feed its model text other than the target's, and is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

# a piece of a multi-byte character decoded alone
REPLACEMENT = "\ufffd"
# at most this many of the target's tokens make the round-trip probe (spread over its ids)
ROUND_TRIP_PROBE = 4096


@lru_cache(maxsize=1)
def _byte_level_table() -> dict[int, str]:
    """The printable character a byte-level vocabulary writes for each byte, back to the byte:
    bytes that print as themselves keep their code; the others (controls, space, ...) are
    shifted past 255 in byte order (the GPT-2 byte-level encoding, as tokenizers' ByteLevel).
    As a `str.translate` table to the byte's Latin-1 character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[256 + shifted] = chr(byte)
            shifted += 1
    return table


def _spelling(tokenizer: Any) -> str:
    """How the tokenizer's vocabulary spells bytes: "byte-level", "metaspace" ("▁" for a space,
    "<0xNN>" for a raw byte) or "plain" (the token's text as it is)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return "plain"
    state = json.loads(decoder.__getstate__())
    text = json.dumps(state, ensure_ascii=False)
    if '"ByteLevel"' in text:
        return "byte-level"
    if '"Metaspace"' in text or "\u2581" in text:
        return "metaspace"
    return "plain"


def token_keys(tokenizer: Any) -> dict[bytes, int]:
    """Each token's bytes -> its id (the lowest where two spell the same bytes); special and
    added tokens under b"\\0" + their text, so they match only each other."""
    spelling = _spelling(tokenizer)
    table = _byte_level_table()
    added = set(tokenizer.get_added_vocab())
    keys: dict[bytes, int] = {}
    for token, index in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        if spelling == "metaspace" and len(token) == 6 and token[:3] == "<0x" and token[5] == ">":
            key = bytes([int(token[3:5], 16)])  # a raw byte (some tokenizers add them)
        elif token in added:
            key = b"\0" + token.encode()
        elif spelling == "byte-level":
            try:
                key = token.translate(table).encode("latin-1")
            except UnicodeEncodeError:
                continue  # not a byte-level token (a stray entry): it matches nothing
        elif spelling == "metaspace":
            key = token.replace("\u2581", " ").encode()
        else:
            key = token.encode()
        keys.setdefault(key, index)
    return keys


@dataclass(frozen=True)
class SharedTokens:
    """The tokens two vocabularies share: `draft_ids` [S] and `target_ids` [S] (int64, pairwise
    the same bytes), and `to_target` [draft width] (the target id of each draft id, -1 where the
    target has none)."""

    draft_ids: torch.Tensor
    target_ids: torch.Tensor
    to_target: torch.Tensor

    def __len__(self) -> int:
        return int(self.draft_ids.numel())


def shared_tokens(target_tok: Any, draft_tok: Any, draft_width: int, target_width: int):
    """The SharedTokens of two tokenizers, limited to ids both models score (`draft_width`,
    `target_width`: their logit widths)."""
    target_keys = token_keys(target_tok)
    pairs = sorted(
        (d, target_keys[key])
        for key, d in token_keys(draft_tok).items()
        if key in target_keys and d < draft_width and target_keys[key] < target_width
    )
    draft_ids = torch.tensor([d for d, _ in pairs], dtype=torch.long)
    target_ids = torch.tensor([t for _, t in pairs], dtype=torch.long)
    to_target = torch.full((draft_width,), -1, dtype=torch.long)
    to_target[draft_ids] = target_ids
    return SharedTokens(draft_ids, target_ids, to_target)


def round_trip_failure(target_tok: Any, draft_tok: Any) -> str | None:
    """None when the draft's tokenizer writes and reads back the text of (up to
    ROUND_TRIP_PROBE of) the target's tokens unchanged, else what it changed."""
    size = len(target_tok)
    stride = max(1, size // ROUND_TRIP_PROBE)
    special = set(target_tok.all_special_ids)
    ids = [i for i in range(0, size, stride) if i not in special]
    pieces = target_tok.batch_decode([[i] for i in ids], clean_up_tokenization_spaces=False)
    for start in range(0, len(pieces), 256):
        chunk = [p for p in pieces[start : start + 256] if p and REPLACEMENT not in p]
        text = "".join(chunk)
        back = draft_tok.decode(
            draft_tok.encode(text, add_special_tokens=False), clean_up_tokenization_spaces=False
        )
        if back != text:
            for piece in chunk:  # name the first piece that does not come back
                again = draft_tok.decode(
                    draft_tok.encode(piece, add_special_tokens=False),
                    clean_up_tokenization_spaces=False,
                )
                if again != piece:
                    return f"it writes {piece!r} of the target's text and reads back {again!r}"
            return "it reads the target's text back changed"
    return None
