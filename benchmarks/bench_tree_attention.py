"""GPU timing of the tree-mask attention kernel, and the verification cost curve of a SmolLM2-shaped model on GPU.

    python benchmarks/bench_tree_attention.py --out benchmarks/out/tree_attention.json

Per shape (batch, prefix length, tree nodes, heads): the kernel on the paged cache (flash-decoding splits, ancestor
bits), timed as each attention layer of the engine pays it (`launch` with the step's plan, built once per step by the
GPU tree runtime; the plan's own cost is reported apart), against (a) torch's scaled_dot_product_attention over the same keys already gathered into contiguous
[B, Hq, P + rows, D] tensors with the tree mask (the gather is not timed: the baseline is favoured), (b) the same SDPA
for a chain of as many rows (a causal mask: what decode attention over a chain of drafts costs; vLLM's own kernels
cannot be carried to the device), and (c) one read of each request's prefix + tree K and V at the measured copy
bandwidth (the issue's target: kernel <= 1.5x that for prefix >= 2048, <= 1.2x the chain). Outputs are checked
against the float32 reference first. `--cost-curve`: seconds of one verification forward of a SmolLM2-135M-shaped
model (random weights, plain torch, bf16) at 1-64 rows per request for batch 1 and 8: the GPU prior of the step
cost model. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from vllm_adaspec.kernels.tree_attention import (ancestor_bits, launch, plan_launch,  # noqa: E402
                                                 tree_attention_reference, tree_attention_triton)
from test_kernel_tree_attention import make_case  # noqa: E402


def sdpa_inputs(case, hq, chain: bool = False):
    q, k_cache, v_cache, table, plen, cu, mask = case
    bs, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    qs, ks, vs, ms = [], [], [], []
    longest = max(int(plen[b]) + int(cu[b + 1] - cu[b]) for b in range(len(plen)))
    rows = int((cu[1:] - cu[:-1]).max())
    for b in range(len(plen)):
        r0, r1 = int(cu[b]), int(cu[b + 1])
        n, p = r1 - r0, int(plen[b])
        pos = torch.arange(p + n, device=q.device)
        slots = table[b, pos // bs].long() * bs + pos % bs
        k = k_cache.reshape(-1, hkv, d)[slots].repeat_interleave(hq // hkv, 1)
        v = v_cache.reshape(-1, hkv, d)[slots].repeat_interleave(hq // hkv, 1)
        pad = longest - (p + n)
        ks.append(torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)).transpose(0, 1))
        vs.append(torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).transpose(0, 1))
        qs.append(torch.nn.functional.pad(q[r0:r1], (0, 0, 0, 0, 0, rows - n)).transpose(0, 1))
        m = torch.zeros(rows, longest, dtype=torch.bool, device=q.device)
        m[:n, :p] = True
        m[:n, p:p + n] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril() if chain else mask[r0:r1, :n]
        m[n:, 0] = True  # padding rows see something (no NaN)
        ms.append(m)
    return torch.stack(qs), torch.stack(ks), torch.stack(vs), torch.stack(ms)[:, None]


def verify_cost_curve(rows_list, batches, dtype) -> dict:
    """{batch: {rows: ms}}: one forward of a SmolLM2-135M-shaped decoder (30 layers, hidden 576, 9 / 3 heads of 64,
    MLP 1536, vocabulary 49152; random weights, plain torch) over `rows` new tokens per request on a 512-token
    cached context (SDPA over the cached keys), the LM head on every row."""
    import triton.testing

    torch.manual_seed(0)
    h, layers, hq, hkv, hd, inter, vocab, ctx = 576, 30, 9, 3, 64, 1536, 49152, 512
    dev = "cuda"
    w = [{k: torch.randn(*shape, device=dev, dtype=dtype) * 0.02 for k, shape in
          {"qkv": (h, (hq + 2 * hkv) * hd), "o": (hq * hd, h), "up": (h, 2 * inter), "down": (inter, h)}.items()}
         for _ in range(layers)]
    head = torch.randn(h, vocab, device=dev, dtype=dtype) * 0.02
    out = {}
    for b in batches:
        kv = [(torch.randn(b, hkv, ctx, hd, device=dev, dtype=dtype), torch.randn(b, hkv, ctx, hd, device=dev,
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
                    k = torch.cat([kc, k.view(b, r, hkv, hd).transpose(1, 2)], 2)
                    v = torch.cat([vc, v.view(b, r, hkv, hd).transpose(1, 2)], 2)
                    a = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                    y = y + a.transpose(1, 2).reshape(b, r, hq * hd) @ lw["o"]
                    gate, up = (torch.nn.functional.rms_norm(y, (h,)) @ lw["up"]).chunk(2, -1)
                    y = y + (torch.nn.functional.silu(gate) * up) @ lw["down"]
                return torch.nn.functional.rms_norm(y, (h,)) @ head

            with torch.no_grad():
                out[b][r] = triton.testing.do_bench(forward, return_mode="median")
            print(f"verify cost: batch {b} rows {r:3d}: {out[b][r]:.3f} ms", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--prefix", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    p.add_argument("--nodes", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--heads", nargs="+", default=["32,8,128", "9,3,64"],
                   help="query heads,kv heads,head size (32/8 as Llama-3-8B, 9/3 as SmolLM2)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cost-curve", action="store_true", help="also the SmolLM2-shaped verification cost curve")
    p.add_argument("--out", default="benchmarks/out/tree_attention.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton.testing

    dtype = getattr(torch, args.dtype)
    buf = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    copy_ms = triton.testing.do_bench(lambda: buf.clone(), return_mode="median")
    copy_gbs = 2 * buf.numel() / (copy_ms * 1e-3) / 1e9  # read + write
    results = []
    for heads in args.heads:
        hq, hkv, hd = map(int, heads.split(","))
        for b in args.batch:
            for prefix in args.prefix:
                for nodes in args.nodes:
                    if b * (prefix + nodes + 1) * hkv * hd * 2 * 2 > 8 << 30:
                        continue  # keep the caches under 8 GiB
                    *head, mask = [x.cuda() for x in make_case([prefix] * b, [nodes] * b, hq, hkv, hd, 16, dtype)]
                    case = (*head, ancestor_bits(mask))
                    scale = hd ** -0.5
                    kw = {"max_rows": nodes + 1, "longest": prefix + nodes + 1}
                    got = tree_attention_triton(*case, scale, **kw)
                    if b * prefix <= 65536:
                        want = tree_attention_reference(*case, scale, dtype=torch.float32)
                        torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
                    q, k_cache, v_cache, table, plen, cu, bits = case
                    t = q.shape[0]
                    plan_args = (plen, cu, bits, torch.arange(t, dtype=torch.int32, device="cuda"),
                                 torch.arange(b, dtype=torch.int32, device="cuda"), hq, hkv, hd)
                    plan = plan_launch(*plan_args, max_rows=nodes + 1, longest=prefix + nodes + 1)
                    out = torch.empty_like(q)
                    t_kernel = triton.testing.do_bench(lambda: launch(plan, q, k_cache, v_cache, table, scale, out),
                                                       return_mode="median")
                    t_plan = triton.testing.do_bench(
                        lambda: plan_launch(*plan_args, max_rows=nodes + 1, longest=prefix + nodes + 1),
                        return_mode="median")
                    sdpa = {}
                    for name, chain in (("tree", False), ("chain", True)):
                        sq, sk, sv, sm = sdpa_inputs((*head, mask), hq, chain=chain)
                        sdpa[name] = triton.testing.do_bench(
                            lambda: torch.nn.functional.scaled_dot_product_attention(sq, sk, sv, attn_mask=sm,
                                                                                     scale=scale),
                            return_mode="median")
                    kv_bytes = 2 * b * (prefix + nodes + 1) * hkv * hd * case[1].element_size()
                    ideal_ms = kv_bytes / (copy_gbs * 1e9) * 1e3
                    row = {"batch": b, "prefix": prefix, "nodes": nodes, "heads": [hq, hkv, hd], "dtype": args.dtype,
                           "splits": plan.splits, "plan_us": t_plan * 1e3, "kernel_us": t_kernel * 1e3, "sdpa_tree_us": sdpa["tree"] * 1e3,
                           "sdpa_chain_us": sdpa["chain"] * 1e3, "over_chain": t_kernel / sdpa["chain"],
                           "kernel_GBps": kv_bytes / (t_kernel * 1e-3) / 1e9, "over_one_kv_read": t_kernel / ideal_ms}
                    results.append(row)
                    print(f"heads {heads} b {b:2d} prefix {prefix:5d} nodes {nodes:2d}: kernel {row['kernel_us']:8.1f} "
                          f"us, sdpa tree {row['sdpa_tree_us']:8.1f} us, chain {row['sdpa_chain_us']:8.1f} us "
                          f"({row['over_chain']:.2f}x), {row['over_one_kv_read']:.2f}x one KV read", flush=True)
    curve = verify_cost_curve([1, 2, 4, 8, 16, 32, 64], [1, 8], dtype) if args.cost_curve else None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_GBps": copy_gbs, "results": results,
                               "verify_cost_ms": curve}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
