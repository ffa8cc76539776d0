"""Verify a draft tree against the target's outputs at every verification row (row 0 = root, 1 + i = node i).

Each function walks from the root and returns (accepted nodes, root to deepest, and the bonus token: the target's
own token after the last accepted node). The committed tokens are the accepted nodes' tokens + the bonus.

    verify_greedy         lossless for greedy decoding: follow the child equal to the target's argmax
    verify_sample_match   lossless sampling: sample the target at a node, continue into the child equal to it
    verify_rrs            lossless sampling with draft probabilities: recursive rejection sampling over siblings
                          drawn i.i.d. from the drafter's q (accept t with min(1, p(t)/q(t)); on rejection
                          p <- norm(max(p - q, 0)); after the last sibling sample the residual)
    verify_typical        LOSSY (Medusa 3.3.1, opt-in): accept a child whose target probability exceeds
                          min(eps, delta * exp(-H(p))); it changes the output distribution
"""

from __future__ import annotations

import torch

from vllm_adaspec.trees.tree import DraftTree


def _children(tree: DraftTree) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, q in enumerate(tree.parents.tolist()):
        out.setdefault(q, []).append(i)
    return out


def _path_to(tree: DraftTree, node: int) -> list[int]:
    path, parents = [], tree.parents.tolist()
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


# Sibling nodes with the same token stand for the same text, so the target's output is the same at each of them:
# every walk below keeps the whole set of equivalent nodes it has reached (the frontier), draws or compares once
# per step, and pools their children. At the end any frontier node's root path is an accepted path.

def verify_greedy(tree: DraftTree, target_argmax: torch.Tensor) -> tuple[list[int], int]:
    """target_argmax [n + 1]: the target's argmax at each row."""
    kids, toks, want = _children(tree), tree.tokens.tolist(), target_argmax.tolist()
    frontier = [-1]
    while True:
        x = want[frontier[0] + 1]
        nxt = [c for f in frontier for c in kids.get(f, ()) if toks[c] == x]
        if not nxt:
            return _path_to(tree, frontier[0]), x
        frontier = nxt


def verify_sample_match(tree: DraftTree, target_probs: torch.Tensor,
                        generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """target_probs [n + 1, V]: the target's (processed) next-token distribution at each row."""
    kids, toks = _children(tree), tree.tokens.tolist()
    frontier = [-1]
    while True:
        x = int(torch.multinomial(target_probs[frontier[0] + 1], 1, generator=generator))
        nxt = [c for f in frontier for c in kids.get(f, ()) if toks[c] == x]
        if not nxt:
            return _path_to(tree, frontier[0]), x
        frontier = nxt


def verify_rrs(tree: DraftTree, target_probs: torch.Tensor, draft_probs: torch.Tensor,
               generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """draft_probs [n + 1, V]: the distribution each row's children were drawn from (i.i.d.)."""
    kids, toks = _children(tree), tree.tokens.tolist()
    frontier = [-1]
    while True:
        p = target_probs[frontier[0] + 1].double()
        q = draft_probs[frontier[0] + 1].double()
        accepted = None
        for c in (c for f in frontier for c in kids.get(f, ())):
            t = toks[c]
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if q[t] > 0 and u * q[t] < p[t]:  # accept with min(1, p(t) / q(t))
                accepted = t
                break
            residual = (p - q).clamp(min=0)
            total = residual.sum()
            if total <= 0:  # p <= q everywhere means p == q: rejection had probability 0
                break
            p = residual / total
        if accepted is None:
            return _path_to(tree, frontier[0]), int(torch.multinomial(p, 1, generator=generator))
        frontier = [c for f in frontier for c in kids.get(f, ()) if toks[c] == accepted]


def verify_typical(tree: DraftTree, target_probs: torch.Tensor, eps: float = 0.09, delta: float = 0.3,
                   generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """LOSSY. Follow the child token with the highest target probability among those above the typical threshold."""
    kids, toks = _children(tree), tree.tokens.tolist()
    frontier = [-1]
    while True:
        p = target_probs[frontier[0] + 1].double()
        entropy = -(p * p.clamp(min=1e-30).log()).sum()
        threshold = min(eps, delta * float(torch.exp(-entropy)))
        ok = [c for f in frontier for c in kids.get(f, ()) if p[toks[c]] > threshold]
        if not ok:
            return _path_to(tree, frontier[0]), int(torch.multinomial(p, 1, generator=generator))
        best = max((toks[c] for c in ok), key=lambda t: float(p[t]))
        frontier = [c for c in ok if toks[c] == best]
