"""Recycled pool (Token Recycling, Luo et al. 2024): the target's own top-k next tokens at every row it verified.

Each verification forward computes the target's distribution at the root and at every draft node, accepted or
not; those rows are already paid for. Their top-k (token -> its k most probable successors, with probabilities)
overwrite a table shared by all requests. Drafting walks the table breadth-first from the request's last token:
children of t are table[t], most probable first. Stale by construction (the successors were seen after t in some
other context), so calibration decides how much each recycled probability is worth."""

from __future__ import annotations

import numpy as np

from vllm_adaspec.pools import Candidates, Taps, TailPool


class RecycleTable:
    def __init__(self, vocab_size: int, k: int = 8):
        self.k = k
        self.ids = np.full((vocab_size, k), -1, dtype=np.int64)  # [V, k] successors, best first (-1: none)
        self.probs = np.zeros((vocab_size, k), dtype=np.float32)  # [V, k]

    def update(self, tokens: np.ndarray, top_ids: np.ndarray, top_probs: np.ndarray) -> None:
        """tokens [R] the input token of each verified row; top_ids, top_probs [R, >= k] the target's top-k there.
        Later rows win where a token repeats (the most recent context)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        ok = (tokens >= 0) & (tokens < len(self.ids))
        self.ids[tokens[ok]] = np.asarray(top_ids)[ok, :self.k]
        self.probs[tokens[ok]] = np.asarray(top_probs)[ok, :self.k]


def propose_recycled(table: RecycleTable, last_token: int, depth: int, width: int = 4,
                     max_nodes: int = 64, min_prob: float = 0.02) -> Candidates:
    """Breadth-first over the table from `last_token`: each node's `width` most probable successors, down to
    `depth`, keeping children whose recorded probability is at least `min_prob`, until `max_nodes`."""
    out = Candidates(pool="recycled")
    frontier = [(-1, int(last_token))]
    for _ in range(depth):
        nxt = []
        for parent, tok in frontier:
            for j in range(width):
                t, p = int(table.ids[tok, j]), float(table.probs[tok, j])
                if t < 0 or p < min_prob:
                    break
                if len(out) >= max_nodes:
                    return out
                nxt.append((out.add(parent, t, p, j), t))
        if not nxt:
            break
        frontier = nxt
    return out


class RecycledPool(TailPool):
    """One table for all requests, fed by verified rows; per request: its last token (where the walk starts)."""
    name = "recycled"
    keep = 1

    def __init__(self, vocab_size: int, k: int = 8):
        super().__init__()
        self.table = RecycleTable(vocab_size, k)
        self.logits_k = k

    @classmethod
    def from_build(cls, build):
        from vllm_adaspec.pools import POOLS

        return cls(build.vocab_size, POOLS[cls.name].logits_k)  # the top-k its spec asks the step for

    def observe_logits(self, tokens: np.ndarray, top_ids: np.ndarray, top_probs: np.ndarray) -> None:
        self.table.update(tokens, top_ids, top_probs)

    def propose(self, requests: list[str], budgets: list[int], taps: Taps) -> list[Candidates]:
        return [propose_recycled(self.table, self.tails[r][-1], depth=b) for r, b in zip(requests, budgets)]
