"""GPU timing of the tree-mask attention kernel against FlashAttention over the same rows, and verification cost
curves of whole decoder forwards captured in CUDA graphs.

    python benchmarks/bench_tree_attention.py --cost-curve --out benchmarks/out/tree_attention.json
    python benchmarks/bench_tree_attention.py --summary benchmarks/device_runs/2026-11-27-h100-c/run3/tree_attention.json

Per shape (heads, batch, prefix length, tree nodes): the kernel as each attention layer of an engine pays it
(`launch` with the step's plan and the engine's tile for trees of that size; the plan's host cost apart), against

- the anchor: torch's FlashAttention-2 backend (`sdpa_kernel(SDPBackend.FLASH_ATTENTION)`), no mask, the query
  heads of each kv head folded into the rows: q [B, Hkv, rows x group, D] over contiguous K / V [B, Hkv, P + rows,
  D]: what a dense kernel pays for the same keys and rows;
- one read of every request's K and V (prefix + tree) at the device's measured copy bandwidth.

It prints kernel / anchor and kernel / one KV read per shape (the targets: <= 1.2x the anchor at nodes <= 16,
<= 1.5x at 64; <= 1.5x one KV read for prefix >= 8192 at nodes <= 16). Outputs are checked against the float32
reference first where the case is small. `--cost-curve`: milliseconds of one decoder forward (random weights, bf16,
plain torch, captured in one CUDA graph: what a graphed engine pays, not Python's launches) over `rows` new tokens
per request on a 1024-token context, for SmolLM2-135M, Qwen2.5-1.5B and Llama-3-8B shapes at batch 1, 8, 32: the
GPU prior of the step cost model (policies/cost_model.py). Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkout import use_checkout  # noqa: E402

if "--cpu" in sys.argv[1:]:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton decorates the kernels

use_checkout()  # the device runs a bare copy of the checkout
from vllm_adaspec.kernels.tree_attention import (ancestor_bits, launch, plan_launch, tile_rows,  # noqa: E402
                                                 tree_attention_reference)
from vllm_adaspec.kernels import tree_cascade  # noqa: E402
from vllm_adaspec.trees import DraftTree, ancestor_mask  # noqa: E402

# name -> (layers, hidden, query heads, kv heads, head size, MLP, vocabulary)
MODELS = {"smollm2-135m": (30, 576, 9, 3, 64, 1536, 49152),
          "qwen2.5-1.5b": (28, 1536, 12, 2, 128, 8960, 151936),
          "llama-3-8b": (32, 4096, 32, 8, 128, 14336, 128256)}


def random_tree_mask(n: int, g: torch.Generator) -> torch.Tensor:
    """[n + 1, n + 1] ancestor-or-self mask of a random breadth-first tree of n nodes."""
    parents, prev, cur = [], [-1], []
    for i in range(n):
        if cur and torch.rand((), generator=g) < 0.4:
            prev, cur = cur, []
        parents.append(prev[int(torch.randint(len(prev), (), generator=g))])
        cur.append(i)
    return ancestor_mask(DraftTree(torch.zeros(n, dtype=torch.long), torch.tensor(parents, dtype=torch.long)))


def make_case(batch: int, prefix: int, nodes: int, hq: int, hkv: int, d: int, dtype, block_size: int = 16, seed=0,
              device: str = "cuda"):
    """A batch of trees over paged prefixes, made on the device: (q, k_cache, v_cache, block_table, prefix_lens,
    cu_rows, bits)."""
    g = torch.Generator().manual_seed(seed)
    rows = nodes + 1
    per_req = math.ceil((prefix + rows) / block_size)
    blocks = batch * per_req
    table = torch.randperm(blocks, device=device).view(batch, per_req).to(torch.int32)
    k_cache = torch.randn(blocks, block_size, hkv, d, device=device, dtype=dtype)
    v_cache = torch.randn(blocks, block_size, hkv, d, device=device, dtype=dtype)
    q = torch.randn(batch * rows, hq, d, device=device, dtype=dtype)
    mask = torch.cat([random_tree_mask(nodes, g) for _ in range(batch)])
    cu = torch.arange(0, batch * rows + 1, rows, dtype=torch.int32, device=device)
    plen = torch.full((batch,), prefix, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, table, plen, cu, ancestor_bits(mask).to(device)


def plan_inputs(case, batch: int, prefix: int, nodes: int, hq: int, hkv: int, d: int) -> tuple[tuple, dict]:
    """plan_launch's arguments for a `make_case` case (its rows packed, one block-table row per request) and the
    engine's tile for trees of that size."""
    q, _, _, _, plen, cu, bits = case
    rows = nodes + 1
    args = (plen, cu, bits, torch.arange(q.shape[0], dtype=torch.int32, device=q.device),
            torch.arange(batch, dtype=torch.int32, device=q.device), hq, hkv, d)
    return args, {"max_rows": rows, "longest": prefix + rows, "block_q": tile_rows(rows, hq, hkv)}


