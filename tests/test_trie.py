"""The multi-pool trie: merging, calibration, node choice against a cost curve (pure Python)."""

import random

import pytest

from vllm_adaspec.pools import Candidates
from vllm_adaspec.trees import DraftTree
from vllm_adaspec.trees.trie import (PRIOR_SCALE, Calibration, best_prefix, cost_curve, feedback, merge, prune,
                                     ranked, subtree)


def cands(*paths, key="a"):
    """Candidates from (token path, prob given parent) pairs, parents inserted first."""
    c, where = Candidates(pool=key), {}
    for toks, p in paths:
        parent = where[toks[:-1]] if len(toks) > 1 else -1
        where[toks] = c.add(parent, toks[-1], p)
    return c


def test_shared_prefixes_merge_and_probabilities_combine():
    a = cands(((5,), 0.5), ((5, 6), 0.8), ((7,), 0.2), key="a")
    b = cands(((5,), 0.5), ((5, 9), 0.4), key="b")
    cal = Calibration(strength=1e9)  # a huge prior strength: calibrated = the prior
    t = merge([a, b], cal, state=(1,))
    nodes = {tuple(t.tokens[j] for j in path(t, i)): i for i in range(len(t))}
    assert set(nodes) == {(5,), (5, 6), (7,), (5, 9)}  # one node for "5"
    five = nodes[(5,)]
    # one key per node: which pools proposed it, their best probability's tenth, competing siblings, evidence, state
    assert cal.key(t.codes[five]) == (("a", "b"), 5, 2, 0, 1)
    assert t.cond[five] == pytest.approx(PRIOR_SCALE * 0.5)
    assert t.path[nodes[(5, 6)]] == pytest.approx(PRIOR_SCALE * 0.5 * PRIOR_SCALE * 0.8)
    assert t.depth[nodes[(5, 9)]] == 2


def path(t, i):
    out = []
    while i >= 0:
        out.append(i)
        i = t.parents[i]
    return out[::-1]


def test_ranked_prefixes_are_closed_under_parents_and_subtree_is_breadth_first():
    rng = random.Random(0)
    for _ in range(50):
        c = Candidates(pool="a")
        for _ in range(rng.randint(1, 20)):
            parent = rng.randrange(-1, len(c)) if len(c) else -1
            c.add(parent, rng.randrange(50), rng.random())
        t = merge([c], Calibration())
        order = ranked(t)
        for k in range(len(order) + 1):
            chosen = set(order[:k])
            assert all(t.parents[i] in chosen or t.parents[i] < 0 for i in chosen)
            tokens, parents, idx = subtree(t, order[:k])
            DraftTree(__import__("torch").tensor(tokens), __import__("torch").tensor(parents))  # validates BFS order
            assert [t.tokens[i] for i in idx] == tokens


def test_pruning_drops_a_node_with_its_subtree_and_keeps_the_rest_as_they_were():
    t = merge([cands(((5,), 0.5), ((5, 6), 0.8), ((5, 6, 2), 0.9), ((7,), 0.2), ((7, 3), 0.6))], Calibration())
    keep = [t.tokens[i] != 6 for i in range(len(t))]  # the grammar forbids "5 6": "5 6 2" goes with it
    p = prune(t, keep)
    assert sorted(tuple(p.tokens[j] for j in path(p, i)) for i in range(len(p))) == [(5,), (7,), (7, 3)]
    for i in range(len(p)):
        old = next(j for j in range(len(t)) if t.tokens[j] == p.tokens[i] and t.depth[j] == p.depth[i])
        assert (p.path[i], p.cond[i], p.codes[i]) == (t.path[old], t.cond[old], t.codes[old])


def test_calibration_moves_a_pool_from_its_own_estimate_to_measured_acceptance():
    cal = Calibration(strength=4)
    one = cands(((5,), 0.9), key="recycled")
    t = merge([one], cal)
    assert t.cond == pytest.approx([PRIOR_SCALE * 0.9])  # no evidence yet: the pool's number (scaled)
    for i in range(100):
        cal.observe(t.codes[0], accepted=i % 5 == 0)  # really accepted 20% of the time
    assert merge([one], cal).cond == pytest.approx([(20 + 4 * PRIOR_SCALE * 0.9) / 104])


def test_feedback_counts_only_nodes_whose_parent_was_accepted():
    c = cands(((1,), 0.9), ((1, 2), 0.9), ((1, 2, 3), 0.9), ((4,), 0.5), ((1, 5), 0.5))
    cal = Calibration()
    t = merge([c], cal)
    chosen = list(range(len(t)))
    n = {tuple(t.tokens[j] for j in path(t, i)): i for i in range(len(t))}
    feedback(t, chosen, [n[(1,)], n[(1, 2)]], cal)  # accepted 1, 2; rejected 3 (tested), 4 and 5 (tested)
    assert [sum(c[0] for c in cal.counts.values()), sum(c[1] for c in cal.counts.values())] == [2, 5]
    assert cal.counts[cal.key(t.codes[n[(1, 2, 3)]])] == [0, 1]  # (1 and 1-2 share a key: [2, 2])


def test_best_prefix_buys_nodes_only_while_they_pay_for_their_rows():
    cost = cost_curve({1: 1.0, 2: 1.1, 3: 1.15, 4: 1.2, 5: 1.6, 8: 1.66})  # rows -> step time: a jump at 5 rows
    assert cost(6) == pytest.approx(1.62) and cost(10) == pytest.approx(1.70)  # between anchors, past the last
    assert best_prefix([0.9, 0.8, 0.7, 0.6, 0.5], 1.0, cost, 1) == 3  # a 4th node would cross into 5 rows
    assert best_prefix([0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9], 1.0, cost, 1) == 7  # certain copies pay the jump
    assert best_prefix([0.05, 0.04], 1.0, cost, 1) == 0  # not worth a single row
    assert best_prefix([0.5] * 3, 2.0, cost, 2) == 2  # two requests (2 rows): two more nodes fit under the jump


def test_yield_calibration_learns_what_chains_and_trees_yield_per_promised_draft():
    """Chains that commit more than their nodes promise get their gains raised, trees that commit less get theirs
    lowered; from 1 at the start, bounded, and off when disabled (the measurement switch)."""
    from vllm_adaspec.trees.trie import YieldCalibration

    y = YieldCalibration()
    assert y.ratio(False) == y.ratio(True) == 1.0
    for _ in range(200):
        y.observe(False, 2.0, 3)  # chains: 1.5x their promise
        y.observe(True, 4.0, 3)  # trees: 0.75x
    assert 1.4 < y.ratio(False) <= 1.5 and 0.74 <= y.ratio(True) < 0.8
    for _ in range(500):
        y.observe(True, 1.0, 10)
    assert y.ratio(True) == 2.0  # clamped
    assert YieldCalibration(enabled=False).ratio(True) == 1.0
