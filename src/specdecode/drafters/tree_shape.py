"""Tree shapes: `static:3,2,2,1,1` (children per node at each depth) or `dynamic:NODES`
(`dynamic:NODES,DEPTH,WIDTH,FLOOR,LEAF` in full)."""

from __future__ import annotations

from dataclasses import dataclass

MAX_NODES = 1024  # a verification forward over more tree nodes than this is surely a typo

_EXAMPLES = "e.g. static:3,2,2,1,1 (children per node at depth 1, 2, ...), dynamic:16 (a budget "
_EXAMPLES += "of 16 nodes), dynamic:16,6,4 (budget, deepest level, nodes expanded per level) or "
_EXAMPLES += "dynamic:16,6,4,0.2 (and the path probability below which no node is expanded) or "
_EXAMPLES += "dynamic:16,6,4,0.2,0.05 (and the one below which no node is verified; FLOOR may be 0 "
_EXAMPLES += "there)"


@dataclass(frozen=True)
class TreeShape:
    """How a tree drafter grows its tree.

    static: every node at depth d - 1 gets `branching[d - 1]` children (the draft's top tokens
    when greedy, that many i.i.d. draws when sampling).
    dynamic (EAGLE-2 style): at each depth the `width` most probable new nodes (cumulative draft
    probability along their path) are expanded with `width` children each, down to `depth`
    levels, within a budget of `nodes` nodes. `floor` > 0: a node whose path probability under
    the draft (the product along its path) is below it gets no children, so a level whose
    nodes are all unlikely costs no draft forward; the root is always expanded. `leaf` > 0
    (greedy only): a node whose path probability is below it is left out of the tree the target
    verifies (the root's most probable child always stays), and not expanded, so a step where
    the draft is unsure verifies fewer rows; a path probability never
    grows along a path, so what is left is still a tree. Sampled trees keep every draw (lossless
    verification needs them) and ignore `leaf`, with a warning.
    """

    branching: tuple[int, ...] = ()  # static
    nodes: int = 0  # dynamic: node budget
    depth: int = 6  # dynamic: deepest level
    width: int = 4  # dynamic: nodes expanded per level, children per expanded node
    floor: float = 0.0  # dynamic: the least path probability of an expanded node
    leaf: float = 0.0  # dynamic, greedy: the least path probability of a verified node

    @property
    def dynamic(self) -> bool:
        return not self.branching

    @property
    def max_depth(self) -> int:
        return self.depth if self.dynamic else len(self.branching)

    def __str__(self) -> str:
        if self.dynamic:
            tail = f",{self.floor:g},{self.leaf:g}" if self.leaf else ""
            tail = tail or (f",{self.floor:g}" if self.floor else "")
            return f"dynamic:{self.nodes},{self.depth},{self.width}{tail}"
        return "static:" + ",".join(map(str, self.branching))


def _positive_ints(text: str, spec: str) -> list[int]:
    parts = [part.strip() for part in text.split(",")]
    if not parts or not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise ValueError(f"bad tree {spec!r}: expected positive integers, {_EXAMPLES}")
    return [int(part) for part in parts]


def _probability(text: str, spec: str, name: str, zero: bool = False) -> float:
    """A FLOOR or LEAF field: a probability in (0, 1), or [0, 1) where `zero` is allowed."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (0.0 <= value < 1.0 if zero else 0.0 < value < 1.0):
        interval = "[0, 1)" if zero else "(0, 1)"
        raise ValueError(
            f"bad tree {spec!r}: {name} must be a probability in {interval}, {_EXAMPLES}"
        )
    return value


def parse_tree_spec(spec: str) -> TreeShape:
    """`static:C1,C2,...` or `dynamic:NODES[,DEPTH[,WIDTH[,FLOOR[,LEAF]]]]` -> TreeShape
    (ValueError if bad)."""
    kind, sep, rest = spec.partition(":")
    if not sep or kind not in ("static", "dynamic"):
        raise ValueError(f"bad tree {spec!r}: {_EXAMPLES}")
    floor = leaf = 0.0
    if kind == "dynamic" and rest.count(",") == 4:
        rest, _, last = rest.rpartition(",")
        leaf = _probability(last.strip(), spec, "LEAF")
    if kind == "dynamic" and rest.count(",") == 3:
        rest, _, last = rest.rpartition(",")
        floor = _probability(last.strip(), spec, "FLOOR", zero=leaf > 0.0)
    numbers = _positive_ints(rest, spec)
    if kind == "static":
        nodes, level = 0, 1
        for children in numbers:
            level *= children
            nodes += level
        if nodes > MAX_NODES:
            raise ValueError(f"tree {spec!r} has {nodes} nodes (at most {MAX_NODES})")
        return TreeShape(branching=tuple(numbers))
    if len(numbers) > 3:
        raise ValueError(f"bad tree {spec!r}: {_EXAMPLES}")
    if numbers[0] > MAX_NODES:
        raise ValueError(f"tree {spec!r} has {numbers[0]} nodes (at most {MAX_NODES})")
    extra = dict(zip(("depth", "width"), numbers[1:], strict=False))  # optional, in order
    return TreeShape(nodes=numbers[0], floor=floor, leaf=leaf, **extra)
