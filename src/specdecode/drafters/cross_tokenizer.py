"""A draft model of another tokenizer: greedy drafts through text, sampled ones through the
tokens both vocabularies share.

The draft reads the committed text in its own tokens (`CommittedText`: the target's tokens
decoded, re-tokenized for the draft a window at a time, so a word split differently in the two
vocabularies is split the draft's way) and drafts from its own cache over them. What it proposes
must be target ids, and it proposes them one of two ways (`route`):

- greedy, **through text**: the draft's tokens are decoded and the text re-tokenized for the
  target together with the last committed target tokens, so that a drafted word that continues
  the last committed one is split as the target would split it (where the re-tokenization would
  re-split the committed tokens, the drafted text is tokenized alone). Verification is greedy on
  target ids, so a proposal split differently from the target's own choice is simply rejected
  there: the output is the target's whatever the draft proposes (Hugging Face's universal
  assisted generation drafts this way).
- sampled, **through the shared tokens** (token-level intersection, models/tokenizer_bridge.py):
  the draft samples only tokens the target also has, from its distribution restricted to them
  and renormalized; that distribution, moved to the target's ids, is `q_draft`, and rejection
  sampling then keeps the target's distribution exactly. Text-route proposals would have no such
  `q_draft`.

Chains only: a token tree needs the draft's tokens to be the target's.
"""

from __future__ import annotations

from typing import Any

import torch

from specdecode.core.protocols import Drafter
from specdecode.core.sampling import SamplingParams, greedy_tokens, logits_to_probs, sample
from specdecode.core.types import Draft, ForwardMeter
from specdecode.models.compat import logits_size
from specdecode.models.lean import draft_cache
from specdecode.models.tokenizer_bridge import REPLACEMENT, SharedTokens

# draft tokens at the end of the committed text that are re-tokenized every step (the ones
# before them are kept: the text's start no longer changes how its end is split)
WINDOW = 32
# committed target tokens re-tokenized with the drafted text (a drafted word may continue them)
TAIL = 4
# a target token that decodes to part of a character waits for the rest, at most this many
PARTIAL = 3


