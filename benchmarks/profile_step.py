"""Where a speculative step's time goes: cProfile around one in-process `LLM.generate` (after a warm-up generate).

    VLLM_CPU_OMP_THREADS_BIND=0-1 python benchmarks/profile_step.py --tree '{"budget": 2, "top_k": 2}'
    VLLM_CPU_OMP_THREADS_BIND=0-1 python benchmarks/profile_step.py --k 2          # a chain of 2, for comparison

Prints the generate's seconds and the functions with the most own time. Run it alone: timings of a shared CPU
mean nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time

PROMPT = 'def quicksort(values):\n    """Sort a list of integers and return the sorted list."""\n'


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--k", type=int, default=None, help="num_speculative_tokens (default: the tree budget, else 2)")
    p.add_argument("--tree", type=json.loads, default=None, help='e.g. \'{"budget": 2, "top_k": 2}\'')
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--top", type=int, default=25, help="rows of the profile to print")
    args = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine runs in this process, so cProfile sees it

    from vllm import LLM, SamplingParams

    from vllm_adaspec.models import fetch_model

    settings = {"speed_guard": False}
    if args.tree is not None:
        settings["tree"] = args.tree
    k = args.k or (args.tree["budget"] if args.tree else 2)
    llm = LLM(model=str(fetch_model(args.model)), dtype="float32", max_model_len=2048, seed=0, enforce_eager=True,
              speculative_config={"model": "vllm_adaspec.EarlyExitProposer", "num_speculative_tokens": k},
              additional_config={"adaspec": settings})
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([PROMPT], params)  # warm-up
    start = time.perf_counter()
    prof = cProfile.Profile()
    prof.enable()
    llm.generate([PROMPT], params)
    prof.disable()
    print(f"generate: {time.perf_counter() - start:.2f} s for {args.max_tokens} tokens")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
