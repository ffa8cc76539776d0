"""ProbeProposer: measures what verifying r rows costs this engine (benchmarks/verify_cost.py), drafting nothing
useful.

Each step it proposes, for every decoding request, a fixed shape of `size` nodes whose tokens the target will not
pick (the highest ids of the vocabulary), cycling `size` through 0..K, and records the wall time from one propose
call to the next against the size it proposed: one verification forward of (1 + size) rows per request, its
sampling and the glue. `VLLM_ADASPEC_PROBE_SHAPE`: "chain" (default) or "tree" (a root with two children, each
node two children, breadth-first: what tree verification costs over the same rows); `VLLM_ADASPEC_PROBE_SIZE`:
one size every step (for profiles). Statistics:
stats["probe_seconds"][size] = [interval, ...]. Never use it to generate text: it only slows decoding down.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from vllm_adaspec.proposers.drafter import Drafter, Stats
from vllm_adaspec.step import DraftPlan, Needs


def binary_tree_parents(n: int) -> list[int]:
    """Breadth-first parents of an n-node tree where the root and every node have two children."""
    return [-1 if i < 2 else (i - 2) // 2 for i in range(n)]


@dataclass
class ProbeStats(Stats):
    probe_seconds: dict = field(default_factory=dict)  # size -> [step seconds, ...]


class ProbeDrafter(Drafter):
    stats_cls = ProbeStats

    def __init__(self, vllm_config, settings, driver):
        super().__init__(vllm_config, settings, driver)
        self.shape = os.environ.get("VLLM_ADASPEC_PROBE_SHAPE", "chain")
        if self.shape not in ("chain", "tree"):
            raise ValueError(f"VLLM_ADASPEC_PROBE_SHAPE must be 'chain' or 'tree', got {self.shape!r}")
        self.tree_mode = self.shape == "tree" and self.cfg.tree_unsupported is None
        self.needs = Needs(trees=self.tree_mode)
        self.vocab = vllm_config.model_config.hf_text_config.vocab_size
        fixed = os.environ.get("VLLM_ADASPEC_PROBE_SIZE")  # one size every step instead of the cycle (profiling)
        self.fixed = int(fixed) if fixed else None
        self._step = 0
        self._last = None  # (time, size) of the previous propose call

    def load_model(self, target_model) -> None:
        pass

    def finish(self, req_ids) -> None:
        self._last = None  # the run ends: a next run's first interval would time the idle gap between them

    def draft(self, view, rows, budgets, policies, plans) -> float:
        now = time.perf_counter()
        if self._last is not None:
            self.stats.probe_seconds.setdefault(str(self._last[1]), []).append(now - self._last[0])
        size = self._step % (self.cfg.num_speculative_tokens + 1) if self.fixed is None else self.fixed
        self._step += 1
        self._last = (now, size) if rows and len(rows) == view.decoding() else None
        parents = (binary_tree_parents(size) if self.shape == "tree" else list(range(-1, size - 1)))
        tokens = tuple(self.vocab - 1 - j for j in range(size))
        if self.tree_mode:
            self.driver.tree_holders = {view.req_ids[i] for i in rows}  # keep their KV copies through the chain-sized steps
        for i in rows:
            if size:
                plans[i] = DraftPlan(tokens, tuple(parents) if self.tree_mode and size > 1 else None)
        return 0.0
