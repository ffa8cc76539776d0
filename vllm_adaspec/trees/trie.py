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

import numpy as np

from vllm_adaspec.compiled import compiled as _compiled
from vllm_adaspec.compiled import njit  # (None without numba: np.add.at adds the observations, the same sums)
from vllm_adaspec.pools import Candidates


# A calibration key as one integer (`key_code`): which pools proposed the node (a bit mask over the pools in the order
# `Calibration.bit` first saw them), their best probability's tenth, competing siblings (at most 3), evidence (0-4)
# and the request's streak state (0-2). Counts live in a dense table, so the compiled choice (trees/step_choice.py)
# reads them as the Python one does.
# MAX_POOLS: a bit of the calibration key per pool; the registry (pools.POOLS) holds 6, so it is full: a seventh
# pool widens the key by one bit (tests/test_pool_interface.py checks the registry fits)
MAX_POOLS, BUCKETS, SIBLINGS, EVIDENCE, STATES = 6, 10, 4, 5, 3
KEY_CODES = (1 << MAX_POOLS) * BUCKETS * SIBLINGS * EVIDENCE * STATES


def key_code(mask: int, bucket: int, siblings: int, evidence: int, state: int) -> int:
    return (((mask * BUCKETS + bucket) * SIBLINGS + siblings) * EVIDENCE + evidence) * STATES + state


class Calibration:
    """key code -> [accepted, tested] over verified nodes whose parent was accepted; a Beta prior centred on the
    pool's own probability with `strength` pseudo-observations until evidence accumulates: a node's calibrated chance
    is (accepted + strength * PRIOR_SCALE * p) / (tested + strength), p the pools' best probability for it (`merge`
    computes it in its loop)."""

    def __init__(self, strength: float = 4.0):
        self.strength = strength
        self._table = np.zeros((KEY_CODES, 2))  # [KEY_CODES, 2]: accepted, tested
        self._codes: list[int] = []  # observations not yet in the table (added in one go when it is next read)
        self._hits: list[bool] = []
        self.pools: list[str] = []  # bit b of a key's pool mask -> the pool's name
        self._names: dict[int, tuple[str, ...]] = {}  # pool mask -> its pools' names (pool_names)

    def bit(self, pool: str) -> int:
        """The mask bit of a pool (assigned on first sight; at most MAX_POOLS pools)."""
        try:
            return 1 << self.pools.index(pool)
        except ValueError:
            if len(self.pools) >= MAX_POOLS:
                raise ValueError(f"calibration keys hold at most {MAX_POOLS} pools: {self.pools + [pool]}") from None
            self.pools.append(pool)
            return 1 << (len(self.pools) - 1)

    @property
    def table(self) -> np.ndarray:
        """[KEY_CODES, 2] accepted, tested: every observation so far."""
        if self._codes:
            add_observations(self._table, np.array(self._codes, np.int64), np.array(self._hits, np.float64))
            self._codes, self._hits = [], []
        return self._table

    def observe(self, code: int, accepted: bool) -> None:
        self._codes.append(code)
        self._hits.append(accepted)

    def observe_many(self, codes: list[int], accepted: list[bool]) -> None:
        """`observe` of each, in order."""
        self._codes += codes
        self._hits += accepted

    def pool_names(self, code: int) -> tuple[str, ...]:
        """The pools that proposed a node of this key, sorted."""
        mask = code // (BUCKETS * SIBLINGS * EVIDENCE * STATES)
        names = self._names.get(mask)
        if names is None:
            names = self._names[mask] = tuple(sorted(name for b, name in enumerate(self.pools) if mask >> b & 1))
        return names

    def key(self, code: int) -> tuple:
        """The key as a tuple: (pools, bucket, siblings, evidence, state) (the audit, replays, tests)."""
        rest, state = divmod(code, STATES)
        rest, evidence = divmod(rest, EVIDENCE)
        rest, siblings = divmod(rest, SIBLINGS)
        return self.pool_names(code), rest % BUCKETS, siblings, evidence, state

    @property
    def counts(self) -> dict[tuple, list[float]]:
        """Every key tested so far: {key tuple: [accepted, tested]} (a copy)."""
        table = self.table
        return {self.key(int(c)): table[c].tolist() for c in np.flatnonzero(table[:, 1])}

    @counts.setter
    def counts(self, counts: dict[tuple, list[float]]) -> None:
        table = self.table
        table[:] = 0.0  # (pending observations dropped with the rest)
        for (pools, bucket, siblings, evidence, state), c in counts.items():
            table[key_code(sum(self.bit(p) for p in pools), bucket, siblings, evidence, state)] = c


