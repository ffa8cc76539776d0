"""Tree core (no vLLM): structure, shapes, greedy verification, and that lossless modes keep the target's
distribution (chi-square on a 4-token vocabulary; a biased verifier must fail the same test)."""

import functools
import itertools

import pytest
import torch
from conftest import random_trees
from stats import chi2_pvalue

from vllm_adaspec.trees import (DraftTree, GrowingTree, add_children, ancestor_bits, ancestor_mask, best_subtree,
                                cartesian_choices, depth_positions, fill_tokens, grow_by_path_probability, paths,
                                shape_from_choices, to_expand, verify_greedy, verify_rrs, verify_sample_match,
                                verify_typical)

V = 4


def tree_of(choices, tokens=None):
    parents, ranks, _ = shape_from_choices(choices)
    toks = torch.tensor(tokens if tokens is not None else ranks, dtype=torch.long)
    return DraftTree(toks, torch.tensor(parents, dtype=torch.long))


# --- structure ---

def test_ancestor_mask_positions_and_paths():
    t = tree_of([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    assert t.parents.tolist() == [-1, -1, 0, 0, 1, 2]
    assert t.depths.tolist() == [1, 1, 2, 2, 2, 3]
    m = ancestor_mask(t)
    for r in range(len(t) + 1):  # brute force: walk up from each row
        want = {0, r}
        q = r - 1
        while q >= 0:
            want.add(q + 1)
            q = t.parents[q].item()
        assert set(torch.nonzero(m[r]).flatten().tolist()) == want, r
    bits = ancestor_bits(t)
    assert all(bool(bits[r] >> c & 1) == bool(m[r, c]) for r in range(7) for c in range(7))
    assert depth_positions(t, 10).tolist() == [10, 11, 11, 12, 12, 12, 13]
    assert paths(t) == [[0, 3], [1, 4], [0, 2, 5]]


def test_bad_trees_and_shapes_are_named():
    with pytest.raises(ValueError, match="parent must come before"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([1, -1]))
    # a chain after a deeper node (a draft branch after the tree's nodes) is a valid row order
    assert DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0, -1])).depths.tolist() == [1, 2, 1]
    with pytest.raises(ValueError, match=r"no parent \(1,\)"):
        shape_from_choices([(0,), (1, 0)])
    with pytest.raises(ValueError, match=">= 1"):
        cartesian_choices(0, 2)


def test_cartesian_and_fill_tokens():
    ch = cartesian_choices(2, 3)
    assert len(ch) == 2 + 4 + 8
    parents, ranks, ordered = shape_from_choices(ch)
    topk = torch.arange((len(ch) + 1) * 2).view(-1, 2)  # row r's top-2 are 2r, 2r + 1
    toks = fill_tokens(parents, ranks, topk)
    assert toks.tolist() == [2 * (q + 1) + r for q, r in zip(parents, ranks)]


def test_growth_keeps_the_most_probable_nodes():
    g = torch.Generator().manual_seed(3)
    table = {}

    def children_of(path):
        if path not in table:
            p = torch.rand(3, generator=g)
            table[path] = ([7, 8, 9], (p / p.sum() * 0.9).tolist())
        return table[path]

    tree, probs = grow_by_path_probability(children_of, budget=9, top_k=3)
    assert len(tree) == 9 and (tree.depths[1:] >= tree.depths[:-1]).all()
    # brute force: every node of the full top-3 tree down to depth 4, by path probability
    allp = []
    for d in range(1, 5):
        for path in itertools.product([7, 8, 9], repeat=d):
            pr = 1.0
            for i in range(d):
                toks, ps = children_of(path[:i])
                pr *= ps[toks.index(path[i])]
            allp.append(pr)
    assert sorted(probs.tolist(), reverse=True) == pytest.approx(sorted(allp, reverse=True)[:9])


