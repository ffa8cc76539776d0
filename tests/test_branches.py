"""Self-Draft branches as pure functions: windows to grams, the LRU gram cache, branch updates, the tree rows they
add and the pool they feed (no vLLM, no model)."""

import pytest

from vllm_adaspec.observers import BranchSlotCheck
from vllm_adaspec.runtime.base import plan_step
from vllm_adaspec.step import DraftPlan
from vllm_adaspec.pools.branches import (GramCache, append_branches, branch_grams, harvest, init_branches,
                                         propose_branches, update_branch)
from vllm_adaspec.trees import DraftTree, ancestor_mask


def test_every_window_with_its_prediction_is_a_gram_keyed_by_its_first_token():
    # branch 1 2 3 4 5; the target's argmax after each prefix: 20 30 40 50 60
    grams = branch_grams([1, 2, 3, 4, 5], [20, 30, 40, 50, 60], gram=4)
    assert grams == [(1, (20,)), (1, (2, 30)), (1, (2, 3, 40)), (2, (3, 4, 50)), (3, (4, 5, 60))]
    assert branch_grams([7, 8], [9, 10], gram=2) == [(7, (9,)), (8, (10,))]


def test_a_branch_grows_by_its_last_prediction_and_drops_its_oldest_token_past_L():
    assert update_branch([1, 2], [5, 6], length=4) == [1, 2, 6]  # only the last prediction extends it
    assert update_branch([1, 2, 3, 4], [5, 6, 7, 8], length=4) == [2, 3, 4, 8]


def test_gram_cache_is_lru_per_key_and_bounded():
    c = GramCache(per_key=2, max_keys=2)
    c.add(1, (2,))
    c.add(1, (3,))
    c.add(1, (2,))  # seen again: most recent, two hits
    assert c.lookup(1) == [((2,), 2), ((3,), 1)]
    c.add(1, (4,))  # a third continuation evicts the least recent one, (3,)
    assert c.lookup(1) == [((4,), 1), ((2,), 2)]
    c.add(5, (6,))
    c.add(7, (8,))  # a third key evicts the least recently touched key, 1
    assert c.lookup(1) == [] and len(c) == 2


def test_harvest_reads_each_branchs_rows_and_leaves_a_cut_branch_as_it_was():
    cache = GramCache()
    branches = [[1, 2], [3, 4]]
    # the scheduler cut the last row: branch 2 ran only its first token
    new, added = harvest(branches, [10, 11, 12], cache, length=2)
    assert new == [[2, 11], [3, 4]] and added == 3
    assert [g for g, _ in cache.lookup(1)] == [(2, 11), (10,)]
    assert [g for g, _ in cache.lookup(3)] == [(12,)]


def test_branches_hang_off_the_root_and_see_only_their_own_earlier_rows():
    tokens, parents = append_branches([5, 6, 7], [-1, -1, 0], [[1, 2], [3, 4, 9]])
    assert tokens == [5, 6, 7, 1, 2, 3, 4, 9] and parents == [-1, -1, 0, -1, 3, -1, 5, 6]
    mask = ancestor_mask(DraftTree(*map(__import__("torch").tensor, (tokens, parents))))  # [9, 9] rows: root + 8
    # row of branch 2's last token (node 7 -> row 8): root, its own two earlier rows, itself
    assert mask[8].nonzero().flatten().tolist() == [0, 6, 7, 8]
    assert not mask[4:6, 1:4].any() and not mask[1:4, 4:].any()  # branches and tree nodes never see each other
    assert not mask[6:, 4:6].any()  # nor one branch the other


