"""Medusa pool: the candidate tree drawn from Medusa heads' top-ranked tokens (heads/medusa.py computes them).

The tree's shape is Medusa's sparse tree (paper 002, 3.3.3): a node is a path of ranks (r_1, ..., r_d) = "head d's
r_d-th choice below the node (r_1, ..., r_{d-1})", and its chance of acceptance is estimated as the product of the
heads' held-out accuracies acc[d][r_d] along the path. The `budget` nodes of highest estimate (a tree: a child never
beats its parent) are chosen once per budget and kept (`SparseTree`); each step only fills in the tokens.
`MedusaPool` runs the heads (an object with `.logits(h, e)`, `.embed`, `.vocab`, `.accuracy`: engine/medusa_heads.py)
on a step's drafting requests in one batch; the only pool that touches torch, and it keeps no per-request state.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from vllm_adaspec.pools import Candidates, Pool, Taps


@dataclass(frozen=True)
class SparseTree:
    """Nodes in parent-before-child order: parents [N] (-1 = child of the root), depth [N] (1 = head 1), rank [N]
    (which of that head's top tokens), estimate [N] (product of accuracies along the path)."""
    parents: tuple[int, ...]
    depth: tuple[int, ...]
    rank: tuple[int, ...]
    estimate: tuple[float, ...]

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def max_rank(self) -> int:
        return 1 + max(self.rank, default=-1)

    @cached_property
    def at(self) -> tuple[np.ndarray, np.ndarray]:
        """(head index [N], rank [N]): where each node's token lies in the heads' [K, width] top tokens (built once,
        read every step)."""
        return np.asarray(self.depth) - 1, np.asarray(self.rank)


def sparse_tree(accuracy: list[list[float]], budget: int) -> SparseTree:
    """accuracy[d][r]: P(head d + 1's rank-r token is the target's token). The `budget` rank paths of highest
    product of accuracies; greedy by a heap is exact because a path's value never exceeds its parent's."""
    heap = [(-accuracy[0][r], (r,), -1) for r in range(len(accuracy[0])) if accuracy[0][r] > 0]
    heapq.heapify(heap)
    parents, depth, rank, est = [], [], [], []
    while heap and len(parents) < budget:
        neg, path, parent = heapq.heappop(heap)
        node = len(parents)
        parents.append(parent)
        depth.append(len(path))
        rank.append(path[-1])
        est.append(-neg)
        if len(path) < len(accuracy):
            for r, a in enumerate(accuracy[len(path)]):
                if a > 0:
                    heapq.heappush(heap, (neg * a, path + (r,), node))
    return SparseTree(tuple(parents), tuple(depth), tuple(rank), tuple(est))


def propose_medusa(tree: SparseTree, top_ids: np.ndarray, top_probs: np.ndarray) -> Candidates:
    """top_ids / top_probs [K, R]: each head's R best tokens (full vocabulary ids) and their probabilities under
    the head. Candidates in the tree's shape; each node's probability is its head's own, its calibration evidence
    the head (depth). Siblings can repeat a token only if a head ranks it twice, which it cannot."""
    at = tree.at
    return Candidates(top_ids[at].tolist(), list(tree.parents), top_probs[at].astype(np.float64).tolist(),
                      list(tree.depth), "medusa")


def ranked_tokens(heads, h, last_tokens: list[int], width: int):
    """The heads' tensor work, on the target's device (a GPU's, where there is one: not host time): h [R, H] final
    hidden states and each request's last token -> (full-vocabulary ids, probabilities) [R, K, width] of each head's
    `width` most probable tokens."""
    import torch

    e = None
    if heads.embed is not None:  # token-conditioned heads: the embedding of each request's last committed token
        e = heads.embed(torch.tensor(last_tokens, device=h.device))
    probs = heads.logits(h, e).float().softmax(-1)  # [R, K, V']
    top_p, top_i = probs.topk(width, dim=-1)  # [R, K, width]
    return heads.vocab[top_i], top_p


# The heads' candidates a request gets at most: their 6 best rank paths (16 added no tokens per step and cost the
# drafter time: benchmarks/log/2026-11-26.md).
MAX_NODES = 6


class MedusaPool(Pool):
    """Stateless per request: everything it reads comes in the step's Taps (hidden states, last tokens)."""
    name = "medusa"

    def __init__(self, heads):
        self.heads = heads
        self.trees: dict[int, SparseTree] = {}  # budget -> its sparse tree, built once
        self.last_top_ids: np.ndarray | None = None  # [R, K, width] the last step's ranked tokens (tests, checks)

    @classmethod
    def from_build(cls, build):
        if build.medusa_heads is None:
            raise ValueError("the medusa pool needs its file loaded: pass medusa_heads")
        return cls(build.medusa_heads)

    def tree(self, budget: int) -> SparseTree:
        """The sparse tree of the `budget` best rank paths, at most MAX_NODES."""
        budget = min(budget, MAX_NODES)
        if budget not in self.trees:
            self.trees[budget] = sparse_tree(self.heads.accuracy, budget)
        return self.trees[budget]

    def propose(self, requests: list[str], budgets: list[int], taps: Taps) -> list[Candidates]:
        """All requests and heads in one matmul on taps.hidden [R, H]; each request's tree is its budget's."""
        if taps.hidden is None:
            raise RuntimeError("medusa pool: the worker did not hand over the target's hidden states")
        if not requests:
            return []
        trees = [self.tree(b) for b in budgets]
        width = max(t.max_rank for t in trees)
        top_ids, top_p = ranked_tokens(self.heads, taps.hidden, taps.last_tokens, width)
        top_ids, top_p = top_ids.cpu().numpy(), top_p.cpu().numpy()  # (the step's one copy to the host)
        self.last_top_ids = top_ids
        if any(t is not trees[0] for t in trees):
            return [propose_medusa(t, top_ids[r], top_p[r]) for r, t in enumerate(trees)]
        # one tree for every request (the usual case): each node's token and probability gathered for all at once
        t = trees[0]
        at = (slice(None), *t.at)
        ids, probs = top_ids[at].tolist(), top_p[at].astype(np.float64).tolist()  # [R][N]
        parents, depth = list(t.parents), list(t.depth)
        return [Candidates(i, parents.copy(), p, depth.copy(), "medusa") for i, p in zip(ids, probs)]
