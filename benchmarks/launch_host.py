"""The host's share of one layer's tree-attention launch on the ready path: what every layer of a GPU tree step
spends in Python before Triton's launcher, measured on any machine.

A GPU engine's step launches the tree kernel once per attention layer; after the step's first layer each launch
takes the compiled kernels the plan holds (`kernels/tree_attention.launch`, `_launch_ready`). Here the compiled
kernels are the suite's stand-ins (tests/test_kernel_tree_attention.py: they record the call and return), so the
time is ours alone: GPUTreeRuntime._launch (the layer's K, V views, the fault guard), the layer key, the pointers.
Llama-3-8B's heads (32 / 8 / 128), 32 layers, a 2-split fused plan.

    .venv/bin/python benchmarks/launch_host.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    import vllm_adaspec.kernels.tree_attention as ta
    from test_kernel_tree_attention import _Jit, make_case
    from vllm_adaspec.runtime.gpu import GPUTreeRuntime

    class Discard(list):
        def append(self, x):
            pass

    for name in ("_tree_attention_split_kernel", "_tree_attention_reduce_kernel"):
        stand_in = _Jit(getattr(ta, name))
        stand_in.calls = Discard()
        setattr(ta, name, stand_in)
    hq, hkv, d, bs = 32, 8, 128, 16
    q, k, _, table, plen, cu, mask = make_case([40, 75], [3, 5], hq, hkv, d, bs, torch.float32)
    bits = ta.ancestor_bits(mask)
    plan = ta.plan_launch(plen, cu, bits, torch.arange(q.shape[0], dtype=torch.int32),
                          torch.arange(2, dtype=torch.int32), hq, hkv, d, max_rows=6, longest=81, splits=2,
                          block_n=16, fused=True)
    runtime = GPUTreeRuntime("cpu")
    layers = [(torch.randn_like(q), torch.randn(k.shape[0], hkv, bs, 2 * d), torch.empty_like(q)) for _ in range(32)]
    for _ in range(3):
        t0, n = time.perf_counter(), 0
        for _ in range(200):
            for qi, kv, out in layers:  # [num_blocks, Hkv, block_size, 2 D]: vLLM's CUDA layout
                runtime._launch(plan, qi, kv, table, 0.25, out)
                n += 1
        print(f"host per layer launch (ready path, stand-in kernels): {(time.perf_counter() - t0) / n * 1e6:.2f} us")


if __name__ == "__main__":
    main()
