"""Tree shapes: Medusa-style choice lists, Cartesian top-k, and greedy growth by estimated path probability.

A shape is a list of "choices": each node is the tuple of child ranks on its path from the root, e.g. (0,) the
root's top-1 child, (0, 1) that child's second-best child (Medusa's `medusa_choices`). The drafter fills tokens:
node (r_1, ..., r_d) takes the r_d-th best token of its parent's draft distribution.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from vllm_adaspec.trees.tree import DraftTree

Choice = tuple[int, ...]


def shape_from_choices(choices: Sequence[Sequence[int]]) -> tuple[list[int], list[int], list[Choice]]:
    """choices -> (parents [n], ranks [n], choices in breadth-first order). Every prefix of a choice must be a
    choice too (a node needs its parent)."""
    uniq = sorted({tuple(c) for c in choices}, key=lambda c: (len(c), c))
    if any(len(c) == 0 or min(c) < 0 for c in uniq):
        raise ValueError("a choice is a non-empty tuple of child ranks >= 0")
    index = {c: i for i, c in enumerate(uniq)}
    missing = [c for c in uniq if len(c) > 1 and c[:-1] not in index]
    if missing:
        raise ValueError(f"choice {missing[0]} has no parent {missing[0][:-1]} in the list")
    parents = [index[c[:-1]] if len(c) > 1 else -1 for c in uniq]
    return parents, [c[-1] for c in uniq], uniq


def cartesian_choices(top_k: int, depth: int) -> list[Choice]:
    """Every node takes its parent's top_k tokens, down to `depth`: top_k + top_k^2 + ... nodes."""
    if top_k < 1 or depth < 1:
        raise ValueError(f"top_k and depth must be >= 1, got {top_k}, {depth}")
    return [c for d in range(1, depth + 1) for c in itertools.product(range(top_k), repeat=d)]


def fill_tokens(parents: list[int], ranks: list[int], topk_ids: torch.Tensor) -> torch.Tensor:
    """topk_ids [n + 1, k] (row 0 = root, row 1 + i = node i: each row's draft top-k) -> node tokens [n]."""
    return torch.stack([topk_ids[q + 1, r] for q, r in zip(parents, ranks)]) if parents else topk_ids.new_zeros(0)


def grow_by_path_probability(children_of: Callable[[tuple[int, ...]], tuple[list[int], list[float]]],
                             budget: int, top_k: int) -> tuple[DraftTree, torch.Tensor]:
    """Best-first growth under a node budget: repeatedly add the candidate with the highest path probability
    (product of draft probabilities from the root), whose children then become candidates.

    children_of(path of tokens from the root) -> (its top tokens, their draft probabilities), best first.
    Returns the tree (breadth-first) and each node's path probability.
    """
    if budget < 1 or top_k < 1:
        raise ValueError(f"budget and top_k must be >= 1, got {budget}, {top_k}")
    heap: list[tuple[float, int, int, int, tuple[int, ...]]] = []  # (-prob, tiebreak, parent, token, path)
    tie = itertools.count()

    def push(parent: int, path: tuple[int, ...], prob: float) -> None:
        toks, probs = children_of(path)
        for t, p in list(zip(toks, probs))[:top_k]:
            heapq.heappush(heap, (-prob * p, next(tie), parent, t, path + (t,)))

    push(-1, (), 1.0)
    nodes: list[tuple[int, int, float, int]] = []  # (parent, token, path prob, depth) in insertion order
    while heap and len(nodes) < budget:
        negp, _, parent, tok, path = heapq.heappop(heap)
        nodes.append((parent, tok, -negp, len(path)))
        push(len(nodes) - 1, path, -negp)
    # Insertion order has parents first but not breadth-first; sort by depth (stable) and remap parents.
    order = sorted(range(len(nodes)), key=lambda i: nodes[i][3])
    new = {old: j for j, old in enumerate(order)}
    parents = [new[nodes[i][0]] if nodes[i][0] >= 0 else -1 for i in order]
    tokens = torch.tensor([nodes[i][1] for i in order], dtype=torch.long)
    probs = torch.tensor([nodes[i][2] for i in order], dtype=torch.float64)
    return DraftTree(tokens, torch.tensor(parents, dtype=torch.long)), probs


# --- growing a tree depth by depth (a drafter that runs every chosen node's children in one batched step) ---

@dataclass
class GrowingTree:
    """Nodes drafted so far, in the order they were added: parent (-1 = root), token, path probability, depth."""
    parents: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)


def add_children(t: GrowingTree, parent: int, ids: Sequence[int], probs: Sequence[float]) -> None:
    """The draft distribution at `parent` (-1 = root) gave these candidates: they become nodes one level down."""
    base, depth = (1.0, 1) if parent < 0 else (t.probs[parent], t.depths[parent] + 1)
    for tok, p in zip(ids, probs):
        t.parents.append(parent)
        t.tokens.append(int(tok))
        t.probs.append(base * float(p))
        t.depths.append(depth)


def _ranked(t: GrowingTree, max_depth: int | None = None) -> list[int]:
    """Nodes by path probability, best first. A child is never more probable than its parent and ties go to
    the shallower node, so every prefix of this order is closed under parents."""
    idx = [i for i in range(len(t.probs)) if max_depth is None or t.depths[i] <= max_depth]
    return sorted(idx, key=lambda i: (-t.probs[i], t.depths[i], i))


def to_expand(t: GrowingTree, depth: int, width: int, budget: int) -> list[int]:
    """Nodes at `depth` worth drafting children for: the `width` most probable of them that rank among the
    `budget` most probable nodes overall (a node outside those cannot be in the final tree, nor its children)."""
    return [i for i in _ranked(t)[:budget] if t.depths[i] == depth][:width]


def best_subtree(t: GrowingTree, budget: int, max_depth: int | None = None) -> tuple[DraftTree, list[int]]:
    """The `budget` most probable nodes no deeper than `max_depth`, as a breadth-first DraftTree, and for each
    of its nodes the index in t it came from."""
    order = sorted(_ranked(t, max_depth)[:budget], key=lambda i: (t.depths[i], i))
    new = {old: j for j, old in enumerate(order)}
    parents = [new[t.parents[i]] if t.parents[i] >= 0 else -1 for i in order]
    tokens = torch.tensor([t.tokens[i] for i in order], dtype=torch.long)
    return DraftTree(tokens, torch.tensor(parents, dtype=torch.long)), order


def copy_capacity(length: int) -> int:
    """Positions a tree request's contiguous KV copy holds once it reaches `length` (runtime/): room
    for a few steps, at most ~1.25x its KV."""
    return length + length // 4 + 64


def admit_within(lengths: Sequence[int], cap: int, holding: Sequence[bool] | None = None) -> list[bool]:
    """Which requests may be verified as trees when their KV copies (lengths [R] positions each) may hold at most
    `cap` positions in all: those already holding a copy first (so copies are not dropped and rebuilt), then the
    rest in order, each while it still fits. The others draft chains this step."""
    order = sorted(range(len(lengths)), key=lambda i: not (holding[i] if holding is not None else False))
    admitted, used = [False] * len(lengths), 0
    for i in order:
        if used + lengths[i] <= cap:
            admitted[i], used = True, used + lengths[i]
    return admitted
