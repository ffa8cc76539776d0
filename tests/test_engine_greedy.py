"""Greedy output with early-exit drafting is identical to vLLM without speculation (float32, real engine)."""

import pytest

from conftest import GROW_MAX_TOKENS, GROW_PROMPTS, greedy_batch, spec_engine
from vllm_adaspec.harness import run_engine

pytestmark = pytest.mark.engine


def assert_identical(run, plain):
    for i, (got, want) in enumerate(zip(run["token_ids"], plain["token_ids"])):
        assert got == want, f"prompt {i} diverged at token {next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))}"
    assert [len(t) for t in run["token_ids"]] == [len(t) for t in plain["token_ids"]]


def test_greedy_identical_mixed_batch_with_prefix_cache_hits(smollm2, plain_greedy):
    # exit_layer 24 drafts well enough (~30% top-1) that multi-token acceptance and rollback both happen a lot.
    res = run_engine({"model": smollm2, "engine": spec_engine(24, 4), "batches": [greedy_batch(repeat=2)]})
    first, second = res["batches"][0]["runs"]
    for run in (first, second):  # the second pass hits the prefix cache for every prompt
        assert_identical(run, plain_greedy["mixed"])
    m = first["metrics"]
    assert m["vllm:spec_decode_num_drafts"] > 0
    assert m["vllm:spec_decode_num_accepted_tokens"] > 10, m
    # Some rounds must accept more than one draft, or rollback of a partial acceptance was never exercised.
    assert m["vllm:spec_decode_num_accepted_tokens_per_pos"][1] > 0, m


def test_greedy_identical_under_preemption_and_chunked_prefill(smollm2, plain_greedy):
    # A KV cache of ~12 blocks of 32 tokens for 8 requests that each grow to ~130 tokens forces preemption and
    # recompute; a small token budget chunks the long prompts of the mixed batch so prefill chunks and draft
    # verification share steps.
    engine = spec_engine(
        20, 3, kv_cache_memory_bytes=18 * 2**20, block_size=32, max_model_len=320, max_num_batched_tokens=64
    )
    res = run_engine({"model": smollm2, "engine": engine, "batches": [greedy_batch(GROW_PROMPTS, GROW_MAX_TOKENS)]})
    run = res["batches"][0]["runs"][0]
    assert_identical(run, plain_greedy["grow"])
    assert run["metrics"]["vllm:num_preemptions"] > 0, "the KV cache was large enough: no preemption was tested"
    assert run["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0
