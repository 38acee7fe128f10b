"""Suffix drafting: token trees from what the text already said, in this request and earlier ones.

No model. The context's last tokens are looked up in a suffix index over the current request
(prompt and output so far) and over a bounded pool of earlier outputs (`SuffixPool`, shared by the
rows of a batch, a server's requests, a batch job's items). Every earlier occurrence of the
longest matched suffix votes for what followed it; the continuations form a trie whose nodes
count their votes. The drafted tree keeps the most-voted nodes (a node's share of the votes is
its estimated acceptance, corrected online per match length), sized where the expected accepted
tokens per verification cost peak (the cost policy's measured v(n) where the batch has one):
deep where one continuation was seen often, none where nothing matched. The idea is
SuffixDecoding's (Oliaro et al., arXiv:2411.04975; vLLM's `suffix` method); the structure here
is our own: an index of where each bigram ends, each match extended backwards token by token.

The tree is deterministic (one-hot q per node), so greedy output is the target's own and
sampling stays lossless (verify_tree.multi_candidate_step). The pool only ever changes what is
drafted, never what is emitted; what it does reveal is timing (a request whose text an earlier
one wrote decodes faster): `pool=off` where requests must not share even that
(docs/usage.md, "Suffix drafting").
"""

from __future__ import annotations

import heapq
import sys
import threading
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode.core.draft_spec import SuffixOptions
from specdecode.core.policies import batch_rate
from specdecode.core.sampling import SamplingParams
from specdecode.core.tree import SizedTreeDrafter, TokenTree
from specdecode.core.types import ForwardMeter

# the longest suffix a match is extended to: longer matches say no more about what follows
MAX_MATCH = 32
# occurrences of the matched suffix that vote, the most recent first (a common bigram in a long
# text has thousands; the recent ones are the likeliest to repeat)
MAX_VOTERS = 64
# match lengths 2, 3, 4-5, 6-9, 10+ learn their own correction of the votes' estimate
_BUCKETS = (2, 3, 4, 6, 10)


class _Text:
    """A token sequence and, for each bigram, the positions where it ends (ascending)."""

    __slots__ = ("ends", "ids")

    def __init__(self, ids: Sequence[int] = ()) -> None:
        self.ids: list[int] = []
        self.ends: dict[tuple[int, int], list[int]] = {}
        self.extend(ids)

    def extend(self, new: Sequence[int]) -> None:
        ids, ends = self.ids, self.ends
        for token in new:
            if ids:
                ends.setdefault((ids[-1], token), []).append(len(ids))
            ids.append(token)

    def nbytes(self) -> int:
        """What the text holds in memory, roughly: its lists, their ints and the index."""
        lists = sum(sys.getsizeof(v) for v in self.ends.values())
        return sys.getsizeof(self.ids) + sys.getsizeof(self.ends) + lists + 72 * len(self.ends)


@dataclass
class _Match:
    """An earlier occurrence of the context's suffix: `length` tokens matched, ending at `end`
    in `text`, whose following tokens are the continuation."""

    length: int
    text: _Text
    end: int


def _matches(text: _Text, context: Sequence[int], before: int, room: int) -> list[_Match]:
    """The most recent occurrences (up to `room`) of the context's last bigram ending before
    position `before` of `text`, each extended backwards as far as it matches (MAX_MATCH)."""
    if len(context) < 2 or room <= 0:
        return []
    ends = text.ends.get((context[-2], context[-1]))
    if not ends:
        return []
    out = []
    ids, n = text.ids, len(context)
    for end in reversed(ends):
        if end >= before:
            continue
        length = 2
        while length < MAX_MATCH and length < n and end - length >= 0:
            if ids[end - length] != context[n - 1 - length]:
                break
            length += 1
        out.append(_Match(length, text, end))
        if len(out) >= room:
            break
    return out


class SuffixPool:
    """Earlier outputs, shared across requests: at most `max_tokens` tokens, the oldest output
    evicted first (a whole output at a time). Thread-safe. A fault inside it (a bug, memory
    corrupted by a caller) empties it and is reported once; it never fails a request."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"a suffix pool holds >= 0 tokens (got {max_tokens})")
        self.max_tokens = max_tokens
        self._texts: deque[_Text] = deque()
        self._tokens = 0
        self._lock = threading.Lock()
        self.evicted = 0  # outputs dropped to stay within max_tokens
        self.faults = 0  # times a fault emptied the pool

    def add(self, ids: Sequence[int]) -> None:
        """Remember one output (only its last `max_tokens` tokens if longer)."""
        ids = list(ids)[-self.max_tokens :] if self.max_tokens else []
        if len(ids) < 2:
            return
        text = _Text(ids)
        with self._lock:
            self._texts.append(text)
            self._tokens += len(ids)
            while self._tokens > self.max_tokens:
                self._tokens -= len(self._texts.popleft().ids)
                self.evicted += 1

    def matches(self, context: Sequence[int], room: int) -> list[_Match]:
        """Occurrences of the context's suffix in the pool, the newest outputs first."""
        try:
            with self._lock:
                texts = list(self._texts)
            out: list[_Match] = []
            for text in reversed(texts):
                out += _matches(text, context, len(text.ids), room - len(out))
                if len(out) >= room:
                    break
            return out
        except Exception as err:  # the pool is a speed-up: drafting goes on without it
            self.clear()
            self.faults += 1
            if self.faults == 1:
                warnings.warn(f"the suffix pool failed ({err!r}) and was emptied", stacklevel=2)
            return []

    def clear(self) -> None:
        with self._lock:
            self._texts.clear()
            self._tokens = 0

    def report(self) -> dict[str, int]:
        """What the pool holds: outputs, tokens (and its limit), bytes (roughly), evictions."""
        with self._lock:
            texts = list(self._texts)
        return {
            "outputs": len(texts),
            "tokens": sum(len(t.ids) for t in texts),
            "max_tokens": self.max_tokens,
            "bytes": sum(t.nbytes() for t in texts),
            "evicted": self.evicted,
            "faults": self.faults,
        }


