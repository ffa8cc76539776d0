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

from vllm_adaspec.policies.fixed import FixedPolicy
from vllm_adaspec.policies.thompson import ThompsonBetaPolicy, ThompsonCaliPolicy
from vllm_adaspec.policies.threshold import AdaEDLPolicy, MaxConfidencePolicy

__all__ = ["POLICIES", "FixedPolicy", "ThompsonBetaPolicy", "ThompsonCaliPolicy", "AdaEDLPolicy", "MaxConfidencePolicy", "make_policy",
           "policy_params", "check_policy"]

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


def check_policy(name: str, params: dict, max_k: int = 4) -> None:
    """Raise ValueError naming what is wrong with a policy name or its parameters (before any engine starts)."""
    if name not in POLICIES:
        raise ValueError(f"unknown draft-length policy {name!r}; known: {', '.join(POLICIES)}")
    allowed = policy_params(name)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"policy {name!r} has no parameter(s) {', '.join(map(repr, unknown))}; "
                         f"it takes: {', '.join(allowed) or 'none'}")
    for key, value in params.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"policy {name!r} parameter {key!r} must be a number, got {value!r}")
    make_policy(name, max_k, 0, params)  # the constructor's own range checks


def make_policy(name: str, max_drafts: int, seed: int = 0, params: dict | None = None):
    """Build the policy named in the config for one request."""
    if name not in POLICIES:
        raise ValueError(f"unknown draft-length policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[name](max_drafts, seed=seed, **(params or {}))
