"""The CPU tree path's attention per layer (TreeRuntime.verify_attention: each tree request's rows over its prefix
copy and its own rows), timed on synthetic steps at SmolLM2-135M's heads (9 query / 3 kv heads of 64), steady
state (the copies already hold the prefix, as after a tree step), against the same function of another git ref.
The two alternate, repeat by repeat, in one process; the median of the repeats is reported. Run alone.

    .venv/bin/python benchmarks/cpu_tree_attention.py --against HEAD~1
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_adaspec.runtime import cpu as tree_runtime  # noqa: E402
from vllm_adaspec.trees import DraftTree  # noqa: E402

HQ, HKV, D, BLOCK = 9, 3, 64, 128
# a tree's parents (breadth-first), cut to its first n nodes
PARENTS = [-1, -1, 0, 0, 1, 2, 4, 4, 5, 3, 9, 9, 10, 6, 13, 7]
SHAPES = [(1, 150, 10), (1, 300, 8), (1, 400, 16), (1, 600, 10), (1, 600, 16), (1, 1500, 16), (8, 300, 8),
          (8, 600, 16)]


def runtime_module(ref: str):
    """The CPU tree runtime as it is at git `ref` (runtime/cpu.py, or engine/tree_runtime.py before the runtime had
    a package of its own), loaded as a module of its own."""
    for rel in ("vllm_adaspec/runtime/cpu.py", "vllm_adaspec/engine/tree_runtime.py"):
        got = subprocess.run(["git", "show", f"{ref}:{rel}"], cwd=ROOT, capture_output=True, text=True)
        if got.returncode == 0:
            break
    src = got.stdout
    path = Path(tempfile.mkdtemp()) / "tree_runtime_ref.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("tree_runtime_ref", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def layer_us(mod, batch: int, prefix: int, nodes: int, iters: int, g: torch.Generator) -> float:
    """Microseconds of one layer's verify_attention for `batch` tree requests of `nodes` nodes over `prefix`."""
    tree = DraftTree(torch.arange(nodes), torch.tensor(PARENTS[:nodes]))
    per = (prefix + nodes + 1) // BLOCK + 2
    cache = torch.randn(batch * per, HKV, BLOCK, 2 * D, generator=g)
    table = torch.arange(batch * per).view(batch, per)
    n1 = nodes + 1
    from vllm import _custom_ops as ops

    from vllm_adaspec.runtime import base

    request = getattr(mod, "TreeRequest", base.TreeRequest)  # (runtime/cpu.py imports it from runtime/base.py)
    reqs = [request(b, f"r{b}", b * n1, prefix, tree) for b in range(batch)]
    step = mod.TreeStep(batch * n1, reqs)
    q = torch.randn(batch * n1, HQ, D, generator=g)
    k, v = torch.randn(batch * n1, HKV, D, generator=g), torch.randn(batch * n1, HKV, D, generator=g)
    out = torch.zeros(batch * n1, HQ, D)
    # the CPU runtime, handed vLLM's cache-write op (before the runtime package: a TreeRuntime that imported it)
    rt = (mod.CPUTreeRuntime(cache_write=ops.cpu_attn_reshape_and_cache) if hasattr(mod, "CPUTreeRuntime")
          else mod.TreeRuntime())
    rt.verify_attention(step, q, k, v, out, cache, table, "vec", D ** -0.5)  # the copies and masks made
    t0 = time.perf_counter()
    for _ in range(iters):
        rt.verify_attention(step, q, k, v, out, cache, table, "vec", D ** -0.5)
    return (time.perf_counter() - t0) / iters * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", default="HEAD~1", help="git ref whose verify_attention is the baseline")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=100, help="layers timed per repeat (a tenth of it at batch 8)")
    args = p.parse_args()
    ref = runtime_module(args.against)
    g = torch.Generator().manual_seed(0)
    print(f"| tree requests, prefix, nodes | {args.against} us a layer | this tree | ratio |")
    print("|---|---|---|---|")
    for batch, prefix, nodes in SHAPES:
        iters = max(1, args.iters // (10 if batch > 1 else 1))
        times = {"ref": [], "now": []}
        for rep in range(args.repeats):
            for name, mod in (("ref", ref), ("now", tree_runtime))[::1 if rep % 2 == 0 else -1]:
                times[name].append(layer_us(mod, batch, prefix, nodes, iters, g))
        a, b = statistics.median(times["ref"]), statistics.median(times["now"])
        print(f"| {batch}, {prefix}, {nodes} | {a:.0f} | {b:.0f} | {b / a:.2f} |", flush=True)


if __name__ == "__main__":
    main()
