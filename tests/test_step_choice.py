"""The step's node choice compiled (trees/step_choice.py) against its definition in Python (trie.py's merge, ranked,
best_path, best_prefix, chains_where_cheaper, subtree): the same nodes, scores and keys for every request, on random
steps and in the drafter's replay of decoding."""

import random
import sys
from pathlib import Path

import numpy as np
import pytest

from vllm_adaspec.policies.cost_model import StepCostModel, TreeExtra, prior_for
from vllm_adaspec.pools import Candidates
from vllm_adaspec.trees import step_choice
from vllm_adaspec.trees.step_choice import Prices, choose_compiled, choose_reference, cost_table
from vllm_adaspec.trees.trie import Calibration, key_code, merge

POOL_NAMES = ("context", "suffix", "recycled", "corpus", "branches", "medusa")


def random_candidates(rng: random.Random, pool: str) -> Candidates:
    """A pool's candidate tree over a small alphabet (pools agree often: merges), probabilities on a coarse grid
    (ties in path probability), evidence outside 0..4 too."""
    c = Candidates(pool=pool)
    for _ in range(rng.choice([0, 1, 3, 8, 20, 40])):
        parent = rng.randrange(-1, len(c)) if len(c) and rng.random() < 0.8 else -1
        c.add(parent, rng.randrange(6), rng.choice([0.0, -0.1, 0.25, 0.5, 0.5, 0.95, rng.random()]),
              rng.randrange(-1, 7))
    return c


def random_step(rng: random.Random, calibration: Calibration, priced: bool):
    r = rng.randint(1, 8)
    pools = rng.sample(POOL_NAMES, rng.randint(1, 4))
    candidates = [[random_candidates(rng, p) for p in pools] for _ in range(r)]
    states = [rng.randrange(3) for _ in range(r)]
    treeish = [rng.random() < 0.8 for _ in range(r)]
    budgets = [rng.choice([1, 2, 4, 8, 16, 64]) for _ in range(r)]
    scale = [rng.choice([1.0, 0.5, 1.7]) for _ in range(r)]
    prices = None
    if priced:
        decoding = r + rng.randrange(3)
        model = StepCostModel(prior_for("cuda", 8e9))
        cost = model.curve(decoding, rng.choice([0.0, 0.01]))
        branching = rng.randrange(2)
        prices = Prices(float(decoding), decoding + 8 * branching, cost,
                        TreeExtra(rng.choice([0.0, 0.004, 0.05, 0.3]), rng.choice([0.0, 0.001, 0.01])),
                        [rng.choice([0.0, 1e-4, 3e-3]) for _ in range(r)], rng.choice([0.0, 0.002]),
                        [rng.random() < 0.8 for _ in range(r)], branching, 8 * branching,
                        (rng.choice([1.0, 0.8]), rng.choice([1.0, 1.3])))
    return candidates, states, treeish, budgets, scale, prices


def calibrated(rng: random.Random) -> Calibration:
    cal = Calibration()
    for name in POOL_NAMES:
        cal.bit(name)
    for _ in range(3000):  # evidence on a spread of keys (the others keep the prior)
        code = key_code(rng.randrange(1, 64), rng.randrange(10), rng.randint(1, 3), rng.randrange(5), rng.randrange(3))
        cal.observe(code, rng.random() < 0.6)
    return cal


@pytest.mark.parametrize("priced", [True, False])
def test_the_compiled_choice_is_the_python_one(priced):
    rng = random.Random(7 if priced else 8)
    cal = calibrated(rng)
    switched = 0
    for _ in range(300):
        candidates, states, treeish, budgets, scale, prices = random_step(rng, cal, priced)
        got, sizes = choose_compiled(candidates, cal, states, treeish, budgets, scale, prices)
        tries = [merge(c, cal, (s,)) for c, s in zip(candidates, states)]
        want = choose_reference(tries, treeish, budgets, scale, prices)
        assert sizes == [len(t) for t in tries]
        assert got == want  # tokens, parents, chances, paths, keys and depths of every chosen node, in order
        for t, b in zip(got, budgets):
            assert len(t) <= b and all(p < i for i, p in enumerate(t.parents))  # within budget, breadth first
        switched += sum(tree and len(set(t.parents)) == len(t.parents) for t, tree in zip(got, treeish))
    assert switched > 20  # (chains chosen for tree requests: chains_where_cheaper's path ran)


def test_the_compiled_choice_starts_compiled():
    """warm_up compiles the one signature a drafting step calls (no compile inside a request's step)."""
    step_choice.warm_up()
    rng = random.Random(3)
    candidates, states, treeish, budgets, scale, prices = random_step(rng, calibrated(rng), True)
    n = len(step_choice._choose.signatures)
    choose_compiled(candidates, calibrated(rng), states, treeish, budgets, scale, prices)
    assert len(step_choice._choose.signatures) == n == 1


