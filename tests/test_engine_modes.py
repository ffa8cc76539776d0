"""Multiprocess engine with plugin auto-discovery, and seeded sampling."""

import json
import subprocess
import sys
from collections import Counter

import pytest

from conftest import ENGINE, PROMPTS, SPEC, greedy_batch, spec_engine
from stats import two_sample_chi2_pvalue
from vllm_adaspec.harness import default_env, run_engine

pytestmark = pytest.mark.engine

# Plain vLLM usage: this script never imports vllm_adaspec. vLLM must find the plugin through its entry point in
# each of its processes (front end, engine core, worker) and install our worker and scheduler by itself.
AUTODISCOVERY = r"""
import json, sys
from vllm import LLM, SamplingParams
job = json.loads(sys.stdin.read())
if __name__ == "__main__":
    imported_before = "vllm_adaspec" in sys.modules
    llm = LLM(model=job["model"], disable_log_stats=False, kv_cache_memory_bytes=2**30, **job["engine"])
    outs = llm.generate(job["prompts"], [SamplingParams(**p) for p in job["params"]], use_tqdm=False)
    counters = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num_")
                and hasattr(m, "value")}
    vc = llm.llm_engine.vllm_config
    print("@@" + json.dumps({
        "imported_before": imported_before,
        "worker_cls": vc.parallel_config.worker_cls,
        "scheduler_cls": vc.scheduler_config.scheduler_cls,
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "counters": counters,
    }), flush=True)
"""


def test_multiprocess_engine_discovers_the_plugin_and_stays_identical(smollm2, plain_greedy, tmp_path):
    batch = greedy_batch()
    job = {"model": smollm2, "engine": spec_engine(12, 3), "prompts": batch["prompts"], "params": batch["params"]}
    env = default_env(multiprocess=True, workdir=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", AUTODISCOVERY], input=json.dumps(job), capture_output=True,
                          text=True, env=env, timeout=900)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("@@")), None)
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(line[2:])
    assert got["imported_before"] is False
    assert got["worker_cls"] == "vllm_adaspec.engine.worker.AdaspecCPUWorker"
    assert got["scheduler_cls"] == "vllm_adaspec.engine.scheduler.AdaspecScheduler"
    assert got["token_ids"] == plain_greedy["mixed"]["token_ids"]
    assert got["counters"]["vllm:spec_decode_num_drafts"] > 0
    assert got["counters"]["vllm:spec_decode_num_accepted_tokens"] > 0


SEEDED = [{"temperature": 0.8, "top_p": 0.95, "seed": 1000 + i, "max_tokens": 48} for i in range(6)]


def test_mixed_batches_draft_for_sampled_requests_and_keep_greedy_rows(smollm2):
    """Greedy rows of a batch that also samples stay identical to plain greedy decoding, and sampled requests
    draft and get drafts accepted (before the expand fix, engine/cpu_sampling_fix.py, such batches flipped greedy
    rows and accepted nothing)."""
    mixed = [{"prompts": PROMPTS[:6], "params": SEEDED[:3] + [{"temperature": 0.0, "max_tokens": 48}] * 3},
             {"prompts": PROMPTS[:6], "params": SEEDED}]
    spec = run_engine({"model": smollm2, "engine": spec_engine(20, 4), "batches": mixed})["batches"]
    plain = run_engine({"model": smollm2, "engine": ENGINE, "batches": mixed[:1]})["batches"]
    assert spec[0]["runs"][0]["token_ids"][3:] == plain[0]["runs"][0]["token_ids"][3:]
    sampled_only = spec[1]["runs"][0]
    assert sampled_only["metrics"]["vllm:spec_decode_num_draft_tokens"] > 0
    assert sampled_only["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0


COUNT_PROMPT = "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"


def test_sampling_with_drafts_keeps_the_distribution(smollm2):
    """Coarse engine-level check (the exact one is tests/test_cpu_sampling_fix.py): 64 seeded samples of a
    4-token continuation at T = 1.0, plain vs adaspec drafting, two-sample chi-square. Before the fix plain
    continued " 13, 1" 45/48 times and adaspec 7/48 (benchmarks/probe_cpu_sampling.py)."""
    n = 64
    batches = [{"prompts": [COUNT_PROMPT] * n,
                "params": [{"temperature": 1.0, "max_tokens": 4, "seed": i} for i in range(n)]}]
    spec = run_engine({"model": smollm2, "engine": spec_engine(20, 2), "batches": batches})["batches"][0]["runs"][0]
    plain = run_engine({"model": smollm2, "engine": ENGINE, "batches": batches})["batches"][0]["runs"][0]
    assert spec["metrics"]["vllm:spec_decode_num_accepted_tokens"] > n  # most samples went through verification
    p = two_sample_chi2_pvalue(spec["texts"], plain["texts"])
    assert p > 1e-3, (p, Counter(spec["texts"]).most_common(3), Counter(plain["texts"]).most_common(3))


def test_seeded_sampling_repeats_itself(smollm2):
    res = run_engine({"model": smollm2, "engine": spec_engine(20, 4),
                      "batches": [{"prompts": PROMPTS[:6], "params": SEEDED, "repeat": 2}]})
    a, b = res["batches"][0]["runs"]
    assert a["token_ids"] == b["token_ids"]
    other = [{**p, "seed": p["seed"] + 7} for p in SEEDED]
    c = run_engine({"model": smollm2, "engine": spec_engine(20, 4),
                    "batches": [{"prompts": PROMPTS[:6], "params": other}]})["batches"][0]["runs"][0]
    assert sum(x != y for x, y in zip(a["token_ids"], c["token_ids"])) >= 3, "other seeds should sample other text"


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}


def test_ngram_seeded_sampling_repeats_itself(smollm2):
    """vLLM's own ngram drafter: seeded sampling did not repeat on CPU before our expand fix (garbage
    temperatures); the plugin corrects the op for every speculative method."""
    engine = {**ENGINE, "speculative_config": NGRAM}
    res = run_engine({"model": smollm2, "engine": engine,
                      "batches": [{"prompts": PROMPTS[:6], "params": SEEDED, "repeat": 2}]})
    a, b = res["batches"][0]["runs"]
    assert a["token_ids"] == b["token_ids"]
