"""How much slower the drafter's per-step Python runs right after a CPU forward than on a warm CPU.

In the CPU engine every forward streams the model's weights (SmolLM2-135M float32: ~540 MB) through the caches,
so the drafter's next propose call starts cache-cold; `profile_step.py` measures it there. A GPU engine's forward
leaves the host's caches alone. This times the same slice of drafting work (the step's price list, one trie merge
of four pools' candidates, ranking its nodes) warm, back to back, and right after streaming `--evict-mb` through the
caches, and prints both medians and their ratio: the factor by which the CPU measurement overstates that work on a
GPU host. No vLLM, no model.

    .venv/bin/python benchmarks/host_cache_cold.py
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from vllm_adaspec.policies.cost_model import VERIFY_COST, DraftCost, StepCostModel
from vllm_adaspec.pools import Candidates
from vllm_adaspec.trees.trie import Calibration, merge, ranked


def candidate_sets(rng: random.Random, n: int, pools: int = 4, nodes: int = 12) -> list[list[Candidates]]:
    """n steps' worth of random candidate trees, `pools` per step, `nodes` each (parents before children)."""
    out = []
    for _ in range(n):
        step = []
        for p in range(pools):
            c = Candidates(pool=f"pool{p}")
            for j in range(nodes):
                c.add(rng.randint(-1, j - 1) if j else -1, rng.randint(0, 50), rng.random(), rng.randint(0, 4))
            step.append(c)
        out.append(step)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--evict-mb", type=int, default=600, help="MB streamed before each cold call (a forward's weights)")
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    costs, draft = StepCostModel(VERIFY_COST), DraftCost()
    for i in range(200):
        costs.observe(1, 3 + i % 5, 0.020 + 0.001 * (i % 5))
        draft.observe(1, 0, 0.001)
    sets = candidate_sets(random.Random(0), 50)
    calibration = Calibration()

    def work(k: int) -> float:  # the price list, a merge, a ranking: the shape of a batch-1 step's drafting
        curve = costs.curve(1, draft.predict(1, 0))
        trie = merge(sets[k % len(sets)], calibration, (1,))
        return curve(5) + costs.attention_seconds(1) + len(ranked(trie))

    buffer = np.ones(args.evict_mb * 2**20 // 8)
    warm, cold = [], []
    for k in range(args.steps):
        t0 = time.perf_counter()
        work(k)
        warm.append(time.perf_counter() - t0)
    for k in range(args.steps):
        buffer += 1.0  # what a CPU forward does to the caches
        t0 = time.perf_counter()
        work(k)
        cold.append(time.perf_counter() - t0)
    w, c = float(np.median(warm)) * 1e6, float(np.median(cold)) * 1e6
    print(f"warm {w:.0f} us, after streaming {args.evict_mb} MB {c:.0f} us: {c / w:.1f}x")


if __name__ == "__main__":
    main()
