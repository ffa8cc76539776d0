"""What verifying r rows per request costs this engine: step time against proposal size, chains vs trees.

Two engines with vllm_adaspec.ProbeProposer stand side by side (harness.EngineSession): one drafts chains, one binary
trees verified through the tree path; each proposes 0..K never-accepted drafts per request in turn and times every step
against the size it verified. The engines take turns, `--calls` generate calls each, the order alternating, so the
machine's drift hits both alike (one engine after the other differed by 3 ms at no drafts on this CPU,
benchmarks/log/2026-11-27.md: drift, not the tree path). Reported per size: the median step time relative to the chain
engine's size 0 (no drafts), at each batch size, and tree / chain at equal rows: what tree verification adds over vLLM's
own chain verification. Run alone (it times steps).

    .venv/bin/python benchmarks/verify_cost.py --batches 1 8 --k 16 --rounds 8      # vLLM's compiled mode
    .venv/bin/python benchmarks/verify_cost.py --batches 1 --eager                   # enforce_eager
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from vllm_adaspec.data.prompts import load_prompts
from vllm_adaspec.harness import EngineSession, default_env
from vllm_adaspec.models import resolve_model

OUT = Path(__file__).parent / "out"
SHAPES = ("chain", "tree")


def measure(model: str, batch: int, k: int, rounds: int, calls: int, dtype: str,
            eager: bool = False) -> dict[str, dict[int, float]]:
    """{shape: {size: median step seconds}} of the two engines, `rounds` steps a size each, over `calls` turns."""
    engine = {"dtype": dtype, "max_model_len": 2048, "seed": 0, **({"enforce_eager": True} if eager else {}),
              "speculative_config": {"model": "vllm_adaspec.ProbeProposer", "num_speculative_tokens": k},
              "additional_config": {"adaspec": {"cost_model": "off", "tree": {"budget": k}}}}
    sessions = {shape: EngineSession(model, engine, env={**default_env(), "VLLM_ADASPEC_PROBE_SHAPE": shape})
                for shape in SHAPES}
    per_call = -(-rounds // calls)  # cycles of every size a call
    params = [{"temperature": 0.0, "max_tokens": (k + 1) * per_call + 8, "ignore_eos": True}]
    batch_job = {"prompts": load_prompts("humaneval", batch), "params": params}
    seen = {shape: {} for shape in SHAPES}  # size -> step seconds of every call so far (the engine's stats grow)
    try:
        for c in range(calls):
            for shape in SHAPES if c % 2 == 0 else SHAPES[::-1]:
                seen[shape] = sessions[shape].generate(batch_job)["adaspec"]["probe_seconds"]
    finally:
        for s in sessions.values():
            s.close()
    # each size's first step is dropped (the engines' first call warms what it touches first)
    return {shape: {int(size): statistics.median(v[1:] or v) for size, v in got.items()} for shape, got in seen.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=8, help="steps measured per size and engine")
    ap.add_argument("--calls", type=int, default=4, help="turns each engine takes (the order alternating)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=str(OUT / "verify_cost.json"))
    ap.add_argument("--eager", action="store_true", help="enforce_eager (default: vLLM's compiled mode, as users run)")
    args = ap.parse_args()
    model = resolve_model(args.model)
    result = {}
    for b in args.batches:
        got = measure(model, b, args.k, args.rounds, args.calls, args.dtype, args.eager)
        for shape in SHAPES:
            result[f"{shape}-b{b}"] = got[shape]
            print(f"{shape} b{b}: " + " ".join(f"{s}:{1000 * t:.1f}ms" for s, t in sorted(got[shape].items())),
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
