"""SpeedGuard finds the draft cap with the best measured throughput per batch size, 0 (plain) included."""

import random

import pytest

from vllm_adaspec.policies.speed_guard import SpeedGuard


def simulate(guard, batch, rate_of_k, steps, noise=0.1, seed=0):
    rng = random.Random(seed)
    picks = []
    for _ in range(steps):
        k = guard.choose(batch)
        picks.append(k)
        tokens = batch * 10
        guard.observe(batch, k, tokens, tokens / (rate_of_k(k) * (1 + rng.uniform(-noise, noise))))
    return picks


def test_climbs_from_plain_while_drafting_gets_faster():
    g = SpeedGuard(5, min_trials=2, explore=0.0)
    picks = simulate(g, 1, {0: 10.0, 1: 12.0, 2: 13.0, 3: 12.5, 4: 9.0, 5: 8.0}.__getitem__, 12, noise=0.0)
    # 0, 1, 2 each faster than the one below; 3 is slower than 2, so 4 and 5 are never tried.
    assert picks == [0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 2, 2]
    assert g.best(1) == 2 and g.exploiting


def test_losing_drafter_costs_only_a_few_steps():
    g = SpeedGuard(8, min_trials=3, explore=0.0)
    picks = simulate(g, 8, lambda k: 100.0 - 10 * k, 50, noise=0.0)
    assert picks[:6] == [0, 0, 0, 1, 1, 1] and set(picks[6:]) == {0}
    assert g.best(8) == 0 and g.exploiting
    assert g.table() == {"8/0": [47, 100.0], "8/1": [3, 90.0]}  # what the engine's stats report (guard_table)


@pytest.mark.parametrize("batch,rates,best", [
    (1, {0: 20.0, 1: 24.0, 2: 26.0, 3: 23.0}, 2),  # batch 1: drafting pays, K=2 is best
    (8, {0: 100.0, 1: 92.0, 2: 85.0, 3: 70.0}, 0),  # batch 8: every cap loses, plain wins
])
def test_converges_to_the_fastest_cap(batch, rates, best):
    g = SpeedGuard(3, seed=1)
    picks = simulate(g, batch, rates.__getitem__, 400)
    assert g.best(batch) == best
    late = picks[200:]
    assert late.count(best) / len(late) > 0.9  # exploration stays a small share
    # Throughput over the run is close to always running the best cap.
    mean_rate = sum(rates[k] for k in picks) / len(picks)
    assert mean_rate > 0.95 * rates[best]


def test_batch_sizes_learn_separately():
    g = SpeedGuard(2, seed=0)
    simulate(g, 1, {0: 10.0, 1: 12.0, 2: 11.0}.__getitem__, 100)
    simulate(g, 8, {0: 80.0, 1: 70.0, 2: 60.0}.__getitem__, 100)
    assert g.best(1) == 1 and g.best(8) == 0 and g.best(9) == 0  # 8..15 share a bucket
    assert g.best(2) is None  # never seen


def test_follows_a_change():
    g = SpeedGuard(1, seed=0, explore=0.1)
    simulate(g, 1, {0: 10.0, 1: 15.0}.__getitem__, 100)
    assert g.best(1) == 1
    simulate(g, 1, {0: 10.0, 1: 6.0}.__getitem__, 300)  # e.g. the text became hard to draft
    assert g.best(1) == 0


def test_rejects_bad_k():
    with pytest.raises(ValueError, match="max_k must be >= 1"):
        SpeedGuard(0)


def test_settled_reports_only_buckets_whose_climb_is_done():
    g = SpeedGuard(3, explore=0.0, min_trials=1)
    for k, rate in ((0, 10.0), (1, 8.0)):  # batch 4: plain is faster, the climb stops at cap 1
        assert g.choose(4) == k
        g.observe(4, k, int(rate), 1.0)
    assert g.choose(1) == 0  # batch 1: still trying
    g.observe(1, 0, 10, 1.0)
    assert g.settled() == {4: 0}
