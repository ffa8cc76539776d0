"""Draft-length policies without vLLM: Thompson sampling (Beta), AdaEDL and max-confidence with the dynamic
threshold, driven by simulated verification."""

import math
import random

import pytest

from vllm_adaspec.policies import AdaEDLPolicy, MaxConfidencePolicy, ThompsonBetaPolicy, make_policy
from vllm_adaspec.policies.threshold import DynamicThreshold


def run_round(policy, accept_prob, rng, confidence=lambda depth: (None, None)):
    """One drafting round against a drafter whose drafts the target accepts independently with `accept_prob`;
    returns (proposed, accepted)."""
    k = policy.begin_round()
    proposed = 0
    for depth in range(1, k + 1):
        if not policy.accept(depth, *confidence(depth)):
            break
        proposed = depth
        if not policy.keep_drafting(depth):
            break
    accepted = 0
    while accepted < proposed and rng.random() < accept_prob:
        accepted += 1
    policy.observe(proposed, accepted)
    return proposed, accepted


@pytest.mark.parametrize("accept_prob,lo,hi", [(0.9, 5.0, 10.0), (0.2, 1.0, 1.6)])
def test_thompson_drafts_long_when_drafts_are_accepted_and_short_when_not(accept_prob, lo, hi):
    p = ThompsonBetaPolicy(10, seed=3)
    rng = random.Random(0)
    lengths = [run_round(p, accept_prob, rng)[0] for _ in range(400)]
    late = sum(lengths[200:]) / 200
    assert lo <= late <= hi, late
    # The posterior mean tracks the per-draft acceptance (each checked draft is one Bernoulli trial).
    assert abs(p.mean - accept_prob) < 0.08, p.mean


def test_thompson_posterior_update_counts_what_the_target_judged():
    p = ThompsonBetaPolicy(5, seed=0, alpha0=2.0, beta0=3.0)
    p.observe(4, 2)  # two accepted, the third rejected, the fourth never judged
    assert (p.alpha, p.beta) == (4.0, 4.0)
    p.observe(3, 3)  # all accepted: no failure
    assert (p.alpha, p.beta) == (7.0, 4.0)


def test_thompson_draws_depend_only_on_the_request_seed():
    a, b, c = (ThompsonBetaPolicy(8, seed=s) for s in (11, 11, 12))
    ra, rb, rc = random.Random(5), random.Random(5), random.Random(5)
    la = [run_round(a, 0.6, ra)[0] for _ in range(50)]
    assert la == [run_round(b, 0.6, rb)[0] for _ in range(50)]  # same seed: same decisions (every TP rank)
    assert la != [run_round(c, 0.6, rc)[0] for _ in range(50)]


def test_dynamic_threshold_follows_the_acceptance_target():
    t = DynamicThreshold(0.5, max_k=4)
    for _ in range(50):
        t.update(4, 1)  # 25% acceptance < alpha = 0.9: raise the bar
    assert t.lam > 0.5 + 0.02
    hi = t.lam
    for _ in range(50):
        t.update(4, 3)  # 75% < 0.9 still: keeps rising
    assert t.lam > hi
    t2 = DynamicThreshold(0.5, max_k=4)
    for _ in range(50):
        t2.update(2, 2)  # meets alpha, but short of max_k: lower the bar to draft more
    assert t2.lam < 0.5 - 0.02
    t3 = DynamicThreshold(0.5, max_k=4)
    t3.update(4, 4)
    assert t3.lam == 0.5  # meets alpha with max_k accepted: hold
    t3.update(0, 0)
    assert t3.lam == 0.5 and t3.ar == 1.0  # nothing judged: no update


def test_adaedl_stops_on_high_entropy():
    p = AdaEDLPolicy(6, gamma=0.2, lambda0=0.5)
    # 1 - sqrt(0.2 H) >= 0.5  <=>  H <= 1.25 nats
    assert p.accept(1, 0.9, 1.2) and not p.accept(1, 0.9, 1.3)
    rng = random.Random(0)
    entropies = {1: 0.1, 2: 0.4, 3: 2.0, 4: 0.1}
    proposed, _ = run_round(p, 1.0, rng, lambda d: (None, entropies.get(d, 0.0)))
    assert proposed == 2  # the third draft is too uncertain: not proposed, the round ends


def test_max_confidence_stops_on_low_top_probability():
    p = MaxConfidencePolicy(6, lambda0=0.6)
    rng = random.Random(0)
    probs = {1: 0.95, 2: 0.7, 3: 0.5}
    assert run_round(p, 1.0, rng, lambda d: (probs.get(d, 0.99), None))[0] == 2


def test_adaedl_beats_fixed_k_when_entropy_predicts_acceptance():
    """Drafts whose acceptance is 1 - sqrt(0.2 H) (the bound AdaEDL assumes): stopping on entropy commits more
    tokens per drafted token than drafting a fixed K."""
    def simulate(policy, rounds=3000, seed=0):
        rng = random.Random(seed)
        drafted = committed = 0
        for _ in range(rounds):
            k = policy.begin_round()
            proposed, accepted = 0, 0
            alive = True
            for depth in range(1, k + 1):
                h = rng.choice([0.02, 0.1, 0.5, 2.0, 4.0])
                if not policy.accept(depth, None, h):
                    break
                proposed = depth
                if alive and rng.random() < max(0.0, 1 - math.sqrt(0.2 * h)):
                    accepted += 1
                else:
                    alive = False
                if not policy.keep_drafting(depth):
                    break
            policy.observe(proposed, accepted)
            drafted += proposed
            committed += accepted + 1
        return committed / (rounds + 0.3 * drafted)  # cost model: a draft costs 0.3 of a target step

    assert simulate(AdaEDLPolicy(5, lambda0=0.5)) > 1.05 * simulate(make_policy("fixed", 5))


def test_make_policy_passes_parameters_and_rejects_unknown_names():
    p = make_policy("adaedl", 4, seed=1, params={"gamma": 0.3, "lambda0": 0.4})
    assert p.gamma == 0.3 and p.threshold.lam == 0.4
    with pytest.raises(ValueError, match="unknown draft-length policy 'nope'"):
        make_policy("nope", 4)
