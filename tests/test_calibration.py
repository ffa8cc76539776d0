"""thompson-cali (EESD Eq. 5-9): the posterior, the policy, the predictor file and the trainer's round samples."""

import random

import numpy as np
import pytest
import torch

from vllm_adaspec.config import AdaspecConfigError
from vllm_adaspec.heads import check_calibration, exit_head_hash
from vllm_adaspec.policies import make_policy
from vllm_adaspec.policies.calibration import MAX_DEPTH, CalibrationPredictor
from vllm_adaspec.policies.thompson import ThompsonCaliPolicy, posterior
from vllm_adaspec.training.calibration_trainer import round_samples


def test_posterior_moves_from_the_prediction_to_the_observed_rate():
    mu, sd = posterior(0.8, 0.2, 0, sigma_m=0.2, sigma_s=0.5)
    assert mu == pytest.approx(0.8) and sd == pytest.approx(0.2)  # n = 0: the model's prediction alone
    mu, sd = posterior(0.8, 0.2, 10_000, sigma_m=0.2, sigma_s=0.5)
    assert mu == pytest.approx(0.2, abs=1e-3) and sd < 0.01  # many rounds: the request's own rate
    # Eq. 6 halfway point: n sigma_m^2 = sigma_s^2
    mu, _ = posterior(0.8, 0.2, 25, sigma_m=0.1, sigma_s=0.5)
    assert mu == pytest.approx(0.5)


def _mean_round(policy, score, accept_prob, rounds=400, seed=0):
    rng = random.Random(seed)
    total = 0
    for _ in range(rounds):
        k = policy.begin_round()
        drafted = 0
        for depth in range(1, k + 1):
            assert policy.accept(depth, None, None, score)
            drafted = depth
            if not policy.keep_drafting(depth):
                break
        accepted = 0
        while accepted < drafted and rng.random() < accept_prob:
            accepted += 1
        policy.observe(drafted, accepted)
        total += drafted
    return total / rounds


def test_prediction_steers_a_new_request_and_evidence_takes_over():
    # Fresh requests: the drafts-per-round follow the predictor's score.
    hi = np.mean([_mean_round(ThompsonCaliPolicy(8, seed=s), 0.9, 0.9, rounds=3) for s in range(200)])
    lo = np.mean([_mean_round(ThompsonCaliPolicy(8, seed=s), 0.1, 0.9, rounds=3) for s in range(200)])
    assert hi > 2 * lo, (hi, lo)
    # A long request whose drafts are almost never accepted stops drafting deep, whatever the score says.
    p = ThompsonCaliPolicy(8, seed=1)
    late = _mean_round(p, 0.9, 0.05, rounds=600)
    assert p.theta_hat < 0.15 and late < 2.5, (p.theta_hat, late)


def test_theta_hat_counts_judged_drafts_and_can_fall():
    p = ThompsonCaliPolicy(5, theta0=0.5)
    p.observe(4, 1)  # one accepted, the second rejected, two never judged
    assert (p.successes, p.trials, p.n) == (1, 2, 1)
    assert p.theta_hat == pytest.approx((0.5 + 1) / 3)
    p.observe(3, 3)
    assert p.theta_hat == pytest.approx((0.5 + 4) / 6)
    p.observe(0, 0)  # no drafts: no verification of ours
    assert p.n == 2


def test_cali_draws_depend_only_on_the_request_seed():
    a, b = make_policy("thompson-cali", 6, 42), make_policy("thompson-cali", 6, 42)
    da = [a.accept(1, None, None, 0.6) and a.keep_drafting(1) for _ in range(50)]
    db = [b.accept(1, None, None, 0.6) and b.keep_drafting(1) for _ in range(50)]
    assert da == db and 0 < sum(da) < 50
    with pytest.raises(ValueError, match="sigma_m"):
        make_policy("thompson-cali", 4, 0, {"sigma_m": 0})
    with pytest.raises(ValueError, match="theta0"):
        make_policy("thompson-cali", 4, 0, {"theta0": 1.5})


def test_predictor_round_trip_and_depth_cap(tmp_path):
    d = 16
    g = torch.Generator().manual_seed(0)
    pred = CalibrationPredictor(torch.randn(MAX_DEPTH, d, generator=g), torch.randn(d, generator=g),
                                torch.randn(MAX_DEPTH, generator=g))
    pred.save(str(tmp_path), {"exit_head_hash": "x"})
    back = CalibrationPredictor.load(str(tmp_path))
    ht, hd = torch.randn(3, d, generator=g), torch.randn(3, d, generator=g)
    proj = back.project_target(ht)
    for depth in (1, 4, 10, 17):
        i = min(depth, MAX_DEPTH) - 1
        want = torch.sigmoid(ht @ pred.u[i] + hd @ pred.w + pred.b[i])
        assert torch.allclose(back.score(proj, hd, depth), want, atol=1e-6)
    with pytest.raises(ValueError, match="shapes"):
        CalibrationPredictor(torch.zeros(MAX_DEPTH, d), torch.zeros(d + 1), torch.zeros(MAX_DEPTH))


def test_check_calibration_names_what_is_missing_or_foreign(tmp_path):
    head = tmp_path / "head"
    head.mkdir()
    (head / "exit_head.safetensors").write_bytes(b"weights")
    with pytest.raises(AdaspecConfigError, match="untrained exit"):
        check_calibration(None, "thompson-cali")
    with pytest.raises(AdaspecConfigError, match="no calibration.json.*adaspec train calibration"):
        check_calibration(str(head), "thompson-cali")
    pred = CalibrationPredictor(torch.zeros(MAX_DEPTH, 4), torch.zeros(4), torch.zeros(MAX_DEPTH))
    pred.save(str(head), {"exit_head_hash": "0123456789abcdef"})
    with pytest.raises(AdaspecConfigError, match="another exit head"):
        check_calibration(str(head), "thompson-cali")
    pred.save(str(head), {"exit_head_hash": exit_head_hash(str(head))})
    check_calibration(str(head), "thompson-cali")


def test_round_samples_follow_the_rounds_that_reach_each_depth():
    agree = np.array([True, True, False, True, True, True])
    a, i = round_samples(agree, max_depth=3)
    pairs = set(zip(a.tolist(), i.tolist()))
    # depth 1: every anchor with a next position; depth 2 needs agreement at a+1; depth 3 at a+1 and a+2.
    assert {(x, 1) for x in range(5)} <= pairs
    assert {(x, 2) for x in range(4) if agree[x + 1]} == {p for p in pairs if p[1] == 2}
    assert {(x, 3) for x in range(3) if agree[x + 1] and agree[x + 2]} == {p for p in pairs if p[1] == 3}
