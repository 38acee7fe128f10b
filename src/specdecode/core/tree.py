"""Token trees: the data structure a tree drafter proposes, and the attention masks over it.

A tree hangs below the *root*, the last committed token (the step's first input, not yet in the
target's cache). Node i holds `tokens[i]`; `parents[i]` is its parent node, or -1 for a child of
the root. Nodes are in topological order (every parent before its children), so one pass in index
order visits each parent first.

In the verification forward the root and the nodes are laid out as one row each:
row 0 = root, row i + 1 = node i. A row attends to the committed prefix, to the rows of its
ancestors and to itself — never to a sibling or a cousin — and sits at position
`past + depth` (root depth 0), so every node sees exactly what it would see at the end of the plain
sequence prefix + ancestors + node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from specdecode.core.protocols import BaseDrafter

# attention implementations that add a custom 4D float mask to the scores as given
# (transformers passes a 4D mask through `masking_utils` untouched; flash-attention kernels
# only know causal/padding masks and would silently ignore the tree structure). flex_attention
# reads a dense mask as an additive score mask too, but is untested here (no CPU support), so
# it is refused until a test covers it. "specdecode_cpu" is kernels/attention.py's.
TREE_ATTENTION = ("eager", "sdpa", "specdecode_cpu")


@dataclass
class TokenTree:
    """A tree of drafted tokens below the root (the last committed token)."""

    tokens: torch.Tensor  # [N] int64 drafted token ids
    parents: torch.Tensor  # [N] int64, parents[i] < i; -1 = child of the root
    # [N, V] the distribution node i's token was sampled from (the draft's q at its parent, after
    # the target's temperature/top-k/top-p); None = a deterministic tree (q one-hot per node)
    q_draft: torch.Tensor | None = None
    # draws[r]: the candidates tried below row r (0 = root, i + 1 = node i), in the order they were
    # drawn, with repeats (i.i.d. draws of one token share one node). None = each child once, in
    # index order (a deterministic tree).
    draws: list[list[int]] | None = None
    depth: torch.Tensor = field(init=False)  # [N] int64, 1 for children of the root

    def __post_init__(self) -> None:
        parents = self.parents.tolist()
        depth: list[int] = []
        for i, parent in enumerate(parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}: parents must come first")
            depth.append(1 if parent < 0 else depth[parent] + 1)
        self.depth = torch.tensor(depth, dtype=torch.long, device=self.tokens.device)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def max_depth(self) -> int:
        """The longest root-to-leaf path: the most drafted tokens one step can accept."""
        return int(self.depth.max()) if len(self) else 0

    def children(self) -> list[list[int]]:
        """Candidates below each row (0 = root, i + 1 = node i), in the order to try them."""
        if self.draws is not None:
            return self.draws
        rows: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, parent in enumerate(self.parents.tolist()):
            rows[parent + 1].append(i)
        return rows


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """[N] parents -> [N+1, N+1] bool: entry [a, b] is True when row b is row a or an ancestor.

    Rows and columns are 0 = root, i + 1 = node i; the root is an ancestor of every node.
    """
    n = parents.shape[0]
    up = torch.cat([parents.new_zeros(1), parents + 1])  # [N+1] parent row; the root is its own
    rows = torch.arange(n + 1, device=parents.device)
    allowed = torch.eye(n + 1, dtype=torch.bool, device=parents.device)
    cursor = rows
    for _ in range(n):  # climb one level per pass; at most N levels
        cursor = up[cursor]
        if bool((allowed[rows, cursor]).all()):
            break
        allowed[rows, cursor] = True
    return allowed


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[q, kv] bool -> [1, 1, q, kv] float mask: 0 where allowed, the dtype's minimum elsewhere.

    Additive, not boolean: eager attention adds the mask to the scores, sdpa and flex accept both.
    """
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def tree_mask(
    ancestors: torch.Tensor, slots: torch.Tensor, prefix_len: int, kv_len: int
) -> torch.Tensor:
    """Which cache columns each query row may attend to: [q, kv_len] bool.

    ancestors: [q, R] bool, ancestor-or-self of each query over the tree's rows (ancestor_matrix).
    slots: [R] int64 cache column of each tree row, -1 for rows not in the cache.
    Every query sees the columns [0, prefix_len) (the committed tokens) and its ancestors' slots.
    """
    allowed = torch.zeros(ancestors.shape[0], kv_len, dtype=torch.bool, device=ancestors.device)
    allowed[:, :prefix_len] = True
    cached = slots >= 0  # [R]
    allowed[:, slots[cached]] = ancestors[:, cached]
    return allowed


