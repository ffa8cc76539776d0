"""EESD's Thompson-sampling draft-length control: Beta posterior (Alg. 1-2, Eq. 3-4) and calibrated (Eq. 5-9).

After each draft the request flips a coin chi ~ Bernoulli(theta) with theta drawn from Beta(alpha, beta): heads,
draft another token; tails, stop. Verification updates the posterior. Counting: every draft the target checked is
one Bernoulli trial (accepted = success; the first rejected one = failure; drafts after it were never judged).
EESD's Eq. 3-4 write the trial count as min(|Q_v| + 1, |Q_d|) and successes as |Q_v| - 1, which is this count
up to how |Q_v| treats the target's own token; we count what the target actually judged.

Draws use the request's own seeded RNG: identical on every tensor-parallel rank and independent of the batch.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


@dataclass
class ThompsonBetaPolicy:
    max_k: int
    seed: int = 0
    alpha0: float = 1.0
    beta0: float = 1.0
    alpha: float = field(init=False)
    beta: float = field(init=False)

    def __post_init__(self):
        if self.max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {self.max_k}")
        if not (self.alpha0 > 0 and self.beta0 > 0):
            raise ValueError(f"alpha0 and beta0 must be > 0, got {self.alpha0}, {self.beta0}")
        self.alpha, self.beta = float(self.alpha0), float(self.beta0)
        self.rng = random.Random(self.seed)

    def begin_round(self) -> int:
        return self.max_k

    def accept(self, depth: int, top_prob: float | None = None, entropy: float | None = None,
               score: float | None = None) -> bool:
        return True

    def keep_drafting(self, depth: int) -> bool:
        if depth >= self.max_k:
            return False
        theta = self.rng.betavariate(self.alpha, self.beta)  # Alg. 1 step 8
        return self.rng.random() < theta  # step 9: chi ~ Bernoulli(theta)

    def observe(self, drafted: int, accepted: int) -> None:
        self.alpha += accepted  # Eq. 3
        self.beta += 1 if accepted < drafted else 0  # Eq. 4

    @property
    def mean(self) -> float:
        return self.alpha / (self.alpha + self.beta)


# --- calibrated variant (EESD Eq. 6-9, Algorithm 3) ---
#
# After draft i, theta ~ N(mu, sigma^2) with the Gaussian posterior of Eq. 6-7 / Eq. 9, whose prior mean is the
# predictor's theta_M (policies/calibration.py) and whose data are the request's own verified rounds:
#     mu      = (sigma_s^2 theta_M + n sigma_m^2 theta_hat) / (n sigma_m^2 + sigma_s^2)
#     sigma^2 = sigma_m^2 sigma_s^2 / (sigma_s^2 + n sigma_m^2)
# then chi ~ Bernoulli(clip(theta, 0, 1)) as above. n counts verified rounds. theta_hat is the observed per-draft
# acceptance rate: Eq. 8 as printed adds |Q_v| to both the sum and the count, so it could only rise toward 1; we
# count what the target judged (the trials of thompson-beta), with theta0 as one prior observation.

def posterior(theta_m: float, theta_hat: float, n: int, sigma_m: float, sigma_s: float) -> tuple[float, float]:
    """Eq. 6 / Eq. 9: (mean, std) of theta after n verified rounds."""
    vm, vs = sigma_m * sigma_m, sigma_s * sigma_s
    mu = (vs * theta_m + n * vm * theta_hat) / (n * vm + vs)
    return mu, math.sqrt(vm * vs / (vs + n * vm))


class ThompsonCaliPolicy:
    """thompson-cali: EESD Cali-TS; needs a drafter with a trained calibration predictor."""

    needs_score = True  # the drafter supplies theta_M (the predictor's score) to accept()

    def __init__(self, max_k: int, seed: int = 0, sigma_m: float = 0.2, sigma_s: float = 0.5, theta0: float = 0.5):
        if max_k < 1:
            raise ValueError(f"thompson-cali: max_k must be >= 1, got {max_k}")
        for key, value in (("sigma_m", sigma_m), ("sigma_s", sigma_s)):
            if not value > 0:
                raise ValueError(f"thompson-cali: {key} must be > 0, got {value}")
        if not 0.0 <= theta0 <= 1.0:
            raise ValueError(f"thompson-cali: theta0 must be in [0, 1], got {theta0}")
        self.max_k, self.sigma_m, self.sigma_s, self.theta0 = max_k, sigma_m, sigma_s, theta0
        self.rng = random.Random(seed)
        self.n = 0  # verified rounds
        self.successes, self.trials = 0, 0
        self._score = theta0

    @property
    def theta_hat(self) -> float:
        return (self.theta0 + self.successes) / (1 + self.trials)

    def begin_round(self) -> int:
        return self.max_k

    def accept(self, depth: int, top_prob: float | None = None, entropy: float | None = None,
               score: float | None = None) -> bool:
        self._score = self.theta0 if score is None else score
        return True

    def keep_drafting(self, depth: int) -> bool:
        if depth >= self.max_k:
            return False
        mu, sd = posterior(self._score, self.theta_hat, self.n, self.sigma_m, self.sigma_s)
        theta = min(1.0, max(0.0, self.rng.gauss(mu, sd)))
        return self.rng.random() < theta

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.n += 1
        self.successes += accepted
        self.trials += accepted + (1 if accepted < drafted else 0)
