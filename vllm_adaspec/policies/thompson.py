"""EESD's Thompson-sampling draft-length control with a Beta posterior (EESD Alg. 1 / Alg. 2, Eq. 3-4).

After each draft the request flips a coin chi ~ Bernoulli(theta) with theta drawn from Beta(alpha, beta): heads,
draft another token; tails, stop. Verification updates the posterior. Counting: every draft the target checked is
one Bernoulli trial (accepted = success; the first rejected one = failure; drafts after it were never judged).
EESD's Eq. 3-4 write the trial count as min(|Q_v| + 1, |Q_d|) and successes as |Q_v| - 1, which is this count
up to how |Q_v| treats the target's own token; we count what the target actually judged.

Draws use the request's own seeded RNG: identical on every tensor-parallel rank and independent of the batch.
"""

from __future__ import annotations

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

    def accept(self, depth: int, top_prob: float | None = None, entropy: float | None = None) -> bool:
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
