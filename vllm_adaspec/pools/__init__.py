"""Candidate pools: cheap sources of draft continuations for MultiBranchProposer. No vLLM, no model.

Each pool proposes, for one request, a small tree of candidate tokens rooted at the request's last committed token
(`Candidates`): nodes in parent-before-child order, each with the pool's own estimate of the probability that the
target continues with it given that its parent was accepted, and a calibration key (the pool's evidence for it,
bucketed) under which verification outcomes are counted (trees/trie.py merges pools and calibrates them).

    context   every earlier occurrence of the request's last tokens in its prompt and output (prompt lookup that
              keeps every match and weights continuations by how often they occur)
    suffix    arctic-inference's suffix trees, in tree mode: the request's prompt + the outputs of earlier requests
    recycled  Token Recycling: the target's own top-k successors of every token it verified, walked breadth-first
    corpus    an n-gram table built offline from general text for one tokenizer (shipped for SmolLM2)

Per-request state is created by `start` and dropped by `stop`; `extend` feeds newly committed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Candidates:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1 = child of the root (the last committed token)
    probs: list[float] = field(default_factory=list)  # P(node | parent accepted), the pool's estimate
    keys: list[tuple] = field(default_factory=list)  # calibration bucket of each node

    def add(self, parent: int, token: int, prob: float, key: tuple) -> int:
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.probs.append(float(prob))
        self.keys.append(key)
        return len(self.tokens) - 1

    def __len__(self) -> int:
        return len(self.tokens)


def prob_bucket(p: float) -> int:
    """0..9: which tenth of [0, 1] a probability falls in (calibration keys)."""
    return min(9, max(0, int(p * 10)))


POOL_NAMES = ("context", "suffix", "recycled", "corpus")
