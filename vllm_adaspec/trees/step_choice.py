"""Which nodes every drafting request verifies this step, for the whole batch in one compiled pass (numba).

MultiBranchProposer's choice, after the pools proposed: each request's candidates merged into one trie and scored
(trees/trie.py `merge`), its nodes ranked (`ranked`, or `best_path` where it drafts a chain), the batch's nodes
bought best first while they pay for their rows (`best_prefix` against the step's cost curve), trees that do not pay
for their extra cost turned into chains (`chains_where_cheaper`), and each request's choice laid out breadth first
(`subtree`). In Python that is ~60-80 us a request on the project's CPU, most of a GPU step's host side at batch 8
(the target: 10% of a Llama-3-8B step, ~0.72 ms). The Python functions stay the definition (`choose_reference`, used
where numba is missing or a step needs what only Python does: a grammar's pruning, a replay's own scores); the
tests compare both, and the decisions (`benchmarks/host_replay.py --digest`) are the same.

A step of R drafting requests, P pools, N candidate nodes in all:

    candidates  tok, par, prob, ev [N]: every pool's Candidates concatenated, request-major, pool-minor;
                seg [R * P + 1]: where each (request, pool) starts; seg_bit [R * P]: its pool's calibration bit
    out         one Trie per request: the chosen nodes breadth first (a parent before its children), parents
                renumbered among them, with their path probabilities and keys (what verification's feedback
                needs)
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Sequence

import numpy as np

from vllm_adaspec.trees.trie import (BUCKETS, EVIDENCE, PRIOR_SCALE, SIBLINGS, STATES, Calibration, Trie, best_path,
                                     best_prefix, chains_where_cheaper, fold_sum, ranked, subtree)

from vllm_adaspec.compiled import compiled as _compiled
from vllm_adaspec.compiled import njit  # (None without numba: Python chooses, slower, the same nodes)


@dataclass
class Prices:
    """What the step's nodes are bought against (seconds, or the cost prior's units before the first step)."""
    decoding: float  # expected tokens without drafts: one per decoding request
    base_rows: int  # rows before any node: the decoding requests' and the draft branches'
    cost: Callable[[int], float]  # step time by rows in all (cost_model.StepCostModel.curve)
    tree_extra: Callable[[int, int], float]  # what tree verification adds: (tree requests, tree rows) -> seconds
    per_row: list[float]  # [R] the attention a row of each request adds
    attention: float  # the attention of the batch's rows before any node
    may_switch: list[bool]  # [R] whose tree may give way to its best chain
    tree_requests: int = 0  # trees that cannot switch (draft branches) and their rows
    tree_rows: int = 0
    yields: tuple[float, float] = (1.0, 1.0)  # what a promised draft yields in a tree, in a chain


def chosen_trie(t: Trie, nodes: Sequence[int]) -> Trie:
    """The chosen nodes of t (closed under parents) as a trie of their own, breadth first (`subtree`'s order): what
    verification's feedback reads (tokens, parents, path probabilities, keys; not cond or depth)."""
    tokens, parents, order = subtree(t, nodes)
    return Trie(tokens, parents, [], [t.path[i] for i in order], [t.codes[i] for i in order])


def choose_reference(tries: list[Trie], treeish: Sequence[bool], budgets: Sequence[int], scale: Sequence[float],
                     prices: Prices | None) -> list[Trie]:
    """The chosen nodes of each request's trie (the definition; module docstring). prices None: every ranked node
    within each budget."""
    cands = [ranked(t)[:b] if tree else best_path(t, b) for t, tree, b in zip(tries, treeish, budgets)]
    # (each node's gain: its path probability, scaled by what proposals of its kind have yielded per promise)
    flat = sorted(((tries[e].path[node] * scale[e], e, j) for e, order in enumerate(cands)
                   for j, node in enumerate(order)), key=lambda x: -x[0])
    if prices is None:
        keep = len(flat)
    else:
        extra = [prices.attention]
        for _, e, _ in flat:
            extra.append(extra[-1] + prices.per_row[e])
        keep = best_prefix([p for p, _, _ in flat], prices.decoding, prices.cost, prices.base_rows, extra)
    count = [0] * len(tries)
    for _, e, j in flat[:keep]:
        count[e] = max(count[e], j + 1)  # a prefix of a request's ranked nodes is closed under parents
    chosen = [cands[e][:count[e]] for e in range(len(tries))]
    if prices is not None:  # trees cost more than chains of their rows: keep each only where it pays
        chains_where_cheaper(tries, chosen, prices.may_switch, prices.decoding + fold_sum(p for p, _, _ in flat[:keep]),
                             prices.base_rows + keep, extra[keep], prices.per_row, prices.tree_requests,
                             prices.tree_rows, prices.cost, prices.tree_extra, list(budgets), yields=prices.yields)
    return [chosen_trie(t, nodes) for t, nodes in zip(tries, chosen)]


# --- compiled ---

def _best_path(t_par, t_path, base, n, budget, best, out, at):
    """best_path of the trie at [base, base + n) into out[at:]: its length. best [>= n + 1]: scratch."""
    best[:n + 1] = -1  # parent + 1 -> its best child so far (first in node order on ties)
    for i in range(n):
        p = t_par[base + i] + 1
        b = best[p]
        if b < 0 or t_path[base + i] > t_path[base + b]:
            best[p] = i
    k, node = 0, best[0]
    while node >= 0 and k < budget:
        out[at + k] = node
        k += 1
        node = best[node + 1]
    return k


def _choose(tok, par, prob, ev, seg, seg_bit, n_pools, table, strength, prior, state, treeish, budget, scale,
            use_costs, decoding, cost, base_rows, per_row, attention0, may_switch, fixed_requests, fixed_rows,
            w_request, w_row, y_tree, y_chain, out_off, o_int, o_path, o_n, sizes):
    """Plain loops over plain arrays, for numba; every float operation in the reference's order (same decisions).
    out_off [R + 1]: where each request's chosen nodes go (room: its budget), o_int [3, room] their tokens, parents
    and keys, o_path [room] their path probabilities; o_n [R]: how many; sizes [R]: its trie's nodes. Scratch arrays
    are allocated once a step (tries of ~30 nodes: allocation would dominate)."""
    r_all = treeish.shape[0]
    n_all = tok.shape[0]
    # every request's trie at [seg[e * P], ...) of these (a trie has at most its candidates' nodes)
    t_tok = np.empty(n_all, np.int64)
    t_par = np.empty(n_all, np.int64)
    t_depth = np.empty(n_all, np.int64)
    t_path = np.empty(n_all, np.float64)
    t_code = np.empty(n_all, np.int64)
    raw = np.empty(n_all, np.float64)
    mask = np.empty(n_all, np.int64)
    evid = np.empty(n_all, np.int64)
    where = np.empty(n_all, np.int64)  # candidate -> its trie node
    nxt = np.empty(n_all, np.int64)  # node -> its next sibling
    head = np.full(n_all + r_all, -1, np.int64)  # node + 1 -> its first child (0: the root's), at seg + e
    siblings = np.zeros(n_all + r_all, np.int64)  # parent + 1 -> its children, at seg + e
    scratch = np.empty(n_all + 1, np.int64)  # _best_path's, then subtree's renumbering
    c_node = np.empty(out_off[r_all], np.int64)  # each request's ranked nodes (then its chosen ones)
    c_len = np.zeros(r_all, np.int64)
    for e in range(r_all):
        base = seg[e * n_pools]
        hb = base + e
        n = 0
        for p in range(n_pools):  # merge
            s = e * n_pools + p
            bit = seg_bit[s]
            for c in range(seg[s], seg[s + 1]):
                if par[c] >= c - seg[s]:  # (a parent after its child: Python's merge fails on it as well)
                    raise IndexError("a candidate's parent does not come before it")
                tp = where[seg[s] + par[c]] if par[c] >= 0 else -1
                t = tok[c]
                node = head[hb + tp + 1]
                while node >= 0 and t_tok[base + node] != t:
                    node = nxt[base + node]
                pr = prob[c]
                v = ev[c]
                if node < 0:
                    node = n
                    n += 1
                    q = base + node
                    t_tok[q] = t
                    t_par[q] = tp
                    t_depth[q] = t_depth[base + tp] + 1 if tp >= 0 else 1
                    raw[q] = pr if pr > 0.0 else 0.0
                    mask[q] = bit
                    evid[q] = v if v < 4 else 4
                    nxt[q] = head[hb + tp + 1]
                    head[hb + tp + 1] = node
                    siblings[hb + tp + 1] += 1
                else:
                    q = base + node
                    if pr > raw[q]:
                        raw[q] = pr
                    mask[q] |= bit
                    if v > evid[q]:
                        evid[q] = v if v < 4 else 4
                where[c] = node
        sizes[e] = n
        for j in range(n):  # score (Calibration's key_code)
            q = base + j
            pp = t_par[q]
            r = raw[q]
            sib = min(siblings[hb + pp + 1], 3)
            v = evid[q] if evid[q] > 0 else 0
            code = (((mask[q] * BUCKETS + (int(r * 10) if r < 0.9 else 9)) * SIBLINGS + sib) * EVIDENCE + v) * STATES \
                + state[e]
            t_code[q] = code
            c = (table[code, 0] + prior * r) / (table[code, 1] + strength)
            t_path[q] = c * t_path[base + pp] if pp >= 0 else c
        at = out_off[e]
        if treeish[e]:  # ranked: path probability, best first; ties shallower first, then node order
            k = min(budget[e], n)
            m = 0  # the best k so far, sorted, at c_node[at:at + m] (insertion: a trie is ~30 nodes)
            for j in range(n):
                pj, dj = t_path[base + j], t_depth[base + j]
                a = m
                while a > 0:
                    o = c_node[at + a - 1]
                    po = t_path[base + o]
                    if po > pj or (po == pj and t_depth[base + o] <= dj):  # (o < j: node order on full ties)
                        break
                    a -= 1
                if a >= k:
                    continue
                for b in range(min(m, k - 1), a, -1):
                    c_node[at + b] = c_node[at + b - 1]
                c_node[at + a] = j
                m = min(m + 1, k)
            c_len[e] = m
        else:
            c_len[e] = _best_path(t_par, t_path, base, n, budget[e], scratch, c_node, at)
    # the batch's nodes by gain, best first (stable: request order, then rank)
    f_all = 0
    for e in range(r_all):
        f_all += c_len[e]
    gain = np.empty(f_all, np.float64)
    neg_gain = np.empty(f_all, np.float64)
    f_req = np.empty(f_all, np.int64)
    f_rank = np.empty(f_all, np.int64)
    f = 0
    for e in range(r_all):
        base = seg[e * n_pools]
        for j in range(c_len[e]):
            gain[f] = t_path[base + c_node[out_off[e] + j]] * scale[e]
            neg_gain[f] = -gain[f]
            f_req[f] = e
            f_rank[f] = j
            f += 1
    flat = np.argsort(neg_gain, kind="mergesort")
    keep = f_all
    extra = np.empty(f_all + 1, np.float64)
    if use_costs:  # best_prefix
        extra[0] = attention0
        for k in range(f_all):
            extra[k + 1] = extra[k] + per_row[f_req[flat[k]]]
        keep = 0
        best = decoding / (cost[base_rows] + extra[0])
        total = decoding
        for k in range(1, f_all + 1):
            total += gain[flat[k - 1]]
            rate = total / (cost[base_rows + k] + extra[k])
            if rate > best:
                keep, best = k, rate
    count = np.zeros(r_all, np.int64)
    for k in range(keep):
        e = f_req[flat[k]]
        count[e] = max(count[e], f_rank[flat[k]] + 1)
    if use_costs:  # chains_where_cheaper
        kept = 0.0
        for k in range(keep):
            kept += gain[flat[k]]
        tokens = decoding + kept
        rows = base_rows + keep
        attention = extra[keep]
        branching = np.zeros(r_all, np.bool_)
        tree_requests, tree_rows = fixed_requests, fixed_rows
        for e in range(r_all):
            if may_switch[e] and count[e] > 1:
                base, at = seg[e * n_pools], out_off[e]
                for a in range(count[e]):
                    for b in range(a):
                        if t_par[base + c_node[at + a]] == t_par[base + c_node[at + b]]:
                            branching[e] = True
                if branching[e]:
                    tree_requests += 1
                    tree_rows += count[e]
        most = 1
        for e in range(r_all):
            most = max(most, budget[e])
        chain = np.empty(most, np.int64)  # a request's best path
        for e in range(r_all):
            if not branching[e]:
                continue
            base, at, n_e = seg[e * n_pools], out_off[e], count[e]
            tree_rate = tokens / (cost[rows] + attention + (w_request * tree_requests + w_row * tree_rows))
            s = 0.0
            for a in range(n_e):
                s += t_path[base + c_node[at + a]]
            t0 = tokens - y_tree * s
            r0, a0 = rows - n_e, attention - per_row[e] * n_e
            others = w_request * (tree_requests - 1) + w_row * (tree_rows - n_e)
            length = _best_path(t_par, t_path, base, sizes[e], budget[e], scratch, chain, 0)
            depth_best, chain_rate, t, t_chain = 0, t0 / (cost[r0] + a0 + others), t0, t0
            for d in range(1, length + 1):
                t += y_chain * t_path[base + chain[d - 1]]
                rate = t / (cost[r0 + d] + a0 + per_row[e] * d + others)
                if rate > chain_rate:
                    depth_best, chain_rate, t_chain = d, rate, t
            if chain_rate >= tree_rate:
                for d in range(depth_best):
                    c_node[at + d] = chain[d]
                count[e] = depth_best
                tokens, rows, attention = t_chain, r0 + depth_best, a0 + per_row[e] * depth_best
                tree_requests, tree_rows = tree_requests - 1, tree_rows - n_e
    for e in range(r_all):  # subtree: breadth first (depth, then node order), parents renumbered
        base, at, n_e = seg[e * n_pools], out_off[e], count[e]
        for a in range(1, n_e):  # insertion sort of the chosen nodes by (depth, node)
            x = c_node[at + a]
            dx = t_depth[base + x]
            b = a
            while b > 0:
                y = c_node[at + b - 1]
                dy = t_depth[base + y]
                if dy < dx or (dy == dx and y < x):
                    break
                c_node[at + b] = y
                b -= 1
            c_node[at + b] = x
        for a in range(n_e):
            scratch[c_node[at + a]] = a
        for a in range(n_e):
            q = base + c_node[at + a]
            o_int[0, at + a] = t_tok[q]
            o_int[1, at + a] = scratch[t_par[q]] if t_par[q] >= 0 else -1
            o_int[2, at + a] = t_code[q]
            o_path[at + a] = t_path[q]
        o_n[e] = n_e


if njit is not None:
    _best_path = _compiled(_best_path)
    _choose = _compiled(_choose)


def compiled() -> bool:
    """Whether choices run compiled (numba importable)."""
    return njit is not None


def cost_table(cost: Callable[[int], float], rows: int) -> np.ndarray:
    """cost(r) for r in 0..rows as an array, each exactly what cost(r) returns (from the curve's own table where it
    carries one: StepCostModel.curve's `table`, its `array` + `plus`, the same float additions)."""
    table = getattr(cost, "table", None)  # (array + plus, made with the curve)
    if table is not None and len(table) > rows:
        return table[:rows + 1]
    array, plus = getattr(cost, "array", None), getattr(cost, "plus", None)
    if array is None or plus is None:
        return np.array([cost(r) for r in range(rows + 1)], np.float64)
    out = array[:rows + 1] + plus
    if len(out) <= rows:
        out = np.concatenate([out, np.array([cost(r) for r in range(len(out), rows + 1)], np.float64)])
    return out


def choose_compiled(candidates: list[list], calibration: Calibration, states: Sequence[int],
                    treeish: Sequence[bool], budgets: Sequence[int], scale: Sequence[float],
                    prices: Prices | None) -> tuple[list[Trie], list[int]]:
    """choose_reference's choice from every request's candidates ([R][P] Candidates, every request the same P
    pools in the same order) merged under `calibration` with each request's streak state (0-2): (the chosen
    tries, each request's whole trie's size). prices.tree_extra must be a cost_model.TreeExtra."""
    r_all = len(candidates)
    n_pools = len(candidates[0]) if r_all else 0
    tok, par, prob, ev, seg = [], [], [], [], [0]
    for cands in candidates:
        if len(cands) != n_pools:
            raise ValueError(f"every request needs one Candidates per pool: {len(cands)} against {n_pools}")
        for c in cands:
            tok += c.tokens
            par += c.parents
            prob += c.probs
            ev += c.evidence
            seg.append(len(tok))
    bits = [calibration.bit(c.pool) for c in candidates[0]] if r_all else []
    seg_bit = np.array(bits * r_all, np.int64)
    out_off = np.array([0, *accumulate(budgets)], np.int64)
    room = int(out_off[-1])
    if prices is not None:
        top = prices.base_rows + room + int(max(budgets, default=0)) + 1  # the most rows any price asks
        cost = cost_table(prices.cost, top)
        w = prices.tree_extra
        args = (True, float(prices.decoding), cost, int(prices.base_rows), np.array(prices.per_row, np.float64),
                float(prices.attention), np.array(prices.may_switch, np.bool_), int(prices.tree_requests),
                int(prices.tree_rows), float(w.per_request), float(w.per_row), float(prices.yields[0]),
                float(prices.yields[1]))
    else:
        z = np.zeros(max(r_all, 1))
        args = (False, 0.0, np.zeros(1), 0, z, 0.0, np.zeros(max(r_all, 1), np.bool_), 0, 0, 0.0, 0.0, 1.0, 1.0)
    o_int, o_path = np.empty((3, room), np.int64), np.empty(room, np.float64)
    o_n, sizes = np.zeros(r_all, np.int64), np.zeros(r_all, np.int64)
    _choose(np.array(tok, np.int64), np.array(par, np.int64), np.array(prob, np.float64), np.array(ev, np.int64),
            np.array(seg, np.int64), seg_bit, n_pools, calibration.table, float(calibration.strength),
            calibration.strength * PRIOR_SCALE, np.array(states, np.int64), np.array(treeish, np.bool_),
            np.array(budgets, np.int64), np.array(scale, np.float64), *args, out_off, o_int, o_path, o_n, sizes)
    (t, q, k), w = o_int.tolist(), o_path.tolist()
    out = []
    for a, b in zip(out_off.tolist(), (out_off[:-1] + o_n).tolist()):
        out.append(Trie(t[a:b], q[a:b], [], w[a:b], k[a:b]))
    return out, sizes.tolist()


def warm_up() -> None:
    """Compile the choice now (start-up), not in a request's first step: a step of two requests, one a tree, one
    a chain, priced (machine code cached on disk: later starts load it)."""
    from vllm_adaspec.pools import Candidates
    from vllm_adaspec.policies.cost_model import TreeExtra

    a = Candidates([5, 6, 7], [-1, 0, -1], [0.9, 0.5, 0.4], [1, 1, 0], "context")
    b = Candidates([5, 8], [-1, 0], [0.7, 0.6], [2, 0], "suffix")
    prices = Prices(2.0, 2, lambda r: 1.0 + 0.01 * r, TreeExtra(0.001, 0.0001), [0.001, 0.002], 0.0, [True, True])
    calibration = Calibration()
    calibration.observe(0, True)  # (its pending observations' compiled add too: trie.add_observations)
    choose_compiled([[a, b], [b, a]], calibration, [0, 2], [True, False], [4, 4], [1.0, 1.0], prices)