class _Calibration:
    """rho, per match-length bucket: the chance that the target keeps a drafted token the votes
    back fully, learnt from the trees it verified (each accepted token a success; a walk that
    stopped where the tree went on, one failure). A node's estimated acceptance is its share of
    the votes x rho^depth: the votes of a short match, or of a text the output has left, promise
    more than the target keeps, and the more so the deeper. The drafter keeps one over every row
    (shared by its forks) and one per row (its prompt's: code or arithmetic repeats short runs
    that the target follows less often than a rewrite's), the first the second's prior."""

    def __init__(self, prior: float = 0.6, weight: float = 4.0, memory: float = 256.0) -> None:
        self.prior, self.weight, self.memory = prior, weight, memory
        self.kept = [0.0] * len(_BUCKETS)
        self.judged = [0.0] * len(_BUCKETS)

    @staticmethod
    def bucket(length: int) -> int:
        return max(i for i, low in enumerate(_BUCKETS) if length >= low)

    def rho(self, length: int, prior: float | None = None) -> float:
        """rho for this match length; `prior`: what it shrinks towards (default `self.prior`)."""
        b = self.bucket(length)
        prior = self.prior if prior is None else prior
        return (self.kept[b] + self.weight * prior) / (self.judged[b] + self.weight)

    def add(self, length: int, kept: int, judged: int) -> None:
        b = self.bucket(length)
        fade = max(0.0, 1.0 - judged / self.memory)  # old evidence fades as new comes
        self.kept[b] = self.kept[b] * fade + kept
        self.judged[b] = self.judged[b] * fade + judged


@dataclass
class SuffixProposal:
    """What the suffix index suggests for one step: the tree's nodes in the order to keep them
    (the likeliest first; every parent before its children), with each node's estimated
    acceptance (its share of the votes x rho^depth, `_Calibration`), and the match length they
    came from."""

    tokens: list[int]
    parents: list[int]  # index into these lists; -1: a child of the root
    gains: list[float]  # each node's estimated acceptance, non-increasing
    length: int

    def best_size(self, costs: object, rows: int = 1) -> tuple[int, float]:
        """(n, rate): how many nodes to keep for the most expected tokens per verification
        time, (1 + sum of the first n gains) / v(n + 1 rows) on a row alone; in a batch of
        `rows` rows, as if each drafted a tree alike (`policies.batch_rate`). n = 0 when no
        tree pays."""
        best, best_rate, emitted = 0, batch_rate(costs, rows, 1.0, 1), 1.0
        for n, gain in enumerate(self.gains, start=1):
            emitted += gain
            rate = batch_rate(costs, rows, emitted, n + 1)
            if rate > best_rate:
                best, best_rate = n, rate
        return best, best_rate


