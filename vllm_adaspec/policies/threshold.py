"""Confidence-threshold stopping with AdaEDL's dynamic threshold (AdaEDL Alg. 1).

`adaedl` keeps a draft while 1 - sqrt(gamma * H) >= lambda, H the entropy (nats) of the drafter's distribution
at that position: an approximate lower bound on the chance the target accepts it (AdaEDL section 3, appendix B).
`max-confidence` (the papers' baseline) keeps it while the top draft probability >= lambda. Both move lambda
after every verified round toward a target acceptance rate alpha: up by eps while the smoothed acceptance is
below alpha, down while it is met and the round did not already accept all max_k drafts; lambda follows that
target through an EMA (beta2). A draft that fails the test is not proposed and the round ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class DynamicThreshold:
    lam: float
    max_k: int
    alpha: float = 0.9
    eps: float = 0.01
    beta1: float = 0.5
    beta2: float = 0.9
    ar: float | None = field(default=None, init=False)  # smoothed acceptance rate

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:  # nothing judged this round
            return
        ar_i = accepted / drafted
        self.ar = ar_i if self.ar is None else self.beta1 * self.ar + (1 - self.beta1) * ar_i
        if self.ar < self.alpha:
            target = self.lam + self.eps
        elif accepted != self.max_k:
            target = self.lam - self.eps
        else:
            target = self.lam
        self.lam = min(1.0, max(0.0, self.beta2 * self.lam + (1 - self.beta2) * target))


def _check(name: str, max_k: int, lam: float, alpha: float, eps: float, beta1: float, beta2: float,
           gamma: float | None = None) -> None:
    if max_k < 1:
        raise ValueError(f"{name}: max_k must be >= 1, got {max_k}")
    for key, value, ok, rule in [("lambda0", lam, 0.0 <= lam <= 1.0, "in [0, 1]"),
                                 ("alpha", alpha, 0.0 < alpha <= 1.0, "in (0, 1]"),
                                 ("eps", eps, 0.0 <= eps <= 1.0, "in [0, 1]"),
                                 ("beta1", beta1, 0.0 <= beta1 < 1.0, "in [0, 1)"),
                                 ("beta2", beta2, 0.0 <= beta2 < 1.0, "in [0, 1)"),
                                 ("gamma", gamma, gamma is None or gamma > 0, "> 0")]:
        if not ok:
            raise ValueError(f"{name}: {key} must be {rule}, got {value}")


class AdaEDLPolicy:
    needs_confidence = True

    def __init__(self, max_k: int, seed: int = 0, gamma: float = 0.2, lambda0: float = 0.5, alpha: float = 0.9,
                 eps: float = 0.01, beta1: float = 0.5, beta2: float = 0.9):
        _check("adaedl", max_k, lambda0, alpha, eps, beta1, beta2, gamma)
        self.max_k, self.gamma = max_k, gamma
        self.threshold = DynamicThreshold(lambda0, max_k, alpha, eps, beta1, beta2)

    def begin_round(self) -> int:
        return self.max_k

    def accept(self, depth: int, top_prob: float | None = None, entropy: float | None = None,
               score: float | None = None) -> bool:
        return 1.0 - math.sqrt(self.gamma * max(0.0, entropy)) >= self.threshold.lam

    def keep_drafting(self, depth: int) -> bool:
        return depth < self.max_k

    def observe(self, drafted: int, accepted: int) -> None:
        self.threshold.update(drafted, accepted)


class MaxConfidencePolicy:
    needs_confidence = True

    def __init__(self, max_k: int, seed: int = 0, lambda0: float = 0.5, alpha: float = 0.9, eps: float = 0.01,
                 beta1: float = 0.5, beta2: float = 0.9):
        _check("max-confidence", max_k, lambda0, alpha, eps, beta1, beta2)
        self.max_k = max_k
        self.threshold = DynamicThreshold(lambda0, max_k, alpha, eps, beta1, beta2)

    def begin_round(self) -> int:
        return self.max_k

    def accept(self, depth: int, top_prob: float | None = None, entropy: float | None = None,
               score: float | None = None) -> bool:
        return top_prob >= self.threshold.lam

    def keep_drafting(self, depth: int) -> bool:
        return depth < self.max_k

    def observe(self, drafted: int, accepted: int) -> None:
        self.threshold.update(drafted, accepted)
