"""The engine port: everything a drafter may ask of vLLM's model runner, in one narrow object, so that drafters
(vllm_adaspec/proposers/) never see the runner. The runner hooks (engine/runner_hooks.py) fill its feedback during
a step; the drafter reads it once, at its next propose call.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_adaspec.engine.tree_sampler import tree_compatible
from vllm_adaspec.step import BatchView, Taps


class EnginePort:
    def __init__(self, runner, runtime=None, observers=()):
        self.runner = runner
        self.runtime = runtime  # engine/tree_runtime.TreeRuntime when trees can be verified, else None
        self.observers = list(observers)  # engine/observers.py (tests)
        self.taps = Taps()
        self.verified_rows: list[int] | None = None  # drafts each batch row took in the last verification

    # --- the batch ---
    def view(self, sampled: list, num_tokens: np.ndarray, token_ids: np.ndarray) -> BatchView:
        b = self.runner.input_batch
        return BatchView(b.req_ids, sampled, num_tokens, token_ids, b.num_prompt_tokens, b.temperature_cpu)

    def tree_compatible(self, req_ids: list[str]) -> list[bool]:
        """Per request: may it be verified as a tree (its sampling settings, engine/tree_sampler.py)."""
        states = self.runner.requests
        return [tree_compatible(getattr(states.get(r), "sampling_params", None)) for r in req_ids]

    def kv_positions(self) -> int:
        """Token positions the engine's KV cache holds."""
        cfg = self.runner.kv_cache_config
        return cfg.num_blocks * cfg.kv_cache_groups[0].kv_cache_spec.block_size

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def bind(self, target_prefix) -> None:
        """A drafter that runs the target's own layers (engine/drafting.TargetPrefix) reads the runner's KV-cache
        groups, block tables and attention builders, and marks its tree steps on the runtime."""
        target_prefix.bind(self.runner, self.runtime)

    # --- feedback, read once per propose call ---
    def feedback(self) -> tuple[dict, int, Taps, list[int] | None]:
        """(tree results {batch row: (accepted nodes, bonus, branch argmax)}, KV slots compaction moved, taps,
        drafts each batch row took in the last verification or None)."""
        results, moves = self.runtime.take_results() if self.runtime is not None else ({}, 0)
        taps, rows = self.taps, self.verified_rows
        self.taps, self.verified_rows = Taps(), None
        return results, moves, taps, rows

    # --- tree runtime ---
    def drop_trees(self, req_ids) -> None:
        if self.runtime is not None:
            self.runtime.drop(req_ids)

    def held_copy_tokens(self) -> int:
        return self.runtime.held_copy_tokens() if self.runtime is not None else 0

    # --- tensor parallelism ---
    @staticmethod
    def from_rank0(value):
        from vllm.distributed import get_tp_group

        return get_tp_group().broadcast_object(value, src=0)

    # --- test instrumentation ---
    def observer_stats(self) -> dict:
        out = {}
        for obs in self.observers:
            out.update(obs.stats())
        return out

    def observer_live(self) -> dict:
        return {k: v for k, v in self.observer_stats().items() if k.endswith("_records")}