class SuffixDrafter(SizedTreeDrafter):
    """Drafts a token tree from the suffix index of the request and the shared pool (module
    docstring). In a batch, `candidates` and `take_candidates` let the batch size every row's
    tree together (`policies.size_trees`). `options`: depth, node and match-size limits, the pool (drafters/suffix.py;
    draft_spec.SuffixOptions). Forks (`batch.fork_drafter`) share the pool and the calibration;
    each row indexes its own request."""

    cost_ratio = 0.0  # no model forward: drafting costs next to nothing

    def __init__(self, options: SuffixOptions | None = None) -> None:
        self.options = options or SuffixOptions()
        self.name = str(self.options)
        self.pool = SuffixPool(self.options.pool_tokens) if self.options.pool else None
        self.calibration = _Calibration()  # every row's (shared by the forks)
        self.row_calibration = _Calibration()  # this row's (`begin` starts it anew)
        self.costs: object = None  # the batch's policy (`share_costs`); None: priors
        self._text = _Text()
        self._row: list[int] = []
        self._prompt_len = 0
        # the last tree's match length and the nodes with children (-1: the root)
        self._last: tuple[int, set[int]] | None = None
        self._proposal = SuffixProposal([], [], [], 0)  # the last `candidates`

    def begin(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        generator: object,
        meter: ForwardMeter,
    ) -> None:
        # the row's committed tokens (the batch extends this very list): read again at `end`,
        # where the output starts at the prefill's first token, the last of prompt_ids
        self._row, self._prompt_len = prompt_ids, len(prompt_ids) - 1
        self._text = _Text(prompt_ids)
        self._last = None
        self.row_calibration = _Calibration()

    def share_costs(self, policy: object) -> None:
        self.costs = policy

    def _sync(self, context: Sequence[int]) -> None:
        known = len(self._text.ids)
        if known > len(context) or self._text.ids[-1:] != list(context[known - 1 : known]):
            self._text = _Text(context)  # not the sequence begun: index it anew
        elif known < len(context):
            self._text.extend(context[known:])

    def suggest(self, context: list[int], max_depth: int) -> SuffixProposal:
        """The candidate nodes for a tree below the context's last token (at most `max_depth`
        deep), before sizing: see `SuffixProposal`."""
        self._sync(context)
        opts = self.options
        depth = min(opts.depth, max_depth)
        found = _matches(self._text, context, len(context) - 1, MAX_VOTERS)
        if self.pool is not None:
            found += self.pool.matches(context, MAX_VOTERS)
        if not found or depth <= 0:
            return SuffixProposal([], [], [], 0)
        length = max(m.length for m in found)
        voters = [m for m in found if m.length == length][:MAX_VOTERS]
        # the trie of what followed each voter: node -> votes
        index: dict[tuple[int, int], int] = {}
        tokens: list[int] = []
        parents: list[int] = []
        votes: list[int] = []
        depths: list[int] = []
        for m in voters:
            node = -1
            for token in m.text.ids[m.end + 1 : m.end + 1 + depth]:
                child = index.get((node, token))
                if child is None:
                    child = index[(node, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                    votes.append(0)
                    depths.append(depths[node] + 1 if node >= 0 else 1)
                votes[child] += 1
                node = child
        # the likeliest nodes first: a child's share of the votes is at most its parent's, and
        # it sits one level deeper, so its estimate is lower and at a tie the shallower comes
        # first: every prefix of this order is a tree
        limit = min(opts.nodes, max(1, round(opts.factor * length)))
        floor = opts.min_prob * len(voters)
        rho = self.rho(length)
        gain = {
            i: votes[i] / len(voters) * rho ** depths[i]
            for i in range(len(tokens))
            if votes[i] >= floor
        }
        order = heapq.nsmallest(limit, gain, key=lambda i: (-gain[i], depths[i], i))
        renumber = {old: new for new, old in enumerate(order)}
        return SuffixProposal(
            [tokens[i] for i in order],
            [renumber[parents[i]] if parents[i] >= 0 else -1 for i in order],
            [gain[i] for i in order],
            length,
        )

    def rho(self, length: int) -> float:
        """This row's rho for a match length: its own evidence, the one over every row its
        prior (`_Calibration`)."""
        return self.row_calibration.rho(length, prior=self.calibration.rho(length))

    def propose_tree(self, context: list[int], max_depth: int) -> TokenTree:
        proposal = self.suggest(context, max_depth)
        n, _ = proposal.best_size(self.costs)
        return self.take(proposal, n)

    def candidates(self, context: list[int], max_depth: int) -> list[float]:
        self._proposal = self.suggest(context, max_depth)
        return self._proposal.gains

    def take_candidates(self, n: int) -> TokenTree:
        return self.take(self._proposal, n)

    def take(self, proposal: SuffixProposal, n: int) -> TokenTree:
        """The proposal's first n nodes as the step's tree, remembered for `observe_path`."""
        # what observe_path needs: the match length, and which nodes had children
        self._last = (proposal.length, set(proposal.parents[:n])) if n else None
        # the proposal's order lists parents before children: its first n nodes are a tree
        return TokenTree(
            torch.tensor(proposal.tokens[:n], dtype=torch.long),
            torch.tensor(proposal.parents[:n], dtype=torch.long),
        )

    def observe_path(self, path: list[int]) -> None:
        if self._last is not None:
            length, parents = self._last
            # the walk stopped below the last accepted node (or the root, -1): a failure
            # where that node had children, none of them the target's token
            stopped_early = (path[-1] if path else -1) in parents
            for calibration in (self.calibration, self.row_calibration):
                calibration.add(length, len(path), len(path) + stopped_early)
        self._last = None

    def end(self) -> None:
        """The row is over: its output goes to the pool for the requests after it."""
        if self.pool is not None:
            self.pool.add(self._row[self._prompt_len :])
        self._row, self._text = [], _Text()


def pool_of(drafter: object) -> SuffixPool | None:
    """The suffix pool a drafter drafts from (a suffix drafter's, a hybrid's), or None."""
    suffix = getattr(drafter, "suffix", drafter)
    return suffix.pool if isinstance(suffix, SuffixDrafter) else None
