"""Token trees inside vLLM (CPU), end to end on SmolLM2 with the shipped exit head:
- greedy tree decoding is token-identical to plain decoding on the mixed batch (prefills, prefix caching, trees);
- a batch mixing tree requests, chain-only requests (a penalty) and seeded sampling, run multiprocess: greedy and
  chain-only rows identical to plain, and sampled tree requests keep the target distribution (coarse two-sample
  check; the exact statistical tests of sample-and-match are in tests/test_trees.py);
- compaction is exercised (accepted paths leave the first-child spine) and the stats count it."""

import pytest
from stats import two_sample_chi2_pvalue

from conftest import ENGINE, PROMPTS, SPEC, greedy_batch
from test_engine_greedy import assert_identical
from vllm_adaspec.harness import default_env, run_engine

pytestmark = pytest.mark.engine


def tree_engine(budget=8, top_k=2, k=8, **extra):
    # The shipped head (N = 6) drafts; guard off (tree mode runs without it anyway).
    return {**ENGINE, "speculative_config": {"model": SPEC, "num_speculative_tokens": k},
            "additional_config": {"adaspec": {"speed_guard": False, "tree": {"budget": budget, "top_k": top_k}}},
            **extra}


def test_greedy_tree_decoding_is_identical_to_plain(smollm2, plain_greedy):
    res = run_engine({"model": smollm2, "engine": tree_engine(), "batches": [greedy_batch()]})
    run = res["batches"][0]["runs"][0]
    assert_identical(run, plain_greedy["mixed"])
    st = run["adaspec"]
    assert st["tree_verified"] > 20, st
    assert st["tree_kv_moves"] > 0, "no accepted path left the first-child spine: compaction was not exercised"
    assert sum(st["tree_accepted_depth"][1:]) > 0.2 * st["tree_verified"], st
    # Drafting under the tree mask: a tree of 8 nodes must accept more per step than a chain of 8 drafts (measured
    # 0.94 vs 0.69 tokens); nodes drafted past a wrong mask would be garbage and lose that.
    chain = {**ENGINE, "speculative_config": {"model": SPEC, "num_speculative_tokens": 8},
             "additional_config": {"adaspec": {"speed_guard": False}}}
    cst = run_engine({"model": smollm2, "engine": chain, "batches": [greedy_batch()]})["batches"][0]["runs"][0]
    tree_rate = st["accepted_drafts"] / st["tree_rounds"]
    chain_rate = cst["adaspec"]["accepted_drafts"] / (cst["adaspec"]["verified_drafts"] / 8)
    assert tree_rate > 1.15 * chain_rate, (tree_rate, chain_rate, st["tree_accepted_depth"])


COUNT_PROMPT = "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"


def test_mixed_tree_chain_and_sampled_batch_multiprocess(smollm2, tmp_path):
    n = 48
    mixed = {"prompts": PROMPTS[:6],
             "params": [{"temperature": 0.0, "max_tokens": 40}] * 2
             + [{"temperature": 0.0, "max_tokens": 40, "repetition_penalty": 1.2}] * 2  # chain-only
             + [{"temperature": 0.8, "top_p": 0.95, "seed": 7 + i, "max_tokens": 40} for i in range(2)]}
    counts = {"prompts": [COUNT_PROMPT] * n,
              "params": [{"temperature": 1.0, "max_tokens": 4, "seed": i} for i in range(n)]}
    env = default_env(multiprocess=True, workdir=str(tmp_path))
    tree = run_engine({"model": smollm2, "engine": tree_engine(), "batches": [mixed, counts]}, env=env)["batches"]
    plain = run_engine({"model": smollm2, "engine": ENGINE, "batches": [mixed, counts]})["batches"]
    got, want = tree[0]["runs"][0]["token_ids"], plain[0]["runs"][0]["token_ids"]
    assert got[:4] == want[:4]  # greedy tree rows and greedy chain-only rows (penalty applied by vLLM)
    sampled = tree[1]["runs"][0]
    assert sampled["adaspec"]["tree_verified"] > n // 2, sampled["adaspec"]
    p = two_sample_chi2_pvalue(sampled["texts"], plain[1]["runs"][0]["texts"])
    assert p > 1e-3, (p, sampled["texts"][:8], plain[1]["runs"][0]["texts"][:8])