def _random_children(seed, k):
    g = torch.Generator().manual_seed(seed)
    table = {}

    def children_of(path):  # (top-k tokens best first, their draft probabilities)
        if path not in table:
            p = torch.rand(k + 1, generator=g)
            p = (p / p.sum()).sort(descending=True).values[:k]
            table[path] = (list(range(10 * len(path) + 1, 10 * len(path) + 1 + k)), p.tolist())
        return table[path]
    return children_of


def _grow_depth_by_depth(children_of, budget, top_k, depth, width):
    t, frontier = GrowingTree(), [-1]
    paths_of = {-1: ()}
    for d in range(1, depth + 1):
        for node in frontier:
            start = len(t.tokens)
            add_children(t, node, *children_of(paths_of[node]))
            for i in range(start, len(t.tokens)):
                paths_of[i] = paths_of[node] + (t.tokens[i],)
        frontier = to_expand(t, d, width, budget)
    return t


@pytest.mark.parametrize("seed,budget,top_k,depth", [(0, 6, 2, 3), (1, 9, 3, 4), (2, 16, 2, 8), (3, 4, 4, 1)])
def test_depth_by_depth_growth_keeps_the_most_probable_nodes(seed, budget, top_k, depth):
    children_of = _random_children(seed, top_k)
    # Width = budget: nothing that could rank in the top `budget` is left unexpanded, so the result must equal
    # the brute-force top `budget` of the full top-k tree down to `depth`.
    t = _grow_depth_by_depth(children_of, budget, top_k, depth, width=budget)
    tree, picked = best_subtree(t, budget, depth)
    allp = []
    for d in range(1, depth + 1):
        for path in itertools.product(range(top_k), repeat=d):
            pr, prefix = 1.0, ()
            for r in path:
                toks, ps = children_of(prefix)
                pr, prefix = pr * ps[r], prefix + (toks[r],)
            allp.append(pr)
    want = sorted(allp, reverse=True)[:budget]
    assert sorted((t.probs[i] for i in picked), reverse=True) == pytest.approx(want)
    # breadth-first, closed under parents, tokens and parents carried over
    assert (tree.depths[1:] >= tree.depths[:-1]).all() if len(tree) > 1 else True
    for j, i in enumerate(picked):
        q = tree.parents[j].item()
        assert t.tokens[i] == tree.tokens[j].item()
        assert (q == -1 and t.parents[i] == -1) or picked[q] == t.parents[i]


def test_narrow_growth_and_depth_limits():
    children_of = _random_children(5, 2)
    t = _grow_depth_by_depth(children_of, budget=8, top_k=2, depth=4, width=2)
    # at most `width` nodes expanded per depth: 2 roots' children + 2 x 2 per deeper level
    assert len(t.tokens) == 2 + 4 * 3
    tree, picked = best_subtree(t, 8, max_depth=2)
    assert len(tree) == 6 and tree.depths.max().item() == 2
    assert to_expand(t, 4, 2, budget=1) == []  # nothing at depth 4 ranks first overall
    with pytest.raises(ValueError):  # a tree needs parents first
        DraftTree(torch.tensor([1, 2]), torch.tensor([1, -1]))


# --- greedy ---

def test_greedy_follows_the_target_argmax_and_takes_the_bonus():
    t = tree_of([(0,), (1,), (0, 0), (1, 0)], tokens=[5, 6, 7, 8])
    # rows: root, n0(5), n1(6), n2(7), n3(8). Target argmax: root->6, n1->8, n3->2
    acc, bonus = verify_greedy(t, torch.tensor([6, 0, 8, 0, 2]))
    assert acc == [1, 3] and bonus == 2
    acc, bonus = verify_greedy(t, torch.tensor([4, 0, 0, 0, 0]))
    assert acc == [] and bonus == 4


