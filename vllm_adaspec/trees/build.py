"""Tree shapes: Medusa-style choice lists, Cartesian top-k, and greedy growth by estimated path probability.

A shape is a list of "choices": each node is the tuple of child ranks on its path from the root, e.g. (0,) the
root's top-1 child, (0, 1) that child's second-best child (Medusa's `medusa_choices`). The drafter fills tokens:
node (r_1, ..., r_d) takes the r_d-th best token of its parent's draft distribution.
"""

from __future__ import annotations

import heapq
import itertools
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


def grow_along_chain(per_depth: Sequence[tuple[list[int], list[float]]], budget: int) -> DraftTree:
    """A drafter that ran one chain (top-1 at each depth) and kept each depth's top-k candidates: the `budget`
    most probable nodes, where only chain nodes have children (nothing was drafted past an alternative).
    per_depth[d] = (candidate ids best first, their draft probabilities) at depth d + 1."""
    chain = tuple(ids[0] for ids, _ in per_depth)
    top_k = max(len(ids) for ids, _ in per_depth)

    def children_of(path: tuple[int, ...]):
        d = len(path)
        return per_depth[d] if d < len(per_depth) and path == chain[:d] else ([], [])

    return grow_by_path_probability(children_of, budget, top_k)[0]