def verification_inputs(
    tree: TokenTree, root_token: int, past: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids [N+1], position ids [N+1] and mask [1, 1, N+1, past+N+1] of the target pass.

    past: the target cache's length (the committed tokens minus the root).
    """
    n = len(tree)
    device = tree.tokens.device  # the target's (the drafter may live elsewhere)
    input_ids = torch.cat([torch.tensor([root_token], device=device), tree.tokens])  # [N+1]
    depth = torch.cat([tree.depth.new_zeros(1), tree.depth]).to(device)  # [N+1], root depth 0
    slots = past + torch.arange(n + 1, device=device)  # row r is written at column past + r
    allowed = tree_mask(ancestor_matrix(tree.parents.to(device)), slots, past, past + n + 1)
    return input_ids, past + depth, additive_mask(allowed, dtype)


def check_tree_attention(model: Any, role: str = "target", use: str = "token trees") -> None:
    """Refuse models whose attention would not honour a custom 4D tree mask; `use` names
    what needs the mask in the message (token trees, a static store's batched rows)."""
    config = model.config
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in TREE_ATTENTION:
        raise ValueError(
            f"{use} need an attention implementation that takes a custom 4D mask "
            f"({', '.join(TREE_ATTENTION)}); the {role} uses {impl!r}: load it with "
            f"attn_implementation='sdpa'"
        )
    layer_types = getattr(config, "layer_types", None) or []
    windowed = getattr(config, "sliding_window", None) and getattr(
        config, "use_sliding_window", True
    )
    if windowed or any(t != "full_attention" for t in layer_types):
        # a custom mask replaces the model's own, sliding windows included
        raise ValueError(f"{use} do not support the {role}'s sliding-window attention")


@runtime_checkable
class TreeDrafter(BaseDrafter, Protocol):
    """A drafter proposing a token tree instead of one chain."""

    def propose_tree(self, context: list[int], max_depth: int) -> TokenTree:
        """Draft a tree of at most `max_depth` levels below the last token of `context`."""

    def observe_path(self, path: list[int]) -> None:
        """Learn the accepted root-to-node path (node indices) and drop every other node."""

    @classmethod
    def propose_trees(
        cls,
        drafters: Sequence[TreeDrafter],
        contexts: Sequence[list[int]],
        max_depths: Sequence[int],
        rows: int = 1,
    ) -> list[TokenTree]:
        """The trees of several drafters of this class, one per context, in one step of a
        batch of `rows` rows; a class that can draft them together (the hybrid: its model's
        chains in one forward per depth) overrides it. Default: one by one."""
        return [
            d.propose_tree(ctx, depth)
            for d, ctx, depth in zip(drafters, contexts, max_depths, strict=True)
        ]


@runtime_checkable
class SizedTreeDrafter(TreeDrafter, Protocol):
    """A tree drafter whose candidate nodes come with their estimated acceptance, so that a
    batch sizes every row's tree together against what its one forward costs
    (`policies.size_trees`) instead of each row pricing its nodes as if it ran alone."""

    def candidates(self, context: list[int], max_depth: int) -> list[float]:
        """The next tree's candidate nodes' gains (expected acceptance) in the order to keep
        them: non-increasing, and every prefix of the order is a tree."""

    def take_candidates(self, n: int) -> TokenTree:
        """The tree of the first n candidates of the last `candidates` call."""
