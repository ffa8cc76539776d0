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


def continuation_trie(continuations, depth: int, max_nodes: int, key) -> Candidates:
    """Candidates from weighted continuations [(tokens, weight), ...] of the root: shared prefixes are one node (at
    most `max_nodes`, each continuation cut at `depth`), and a node's probability given its parent is the share of
    the parent's weight that continues with it (the root's: of all weight). key(prob) -> its calibration key."""
    out = Candidates()
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    count: list[float] = []
    total = 0
    for cont, weight in continuations:
        total += weight
        parent = -1
        for t in cont[:depth]:
            node = children.get((parent, t))
            if node is None:
                if len(out) >= max_nodes:
                    break
                node = children[(parent, t)] = out.add(parent, t, 0.0, ())
                count.append(0)
            count[node] += weight
            parent = node
    for i, parent in enumerate(out.parents):
        prob = count[i] / (count[parent] if parent >= 0 else total)
        out.probs[i] = prob
        out.keys[i] = key(prob)
    return out


def prob_bucket(p: float) -> int:
    """0..9: which tenth of [0, 1] a probability falls in (calibration keys)."""
    return min(9, max(0, int(p * 10)))


POOL_NAMES = ("context", "suffix", "recycled", "corpus")