def _add_loop(table, codes, hits):
    """table[codes[i]] += (hits[i], 1), in order: np.add.at's sums (for numba)."""
    for i in range(codes.shape[0]):
        table[codes[i], 0] += hits[i]
        table[codes[i], 1] += 1.0


_ADD = [_compiled(_add_loop) if njit is not None else None]  # (None once it failed: np.add.at from then on)


def add_observations(table: np.ndarray, codes: np.ndarray, hits: np.ndarray) -> None:
    """table [KEY_CODES, 2] += each observation (codes [n] int64, hits [n] float64), in order. Compiled: the
    drafter adds a step's ~50 at the step's first read of the table (~1 us; np.add.at's two calls ~10 us). Compiled
    at start-up with the node choice (step_choice.warm_up)."""
    add = _ADD[0]
    if add is not None:
        try:
            add(table, codes, hits)
            return
        except IndexError:
            raise
        except Exception:  # (numba failed to compile it: it raised before writing anything)
            _ADD[0] = None
    np.add.at(table, (codes, 0), hits)
    np.add.at(table, (codes, 1), 1.0)


@dataclass
class YieldCalibration:
    """Accepted drafts against what the calibrated node probabilities promised them, per kind of proposal (chains,
    trees), learned online. Nodes are calibrated one at a time, but a proposal's nodes are the ones that scored
    highest (their errors do not cancel out) and a tree's siblings exclude each other: measured, chains commit more
    than their probabilities say and trees less (benchmarks/log/2026-11-26.md, the audit). The ratio scales the
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
    codes: list[int] = field(default_factory=list)  # per node: its calibration key (key_code; merge)
    depth: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)


def merge(pools: Sequence[Candidates], calibrate: Calibration, state: tuple = ()) -> Trie:
    """Insert every pool's candidates into one trie rooted at the last committed token, then score each node as
    one event: its calibration key is which pools proposed it, their best probability (bucketed), how many
    siblings compete with it, the strongest evidence behind it (a pool's match length / rank) and `state` (what
    the request's recent steps say: a request that is copying tends to go on copying; `streak_state`, () = (0,)).

    Scoring per node, not per pool, matters: pools agree on copies (counting each pool's calibrated chance as
    independent evidence doubled the predicted acceptance in replays) and siblings exclude each other (each
    pool's chance, calibrated where it was alone, overstates it where several pools disagree). The definition of
    what trees/step_choice.py computes compiled for a whole step."""
    t = Trie()
    tokens, parents, depth = t.tokens, t.parents, t.depth
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    raw: list[float] = []
    pools_of: list[int] = []  # per node: the mask of the pools that proposed it (Calibration.bit)
    evidence: list[int] = []  # per node: the strongest evidence behind it, at most 4
    # (the hot loop of a step's drafting, ~30 nodes per request: local names)
    for cand in pools:
        bit = calibrate.bit(cand.pool)
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
                pools_of.append(bit)
                evidence.append(ev if ev < 4 else 4)
            else:
                if prob > raw[node]:
                    raw[node] = prob
                pools_of[node] |= bit
                if ev > evidence[node]:
                    evidence[node] = ev if ev < 4 else 4
            where.append(node)
    siblings: dict[int, int] = {}  # parent -> its children, at most 3
    for parent in parents:
        siblings[parent] = siblings.get(parent, 0) + 1
    for parent, n in siblings.items():
        if n > 3:
            siblings[parent] = 3
    cond, path, codes = t.cond, t.path, t.codes
    table, strength = calibrate.table, calibrate.strength  # (Calibration's counts, read inline)
    prior, st = strength * PRIOR_SCALE, (state[0] if state else 0)
    for parent, mask, r, ev in zip(parents, pools_of, raw, evidence):  # parents come before their children
        # key_code(mask, bucket, siblings, evidence, state), inlined; r >= 0: its tenth of [0, 1], 9 at most
        code = (((mask * BUCKETS + (int(r * 10) if r < 0.9 else 9)) * SIBLINGS + siblings[parent]) * EVIDENCE
                + (ev if ev > 0 else 0)) * STATES + st
        codes.append(code)
        acc, tested = table[code].tolist()
        c = (acc + prior * r) / (tested + strength)
        cond.append(c)
        path.append(c * path[parent] if parent >= 0 else c)
    return t


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
            out.codes.append(t.codes[i])
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
    parents, codes = t.parents, t.codes
    tested = [i for i in chosen if parents[i] in accepted_parents]
    calibrate.observe_many([codes[i] for i in tested], [i in on_path for i in tested])


def streak_state(accepted_last: int) -> tuple:
    """Calibration state from the request's last verification: none, some or many drafts accepted."""
    return (0 if accepted_last <= 0 else 1 if accepted_last < 3 else 2,)


def fold_sum(values) -> float:
    """Left to right from 0.0, as the compiled choice adds (Python 3.12's `sum` of floats compensates)."""
    total = 0.0
    for v in values:
        total += v
    return total


def is_tree(trie: Trie, nodes: list[int]) -> bool:
    """Whether some chosen node has a chosen sibling (else the nodes form a chain)."""
    parents = [trie.parents[i] for i in nodes]
    return len(set(parents)) < len(parents)


def chains_where_cheaper(tries: list[Trie], chosen: list[list[int]], may_switch: list[bool], tokens: float,
                         rows: int, attention: float, per_row: list[float], tree_requests: int, tree_rows: int, cost,
                         tree_extra, budgets: list[int], yields: tuple[float, float] = (1.0, 1.0)) -> None:
    """Tree verification costs more than a chain of as many rows (its own attention: tree_extra(requests, rows)).
    For each request whose chosen nodes branch (and `may_switch`), keep the tree only if the batch's expected
    tokens per second beat those with the request's best chain instead: its trie's best path (up to its budget),
    as deep as pays (a tree spreads its rows over branches; the chain that replaces it takes them along one path:
    cut to the tree's own nodes, batch 1 on this CPU ran 1.3-2.6% slower a round, benchmarks/log/2026-11-27.md).
    chosen[e] is replaced in place. tokens / rows / attention: the batch's expected tokens, rows and attention
    seconds with every choice as it stands (per_row[e]: what a row of request e adds to attention); tree_requests /
    tree_rows: tree rows that cannot switch (draft branches). yields: what a promised draft yields in a tree and in a
    chain (`tokens` counts the trees' at y_tree)."""
    y_tree, y_chain = yields  # what a promised draft yields as part of a tree, of a chain (YieldCalibration)
    branching = [e for e, nodes in enumerate(chosen) if may_switch[e] and is_tree(tries[e], nodes)]
    tree_requests += len(branching)
    tree_rows += sum(len(chosen[e]) for e in branching)
    for e in branching:
        nodes, trie = chosen[e], tries[e]
        tree_rate = tokens / (cost(rows) + attention + tree_extra(tree_requests, tree_rows))
        # the batch without this request's nodes, then its best chain at the depth that pays most
        t0 = tokens - y_tree * fold_sum(trie.path[i] for i in nodes)
        r0, a0 = rows - len(nodes), attention - per_row[e] * len(nodes)
        others = tree_extra(tree_requests - 1, tree_rows - len(nodes))
        path = best_path(trie, budgets[e])
        chain, chain_rate, t = [], t0 / (cost(r0) + a0 + others), t0
        t_chain = t0
        for depth, node in enumerate(path, start=1):
            t += y_chain * trie.path[node]
            rate = t / (cost(r0 + depth) + a0 + per_row[e] * depth + others)
            if rate > chain_rate:
                chain, chain_rate, t_chain = path[:depth], rate, t
        if chain_rate >= tree_rate:
            chosen[e] = chain
            tokens, rows, attention = t_chain, r0 + len(chain), a0 + per_row[e] * len(chain)
            tree_requests, tree_rows = tree_requests - 1, tree_rows - len(nodes)


def best_path(trie: Trie, budget: int) -> list[int]:
    """Chain fallback: from the root, always the child with the highest path probability, up to `budget` nodes
    (ties: the first in node order). One pass for every node's best child: it runs for each branching request."""
    best: dict[int, int] = {}  # parent -> its best child so far
    path = trie.path
    for i, parent in enumerate(trie.parents):
        b = best.get(parent)
        if b is None or path[i] > path[b]:
            best[parent] = i
    out, node = [], best.get(-1)
    while node is not None and len(out) < budget:
        out.append(node)
        node = best.get(node)
    return out