def graphed_time(fn, reps: int = 10) -> float:
    """Milliseconds of one fn() on the GPU alone: `reps` calls captured in one CUDA graph and replayed (Python's
    launch cost out)."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=40, return_mode="median") / reps


def cascade_inputs(case, batch: int, prefix: int, nodes: int, hq: int, hkv: int, d: int, block_q: int):
    """The same case as a cascade (kernels/tree_cascade.py): the folded rows and the prefix's contiguous K / V for
    the dense kernel (as the anchor reads them), the tree kernel's partials plan over the trees' own keys in the
    paged cache -> fn() running the three launches into `out` (returned with it)."""
    q, k_cache, v_cache, table, plen, cu, bits = case
    rows, scale = nodes + 1, d ** -0.5
    fq = tree_cascade.fold_rows(q, batch, rows, hkv)
    fk, fv = (tree_cascade.contiguous_keys(c, table, 0, prefix) for c in (k_cache, v_cache))
    q_rows = torch.arange(q.shape[0], dtype=torch.int32, device=q.device)
    plan = plan_launch(plen, cu, bits, q_rows, torch.arange(batch, dtype=torch.int32, device=q.device), hq, hkv, d,
                       max_rows=rows, longest=prefix + rows, block_q=block_q, partials=True)
    o_p, lse = tree_cascade.prefix_attention(fq, fk, fv, scale)
    offsets = tree_cascade.folded_offsets(batch, rows, hq, hkv, o_p, lse)  # (its output's strides: each call's)
    out = torch.empty_like(q)

    def fn():
        o_p, lse = tree_cascade.prefix_attention(fq, fk, fv, scale)
        launch(plan, q, k_cache, v_cache, table, scale, out)  # partials only
        tree_cascade.merge(o_p, lse, offsets, plan.acc, plan.m, plan.l, q_rows, out)
        return out
    return fn


def bench_shapes(args, copy_gbs: float, do_bench, gpu_time=None, device: str = "cuda") -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = getattr(torch, args.dtype)
    deadline = time.monotonic() + (args.deadline or float("inf"))
    results = []
    for heads in args.heads:
        hq, hkv, d = map(int, heads.split(","))
        group = hq // hkv
        for b in args.batch:
            for prefix in args.prefix:
                for nodes in args.nodes:
                    rows = nodes + 1
                    if b * (prefix + rows) * hkv * d * 2 * 2 > 8 << 30:
                        continue  # keep the caches under 8 GiB
                    if time.monotonic() > deadline:
                        print(f"deadline: {heads} batch {b} prefix {prefix} nodes {nodes} and later shapes not run",
                              flush=True)
                        return results
                    case = make_case(b, prefix, nodes, hq, hkv, d, dtype, device=device)
                    q, k_cache, v_cache, table, plen, cu, bits = case
                    scale = d ** -0.5
                    plan_args, kw = plan_inputs(case, b, prefix, nodes, hq, hkv, d)
                    plan = plan_launch(*plan_args, **kw)
                    out = torch.empty_like(q)
                    launch(plan, q, k_cache, v_cache, table, scale, out)
                    if b * prefix <= 65536:
                        want = tree_attention_reference(q, k_cache, v_cache, table, plen, cu, bits, scale,
                                                        dtype=torch.float32)
                        torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)
                    cascade = None
                    if args.cascade:
                        cascade = cascade_inputs(case, b, prefix, nodes, hq, hkv, d, kw["block_q"])
                        if b * prefix <= 65536:  # the same output as the kernel's (else not timed: FAILED)
                            err = float((cascade().float() - want).abs().max())
                            if not err <= 3e-2:
                                print(f"heads {heads} batch {b} prefix {prefix} nodes {nodes}: the cascade's output "
                                      f"differs from the reference by {err:.3g} (FAILED)", flush=True)
                                cascade = None
                    t_kernel = do_bench(lambda: launch(plan, q, k_cache, v_cache, table, scale, out))
                    t_plan = do_bench(lambda: plan_launch(*plan_args, **kw))
                    # the anchor: dense FlashAttention over the same keys and rows, GQA folded into the rows
                    aq = torch.randn(b, hkv, rows * group, d, device=device, dtype=dtype)
                    ak = torch.randn(b, hkv, prefix + rows, d, device=device, dtype=dtype)
                    av = torch.randn_like(ak)
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        t_anchor = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(aq, ak, av,
                                                                                                    scale=scale))
                    kv_bytes = 2 * b * (prefix + rows) * hkv * d * k_cache.element_size()
                    one_read_ms = kv_bytes / (copy_gbs * 1e9) * 1e3
                    row = {"heads": [hq, hkv, d], "batch": b, "prefix": prefix, "nodes": nodes, "dtype": args.dtype,
                           "splits": plan.splits, "block_q": plan.block_q, "q_blocks": plan.q_blocks,
                           "kernel_us": t_kernel * 1e3, "anchor_us": t_anchor * 1e3, "plan_us": t_plan * 1e3,
                           "over_anchor": t_kernel / t_anchor, "over_one_kv_read": t_kernel / one_read_ms,
                           "anchor_over_one_kv_read": t_anchor / one_read_ms}
                    more = ""
                    if cascade is not None:
                        t_cascade = do_bench(cascade)
                        row.update(cascade_us=t_cascade * 1e3, cascade_over_anchor=t_cascade / t_anchor,
                                   cascade_over_one_kv_read=t_cascade / one_read_ms)
                        more = f"; cascade {row['cascade_us']:.1f} us: {row['cascade_over_anchor']:.2f}x"
                    gpu = ""
                    if gpu_time is not None:
                        # the GPU alone, both sides captured in a CUDA graph: what the step pays where the host runs
                        # ahead of the GPU (the launch's host cost is timed apart: kernel_sweep.py --launch)
                        try:
                            g_kernel = gpu_time(lambda: launch(plan, q, k_cache, v_cache, table, scale, out))
                            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                                g_anchor = gpu_time(lambda: torch.nn.functional.scaled_dot_product_attention(
                                    aq, ak, av, scale=scale))
                            row.update(gpu_kernel_us=g_kernel * 1e3, gpu_anchor_us=g_anchor * 1e3,
                                       gpu_over_anchor=g_kernel / g_anchor, gpu_over_one_kv_read=g_kernel / one_read_ms)
                            gpu = (f"; GPU alone {row['gpu_kernel_us']:.1f} / {row['gpu_anchor_us']:.1f} us: "
                                   f"{row['gpu_over_anchor']:.2f}x, {row['gpu_over_one_kv_read']:.2f}x one KV read")
                            if cascade is not None:
                                g_cascade = gpu_time(cascade)
                                row.update(gpu_cascade_us=g_cascade * 1e3, gpu_cascade_over_anchor=g_cascade / g_anchor,
                                           gpu_cascade_over_one_kv_read=g_cascade / one_read_ms)
                                gpu += (f"; cascade {row['gpu_cascade_us']:.1f} us: "
                                        f"{row['gpu_cascade_over_anchor']:.2f}x")
                        except Exception as e:  # a capture that fails costs this column, not the run
                            gpu = f"; GPU alone failed: {type(e).__name__}: {e}"
                    results.append(row)
                    print(f"heads {heads:9s} batch {b:2d} prefix {prefix:5d} nodes {nodes:2d}: kernel "
                          f"{row['kernel_us']:8.1f} us ({plan.splits} splits), FlashAttention {row['anchor_us']:8.1f} "
                          f"us: {row['over_anchor']:.2f}x; {row['over_one_kv_read']:.2f}x one KV read "
                          f"(anchor {row['anchor_over_one_kv_read']:.2f}x); plan {row['plan_us']:.1f} us{more}{gpu}",
                          flush=True)
                    del case, q, k_cache, v_cache, aq, ak, av, cascade
    return results


def verify_cost_curve(model: str, rows_list, batches, dtype, do_bench, ctx: int = 1024) -> dict:
    """{batch: {rows: ms}}: one decoder forward of `model`'s shape (random weights, plain torch) over `rows` new
    tokens per request on a `ctx`-token cached context (the new keys written into the cache in place, SDPA over the
    cached keys), the LM head on every row, captured in one CUDA graph and replayed. (An earlier version, run on an
    H100 in benchmarks/device_runs/2026-11-27-h100-a, concatenated the context with the new keys in every layer: a
    copy of the whole cache per layer, which made a batch of 8 one-row requests cost 1.57x one request on Llama-3-8B's
    shape; the H100 reference table the GPU targets are stated against, 1.08x.)"""
    layers, h, hq, hkv, hd, inter, vocab = MODELS[model]
    torch.manual_seed(0)
    dev = "cuda"
    w = [{k: torch.randn(*shape, device=dev, dtype=dtype) * 0.02 for k, shape in
          {"qkv": (h, (hq + 2 * hkv) * hd), "o": (hq * hd, h), "up": (h, 2 * inter), "down": (inter, h)}.items()}
         for _ in range(layers)]
    head = torch.randn(h, vocab, device=dev, dtype=dtype) * 0.02
    out = {}
    for b in batches:
        most = ctx + max(rows_list)  # the cache holds the new rows' keys too, written in place (as vLLM's does)
        kv = [(torch.randn(b, hkv, most, hd, device=dev, dtype=dtype), torch.randn(b, hkv, most, hd, device=dev,
                                                                                    dtype=dtype)) for _ in range(layers)]
        out[b] = {}
        for r in rows_list:
            x = torch.randn(b, r, h, device=dev, dtype=dtype)

            def forward():
                y = x
                for lw, (kc, vc) in zip(w, kv):
                    qkv = torch.nn.functional.rms_norm(y, (h,)) @ lw["qkv"]
                    q, k, v = qkv.split([hq * hd, hkv * hd, hkv * hd], -1)
                    q = q.view(b, r, hq, hd).transpose(1, 2)
                    kc[:, :, ctx:ctx + r].copy_(k.view(b, r, hkv, hd).transpose(1, 2))  # no copy of the context
                    vc[:, :, ctx:ctx + r].copy_(v.view(b, r, hkv, hd).transpose(1, 2))
                    a = torch.nn.functional.scaled_dot_product_attention(q, kc[:, :, :ctx + r], vc[:, :, :ctx + r],
                                                                         enable_gqa=True)
                    y = y + a.transpose(1, 2).reshape(b, r, hq * hd) @ lw["o"]
                    gate, up = (torch.nn.functional.rms_norm(y, (h,)) @ lw["up"]).chunk(2, -1)
                    y = y + (torch.nn.functional.silu(gate) * up) @ lw["down"]
                return torch.nn.functional.rms_norm(y, (h,)) @ head

            with torch.no_grad():
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    forward()  # warm-up outside the graph (cuBLAS workspaces)
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    forward()
                out[b][r] = do_bench(graph.replay)
            print(f"verify cost {model}: batch {b:2d} rows {r:3d}: {out[b][r]:.3f} ms "
                  f"({out[b][r] / out[b][rows_list[0]]:.2f}x rows {rows_list[0]})", flush=True)
            del graph
        del kv
    del w, head
    torch.cuda.empty_cache()
    return out


def summarize(results: list[dict], gpu: bool = False, column: str = "kernel") -> dict:
    """The tree kernel's targets over one run's shapes: the geometric mean of kernel / anchor, and how many shapes meet
    each target (<= 1.2x the anchor at nodes <= 16, <= 1.5x at 64 nodes, <= 1.5x one KV read at prefix >= 8192 and nodes
    <= 16), with the medians. `gpu`: over the GPU-alone times (CUDA graphs) of the shapes that have them. column:
    "kernel", "cascade" (kernels/tree_cascade.py, where --cascade timed it) or "best" (the faster of the two per shape:
    what an engine choosing per step would pay)."""
    pre = "gpu_" if gpu else ""
    if column != "kernel":
        def pick(r):
            c, k = r[pre + "cascade_over_anchor"], r[pre + "over_anchor"]
            kv_c, kv_k = r[pre + "cascade_over_one_kv_read"], r[pre + "over_one_kv_read"]
            return (c, kv_c) if column == "cascade" or c < k else (k, kv_k)
        results = [dict(r, **dict(zip((pre + "over_anchor", pre + "over_one_kv_read"), pick(r))))
                   for r in results if pre + "cascade_over_anchor" in r]
    if gpu:
        results = [dict(r, over_anchor=r["gpu_over_anchor"], over_one_kv_read=r["gpu_over_one_kv_read"])
                   for r in results if "gpu_over_anchor" in r]
    if not results:
        return {}
    small = [r for r in results if r["nodes"] <= 16]
    big = [r for r in results if r["nodes"] > 16]
    long = [r for r in small if r["prefix"] >= 8192]

    def median(xs):
        xs = sorted(xs)
        return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2 if xs else float("nan")

    return {"shapes": len(results),
            "geomean_over_anchor": math.exp(sum(math.log(r["over_anchor"]) for r in results) / len(results)),
            "small_within_1.2": sum(r["over_anchor"] <= 1.2 for r in small), "small": len(small),
            "small_median": median(r["over_anchor"] for r in small),
            "big_within_1.5": sum(r["over_anchor"] <= 1.5 for r in big), "big": len(big),
            "big_median": median(r["over_anchor"] for r in big),
            "long_kv_within_1.5": sum(r["over_one_kv_read"] <= 1.5 for r in long), "long": len(long)}


def summary_line(s: dict, column: str = "kernel") -> str:
    return (f"{s['shapes']} shapes: {column} / anchor geometric mean {s['geomean_over_anchor']:.2f}x; nodes <= 16: "
            f"{s['small_within_1.2']} of {s['small']} within 1.2x (median {s['small_median']:.2f}x); 64 nodes: "
            f"{s['big_within_1.5']} of {s['big']} within 1.5x (median {s['big_median']:.2f}x); one KV read <= 1.5x at "
            f"prefix >= 8192, nodes <= 16: {s['long_kv_within_1.5']} of {s['long']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--summary", nargs="+", metavar="JSON",
                   help="no timing: the targets' counts of runs saved by --out (any machine)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--prefix", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    p.add_argument("--nodes", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--heads", nargs="+", default=["32,8,128", "9,3,64"],
                   help="query heads,kv heads,head size (32/8/128 as Llama-3-8B, 9/3/64 as SmolLM2)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cost-curve", action="store_true", help="also the models' verification cost curves")
    p.add_argument("--curve-models", nargs="+", default=list(MODELS))
    p.add_argument("--no-gpu-alone", action="store_true",
                   help="time launches only as Python makes them (eager), not also captured in CUDA graphs")
    p.add_argument("--cascade", action="store_true",
                   help="also the cascade (kernels/tree_cascade.py: FlashAttention over the prefix with its "
                        "log-sum-exp, the tree kernel over the trees' keys, one merge) per shape")
    p.add_argument("--deadline", type=float, default=None, metavar="S",
                   help="no new shape after S seconds (what ran is printed and saved)")
    p.add_argument("--cpu", action="store_true",
                   help="CPU tensors, Triton's interpreter, the given (tiny) shapes: the script's own check")
    p.add_argument("--out", default="benchmarks/out/tree_attention.json")
    args = p.parse_args(argv)
    if args.summary:
        for path in args.summary:
            results = json.loads(Path(path).read_text())["results"]
            for column in ("kernel", "cascade", "best"):
                if summarize(results, column=column):
                    print(f"{path}: {summary_line(summarize(results, column=column), column)}")
                if summarize(results, gpu=True, column=column):
                    print(f"{path}, GPU alone: {summary_line(summarize(results, gpu=True, column=column), column)}")
        return 0
    if args.cpu:
        def do_bench(fn) -> float:  # ms, the median of 3 (the interpreter: correctness, not speed)
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return sorted(times)[1]
        device, gpu_time, name = "cpu", None, "cpu (interpreter)"
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU (or --cpu)", file=sys.stderr)
        return 2
    else:
        import triton.testing

        def do_bench(fn) -> float:
            return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
        device, gpu_time, name = "cuda", None if args.no_gpu_alone else graphed_time, torch.cuda.get_device_name()

    buf = torch.empty(1 << (22 if args.cpu else 28), dtype=torch.uint8, device=device)
    copy_ms = do_bench(lambda: buf.clone())
    copy_gbs = 2 * buf.numel() / (copy_ms * 1e-3) / 1e9  # read + write
    del buf
    print(f"device {name}: copy {copy_gbs:.0f} GB/s (read + write)", flush=True)
    results = bench_shapes(args, copy_gbs, do_bench, gpu_time, device)
    curves = {}
    if args.cost_curve:
        for model in args.curve_models:
            curves[model] = verify_cost_curve(model, [1, 2, 4, 8, 16, 32, 64], [1, 8, 32], torch.bfloat16, do_bench)
    for column in ("kernel", "cascade", "best") if args.cascade else ("kernel",):
        if summarize(results, column=column):
            print(summary_line(summarize(results, column=column), column), flush=True)
        if summarize(results, gpu=True, column=column):
            print("GPU alone: " + summary_line(summarize(results, gpu=True, column=column), column), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": name, "copy_GBps": copy_gbs, "results": results,
                               "verify_cost_ms": curves}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
