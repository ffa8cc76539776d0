"""Where the tree-attention kernel's time goes on a GPU, and which launch options cut it: one run a session lent a
device can afford (about 3 minutes on an H100).

Per shape (a subset of bench_tree_attention.py's: the ones furthest from the kernel's targets):
- the kernel as bench_tree_attention.py times it (eager launches back to back: Python's launch cost included where
  it exceeds the GPU's), its host cost per launch (launches queued without a wait), and its GPU time alone (ten
  launches captured in one CUDA graph, replayed), beside the FlashAttention anchor captured the same way;
- the GPU time of every launch option (BLOCK_N x num_warps x num_stages x whole prefix tiles without masks x pages
  loaded a tile ahead; at one of them also half and twice the planned splits, and the splits that fill the SMs once),
  each checked against the default's output first; the best one per shape and over all shapes (geometric mean).

    python benchmarks/kernel_sweep.py --out benchmarks/out/kernel_sweep.json
    python benchmarks/kernel_sweep.py --cpu      # the wiring on CPU tensors, one tiny shape, Triton interpreted
    python benchmarks/kernel_sweep.py --launch   # only the launch's host cost, Triton's dispatch every launch
                                                 # against the plan's compiled kernels (FAST_LAUNCH), outputs equal
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkout import use_checkout  # noqa: E402

use_checkout()

SHAPES = [  # (heads, batch, prefix, nodes)
    ((32, 8, 128), 1, 8192, 16), ((32, 8, 128), 1, 32768, 16), ((32, 8, 128), 8, 2048, 16),
    ((32, 8, 128), 8, 8192, 16), ((32, 8, 128), 8, 8192, 64), ((32, 8, 128), 64, 2048, 16),
    ((9, 3, 64), 8, 8192, 16), ((9, 3, 64), 1, 2048, 16)]
# BLOCK_N, num_warps, num_stages, whole prefix tiles without masks (`even`), pages loaded a tile ahead (`prefetch`): the
# defaults' neighbours (BLOCK_N 64, 3 stages, even, prefetch; warps by tile) and the earlier loop (pages in the tile's
# own iteration). An H100's first run (benchmarks/device_runs/2026-11-27-h100-a): pages in the tile's own iteration,
# stages 2-4, no `even` (2 stages best). A second H100's first sweep: without prefetch 2 stages, with it 2-4 stages x
# BLOCK_N 64 / 128 x 4 / 8 warps, and `even` at 3 stages
# (benchmarks/device_runs/2026-11-27-h100-b/run2/kernel_sweep.txt): prefetch at 3 stages 0.85x the old loop's time.
# Last: fused, the split programs' own reduction (no second launch: eager time too, where the host may be what counts)
OPTIONS = [(64, 8, 3, True, True, False), (64, 4, 3, True, True, False), (64, 8, 4, True, True, False),
           (128, 8, 3, True, True, False), (64, 8, 3, False, True, False), (64, 8, 2, False, False, False),
           (64, 4, 2, False, False, False),
           # the split programs combining their partials themselves (the default at 2 .. FUSED_MAX_SPLITS chunks since
           # an H100 sweep, benchmarks/device_runs/2026-11-27-h100-c; the plain options above are the split kernel and
           # the reduce launch)
           (64, 8, 3, True, True, True), (64, 4, 3, True, True, True)]


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="CPU tensors, one tiny shape, Triton's interpreter")
    p.add_argument("--deadline", type=float, default=200.0, help="seconds; the sweep stops starting shapes after it")
    p.add_argument("--launch", action="store_true", help="only the launch's host cost, with and without FAST_LAUNCH")
    p.add_argument("--shapes", nargs="+", metavar="HQ,HKV,D:BATCH:PREFIX:NODES",
                   help="these shapes instead of the default eight (e.g. 32,8,128:8:32768:4)")
    p.add_argument("--half-tiles", action="store_true",
                   help="only the planned launch and half tiles (where the plan's are 128 rows x heads)")
    p.add_argument("--out", default="benchmarks/out/kernel_sweep.json")
    return p.parse_args(argv)


def parse_shape(text: str):
    """'32,8,128:8:32768:4' -> ((32, 8, 128), 8, 32768, 4)."""
    heads, b, prefix, nodes = text.split(":")
    return tuple(int(x) for x in heads.split(",")), int(b), int(prefix), int(nodes)


ARGS = parse(sys.argv[1:] if __name__ == "__main__" else [])
if ARGS.cpu:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from bench_tree_attention import graphed_time, make_case, plan_inputs  # noqa: E402
from vllm_adaspec.kernels import tree_attention as ta  # noqa: E402
from vllm_adaspec.kernels.tree_attention import launch, plan_launch  # noqa: E402

DEVICE = "cpu" if ARGS.cpu else "cuda"


def gpu_time(fn, reps: int = 10) -> float:
    """Milliseconds of one fn() on the GPU alone: `reps` calls captured in one CUDA graph, replayed (Python's launch
    cost out). On CPU: wall time of one call."""
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return graphed_time(fn, reps)


def eager_time(fn) -> float:
    if DEVICE != "cuda":
        return gpu_time(fn)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def host_time(fn, n: int = 200) -> float:
    """Milliseconds of Python per call, calls queued without a wait (the GPU may fall behind: it is not waited on).
    On CPU (the suite's run under the interpreter, where each call runs the whole kernel): 2 calls."""
    n = n if DEVICE == "cuda" else 2
    fn()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e3
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return host


def sweep_shape(heads, b, prefix, nodes, dtype, deadline: float) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq, hkv, d = heads
    rows = nodes + 1
    case = make_case(b, prefix, nodes, *heads, dtype, device=DEVICE)
    q, k_cache, v_cache, table = case[:4]
    scale = d ** -0.5
    plan_args, kw = plan_inputs(case, b, prefix, nodes, *heads)
    plan = plan_launch(*plan_args, **kw)
    want = torch.empty_like(q)
    launch(plan, q, k_cache, v_cache, table, scale, want)
    row = {"heads": list(heads), "batch": b, "prefix": prefix, "nodes": nodes, "splits": plan.splits,
           "block_q": plan.block_q,
           "eager_ms": eager_time(lambda: launch(plan, q, k_cache, v_cache, table, scale, want)),
           "host_ms": host_time(lambda: launch(plan, q, k_cache, v_cache, table, scale, want)),
           "gpu_ms": gpu_time(lambda: launch(plan, q, k_cache, v_cache, table, scale, want))}
    if DEVICE == "cuda":
        group = hq // hkv
        aq = torch.randn(b, hkv, rows * group, d, device=DEVICE, dtype=dtype)
        ak = torch.randn(b, hkv, prefix + rows, d, device=DEVICE, dtype=dtype)
        av = torch.randn_like(ak)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            row["anchor_gpu_ms"] = gpu_time(lambda: torch.nn.functional.scaled_dot_product_attention(aq, ak, av,
                                                                                                    scale=scale))
            row["anchor_eager_ms"] = eager_time(lambda: torch.nn.functional.scaled_dot_product_attention(
                aq, ak, av, scale=scale))
    options = {}
    # the planned splits, half and twice them, and as many as fill the SMs once (no second wave on a few SMs)
    base = b * hkv * plan.q_blocks
    once = max(1, min(64, ta.device_programs(q.device) // base))
    # (and 2-4 programs a slot: tiles of up to 64 rows x heads leave room on an SM for more than one program)
    splits_around = sorted({max(1, plan.splits // 2), plan.splits, min(64, plan.splits * 2), once,
                            min(64, 2 * once), min(64, 4 * once)})
    row["splits_once"] = once
    for block_n, warps, stages, even, prefetch, fused in ([] if ARGS.half_tiles else OPTIONS):
        around = (block_n, stages, even, prefetch) == (64, 3, True, True)  # (other splits at one loop shape)
        for splits in (splits_around if around else (plan.splits,)):
            if time.perf_counter() > deadline:
                break
            key = f"n{block_n} w{warps} s{stages} e{int(even)} p{int(prefetch)}{' f1' if fused else ''} x{splits}"
            try:
                p = plan_launch(*plan_args, **kw, block_n=block_n, splits=splits, num_warps=warps, num_stages=stages,
                                even=even, prefetch=prefetch, fused=fused)
                out = torch.empty_like(q)
                launch(p, q, k_cache, v_cache, table, scale, out)
                err = float((out.float() - want.float()).abs().max())
                if not err <= 2e-2:
                    options[key] = {"error": f"off by {err:.3g}"}
                    continue
                options[key] = {"gpu_ms": gpu_time(lambda: launch(p, q, k_cache, v_cache, table, scale, out))}
                if fused:  # one launch a layer instead of two: what the host saves shows in eager time
                    options[key]["eager_ms"] = eager_time(lambda: launch(p, q, k_cache, v_cache, table, scale, out))
            except Exception as e:  # e.g. out of shared memory: this option does not exist for the shape
                options[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
    # half the tile (64 rows x heads where the plan's is 128): more programs of fewer registers and less shared
    # memory each, so several share an SM (an H200, benchmarks/device_runs/2026-11-27-h200: the 128 x 128 tile's 236
    # registers a thread at 8 warps and 131 KB leave one program an SM; 4 warps spill). Each key tile is then read by
    # twice the programs.
    m = ta.tile_m(plan.block_q, hq // hkv)
    if m >= ta.MAX_TILE_M and plan.block_q > 1:
        half = plan.block_q // 2
        for block_n, warps, stages in ((64, 4, 3), (64, 8, 3), (32, 4, 3), (64, 4, 2)):
            if time.perf_counter() > deadline:
                break
            key = f"q{half} n{block_n} w{warps} s{stages} e1 p1"
            try:
                p = plan_launch(*plan_args, **{**kw, "block_q": half}, block_n=block_n, num_warps=warps,
                                num_stages=stages)
                key += f" x{p.splits}{' f1' if p.done is not None else ''}"
                out = torch.empty_like(q)
                launch(p, q, k_cache, v_cache, table, scale, out)
                err = float((out.float() - want.float()).abs().max())
                options[key] = ({"gpu_ms": gpu_time(lambda: launch(p, q, k_cache, v_cache, table, scale, out))}
                                if err <= 2e-2 else {"error": f"off by {err:.3g}"})
            except Exception as e:
                options[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
    row["options"] = options
    timed = {k: v["gpu_ms"] for k, v in options.items() if "gpu_ms" in v}
    if timed:
        best = min(timed, key=timed.get)
        row["best"], row["best_gpu_ms"] = best, timed[best]
    return row


def launch_cost(heads, b, prefix, nodes, dtype) -> dict:
    """Host milliseconds per launch (one layer: the split kernel and, with splits, the reduction) through Triton's
    dispatch every time and through the plan's compiled kernels, eager and graphed GPU times, and whether the
    two give the same output bit for bit."""
    d = heads[2]
    case = make_case(b, prefix, nodes, *heads, dtype, device=DEVICE)
    q, k_cache, v_cache, table = case[:4]
    plan_args, kw = plan_inputs(case, b, prefix, nodes, *heads)
    row = {"heads": list(heads), "batch": b, "prefix": prefix, "nodes": nodes}
    outs = {}
    for fast in (False, True):
        ta.FAST_LAUNCH = fast
        plan = plan_launch(*plan_args, **kw)
        out = torch.zeros_like(q)
        fn = lambda: launch(plan, q, k_cache, v_cache, table, d ** -0.5, out)  # noqa: E731
        name = "compiled" if fast else "dispatch"
        row[f"{name}_host_ms"] = host_time(fn)
        row[f"{name}_eager_ms"] = eager_time(fn)
        row["splits"], row["kept"] = plan.splits, len(plan.compiled)
        outs[fast] = out.clone()
    row["gpu_ms"] = gpu_time(fn)
    row["equal"] = bool(torch.equal(outs[False], outs[True]))
    return row


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --cpu)")
        return 2
    start = time.perf_counter()
    deadline = start + ARGS.deadline
    dtype = torch.float32 if ARGS.cpu else torch.bfloat16
    shapes = ([parse_shape(t) for t in ARGS.shapes] if ARGS.shapes
              else [((4, 2, 16), 2, 70, 4)] if ARGS.cpu else SHAPES)
    if ARGS.cpu:
        global OPTIONS
        OPTIONS = [(16, 4, 2, False, False, False), (64, 4, 3, True, True, False),  # (more splits: 2nd)
                   (32, 4, 2, False, True, False), (16, 4, 3, True, True, True)]
    if ARGS.launch:
        rows = [launch_cost(heads, b, prefix, nodes, dtype) for heads, b, prefix, nodes in shapes]
        for r in rows:
            print(f"launch heads {r['heads']} batch {r['batch']:2d} prefix {r['prefix']:5d} nodes {r['nodes']:2d} "
                  f"({r['splits']} splits): host per launch {r['dispatch_host_ms'] * 1e3:6.1f} us dispatched, "
                  f"{r['compiled_host_ms'] * 1e3:6.1f} us compiled ({r['kept']} kept); eager "
                  f"{r['dispatch_eager_ms'] * 1e3:6.1f} / {r['compiled_eager_ms'] * 1e3:6.1f} us, GPU alone "
                  f"{r['gpu_ms'] * 1e3:6.1f} us; outputs {'equal' if r['equal'] else 'DIFFER'}", flush=True)
        ok = all(r["equal"] for r in rows) and (ARGS.cpu or all(r["kept"] for r in rows))
        print(f"launch check: {'PASS' if ok else 'FAIL'}", flush=True)
        Path(ARGS.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ARGS.out).write_text(json.dumps({"rows": rows}, indent=1))
        return 0 if ok else 1
    rows = []
    for heads, b, prefix, nodes in shapes:
        if time.perf_counter() > deadline:
            print(f"deadline: {heads} batch {b} prefix {prefix} nodes {nodes} not run", flush=True)
            continue
        r = sweep_shape(heads, b, prefix, nodes, dtype, deadline)
        rows.append(r)
        anchor = r.get("anchor_gpu_ms")
        print(f"heads {r['heads']} batch {b:2d} prefix {prefix:5d} nodes {nodes:2d} ({r['splits']} splits): eager "
              f"{r['eager_ms'] * 1e3:7.1f} us, host {r['host_ms'] * 1e3:6.1f} us/launch, GPU {r['gpu_ms'] * 1e3:7.1f} us"
              + (f"; anchor GPU {anchor * 1e3:6.1f} us (eager {r['anchor_eager_ms'] * 1e3:6.1f}): kernel GPU / anchor "
                 f"{r['gpu_ms'] / anchor:.2f}x" if anchor else "")
              + (f"; best {r['best']} {r['best_gpu_ms'] * 1e3:7.1f} us"
                 + (f" ({r['best_gpu_ms'] / anchor:.2f}x anchor)" if anchor else "") if "best" in r else ""),
              flush=True)
        fails = {k: v["error"] for k, v in r["options"].items() if "error" in v}
        if fails:
            print(f"  {len(fails)} options failed, e.g. {next(iter(fails.items()))}", flush=True)
    # one option for every shape: the geometric mean of GPU time over the default's, where every shape has it
    common = None
    for r in rows:
        keys = {k.rsplit(' x', 1)[0] + (" x=" if int(k.rsplit('x', 1)[1]) == r["splits"] else " x?")
                for k, v in r["options"].items() if "gpu_ms" in v}
        common = keys if common is None else common & keys
    ranked = []
    for opt in sorted(o for o in (common or ()) if o.endswith(" x=")):
        base = opt[:-3]
        ratios = [r["options"][f"{base} x{r['splits']}"]["gpu_ms"] / r["gpu_ms"] for r in rows]
        ranked.append((math.exp(statistics.fmean(math.log(x) for x in ratios)), base, ratios))
    ranked.sort()
    for gm, base, ratios in ranked[:6]:
        print(f"option {base} (planned splits) over the default, every shape: geo mean {gm:.3f} "
              f"({', '.join(f'{x:.2f}' for x in ratios)})", flush=True)
    for warps in (4, 8):  # the splits that fill the SMs once against the planned ones, at one loop shape
        ratios = []
        for r in rows:
            at = {x: r["options"].get(f"n64 w{warps} s3 e1 p1 x{x}", {}).get("gpu_ms")
                  for x in (r["splits_once"], r["splits"])}
            if None not in at.values():
                ratios.append(at[r["splits_once"]] / at[r["splits"]])
        if ratios:
            print(f"splits filling the SMs once over the planned (n64 w{warps} s3 e1 p1), every shape: "
                  + ", ".join(f"{x:.2f}" for x in ratios), flush=True)
    for r in rows:  # the fused reduction (one launch a layer) against the default (two where the keys are split)
        for warps in (4, 8):
            f = r["options"].get(f"n64 w{warps} s3 e1 p1 f1 x{r['splits']}", {})
            if "gpu_ms" in f and r["splits"] > 1:
                print(f"fused, {warps} warps, heads {r['heads']} batch {r['batch']} prefix {r['prefix']} nodes "
                      f"{r['nodes']}: GPU {f['gpu_ms'] / r['gpu_ms']:.2f}x, eager {f['eager_ms'] / r['eager_ms']:.2f}x "
                      "the default's", flush=True)
    out = Path(ARGS.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "rows": rows,
                               "ranked": ranked, "seconds": time.perf_counter() - start}, indent=1))
    print(f"kernel sweep: {len(rows)} shapes in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