def test_greedy_matches_sequential_argmax_on_random_trees():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        ch = cartesian_choices(2, 3)
        parents, ranks, _ = shape_from_choices(ch)
        toks = torch.randint(0, 3, (len(ch),), generator=g)
        tree = DraftTree(toks, torch.tensor(parents))
        # The target's argmax is a function of the text: equal siblings (same text) get the same argmax.
        table = torch.randint(0, 3, (64,), generator=g)
        argmax = torch.tensor([int(table[hash(p) % 64]) for p in _row_prefixes(tree)])
        acc, bonus = verify_greedy(tree, argmax)
        # brute force: the longest root path whose tokens equal the argmax at their parents
        best = []
        for path in paths(tree):
            ok = []
            for node in path:
                par = parents[node]
                if toks[node] != argmax[par + 1]:
                    break
                ok.append(node)
            best = max(best, ok, key=len)
        assert [toks[i].item() for i in acc] == [toks[i].item() for i in best]
        assert bonus == argmax[(acc[-1] if acc else -1) + 1].item()


# --- stochastic: the committed text must follow the target's distribution ---

@functools.lru_cache(maxsize=None)  # prefixes repeat: each distribution is drawn once
def _dist(seed_base: int, prefix: tuple, temp: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed_base * 1000 + hash(prefix) % 1000)
    return torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 1.5 / temp, 0)


def target(prefix):
    return _dist(1, prefix)


def drafter(prefix):
    return _dist(2, prefix, temp=0.7)


def _sample_text(verify, make_tree, n, length, g):
    counts = torch.zeros(V ** length, dtype=torch.float64)
    for _ in range(n):
        text: tuple = ()
        while len(text) < length:
            tree, row_prefix = make_tree(text, g)
            tp = torch.stack([target(text + p) for p in row_prefix])
            acc, bonus = verify(tree, tp, torch.stack([drafter(text + p) for p in row_prefix]), g)
            text = text + tuple(tree.tokens[i].item() for i in acc) + (bonus,)
        idx = 0
        for tok in text[:length]:
            idx = idx * V + tok
        counts[idx] += 1
    return counts


def _exact(length):
    probs = torch.zeros(V ** length, dtype=torch.float64)
    for seq in itertools.product(range(V), repeat=length):
        pr = 1.0
        for i in range(length):
            pr *= float(target(seq[:i])[seq[i]])
        idx = 0
        for tok in seq:
            idx = idx * V + tok
        probs[idx] = pr
    return probs


def _row_prefixes(tree):
    rows = [()]
    toks = tree.tokens.tolist()
    for i, q in enumerate(tree.parents.tolist()):
        rows.append(rows[q + 1] + (toks[i],))
    return rows


def iid_tree(text, g):
    """Each node's children drawn i.i.d. from the drafter at that node: 2 at the root, 2 under each."""
    parents, ranks, _ = shape_from_choices(cartesian_choices(2, 2))
    toks: list[int] = []
    rows = [()]
    for q in parents:
        t = int(torch.multinomial(drafter(text + rows[q + 1]), 1, generator=g))
        toks.append(t)
        rows.append(rows[q + 1] + (t,))
    tree = DraftTree(torch.tensor(toks), torch.tensor(parents))
    return tree, _row_prefixes(tree)


def topk_tree(text, g):
    """Deterministic: the drafter's top-2 at the root and top-2 under each (sample-and-match needs no q)."""
    parents, ranks, _ = shape_from_choices(cartesian_choices(2, 2))
    toks: list[int] = []
    rows = [()]
    for q, r in zip(parents, ranks):
        t = int(torch.topk(drafter(text + rows[q + 1]), 2).indices[r])
        toks.append(t)
        rows.append(rows[q + 1] + (t,))
    tree = DraftTree(torch.tensor(toks), torch.tensor(parents))
    return tree, _row_prefixes(tree)


N, LENGTH = 12000, 3


@pytest.mark.parametrize("name", ["sample-match", "rrs"])
def test_lossless_modes_reproduce_the_target_distribution(name):
    g = torch.Generator().manual_seed(7)
    if name == "rrs":
        counts = _sample_text(lambda t, p, q, g: verify_rrs(t, p, q, g), iid_tree, N, LENGTH, g)
    else:
        counts = _sample_text(lambda t, p, q, g: verify_sample_match(t, p, g), topk_tree, N, LENGTH, g)
    exact = _exact(LENGTH)
    assert chi2_pvalue(counts, exact) > 1e-3
    tv = 0.5 * (counts / counts.sum() - exact).abs().sum()
    assert tv < 0.04, float(tv)


