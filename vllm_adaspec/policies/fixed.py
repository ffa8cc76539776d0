"""Fixed draft length K: the baseline every adaptive policy is compared with."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FixedPolicy:
    k: int
    seed: int = 0

    def __post_init__(self):
        if self.k < 1:
            raise ValueError(f"FixedPolicy needs k >= 1, got {self.k}")

    def begin_round(self) -> int:
        return self.k

    def accept(self, depth: int, top_prob: float | None = None, entropy: float | None = None,
               score: float | None = None) -> bool:
        return True

    def keep_drafting(self, depth: int) -> bool:
        return depth < self.k

    def observe(self, drafted: int, accepted: int) -> None:
        pass
