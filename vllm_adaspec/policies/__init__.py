"""Draft-length policies: one object per request decides how many tokens to draft each step.

The interface every drafter relies on (kept narrow so adaptive policies plug in without drafter changes):
    begin_round() -> int                   most drafts this step (0 = do not draft)
    accept(depth, top_prob, entropy, score) -> bool
                                           draft `depth` (1-based) was just computed: propose it? False ends
                                           the round without it. top_prob / entropy describe the drafter's
                                           distribution there, computed only if the policy sets
                                           `needs_confidence = True`; score is the drafter's predicted
                                           acceptance (policies/calibration.py), only if `needs_score = True`
                                           (else None).
    keep_drafting(depth) -> bool           after proposing draft `depth`: compute another?
    observe(drafted, accepted) -> None     verification feedback for the previous round
Constructor: Policy(max_k, seed=..., **params); `seed` is per request and identical on every rank.
"""

from __future__ import annotations

import inspect

from vllm_adaspec.errors import Interval, is_number, show, typed
from vllm_adaspec.policies.fixed import FixedPolicy
from vllm_adaspec.policies.thompson import ThompsonBetaPolicy, ThompsonCaliPolicy
from vllm_adaspec.policies.threshold import AdaEDLPolicy, MaxConfidencePolicy

__all__ = ["POLICIES", "FixedPolicy", "ThompsonBetaPolicy", "ThompsonCaliPolicy", "AdaEDLPolicy", "MaxConfidencePolicy", "make_policy",
           "policy_params", "check_policy", "PARAM_RANGES", "PolicyError"]

POLICIES = {
    "fixed": FixedPolicy,
    "thompson-beta": ThompsonBetaPolicy,
    "thompson-cali": ThompsonCaliPolicy,
    "adaedl": AdaEDLPolicy,
    "max-confidence": MaxConfidencePolicy,
}


def policy_params(name: str) -> dict:
    """Tunable parameters of a policy and their defaults."""
    sig = inspect.signature(POLICIES[name])
    return {p.name: p.default for p in list(sig.parameters.values())[1:]
            if p.name != "seed" and p.default is not inspect.Parameter.empty}


# Every tunable parameter's range (the same name means the same thing in every policy). Finite numbers only:
# random.betavariate(inf, .) never returns, and an infinite gamma or sigma_m silently stops drafting. The bounds are
# wide enough for any setting that does something and narrow enough that no draw or threshold degenerates.
PARAM_RANGES = {
    "alpha0": Interval(1e-6, 1e6),  # thompson-beta: Beta prior pseudo-counts
    "beta0": Interval(1e-6, 1e6),
    "sigma_m": Interval(1e-6, 1e3),  # thompson-cali: std of the predictor's and of the observed acceptance
    "sigma_s": Interval(1e-6, 1e3),
    "theta0": Interval(0, 1),  # a probability
    "gamma": Interval(1e-6, 100),  # adaedl: 1 - sqrt(gamma * H); past 100 only H ~ 0 drafts
    "lambda0": Interval(0, 1),  # thresholds on probabilities
    "alpha": Interval(0, 1, lo_open=True),
    "eps": Interval(0, 1),
    "beta1": Interval(0, 1, hi_open=True),  # EMA weights: 1 would never move
    "beta2": Interval(0, 1, hi_open=True),
}


class PolicyError(ValueError):
    """A bad policy setting; `param` names the parameter when one is at fault."""

    def __init__(self, msg: str, param: str | None = None):
        super().__init__(msg)
        self.param = param


def check_policy(name: str, params: dict, max_k: int = 4) -> dict:
    """The parameters as floats, checked (before any engine starts); PolicyError naming what is wrong."""
    if name not in POLICIES:
        raise PolicyError(f"unknown draft-length policy {name!r}; known: {', '.join(POLICIES)}")
    allowed = policy_params(name)
    unknown = set(params) - set(allowed)
    if unknown:
        names = ", ".join(map(show, sorted(unknown, key=show)))
        raise PolicyError(f"policy {name!r} has no parameter(s) {names}; it takes: {', '.join(allowed) or 'none'}")
    out = {}
    for key, value in params.items():
        interval = PARAM_RANGES[key]
        if not is_number(value) or value not in interval:
            raise PolicyError(f"must be a finite number in {interval}, got {typed(value)}", key)
        out[key] = float(value)
    try:
        make_policy(name, max_k, 0, out)  # the constructor's own checks (none should be left to fail)
    except ValueError as e:
        raise PolicyError(str(e)) from None
    return out


def make_policy(name: str, max_drafts: int, seed: int = 0, params: dict | None = None):
    """Build the policy named in the config for one request."""
    if name not in POLICIES:
        raise ValueError(f"unknown draft-length policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[name](max_drafts, seed=seed, **(params or {}))