def test_the_distribution_test_catches_biased_verifiers():
    g = torch.Generator().manual_seed(7)
    exact = _exact(LENGTH)

    def accept_all(tree, p, q, g):  # take the first path whole: the drafter's text, not the target's
        path = paths(tree)[0]
        return path, int(torch.multinomial(p[path[-1] + 1], 1, generator=g))

    def rrs_without_residual(tree, p, q, g):  # reject, then resample from p instead of the residual
        acc, _ = verify_rrs(tree, p, q, g)
        return acc, int(torch.multinomial(p[(acc[-1] if acc else -1) + 1], 1, generator=g))

    for biased, make in ((accept_all, iid_tree), (rrs_without_residual, iid_tree),
                         (lambda t, p, q, g: verify_typical(t, p, generator=g), topk_tree)):
        counts = _sample_text(biased, make, N // 2, LENGTH, g)
        assert chi2_pvalue(counts, exact) < 1e-6, biased


def test_typical_acceptance_moves_mass_onto_drafted_plausible_tokens():
    """What the opt-in `"acceptance": "typical"` does to the output (README: not lossless): a drafted token the target
    finds plausible (above min(eps, delta * exp(-H))) is taken whenever it is drafted, so drafted text gains mass
    over the target's distribution and undrafted text loses it. Measured on the first token, where the tree's root
    children are the drafter's top-2: their share rises above the target's."""
    g = torch.Generator().manual_seed(11)
    n = N // 2
    typical = _sample_text(lambda t, p, q, g: verify_typical(t, p, 0.09, 0.3, generator=g), topk_tree, n, 1, g)
    exact = _exact(1)
    drafted = torch.topk(drafter(()), 2).indices
    p = target(()).double()
    threshold = min(0.09, 0.3 * float(torch.exp((p * p.log()).sum())))
    plausible = [int(t) for t in drafted if p[t] > threshold]
    assert plausible, "the toy drafter's top-2 must include a plausible token for this test to say anything"
    share = float(typical[plausible].sum() / n)
    assert share > float(exact[plausible].sum()) + 0.05, (share, float(exact[plausible].sum()))
    tv = 0.5 * (typical / n - exact).abs().sum()
    assert tv > 0.05, float(tv)  # far beyond sampling noise at n = 6000 (the lossless modes stay under 0.04 at 3 tokens)


def test_batched_verification_equals_the_per_tree_walks():
    """trees/batch.py, as the GPU tree runtime runs it: greedy over padded trees equals verify_greedy tree by tree,
    and sample-and-match whose rows are one-hot (a draw can only be the argmax) equals it too: the same paths, the
    same bonus, equal siblings pooled alike."""
    from vllm_adaspec.trees import pack_trees, verify_greedy_batch, verify_sample_batch

    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        trees = random_trees(int(torch.randint(1, 7, (), generator=g)), g)
        batch = pack_trees(trees, width=40)
        argmax = torch.randint(0, 4, (len(trees), 41), generator=g)
        greedy = verify_greedy_batch(batch, argmax)
        one_hot = torch.nn.functional.one_hot(argmax, 4).double()  # [R, N + 1, V]: a draw can only be the argmax
        sampled = verify_sample_batch(batch, one_hot.log())
        for (path, count, bonus) in (greedy, sampled):
            for i, tree in enumerate(trees):
                want_path, want_bonus = verify_greedy(tree, argmax[i, :len(tree) + 1])
                assert path[i, :count[i]].tolist() == want_path and int(bonus[i]) == want_bonus
                assert (path[i, count[i]:] == -1).all()


def test_batched_sample_and_match_keeps_the_target_distribution():
    """15000 trees verified in one batch (the drafter's top-2 under top-2), each text completed by plain draws from
    the target: the first three tokens follow the target's exact distribution; the same batch verified against the
    drafter's distributions instead does not (the test's power)."""
    from vllm_adaspec.trees import pack_trees, verify_sample_batch

    g = torch.Generator().manual_seed(3)
    tree, prefixes = topk_tree((), g)
    r = 15000
    batch = pack_trees([tree] * r)
    exact = _exact(3)
    for dist, lossless in ((target, True), (drafter, False)):
        rows = torch.stack([dist(p) for p in prefixes])  # [N + 1, V] the distribution at each row
        path, count, bonus = verify_sample_batch(batch, rows.log().expand(r, -1, -1), generator=g)
        counts = torch.zeros(V ** 3, dtype=torch.float64)
        for i in range(r):
            text = tuple(tree.tokens[path[i, :count[i]]].tolist()) + (int(bonus[i]),)
            while len(text) < 3:
                text += (int(torch.multinomial(target(text), 1, generator=g)),)
            counts[text[0] * V * V + text[1] * V + text[2]] += 1
        p = chi2_pvalue(counts, exact)
        assert (p > 1e-3) if lossless else (p < 1e-6), (dist.__name__, p)


def test_ancestor_words_are_the_packed_ancestor_mask():
    """tree.ancestor_words (what GPU planning builds, without a dense mask) equals ancestor_mask packed into 32-bit
    words, for trees past 32 and 64 rows and with extra words."""
    import numpy as np

    from vllm_adaspec.trees.batch import pack_words
    from vllm_adaspec.trees.tree import ancestor_words

    g = torch.Generator().manual_seed(7)
    for n in (1, 5, 31, 32, 63, 64, 100):
        parents = [-1] + [int(torch.randint(i + 1, (), generator=g)) - 1 for i in range(n - 1)]
        tree = DraftTree(torch.zeros(n, dtype=torch.long), torch.tensor(parents))
        want = pack_words(ancestor_mask(tree)).numpy()
        assert np.array_equal(ancestor_words(parents), want), n
        wide = ancestor_words(parents, want.shape[1] + 1)
        assert np.array_equal(wide[:, :-1], want) and not wide[:, -1].any()


def test_a_tree_built_from_host_tuples_is_the_tree_and_keeps_its_host_lists():
    """DraftTree.of (the GPU plan's constructor) gives the same tensors as DraftTree(tensors), its host lists and
    depths equal the tensors', and a bad parent is refused the same way."""
    tokens, parents = (7, 8, 9, 7, 5), (-1, -1, 0, 2, 1)
    a = DraftTree.of(tokens, parents)
    b = DraftTree(torch.tensor(tokens), torch.tensor(parents))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert a.tokens.dtype == b.tokens.dtype == torch.long
    assert a.token_list == b.token_list == list(tokens) and a.parent_list == b.parent_list == list(parents)
    assert a.depth_list == b.depth_list == [1, 1, 2, 3, 2] and torch.equal(a.depths, b.depths)
    with pytest.raises(ValueError, match="node 1 has parent 1"):
        DraftTree.of((1, 2), (-1, 1))


def test_preorder_is_the_depth_first_walk_with_children_in_node_order():
    """trees.batch.preorder (sorted root paths) ranks nodes as a depth-first walk visiting children in node order
    does, on random trees of 0-70 nodes."""
    import random

    from vllm_adaspec.trees.batch import preorder

    def walk(parents):
        kids: dict[int, list[int]] = {}
        for j, q in enumerate(parents):
            kids.setdefault(q, []).append(j)
        rank, at = [0] * len(parents), 0

        def visit(node):
            nonlocal at
            for c in kids.get(node, []):
                rank[c], at = at, at + 1
                visit(c)
        visit(-1)
        return rank

    rng = random.Random(0)
    for _ in range(500):
        parents = [rng.randint(-1, i - 1) for i in range(rng.randint(0, 70))]
        assert preorder(parents) == walk(parents), parents