def decode(tokenizer: Any, ids: list[int]) -> str:
    """Ids to text exactly as written: special tokens kept, no clean-up of spaces."""
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Text to ids, adding no special token (a BOS belongs at the start only)."""
    return tokenizer.encode(text, add_special_tokens=False)


class CommittedText:
    """The committed target tokens as text, and that text in the draft's tokens.

    `update(context)` appends the text of the target tokens not seen yet and returns the draft's
    ids for all of it: the kept ids (`kept`, over text[:anchor]) and the re-tokenized window
    after them. When the window passes 2 * WINDOW tokens its start moves to a word boundary
    WINDOW tokens from the end, checked by decoding: the kept ids always spell text[:anchor].
    """

    def __init__(self, target_tok: Any, draft_tok: Any) -> None:
        self.target_tok, self.draft_tok = target_tok, draft_tok
        self.synced = 0  # target tokens whose text is in `text`
        self.text = ""
        bos = draft_tok.bos_token_id
        starts = draft_tok.encode("", add_special_tokens=True)
        self.kept: list[int] = [bos] if bos is not None and starts[:1] == [bos] else []
        self.anchor = 0  # text[:anchor] is spelled by `kept` (after a BOS)

    def update(self, context: list[int]) -> list[int]:
        if len(context) > self.synced:
            self._append(context)
        window = encode(self.draft_tok, self.text[self.anchor :])
        if len(window) > 2 * WINDOW:
            window = self._move_anchor(window)
        return self.kept + window

    def _append(self, context: list[int]) -> None:
        start = max(0, self.synced - TAIL)  # decode with a little context: whole characters
        head = decode(self.target_tok, context[start : self.synced])
        end = len(context)
        text = decode(self.target_tok, context[start:end])
        # tokens ending inside a character wait for the rest (never more than a character's)
        while text.endswith(REPLACEMENT) and end > max(self.synced + 1, len(context) - PARTIAL):
            end -= 1
            text = decode(self.target_tok, context[start:end])
        if text.endswith(REPLACEMENT) and len(context) - self.synced <= PARTIAL:
            return
        self.text += text[len(head) :] if text.startswith(head) else text
        self.synced = end

    def _move_anchor(self, window: list[int]) -> list[int]:
        """Keep all but the last WINDOW (or a few more) ids of `window`: cut before a token that
        starts a word, where the ids before it decode to exactly the text before it."""
        tail = self.text[self.anchor :]
        for cut in range(len(window) - WINDOW, 0, -1):
            first = decode(self.draft_tok, window[cut : cut + 1])
            if not first[:1].isspace():
                continue
            before = decode(self.draft_tok, window[:cut])
            if tail.startswith(before) and not before.endswith(REPLACEMENT):
                self.kept += window[:cut]
                self.anchor += len(before)
                return window[cut:]
        return window


class CrossTokenizerDrafter(Drafter):
    """Drafts k target tokens with `model`, whose tokenizer `draft_tok` is not the target's
    `target_tok` (`shared`: the tokens both have, over the target's `target_width` logits).

    Per step: the committed text's draft ids are brought up to date; the draft's cache keeps
    its longest common prefix with them (accepted drafts, re-tokenized alike, stay) and takes
    the rest in one forward; then k draft tokens, one forward each. All of it (the text work
    too) is timed as draft forwards, so the cost policy sees what drafting costs."""

    def __init__(
        self,
        model: Any,
        target_tok: Any,
        draft_tok: Any,
        shared: SharedTokens,
        target_width: int,
        name: str = "draft",
    ) -> None:
        self.model, self.name = model, name
        self.target_tok, self.draft_tok = target_tok, draft_tok
        self.shared, self.target_width = shared, target_width
        # ids past the draft tokenizer's end are padding rows: never drafted
        self.draft_vocab = min(len(draft_tok), logits_size(model))
        self.cost_ratio: float | None = None  # policies.prior_cost_ratio sizes the model
        self.cache: Any = None
        self.route: str | None = None  # "text" or "shared tokens", set by begin

    def describe(self) -> str:
        """Which way it drafts, for the command line and the reports."""
        return (
            f"a draft of another tokenizer ({len(self.draft_tok)} tokens, the target's "
            f"{len(self.target_tok)}): greedy drafts through text, sampled ones through the "
            f"{len(self.shared)} tokens both have"
        )

    def begin(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        generator: torch.Generator | None,
        meter: ForwardMeter,
    ) -> None:
        self.params, self.generator, self.meter = params, generator, meter
        self.route = "text" if params.greedy else "shared tokens"
        self.committed = CommittedText(self.target_tok, self.draft_tok)
        self.cache = draft_cache(self.model)
        self.device = next(self.model.parameters()).device
        self.cached: list[int] = []  # the draft ids the cache covers
        with meter.forward("draft_prefill", len(prompt_ids) - 1):
            ids = self.committed.update(prompt_ids)
            if len(ids) > 1:
                self.cache.forward(self._tensor(ids[:-1]), last_only=True)
                self.cached = ids[:-1]

    def end(self) -> None:
        self.cache = None

    def _tensor(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def _catch_up(self, ids: list[int]) -> torch.Tensor:
        """Bring the cache to `ids`, keeping what it already holds of them; the logits [V] after
        the last."""
        same = 0
        for have, want in zip(self.cached, ids, strict=False):
            if have != want:
                break
            same += 1
        keep = min(same, len(ids) - 1)
        self.cache.rollback(keep)
        self.cached = list(ids)
        return self.cache.forward(self._tensor(ids[keep:]), last_only=True)[0]

    @torch.inference_mode()
    def propose(self, context: list[int], k: int) -> Draft:
        if k < 1:
            raise ValueError(f"a draft needs k >= 1 (got {k})")
        drafted: list[int] = []
        qs: list[torch.Tensor] = []
        proposal = None
        for depth in range(k):
            fed = max(1, len(context) - self.committed.synced) if depth == 0 else 1
            with self.meter.forward("draft", fed):
                if depth == 0:  # the committed text's new tokens, then the first draft
                    ids = self.committed.update(context)
                    logits = self._catch_up(ids)
                else:
                    logits = self.cache.forward(self._tensor(drafted[-1:]), last_only=True)[0]
                    self.cached.append(drafted[-1])
                drafted.append(self._choose(logits, qs))
                if depth == k - 1 and self.route == "text":
                    proposal = self._through_text(context, ids, drafted, k)
        if proposal is not None:
            return Draft(proposal)
        tokens = self.shared.to_target[torch.tensor(drafted)]  # [k]
        return Draft(tokens, torch.stack(qs))

    def _choose(self, logits: torch.Tensor, qs: list[torch.Tensor]) -> int:
        """The next draft token from the draft's logits [V_draft]: the argmax over its
        vocabulary (text route), or a sample from its distribution over the shared tokens
        (whose copy over the target's ids is appended to `qs`)."""
        if self.route == "text":
            return int(greedy_tokens(logits[: self.draft_vocab]))
        restricted = torch.full_like(logits, float("-inf"))
        shared = self.shared.draft_ids.to(logits.device)
        restricted[shared] = logits[shared]
        q = logits_to_probs(restricted, self.params)  # [V_draft], zero off the shared tokens
        token = int(sample(q, self.generator))
        q_target = torch.zeros(self.target_width, dtype=q.dtype, device=q.device)
        q_target.index_add_(0, self.shared.target_ids.to(q.device), q[shared])
        qs.append(q_target)
        return token

    def _through_text(
        self, context: list[int], ids: list[int], drafted: list[int], k: int
    ) -> torch.Tensor:
        """The target ids of the drafted text (at most k): re-tokenized with the last committed
        target tokens where that keeps them as they are, else alone."""
        before = ids[-TAIL:]
        head = decode(self.draft_tok, before)
        text = decode(self.draft_tok, before + drafted)
        text = text[len(head) :] if text.startswith(head) else decode(self.draft_tok, drafted)
        text = text.rstrip(REPLACEMENT)  # a character the draft has not finished
        tail = context[-TAIL:]
        joined = encode(self.target_tok, decode(self.target_tok, tail) + text)
        if joined[: len(tail)] == tail:
            proposal = joined[len(tail) :]
        else:  # the drafted text would re-split the committed tokens: the target cannot
            proposal = encode(self.target_tok, text)
        proposal = proposal[:k]
        if any(t >= self.target_width for t in proposal):  # an id the target does not score
            proposal = proposal[: [t >= self.target_width for t in proposal].index(True)]
        return torch.tensor(proposal, dtype=torch.long)

    def observe(self, n_accepted: int) -> None:
        """Nothing to do now: the next `propose` re-reads the committed text and keeps the
        cache's common prefix with it."""
