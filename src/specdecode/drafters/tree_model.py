"""A draft model growing a token tree, one batched draft forward per depth (`TreeGrowth`: the
growing itself, which an EAGLE-3 head shares, drafters/eagle.py).

Children of a node: greedy — the draft's top tokens (distinct); sampling — i.i.d. draws from the
draft's q at that node (with replacement), where repeats of one token share one node and the draw
order is kept in `TokenTree.draws`: exactly what `verify_tree_sampling` needs to stay lossless.
Which nodes get children (dynamic trees) is decided from tokens at their depth or above, before
their own children are drawn, and no draw is ever dropped afterwards (sampling); a greedy tree is
deterministic, so it is also pruned to the `nodes` most probable at the end (EAGLE-2's re-rank),
then rid of the nodes below the shape's `leaf` path probability (the root's most probable child
always stays).

Cache bookkeeping: `propose_tree` first feeds the committed tokens the draft has not seen (causal,
as ModelDrafter), then each level's expanded nodes in one forward with a tree mask; the cache then
covers the context plus every expanded node. `observe_path` compacts it to the context plus the
accepted nodes it holds (an accepted path's expanded nodes are a prefix of it).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from specdecode.core.sampling import SamplingParams, draw, logits_to_probs
from specdecode.core.tree import (
    TokenTree,
    TreeDrafter,
    additive_mask,
    ancestor_matrix,
    check_tree_attention,
    tree_mask,
)
from specdecode.core.types import ForwardMeter
from specdecode.drafters.model import DraftModelState
from specdecode.drafters.tree_shape import TreeShape


class _Pool:
    """Every node drafted this step (pool ids), before a dynamic greedy tree is pruned."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []  # pool id, -1 = root
        self.depth: list[int] = []
        self.score: list[float] = []  # log of the cumulative draft probability along the path
        self.slot: list[int] = []  # draft cache column, -1 = never fed
        self.q: list[torch.Tensor] = []  # [V] the distribution the token was drawn from
        self.draws: list[list[int]] = [[]]  # per row (0 = root, i + 1 = node i), draw order

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, score: float, q: torch.Tensor | None) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depth.append(1 if parent < 0 else self.depth[parent] + 1)
        self.score.append(score)
        self.slot.append(-1)
        if q is not None:
            self.q.append(q)
        self.draws.append([])
        return len(self.tokens) - 1

    def expand(
        self,
        parent: int,
        logits: torch.Tensor,
        count: int,
        q: torch.Tensor | None,
        generator: torch.Generator | None,
    ) -> list[int]:
        """Give `parent` children from its draft row; returns the new pool ids.

        logits: [V] the draft's logits at the parent. Greedy (q None): the top `count` tokens.
        Sampling: `count` i.i.d. draws from q ([V]); repeats of a token share its node, and
        `draws` keeps every draw in order (what lossless verification needs).
        """
        base = self.score[parent] if parent >= 0 else 0.0
        if q is None:
            logq = logits.float().log_softmax(-1)  # [V], scores only
            top = torch.topk(logq, min(count, logq.shape[0]))
            return [
                self._draw(parent, token, base + lq, None, {})
                for token, lq in zip(top.indices.tolist(), top.values.tolist(), strict=True)
            ]
        drawn = draw(q, count, generator).tolist()
        logq = q.log()
        seen: dict[int, int] = {}
        new: list[int] = []
        for token in drawn:
            before = len(self)
            node = self._draw(parent, token, base + float(logq[token]), q, seen)
            if len(self) > before:
                new.append(node)
        return new

    def _draw(
        self, parent: int, token: int, score: float, q: torch.Tensor | None, seen: dict[int, int]
    ) -> int:
        node = seen.get(token)
        if node is None:
            node = seen[token] = self.add(parent, token, score, q)
        self.draws[parent + 1].append(node)
        return node

    def best(self, nodes: list[int], n: int) -> list[int]:
        """The n highest-scoring of `nodes`; ties go to the older node (smaller pool id)."""
        return sorted(nodes, key=lambda i: (-self.score[i], i))[:n]

    def tree(self, keep: list[int], device: torch.device) -> TokenTree:
        """The TokenTree over the pool ids `keep` (ancestor-closed), renumbered in pool order."""
        keep = sorted(keep)
        index = {node: i for i, node in enumerate(keep)}
        parents = [index[self.parents[n]] if self.parents[n] >= 0 else -1 for n in keep]
        q = torch.stack([self.q[n] for n in keep]) if self.q else None  # [N, V]
        draws = None
        if self.q:  # sampling keeps every draw (keep is then the whole pool)
            draws = [[index[c] for c in self.draws[0]]]
            draws += [[index[c] for c in self.draws[n + 1]] for n in keep]
        return TokenTree(
            tokens=torch.tensor([self.tokens[n] for n in keep], device=device),
            parents=torch.tensor(parents, device=device),
            q_draft=q,
            draws=draws,
        )


