"""What verifying r rows per request costs this engine: step time against proposal size, chains vs trees.

An engine with vllm_adaspec.ProbeProposer proposes 0..K never-accepted drafts per request in turn (a chain, or a
binary tree verified through the tree path) and times every step against the size it verified. Reported per
size: the median step time relative to size 0 (no drafts), at each batch size, and tree / chain at equal rows:
what tree verification adds over vLLM's own chain verification. Run alone (it times steps).

    .venv/bin/python benchmarks/verify_cost.py --batches 1 8 --k 16 --rounds 8      # vLLM's compiled mode
    .venv/bin/python benchmarks/verify_cost.py --batches 1 --eager                   # enforce_eager
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from vllm_adaspec.data.prompts import load_prompts
from vllm_adaspec.harness import default_env, run_engine
from vllm_adaspec.models import resolve_model

OUT = Path(__file__).parent / "out"


def measure(model: str, shape: str, batch: int, k: int, rounds: int, dtype: str,
            eager: bool = False) -> dict[int, float]:
    prompts = (load_prompts("humaneval", batch))
    engine = {"dtype": dtype, "max_model_len": 2048, "seed": 0, **({"enforce_eager": True} if eager else {}),
              "speculative_config": {"model": "vllm_adaspec.ProbeProposer", "num_speculative_tokens": k},
              "additional_config": {"adaspec": {"cost_model": "off", "tree": {"budget": k}}}}
    tokens = (k + 1) * rounds + 8
    params = [{"temperature": 0.0, "max_tokens": tokens, "ignore_eos": True}]
    env = default_env()
    env["VLLM_ADASPEC_PROBE_SHAPE"] = shape
    res = run_engine({"model": model, "engine": engine, "batches": [{"prompts": prompts, "params": params}]}, env=env)
    secs = res["batches"][0]["runs"][0]["adaspec"]["probe_seconds"]
    return {int(size): statistics.median(v[1:] or v) for size, v in secs.items()}  # drop each size's first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=8, help="steps measured per size")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=str(OUT / "verify_cost.json"))
    ap.add_argument("--eager", action="store_true", help="enforce_eager (default: vLLM's compiled mode, as users run)")
    args = ap.parse_args()
    model = resolve_model(args.model)
    result = {}
    for b in args.batches:
        for shape in ("chain", "tree"):
            result[f"{shape}-b{b}"] = measure(model, shape, b, args.k, args.rounds, args.dtype, args.eager)
            print(f"{shape} b{b}: " + " ".join(f"{s}:{1000 * t:.1f}ms" for s, t in sorted(result[f'{shape}-b{b}'].items())),
                  flush=True)
    OUT.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "seconds": result}, indent=1))
    head = "| rows per request | " + " | ".join(f"chain b{b} | tree b{b} | tree / chain b{b}" for b in args.batches)
    print("\n" + head + " |\n|" + " --- |" * (1 + 3 * len(args.batches)))
    for size in range(args.k + 1):
        cells = []
        for b in args.batches:
            c, t = result[f"chain-b{b}"], result[f"tree-b{b}"]
            base = c[0]
            cells += [f"{c[size] / base:.2f}", f"{t[size] / base:.2f}", f"{t[size] / c[size]:.2f}"]
        print(f"| {size + 1} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
