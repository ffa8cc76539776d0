"""MultiBranchProposer's choice between a request's tree and its best chain (proposers/multi_branch.py,
`chains_where_cheaper`): a tree that does not pay for its extra cost gives way to the request's best chain, as deep
as pays, not to the few of its own nodes that lie on one path."""

import pytest

from vllm_adaspec.proposers.multi_branch import best_path, chains_where_cheaper
from vllm_adaspec.trees.trie import Trie


def trie(nodes):
    """Trie from (parent, path probability) per node, parents first."""
    t = Trie()
    for i, (parent, p) in enumerate(nodes):
        t.tokens.append(100 + i)
        t.parents.append(parent)
        t.path.append(p)
        t.cond.append(p / (t.path[parent] if parent >= 0 else 1.0))
        t.depth.append(t.depth[parent] + 1 if parent >= 0 else 1)
        t.codes.append(0)
    return t


# root -> 0 (0.9) -> 2 (0.85) -> 3 (0.8) -> 4 (0.75) -> 5 (0.05); root -> 1 (0.3): a sibling at depth 1
T = trie([(-1, 0.9), (-1, 0.3), (0, 0.85), (2, 0.8), (3, 0.75), (4, 0.05)])


def choose(chosen, tree_extra_s, budget=6, cost=lambda rows: 1.0 + 0.05 * rows):
    chosen = [list(chosen)]
    tokens = 1.0 + sum(T.path[i] for i in chosen[0])
    chains_where_cheaper([T], chosen, [True], tokens, 1 + len(chosen[0]), 0.0, [0.0], 0, 0, cost,
                         lambda reqs, rows: tree_extra_s * reqs, [budget])
    return chosen[0]


def test_a_dear_tree_gives_way_to_the_best_chain_as_deep_as_pays():
    # chosen: the sibling pair at depth 1 and one node below; its own nodes on one path are only 0 -> 2
    got = choose([0, 1, 2], tree_extra_s=0.5)
    assert got == [0, 2, 3, 4]  # the best path, without the 0.05 node that does not pay for its row
    assert got == best_path(T, 6)[:4]


def test_the_chain_stays_within_the_budget():
    assert choose([0, 1, 2], tree_extra_s=0.5, budget=3) == [0, 2, 3]


def test_a_tree_that_pays_stays():
    # the whole best path and the sibling, rows and trees free: no chain promises as much
    assert choose([0, 1, 2, 3, 4], tree_extra_s=0.0, cost=lambda rows: 1.0) == [0, 1, 2, 3, 4]


def test_no_draft_at_all_when_no_chain_pays():
    # rows so dear that no draft pays: the request drafts nothing rather than its tree
    assert choose([0, 1, 2], tree_extra_s=0.5, cost=lambda rows: 1.0 + 50.0 * rows) == []


@pytest.mark.parametrize("extra", [0.0, 0.01, 0.3, 2.0])
def test_the_choice_never_lowers_the_batchs_expected_rate(extra):
    cost = lambda rows: 1.0 + 0.05 * rows  # noqa: E731
    before = [0, 1, 2]
    tree_rate = (1.0 + sum(T.path[i] for i in before)) / (cost(4) + extra)
    got = choose(before, tree_extra_s=extra, cost=cost)
    is_tree = len({T.parents[i] for i in got}) < len(got)
    rate = (1.0 + sum(T.path[i] for i in got)) / (cost(1 + len(got)) + (extra if is_tree else 0.0))
    assert rate >= tree_rate - 1e-12