def test_prompt_init_takes_windows_of_the_prompt_random_init_is_seeded():
    prompt = list(range(100, 140))
    b = init_branches(prompt, 4, 3, "prompt", seed=7, vocab_size=50)
    assert len(b) == 4 and all(len(x) == 3 for x in b)
    assert all(prompt[prompt.index(x[0]):prompt.index(x[0]) + 3] == x for x in b)  # contiguous windows
    assert len({x[0] for x in b}) == 4  # spread over the prompt
    assert init_branches([1, 2], 2, 4, "prompt", 0, 50) == [[1, 2], [1, 2]]  # short prompt: all of it
    r = init_branches(prompt, 2, 5, "random", seed=3, vocab_size=50)
    assert r == init_branches(prompt, 2, 5, "random", seed=3, vocab_size=50) and all(0 <= t < 50 for x in r for t in x)
    with pytest.raises(ValueError, match="prompt"):
        init_branches(prompt, 1, 1, "zeros", 0, 50)


def test_the_pool_weights_continuations_by_hits():
    c = GramCache()
    for cont in [(2, 3), (2, 3), (2, 4), (5,)]:
        c.add(1, cont)
    cand = propose_branches(c, 1, depth=2)
    paths = {}
    for i, (t, p, q) in enumerate(zip(cand.tokens, cand.parents, cand.probs)):
        paths[i] = (paths[p] if p >= 0 else ()) + (t,)
    probs = {paths[i]: q for i, q in enumerate(cand.probs)}
    assert probs == {(2,): 0.75, (2, 3): pytest.approx(2 / 3), (2, 4): pytest.approx(1 / 3), (5,): 0.25}
    assert cand.pool == "branches" and set(cand.evidence) == {3}  # evidence: the continuations found (3)
    assert len(propose_branches(c, 9, depth=2)) == 0 and len(propose_branches(c, 1, depth=1)) == 2


def test_plan_step_verifies_only_the_tree_nodes_and_positions_branches_by_depth():
    import numpy as np
    import torch

    tokens, parents = append_branches([5, 6], [-1, 0], [[1, 2, 3]])  # chain of 2 + a branch of 3
    positions = torch.arange(10, 16)  # root at 10, 5 draft rows
    plan = {"a": DraftPlan(tuple(tokens), tuple(parents), 2)}
    step = plan_step(["a"], np.array([0, 6]), np.array([10]), {"a": tokens}, plan, 6)
    (r,) = step.requests
    assert r.num_verified == 2 and len(r.tree) == 5  # a chain of verified nodes still goes the tree path
    rows, pos = step.depth_positions()
    positions[torch.from_numpy(rows)] = torch.from_numpy(pos)
    assert positions.tolist() == [10, 11, 12, 11, 12, 13]
    # the scheduler cut the drafts to 3: both nodes and one branch row remain
    positions = torch.arange(10, 14)
    step = plan_step(["a"], np.array([0, 4]), np.array([10]), {"a": tokens[:3]}, plan, 4)
    assert step.requests[0].num_verified == 2 and len(step.requests[0].tree) == 3
    # cut to the nodes only: a plain chain, left to vLLM
    step = plan_step(["a"], np.array([0, 3]), np.array([10]), {"a": tokens[:2]}, plan, 3)
    assert step is None


def test_branch_slot_check_flags_a_committed_position_last_written_by_a_branch_row():
    import numpy as np

    check = BranchSlotCheck()
    tokens, parents = append_branches([5], [-1], [[1, 2]])  # 1 node + a branch of 2: rows root, 5, 1, 2
    roots = np.array([20])  # the request's first row (its root) at position 20
    step = plan_step(["a"], np.array([0, 4]), roots, {"a": tokens}, {"a": DraftPlan(tuple(tokens), tuple(parents), 1)},
                     4)
    check.before_forward(["a"], np.array([0, 4]), roots, step)
    assert check.dirty["a"] == {22, 23}  # branch rows at slots root + 2, root + 3
    # node accepted: the bonus goes at 22 and the next forward starts there (overwrites it): no violation
    check.before_forward(["a"], np.array([0, 1]), np.array([22]), None)
    assert check.violations == 0 and check.dirty["a"] == {23}
    # a forward starting past a dirty slot would read it as committed: counted
    check.before_forward(["a"], np.array([0, 1]), np.array([25]), None)
    assert check.violations == 1 and check.checked == 3
    check.forget(["a"])
    assert "a" not in check.dirty and check.live()["branch_slot_records"] == 0
