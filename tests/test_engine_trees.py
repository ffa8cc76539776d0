"""Token trees inside vLLM (CPU): greedy tree decoding is token-identical to plain decoding in a mixed batch,
trees actually branch off the chain (KV compaction moved slots), chain-only requests fall back to chains."""

import pytest

from conftest import ENGINE, PROMPTS, SPEC, greedy_batch
from test_engine_greedy import assert_identical
from vllm_adaspec.harness import run_engine

pytestmark = pytest.mark.engine


def tree_engine(budget=8, top_k=2, k=8, **extra):
    # The shipped head (N = 6) drafts; guard off so every step drafts.
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
    assert sum(st["tree_accepted_depth"][1:]) > 0