def test_pending_observations_add_as_numpys_add_at_compiled_or_not(monkeypatch):
    """Calibration's pending observations go into its table by a compiled loop, warmed with the choice (not
    compiled in a step): the same sums as np.add.at's, in the same order (repeated keys, fractional sums), and the
    same where numba fails (np.add.at from then on)."""
    from vllm_adaspec.trees import trie

    step_choice.warm_up()
    assert len(trie._ADD[0].signatures) == 1
    rng = np.random.default_rng(5)
    codes = rng.integers(0, 40, 3000)  # (many repeats of each key)
    hits = rng.random(3000) < 0.37
    want = np.zeros((trie.KEY_CODES, 2))
    np.add.at(want, (codes, 0), hits.astype(np.float64) * 0.1)  # (tenths: sums that depend on their order)
    np.add.at(want, (codes, 1), 1.0)
    for fail in (False, True):
        if fail:
            monkeypatch.setattr(trie, "_ADD", [lambda *a: (_ for _ in ()).throw(RuntimeError("no numba here"))])
        cal = Calibration()
        got = np.zeros_like(want)
        trie.add_observations(got, codes, hits.astype(np.float64) * 0.1)
        assert np.array_equal(got, want)
        for c, h in zip(codes[:50].tolist(), hits[:50].tolist()):
            cal.observe(c, h)
        assert cal.table[:, 1].sum() == 50 and cal.table[codes[0], 1] >= 1
    assert trie._ADD[0] is None  # (fell back once, and stays)
    assert len(step_choice._choose.signatures) == 1


def test_cost_table_is_the_curve_exactly_past_its_own_table_too():
    model = StepCostModel(prior_for("cuda", 8e9))
    for plus in (0.0, 0.013):
        cost = model.curve(8, plus)
        top = len(cost.array) + 40
        table = cost_table(cost, top)
        assert table.tolist() == [cost(r) for r in range(top + 1)]
    assert cost_table(lambda r: 0.5 * r, 3).tolist() == [0.0, 0.5, 1.0, 1.5]


def test_calibration_keys_round_trip():
    cal = Calibration()
    bits = {name: cal.bit(name) for name in ("suffix", "context", "medusa")}
    code = key_code(bits["suffix"] | bits["medusa"], 7, 2, 4, 1)
    assert cal.key(code) == (("medusa", "suffix"), 7, 2, 4, 1)
    cal.observe(code, True)
    cal.observe(code, False)
    counts = cal.counts
    assert counts == {(("medusa", "suffix"), 7, 2, 4, 1): [1.0, 2.0]}
    other = Calibration()
    other.counts = counts  # (decision_replay carries counts from one replay to the next)
    assert other.counts == counts
    with pytest.raises(ValueError, match="at most 6 pools"):
        for k in range(7):
            cal.bit(f"pool{k}")


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_the_drafter_decodes_the_same_compiled_python_or_after_a_fault(monkeypatch):
    """MultiBranchProposer's real driver on the decision replay (pools, calibration, the cost model and the audit's
    observer): the compiled choice drafts, accepts and calibrates exactly as the Python one; a fault in it hands
    the choice to Python for good, nothing lost."""
    import decision_replay as dr
    import test_decision_replay as tdr

    import vllm_adaspec.proposers.multi_branch as mb
    from vllm_adaspec.models import resolve_model

    data = tdr.synthetic()
    names = [f"r{k}" for k in range(len(data))]
    model = resolve_model("smollm2-135m-instruct")
    calls = []
    compiled = mb.choose_compiled

    def counted(*args):
        calls.append(1)
        if fail_at and len(calls) == fail_at:
            raise IndexError("injected")
        return compiled(*args)

    monkeypatch.setattr(mb, "choose_compiled", counted)
    runs = {}
    for label, fail_at, on in (("compiled", 0, True), ("python", 0, False), ("fault", 3, True)):
        monkeypatch.setattr(mb, "choice_compiled", lambda on=on: on)
        calls.clear()
        got = dr.replay_ours(data, {"synthetic": list(range(len(data)))}, names,
                             {"pools": ["context", "suffix", "corpus"]}, model, 2, 40, dr.cpu_step(0.02), heads=None)
        runs[label] = (got["synthetic"], got["calibration"], len(calls))
    (c, cal_c, n_c), (p, cal_p, n_p), (f, cal_f, n_f) = runs["compiled"], runs["python"], runs["fault"]
    assert n_c > 20 and n_p == 0 and n_f == 3  # compiled every step; never; until the fault
    for k, out in c["output"].items():
        assert out == data[k]["cont"][:len(out)]
    for key in ("output", "forwards", "drafted", "accepted"):
        assert c[key] == p[key], key
    assert cal_c == cal_p == cal_f and len(cal_c) > 5
    for key in ("output", "forwards", "drafted", "accepted"):
        assert f[key] == c[key], key


def test_where_the_compiled_choice_cannot_compile_python_chooses(monkeypatch, caplog):
    """A start-up that cannot compile the choice (no LLVM, an unwritable cache is fine) says so once and drafts with
    the Python choice: the same nodes, more host time."""
    import vllm_adaspec.proposers.multi_branch as mb

    def broken():
        raise RuntimeError("no LLVM here")

    monkeypatch.setattr(step_choice, "warm_up", broken)
    assert mb.choice_ready() is False
    assert [r.message for r in caplog.records] == [
        "vllm_adaspec: the compiled node choice did not compile; the Python one chooses (the same nodes, more host "
        "time a step)"]


def test_a_candidate_before_its_parent_is_refused_not_read():
    """A pool that lists a child before its parent: the compiled choice raises (the driver contains it: the step
    drafts nothing for it), as Python's merge does, instead of reading a node not yet made."""
    bad = Candidates([5, 6], [1, -1], [0.5, 0.5], [0, 0], "context")
    with pytest.raises(IndexError):
        merge([bad], Calibration())
    with pytest.raises(IndexError, match="parent does not come before it"):
        choose_compiled([[bad]], Calibration(), [0], [True], [4], [1.0], None)
