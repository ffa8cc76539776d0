"""Host time of planning a GPU tree step (GPUTreeRuntime.begin_step: matching the scheduled drafts to the planned
trees, ancestor words, the padded trees of the batched verification, vLLM's chain indices, the staging copies),
on CPU tensors: what the host adds to every GPU tree step before the forward (the host side's budget: <= 10%
of a 7-9 ms Llama-3-8B step). The step's arrays are built by the compiled plan (trees/step_plan.py) and, alternating
with it on the same steps, by the Python it replaced (GPUTreeRuntime.prepare_reference).

    .venv/bin/python benchmarks/plan_cost.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vllm_adaspec.runtime.gpu import GPUTreeRuntime  # noqa: E402
from vllm_adaspec.step import DraftPlan  # noqa: E402


def plan(n: int, g) -> DraftPlan:
    parents = [-1] + [int(torch.randint(i + 1, (), generator=g)) - 1 for i in range(n - 1)]
    return DraftPlan(tuple(range(5, 5 + n)), tuple(parents), tree_path=True)


def main() -> int:
    from vllm_adaspec.trees import step_plan

    g = torch.Generator().manual_seed(0)
    rt = GPUTreeRuntime("cpu", plain=lambda r: "greedy" if r.startswith("g") else "sampled", max_rows=65)
    rt.heads, rt.block_q = (32, 8, 128), 4  # Llama-3-8B's heads
    step_plan.warm_up()  # as start-up does
    compiled = GPUTreeRuntime.prepare
    python = lambda self, step: None if step is None else self.prepare_reference(step)  # noqa: E731
    print("| trees x nodes | ms per planned step, compiled plan | Python plan | compiled / Python |\n|---|---|---|---|")
    for trees, nodes in ((1, 16), (8, 16), (8, 64), (64, 16)):
        req_ids = [("g" if i % 2 == 0 else "s") + str(i) for i in range(trees)]
        plans = {r: plan(nodes, g) for r in req_ids}
        qs = np.concatenate([[0], np.cumsum([nodes + 1] * trees)])
        t = int(qs[-1])
        spec = {r: list(p.tokens) for r, p in plans.items()}
        pos, lens = torch.zeros(t, dtype=torch.long), torch.zeros(trees, dtype=torch.int32)
        runs = {"compiled": [], "python": []}
        for k in range(14):  # 7 each, alternating
            name = ("compiled", "python")[k % 2]
            GPUTreeRuntime.prepare = compiled if name == "compiled" else python
            t0 = time.perf_counter()
            for _ in range(50):
                rt.begin_step(req_ids, qs, np.full(trees, 8000), pos, spec, plans, t, lens, set(), set())
                rt.take_step()
            runs[name].append((time.perf_counter() - t0) / 50 * 1e3)
        GPUTreeRuntime.prepare = compiled
        a, b = sorted(runs["compiled"])[3], sorted(runs["python"])[3]
        print(f"| {trees} x {nodes} | {a:.3f} | {b:.3f} | {a / b:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
