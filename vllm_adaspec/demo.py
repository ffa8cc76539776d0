"""`adaspec demo`: fetch a model, generate with and without adaspec, print tau and speedup."""

from __future__ import annotations

import sys

from vllm_adaspec.harness import run_engine
from vllm_adaspec.models import resolve_model

DEMO_PROMPTS = [
    "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "class Stack:\n    \"\"\"A last-in first-out stack backed by a list.\"\"\"\n",
    "def word_count(text):\n    \"\"\"Count how often each word occurs in text.\"\"\"\n",
]


# What runs, in this order: plain vLLM, vLLM's best built-in method on this machine (benchmarks/RESULTS.md), ours.
METHODS = ("plain", "vllm-suffix", "adaspec")


def demo_engines(proposer: str, k: int, exit_layer: int | None, exit_head: str) -> dict:
    if proposer == "multibranch":
        ours = {"speculative_config": {"model": "vllm_adaspec.MultiBranchProposer", "num_speculative_tokens": k}}
    else:
        ours = {"speculative_config": {"model": "vllm_adaspec.EarlyExitProposer", "num_speculative_tokens": k},
                "additional_config": {"adaspec": {"exit_head": exit_head,
                                                  **({"exit_layer": exit_layer} if exit_layer is not None else {})}}}
    return {"plain": {}, "vllm-suffix": {"speculative_config": {"method": "suffix"}}, "adaspec": ours}


def run_demo(model: str, exit_layer: int | None, k: int, max_tokens: int, dtype: str = "float32",
             exit_head: str = "auto", proposer: str = "multibranch") -> dict:
    path = resolve_model(model)
    engine = {"dtype": dtype, "max_model_len": 2048, "seed": 0, "enforce_eager": True}
    # Batch 1, one prompt per call, after a warm-up call: the setting speculative decoding is for.
    batches = [{"prompts": ["Hello"], "params": [{"temperature": 0, "max_tokens": 8}]}] + [
        {"prompts": [p], "params": [{"temperature": 0, "max_tokens": max_tokens}]} for p in DEMO_PROMPTS
    ]
    out = {}
    for name, extra in demo_engines(proposer, k, exit_layer, exit_head).items():
        print(f"[demo] running {name} ...", file=sys.stderr, flush=True)
        runs = [b["runs"][0] for b in run_engine({"model": path, "engine": {**engine, **extra}, "batches": batches})["batches"][1:]]
        tokens = sum(len(r["token_ids"][0]) for r in runs)
        accepted = sum(r["metrics"].get("vllm:spec_decode_num_accepted_tokens", 0) for r in runs)
        out[name] = {
            "tok_s": tokens / sum(r["seconds"] for r in runs),
            "tau": tokens / max(1, tokens - accepted),
            "draft_share": sum(r.get("adaspec", {}).get("draft_seconds", 0.0) for r in runs) / sum(r["seconds"] for r in runs),
            "ids": [r["token_ids"][0] for r in runs],
            "texts": [r["texts"][0] for r in runs],
            "config": runs[-1].get("adaspec", {}).get("config", {}),
        }
    out["proposer"] = proposer
    return out


def print_demo(res: dict, k: int) -> None:
    plain, ada = res["plain"], res["adaspec"]
    cfg = ada.get("config", {})
    if res.get("proposer") == "multibranch":
        label = f"adaspec MultiBranchProposer K={k}"
    else:
        print(f"exit head: {cfg.get('exit_head') or 'untrained (final norm + LM head on h_N)'}")
        label = f"adaspec early exit N={cfg.get('exit_layer')} K={k}"
    print(f"--- first completion (adaspec) ---\n{DEMO_PROMPTS[0]}{ada['texts'][0]}\n---")
    print(f"{'plain decoding':36s} {plain['tok_s']:7.1f} tok/s")
    for name, title in (("vllm-suffix", "vLLM suffix decoding (built in)"), ("adaspec", label)):
        r = res[name]
        same = sum(a == b for a, b in zip(plain["ids"], r["ids"]))
        print(f"{title:36s} {r['tok_s']:7.1f} tok/s   tau {r['tau']:.2f}   speedup {r['tok_s'] / plain['tok_s']:.2f}x   "
              f"identical to plain {same}/{len(plain['ids'])}"
              + (f"   (drafting {r['draft_share']:.0%} of the time)" if name == "adaspec" else ""))
