"""Resident memory of arctic-inference's suffix cache alone once its request bound is reached (the `suffix` pool's
global cache; `suffix_cache_requests` bounds it): rounds of requests started, extended, speculated on and stopped,
RSS after each. Flat after the bound means the cache's own trees do not grow.

    .venv/bin/python benchmarks/suffix_cache_memory.py --bound 24 --rounds 60
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bound", type=int, default=24, help="max_cached_requests")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--requests", type=int, default=24, help="requests per round")
    p.add_argument("--prompt", type=int, default=400, help="prompt tokens")
    p.add_argument("--steps", type=int, default=30, help="output steps of 4 tokens per request")
    args = p.parse_args(argv)

    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=args.bound)
    rng = np.random.default_rng(0)
    rows, n = [], 0
    for r in range(args.rounds):
        for _ in range(args.requests):
            prompt = rng.integers(0, 49152, args.prompt, dtype=np.int32)
            req = f"r{n}"
            n += 1
            cache.start_request(req, prompt)
            for _ in range(args.steps):
                cache.add_active_response(req, rng.integers(0, 49152, 4, dtype=np.int32))
                cache.speculate(req, prompt[-24:], max_spec_tokens=8, use_tree_spec=True)
            cache.stop_request(req)
        rows.append({"round": r + 1, "rss_mib": round(rss_mib(), 1)})
        print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
