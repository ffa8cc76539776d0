"""GPU timing of the fused entropy / max-probability / top-k kernel against the torch ops it replaces.

    python benchmarks/bench_entropy_topk.py --out benchmarks/out/entropy_topk.json

Torch baseline: softmax + log_softmax + entropy sum + topk over logits / T (what the policies would otherwise run).
Median of triton.testing.do_bench per shape; the kernel's achieved bandwidth counts one read of the logits. Checks
the outputs agree before timing. Needs CUDA (run it where the device tool lends a GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vllm_adaspec.kernels.entropy_topk import entropy_topk_reference, entropy_topk_triton  # noqa: E402


def torch_ops(logits, temps, k, top_n=None):
    x = logits.float() / temps[:, None]
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    entropy = -(p * logp).sum(-1)
    top_probs, top_ids = p.topk(k, dim=-1)
    top_n_entropy = None
    if top_n is not None:
        pn, idx = p.topk(top_n, dim=-1)
        top_n_entropy = -(pn * logp.gather(-1, idx)).sum(-1)
    return entropy, top_probs[:, 0], top_ids, top_probs, top_n_entropy


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--vocab", type=int, nargs="+", default=[8192, 49152, 151936])
    p.add_argument("--k", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--top-n", type=int, default=None,
                   help="also C2T's top-n entropy (e.g. 1000); torch baseline adds a topk(n) and a gather")
    p.add_argument("--out", default="benchmarks/out/entropy_topk.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton.testing

    dtype = getattr(torch, args.dtype)
    rows_out = []
    for vocab in args.vocab:
        for rows in args.rows:
            for k in args.k:
                logits = (torch.randn(rows, vocab, device="cuda") * 3).to(dtype)
                temps = torch.full((rows,), 0.8, device="cuda")
                n = args.top_n
                got = entropy_topk_triton(logits, temps, k, top_n=n)
                ref = entropy_topk_reference(logits, temps, k, top_n=n)
                torch.testing.assert_close(got.entropy.double(), ref.entropy, rtol=1e-3, atol=1e-3)
                torch.testing.assert_close(got.top_probs.double(), ref.top_probs, rtol=1e-3, atol=1e-5)
                if n is not None:
                    torch.testing.assert_close(got.top_n_entropy.double(), ref.top_n_entropy, rtol=1e-3, atol=1e-3)
                t_kernel = triton.testing.do_bench(lambda: entropy_topk_triton(logits, temps, k, top_n=n),
                                                   return_mode="median")
                t_torch = triton.testing.do_bench(lambda: torch_ops(logits, temps, k, n), return_mode="median")
                gbs = logits.numel() * logits.element_size() / (t_kernel * 1e-3) / 1e9
                row = {"rows": rows, "vocab": vocab, "k": k, "top_n": n, "dtype": args.dtype, "kernel_us": t_kernel * 1e3,
                       "torch_us": t_torch * 1e3, "speedup": t_torch / t_kernel, "kernel_GBps": gbs}
                rows_out.append(row)
                print(f"rows {rows:4d} vocab {vocab:6d} k {k}: kernel {row['kernel_us']:8.1f} us  torch "
                      f"{row['torch_us']:8.1f} us  {row['speedup']:5.2f}x  {gbs:7.1f} GB/s", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": rows_out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