class TreeGrowth:
    """How a tree grows, whatever drafts it: `_root(context)` gives the logits at the root
    ([1, V], the committed tokens fed first) and `_feed(nodes)` the logits at pool nodes
    ([m, V], one forward with a tree mask); a subclass sets `shape`, `params`, `generator`,
    `device` and calls `_start_tree` from its constructor; it comes before the drafter it grows
    trees for in the bases (its `begin` warns, then begins that drafter)."""

    shape: TreeShape
    params: SamplingParams
    generator: torch.Generator | None
    device: torch.device

    def _start_tree(self, shape: TreeShape, name: str) -> None:
        self.shape = shape
        self.name = f"{name} tree {shape}"
        self._pool = _Pool()
        self._kept: list[int] = []  # pool id of each node of the last tree
        self._context_len = 0

    def begin(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        generator: torch.Generator | None,
        meter: ForwardMeter,
    ) -> None:
        if self.shape.leaf > 0.0 and not params.greedy:
            warnings.warn(
                f"tree {self.shape}: LEAF applies to greedy trees only; sampled trees verify "
                "every draw (lossless verification needs them)",
                stacklevel=2,
            )
        super().begin(prompt_ids, params, generator, meter)  # type: ignore[misc]

    def _node_mask(
        self, nodes: list[int], past: int, prefix: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool `nodes` placed at cache columns past.. (their slots set): which of the past + m
        columns each sees ([m, past + m] bool: the first `prefix` and its ancestors) and each
        node's depth [m]."""
        pool = self._pool
        for r, node in enumerate(nodes):
            pool.slot[node] = past + r
        parents = torch.tensor(pool.parents, device=self.device)  # [P]
        rows = torch.tensor(nodes, device=self.device) + 1  # tree rows of the queries
        slots = torch.tensor([-1, *pool.slot], device=self.device)  # root: inside the prefix
        allowed = tree_mask(ancestor_matrix(parents)[rows], slots, prefix, past + len(nodes))
        depth = torch.tensor([pool.depth[n] for n in nodes], device=self.device)
        return allowed, depth

    def _root(self, context: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def _feed(self, nodes: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def _q(self, logits: torch.Tensor) -> torch.Tensor | None:
        return None if self.params.greedy else logits_to_probs(logits, self.params)

    @torch.inference_mode()
    def propose_tree(self, context: list[int], max_depth: int) -> TokenTree:
        self._context_len = len(context)
        pool = self._pool = _Pool()
        frontier, rows = [-1], self._root(context)  # [1, V]: q at the root
        levels = min(self.shape.max_depth, max_depth)
        budget = self.shape.nodes  # dynamic sampling: nodes still allowed
        for level in range(1, levels + 1):
            if level > 1:
                frontier = self._worth_expanding(frontier)
                if not frontier:
                    break
                rows = self._feed(frontier)  # [m, V]
            new: list[int] = []
            for parent, logits in zip(frontier, rows, strict=True):
                count = self._children(level, budget)
                if count == 0:
                    break
                q = self._q(logits)
                added = pool.expand(parent, logits, count, q, self.generator)
                budget -= len(added) if q is not None else 0
                new.extend(added)
            if self.shape.dynamic:
                # the next level expands the most probable new nodes, chosen before their draws
                frontier = pool.best(new, self.shape.width)
                if not self.params.greedy and budget <= 0:
                    break
            else:
                frontier = new
        keep = list(range(len(pool)))
        if self.shape.dynamic and self.params.greedy:
            keep = pool.best(keep, self.shape.nodes)  # EAGLE-2's re-rank; ancestor-closed
            if self.shape.leaf > 0.0 and keep:
                # verify no unlikely node, but always the most probable one (keep[0], a child of
                # the root); a path probability never grows along a path, so still a tree
                least = math.log(self.shape.leaf)
                keep = keep[:1] + [node for node in keep[1:] if pool.score[node] >= least]
        self._kept = sorted(keep)
        return pool.tree(self._kept, self.device)

    def _children(self, level: int, budget: int) -> int:
        if not self.shape.dynamic:
            return self.shape.branching[level - 1]
        if self.params.greedy:
            return self.shape.width  # pruned to the budget at the end
        return min(self.shape.width, budget)  # decided before the draws: no draw is dropped

    def _worth_expanding(self, frontier: list[int]) -> list[int]:
        """Dynamic trees skip nodes below the shape's path-probability floor and (greedy) nodes
        whose children could not make the final cut: below the `leaf` probability (a child
        scores at most its parent) or the node budget. All depend on the draft alone."""
        pool, shape = self._pool, self.shape
        least = max(shape.floor, shape.leaf if self.params.greedy else 0.0)
        if least > 0.0:
            floor = math.log(least)
            frontier = [node for node in frontier if pool.score[node] >= floor]
        if not (shape.dynamic and self.params.greedy) or len(pool) < shape.nodes:
            return frontier
        cut = pool.score[pool.best(list(range(len(pool))), shape.nodes)[-1]]
        # a child scores at most its parent and loses ties to every older node
        return [node for node in frontier if pool.score[node] > cut]


class TreeModelDrafter(TreeGrowth, DraftModelState, TreeDrafter):
    """Drafts a token tree with a small causal LM (see the module docstring)."""

    def __init__(
        self, model: Any, shape: TreeShape, vocab_size: int | None = None, name: str = "draft"
    ) -> None:
        check_tree_attention(model, "draft")
        super().__init__(model, vocab_size)
        self._start_tree(shape, name)

    def _root(self, context: list[int]) -> torch.Tensor:
        """The committed tokens the draft has not seen, causal; the logits at the last [1, V]."""
        assert self.cache is not None, "begin() first"
        with self.meter.forward("draft", len(context) - len(self.cache)):
            root = self.cache.forward(self._ids(context[len(self.cache) :]), last_only=True)
        return root[:, : self.vocab_size]

    def _feed(self, nodes: list[int]) -> torch.Tensor:
        """One draft forward over `nodes` with a tree mask; returns their logits [m, V]."""
        assert self.cache is not None
        allowed, depth = self._node_mask(nodes, len(self.cache), self._context_len)
        with self.meter.forward("draft", len(nodes)):
            logits = self.cache.forward(
                self._ids([self._pool.tokens[n] for n in nodes]),
                position_ids=self._context_len - 1 + depth,  # the root sits at L - 1
                attention_mask=additive_mask(allowed, self.dtype),
            )
        return logits[:, : self.vocab_size]  # [m, V_common]

    def observe_path(self, path: list[int]) -> None:
        """Keep the context and the accepted nodes the cache holds; drop every other node."""
        assert self.cache is not None
        slots = [self._pool.slot[self._kept[node]] for node in path]
        fed = slots[: next((i for i, s in enumerate(slots) if s < 0), len(slots))]
        self.cache.compact(
            torch.cat([torch.arange(self._context_len), torch.tensor(fed, dtype=torch.long)])
        )
