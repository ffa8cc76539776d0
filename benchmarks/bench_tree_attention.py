"""GPU timing of the tree-mask attention kernel against torch SDPA with an explicit mask.

    python benchmarks/bench_tree_attention.py --out benchmarks/out/tree_attention.json

Per shape (batch, prefix length, tree nodes, heads): the kernel on the paged cache, and torch's
scaled_dot_product_attention on keys already gathered into contiguous [B, Hq, P + rows, D] tensors with a boolean
mask (the gather is not timed: the baseline is favoured). Reports medians of triton.testing.do_bench, the kernel's
achieved bandwidth counting one read of each request's prefix + tree K and V, and that time over the time one
read of the KV takes at the measured copy bandwidth (the issue's target: <= 1.5). Checks outputs first. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from vllm_adaspec.kernels.tree_attention import tree_attention_reference, tree_attention_triton  # noqa: E402
from test_kernel_tree_attention import make_case  # noqa: E402


def sdpa_inputs(case, hq):
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
        m[:n, p:p + n] = mask[r0:r1, :n]
        m[n:, 0] = True  # padding rows see something (no NaN)
        ms.append(m)
    return torch.stack(qs), torch.stack(ks), torch.stack(vs), torch.stack(ms)[:, None]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prefix", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--nodes", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--heads", default="32,8", help="query heads,kv heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default="benchmarks/out/tree_attention.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton.testing

    hq, hkv = map(int, args.heads.split(","))
    dtype = getattr(torch, args.dtype)
    buf = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    copy_ms = triton.testing.do_bench(lambda: buf.clone(), return_mode="median")
    copy_gbs = 2 * buf.numel() / (copy_ms * 1e-3) / 1e9  # read + write
    results = []
    for b in args.batch:
        for prefix in args.prefix:
            for nodes in args.nodes:
                case = [x.cuda() for x in make_case([prefix] * b, [nodes] * b, hq, hkv, args.head_dim, 16, dtype)]
                scale = args.head_dim ** -0.5
                got = tree_attention_triton(*case, scale)
                want = tree_attention_reference(*case, scale, dtype=torch.float32)
                torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
                t_kernel = triton.testing.do_bench(lambda: tree_attention_triton(*case, scale), return_mode="median")
                sq, sk, sv, sm = sdpa_inputs(case, hq)
                t_sdpa = triton.testing.do_bench(
                    lambda: torch.nn.functional.scaled_dot_product_attention(sq, sk, sv, attn_mask=sm, scale=scale),
                    return_mode="median")
                kv_bytes = 2 * b * (prefix + nodes + 1) * hkv * args.head_dim * case[1].element_size()
                gbs = kv_bytes / (t_kernel * 1e-3) / 1e9
                ideal_ms = kv_bytes / (copy_gbs * 1e9) * 1e3
                row = {"batch": b, "prefix": prefix, "nodes": nodes, "heads": [hq, hkv], "dtype": args.dtype,
                       "kernel_us": t_kernel * 1e3, "sdpa_us": t_sdpa * 1e3, "speedup_vs_sdpa": t_sdpa / t_kernel,
                       "kernel_GBps": gbs, "over_one_kv_read": t_kernel / ideal_ms}
                results.append(row)
                print(f"b {b} prefix {prefix:5d} nodes {nodes:3d}: kernel {row['kernel_us']:8.1f} us  sdpa "
                      f"{row['sdpa_us']:8.1f} us  {gbs:7.1f} GB/s  {row['over_one_kv_read']:.2f}x one KV read",
                      flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_GBps": copy_gbs,
                               "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
