"""One token trie per request from every pool's candidates, scored on one scale, and the nodes worth verifying.

Each pool proposes nodes with its own probability that the target continues with them (given the parent was
accepted). Those numbers are not comparable across pools (a suffix tree's frequency, a recycled softmax
probability from another context), so each is calibrated against verification: `Calibration` counts, per
calibration key (pool + its evidence, bucketed), how often a node whose parent was accepted was accepted itself.
Nodes proposed by several pools are merged (shared prefixes are one node) and their calibrated probabilities
combined. A node's path probability (the product along its path) is the chance verification accepts it, so the
expected tokens of a step are 1 + the sum of the verified nodes' path probabilities; which and how many nodes to
verify is then a trade against the cost of verifying rows (`best_prefix`). Pure Python: no vLLM, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from vllm_adaspec.pools import Candidates


class Calibration:
    """key -> [accepted, tested] over verified nodes whose parent was accepted; a Beta prior centred on the pool's
    own probability with `strength` pseudo-observations until evidence accumulates: a node's calibrated chance is
    (accepted + strength * PRIOR_SCALE * p) / (tested + strength), p the pools' best probability for it (`merge`
    computes it in its loop)."""

    def __init__(self, strength: float = 4.0):
        self.strength = strength
        self.counts: dict[tuple, list[float]] = {}

    def observe(self, key: tuple, accepted: bool) -> None:
        c = self.counts.setdefault(key, [0.0, 0.0])
        c[0] += accepted
        c[1] += 1


@dataclass
class YieldCalibration:
    """Accepted drafts against what the calibrated node probabilities promised them, per kind of proposal (chains,
    trees), learned online. Nodes are calibrated one at a time, but a proposal's nodes are the ones that scored
    highest (their errors do not cancel out) and a tree's siblings exclude each other: measured, chains commit more
    than their probabilities say and trees less (benchmarks/RESULTS.md, session 20's audit). The ratio scales the
    gains a step's choice of nodes weighs. Starts at 1 (`strength` drafts of pseudo-evidence), forgets slowly,
    clamped to [1/2, 2]."""
    strength: float = 20.0
    forget: float = 0.995
    enabled: bool = True
    sums: dict = field(default_factory=lambda: {False: [0.0, 0.0], True: [0.0, 0.0]})  # tree? -> [accepted, promised]

    def ratio(self, tree: bool) -> float:
        if not self.enabled:
            return 1.0
        accepted, promised = self.sums[tree]
        return min(2.0, max(0.5, (accepted + self.strength) / (promised + self.strength)))

    def observe(self, tree: bool, promised: float, accepted: int) -> None:
        s = self.sums[tree]
        s[0] = s[0] * self.forget + accepted
        s[1] = s[1] * self.forget + promised


@dataclass
class Trie:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1 = child of the root
    cond: list[float] = field(default_factory=list)  # calibrated P(accepted | parent accepted), pools combined
    path: list[float] = field(default_factory=list)  # P(accepted): product of cond along the path
    keys: list[list[tuple]] = field(default_factory=list)  # per node: [its calibration key] (merge)
    depth: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)


def merge(pools: Sequence[Candidates], calibrate: Calibration, state: tuple = ()) -> Trie:
    """Insert every pool's candidates into one trie rooted at the last committed token, then score each node as
    one event: its calibration key is which pools proposed it, their best probability (bucketed), how many
    siblings compete with it, the strongest evidence behind it (a pool's match length / rank) and `state` (what
    the request's recent steps say: a request that is copying tends to go on copying).

    Scoring per node, not per pool, matters: pools agree on copies (counting each pool's calibrated chance as
    independent evidence doubled the predicted acceptance in replays) and siblings exclude each other (each
    pool's chance, calibrated where it was alone, overstates it where several pools disagree)."""
    t = Trie()
    tokens, parents, depth = t.tokens, t.parents, t.depth
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    raw: list[float] = []
    pools_of: list = []  # per node: the one pool's (name,), or a set of names once a second pool proposes it
    evidence: list[int] = []  # per node: the strongest evidence behind it, at most 4
    # (the hot loop of a step's drafting, ~30 nodes per request: local names, no per-node set unless pools overlap)
    for cand in pools:
        name = (cand.pool, )
        where: list[int] = []  # candidate node -> trie node (a candidate's parent comes before it)
        for tok, parent, prob, ev in zip(cand.tokens, cand.parents, cand.probs, cand.evidence):
            tp = where[parent] if parent >= 0 else -1
            k = (tp, tok)
            node = index.get(k)
            if node is None:
                node = index[k] = len(tokens)
                tokens.append(tok)
                parents.append(tp)
                depth.append(depth[tp] + 1 if tp >= 0 else 1)
                raw.append(prob if prob > 0.0 else 0.0)
                pools_of.append(name)
                evidence.append(ev if ev < 4 else 4)
            else:
                if prob > raw[node]:
                    raw[node] = prob
                names = pools_of[node]
                if names.__class__ is set:
                    names.add(name[0])
                elif names != name:
                    pools_of[node] = {names[0], name[0]}
                if ev > evidence[node]:
                    evidence[node] = ev if ev < 4 else 4
            where.append(node)
    siblings: dict[int, int] = {}  # parent -> its children, at most 3
    for parent in parents:
        siblings[parent] = siblings.get(parent, 0) + 1
    for parent, n in siblings.items():
        if n > 3:
            siblings[parent] = 3
    cond, path, keys = t.cond, t.path, t.keys
    counts, strength = calibrate.counts, calibrate.strength  # (Calibration.__call__, inlined)
    prior, get = strength * PRIOR_SCALE, counts.get
    for parent, names, r, ev in zip(parents, pools_of, raw, evidence):  # parents come before their children
        key = (tuple(sorted(names)) if names.__class__ is set else names, int(r * 10) if r < 0.9 else 9,
               siblings[parent], ev if ev > 0 else 0) + state  # (r >= 0: its tenth of [0, 1], 9 at most)
        keys.append([key])
        acc, tested = get(key, _UNSEEN)
        c = (acc + prior * r) / (tested + strength)
        cond.append(c)
        path.append(c * path[parent] if parent >= 0 else c)
    return t


_UNSEEN = (0.0, 0.0)
PRIOR_SCALE = 0.5  # until evidence accumulates a node is trusted half its pools' own probability (they overstate)


def prune(t: Trie, keep: Sequence[bool]) -> Trie:
    """The trie without the nodes not kept (keep [len(t)], closed under parents: a dropped node's subtree is
    dropped too), in the same order with parents renumbered. Scores stay: a node's chance is its own."""
    new: dict[int, int] = {}
    out = Trie()
    for i, parent in enumerate(t.parents):
        if keep[i] and (parent < 0 or parent in new):
            new[i] = len(out.tokens)
            out.tokens.append(t.tokens[i])
            out.parents.append(new[parent] if parent >= 0 else -1)
            out.cond.append(t.cond[i])
            out.path.append(t.path[i])
            out.keys.append(t.keys[i])
            out.depth.append(t.depth[i])
    return out


def ranked(t: Trie) -> list[int]:
    """Nodes by path probability, best first; a child never outranks its parent (ties: shallower first), so every
    prefix of this order is closed under parents."""
    return sorted(range(len(t)), key=lambda i: (-t.path[i], t.depth[i], i))


def subtree(t: Trie, nodes: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """The chosen nodes (closed under parents) as a breadth-first tree: (tokens, parents, trie node of each)."""
    order = sorted(nodes, key=lambda i: (t.depth[i], i))
    new = {old: j for j, old in enumerate(order)}
    return [t.tokens[i] for i in order], [new[t.parents[i]] if t.parents[i] >= 0 else -1 for i in order], order


def best_prefix(gains: Sequence[float], base_tokens: float, cost: Callable[[int], float], base_rows: int,
                extra: Sequence[float] | None = None) -> int:
    """How many of the candidate nodes (sorted by gain, best first) to verify: the k that maximises expected tokens
    per unit of time, (base_tokens + sum(gains[:k])) / (cost(base_rows + k) + extra[k]), where cost(r) is the time of
    a verification step of r rows in all (the batch's requests plus the nodes) and extra[k] [len(gains) + 1] what
    else the first k nodes cost (early exit: draft passes; default nothing)."""
    best_k, best, total = 0, base_tokens / (cost(base_rows) + (extra[0] if extra else 0.0)), base_tokens
    for k, g in enumerate(gains, start=1):
        total += g
        rate = total / (cost(base_rows + k) + (extra[k] if extra else 0.0))
        if rate > best:
            best_k, best = k, rate
    return best_k


def cost_curve(anchors: dict[int, float]) -> Callable[[int], float]:
    """Step time by rows, linear between measured anchors {rows: relative time} and along the last slope past
    them. Tabulated once up to the last anchor: the proposer asks for it per candidate node every step."""
    xs = sorted(anchors)
    ys = [anchors[x] for x in xs]

    def between(rows: int) -> float:
        if rows <= xs[0]:
            return ys[0]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if rows <= x1:
                return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)
        raise AssertionError(rows)

    table = [between(r) for r in range(xs[-1] + 1)]  # [rows] -> relative time
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0

    def cost(rows: int) -> float:
        return table[max(rows, 0)] if rows < len(table) else ys[-1] + slope * (rows - xs[-1])

    return cost


def feedback(t: Trie, chosen: Sequence[int], path_nodes: Sequence[int], calibrate: Calibration) -> None:
    """After verification: every chosen node whose parent was accepted (or is the root) was tested; it passed if
    it lies on the accepted path (path_nodes: trie nodes, root to deepest)."""
    on_path = set(path_nodes)
    accepted_parents = {-1} | on_path
    for i in chosen:
        if t.parents[i] in accepted_parents:
            for key in t.keys[i]:
                calibrate.observe(key, i in on_path)


def streak_state(accepted_last: int) -> tuple:
    """Calibration state from the request's last verification: none, some or many drafts accepted."""
    return (0 if accepted_last <= 0 else 1 if accepted_last < 3 else 2,)
