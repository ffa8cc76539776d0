"""A per-step cap on the number of drafts, learned from measured throughput: never slower than not drafting.

Whether drafting pays depends on the machine, the batch size and how well the drafter agrees with the target:
on a CPU a batch of 8 verifies 8 (k + 1) tokens per step and may lose what a batch of 1 gains. So the guard
measures instead of modelling. For each batch-size bucket it keeps the observed tokens per second of caps
k in 0..K (0 = plain decoding) over pure decode steps and picks the best, exploring now and then so it follows
changes. Each interval it sees runs from one propose call to the next: the drafts of cap k plus the target step
that verified them.

Exploration is what a losing drafter costs, so it is kept small: caps are tried upwards from 0 and the climb
stops at the first cap that is not faster than the one below it (throughput against k rises while drafts are
accepted often enough, then falls). Where drafting loses, a bucket costs `min_trials` steps at cap 1.

Pure Python (no vLLM, no torch): the drafter owns one guard and feeds it.
"""

from __future__ import annotations

import random

__all__ = ["SpeedGuard"]


class SpeedGuard:
    def __init__(self, max_k: int, seed: int = 0, explore: float = 0.03, min_trials: int = 3,
                 smoothing: float = 0.8):
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        self.max_k = max_k
        self.rng = random.Random(seed)
        self.explore = explore
        self.min_trials = min_trials
        self.smoothing = smoothing
        self.rate: dict[tuple[int, int], float] = {}  # (bucket, k) -> EMA of tokens / second
        self.trials: dict[tuple[int, int], int] = {}
        self.exploiting = False  # the last choice was the believed-best cap (not a trial or an exploration)

    @staticmethod
    def bucket(batch: int) -> int:
        """1 -> 1, 2-3 -> 2, 4-7 -> 3, 8-15 -> 4, ...: steps with similar batch sizes share estimates."""
        return max(1, batch).bit_length()

    def _climb(self, b: int) -> tuple[int | None, list[int]]:
        """(cap still being tried or None, caps whose trials are done)."""
        tried = []
        for k in range(self.max_k + 1):
            if self.trials.get((b, k), 0) < self.min_trials:
                return k, tried
            tried.append(k)
            if k > 0 and self.rate[(b, k)] <= self.rate[(b, k - 1)]:
                break
        return None, tried

    def choose(self, batch: int) -> int:
        """The cap on drafts per request for the next step of a batch of `batch` decoding requests."""
        b = self.bucket(batch)
        trying, tried = self._climb(b)
        self.exploiting = False
        if trying is not None:
            return trying
        if self.rng.random() < self.explore:
            return self.rng.choice(tried)
        self.exploiting = True
        return max(tried, key=lambda k: self.rate[(b, k)])

    def observe(self, batch: int, k: int, tokens: int, seconds: float) -> None:
        """One interval: cap k for `batch` requests committed `tokens` tokens in `seconds`."""
        if seconds <= 0 or tokens <= 0:
            return
        key = (self.bucket(batch), k)
        r = tokens / seconds
        old = self.rate.get(key)
        self.rate[key] = r if old is None else self.smoothing * old + (1 - self.smoothing) * r
        self.trials[key] = self.trials.get(key, 0) + 1

    def best(self, batch: int) -> int | None:
        """The cap currently believed best for this batch size (None while caps are still being tried)."""
        b = self.bucket(batch)
        trying, tried = self._climb(b)
        return None if trying is not None else max(tried, key=lambda k: self.rate[(b, k)])

    def table(self) -> dict[str, list]:
        """{"batch size/cap": [trials, tokens per second]} for every (bucket, cap) observed: what the guard knows."""
        return {f"{1 << (b - 1)}/{k}": [self.trials[(b, k)], round(self.rate[(b, k)], 1)]
                for b, k in sorted(self.trials)}

    def settled(self) -> dict[int, int]:
        """{smallest batch size of a bucket: its best cap} for every bucket whose caps have all been tried."""
        out = {}
        for b in sorted({b for b, _ in self.trials}):
            trying, tried = self._climb(b)
            if trying is None:
                out[1 << (b - 1)] = max(tried, key=lambda k: self.rate[(b, k)])
        return out
