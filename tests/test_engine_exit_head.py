"""The shipped trained exit head inside vLLM: lossless, its KV owned by the engine and kept current, useful."""

import pytest

from conftest import ENGINE, GROW_MAX_TOKENS, GROW_PROMPTS, MAX_TOKENS, SPEC, greedy_batch
from test_engine_greedy import assert_identical
from vllm_adaspec.harness import run_engine

pytestmark = pytest.mark.engine


def head_engine(k=3, guard=False, **extra):
    # No exit_layer: "auto" picks the shipped head and its N. Guard off: every step drafts K, every path runs.
    return {**ENGINE, "speculative_config": {"model": SPEC, "num_speculative_tokens": k},
            "additional_config": {"adaspec": {"speed_guard": guard}}, **extra}


def accept_rate(m):
    return m["vllm:spec_decode_num_accepted_tokens"] / m["vllm:spec_decode_num_draft_tokens"]


def test_shipped_head_is_lossless_and_drafts_well(smollm2, plain_greedy):
    res = run_engine({"model": smollm2, "engine": head_engine(), "batches": [greedy_batch(repeat=2)]})
    first, second = res["batches"][0]["runs"]
    for run in (first, second):  # the second pass hits the prefix cache (exit-layer KV included)
        assert_identical(run, plain_greedy["mixed"])
    cfg = first["adaspec"]["config"]
    assert cfg["exit_head"] and "heads" in cfg["exit_head"], cfg
    # The exit layer's KV is part of the engine's KV-cache spec (allocated and accounted by vLLM).
    assert cfg["exit_kv_layers"] == ["adaspec_exit.layers.30.self_attn.attn"], cfg
    # An untrained exit agrees ~3% of the time; stale or missing exit-layer KV would wreck agreement too.
    # (Measured with the shipped head on these prompts: 36% of first drafts, 21% of all drafts at K=3.)
    m = first["metrics"]
    assert accept_rate(m) > 0.12, m
    assert m["vllm:spec_decode_num_accepted_tokens_per_pos"][0] / m["vllm:spec_decode_num_drafts"] > 0.25, m
    assert accept_rate(second["metrics"]) > 0.12, second["metrics"]


def test_shipped_head_lossless_under_preemption_and_chunked_prefill(smollm2, plain_greedy):
    engine = head_engine(kv_cache_memory_bytes=19 * 2**20, block_size=32, max_model_len=320, max_num_batched_tokens=64)
    res = run_engine({"model": smollm2, "engine": engine, "batches": [greedy_batch(GROW_PROMPTS, GROW_MAX_TOKENS)]})
    run = res["batches"][0]["runs"][0]
    assert_identical(run, plain_greedy["grow"])
    assert run["metrics"]["vllm:num_preemptions"] > 0, "no preemption happened: the test did not test it"
    assert accept_rate(run["metrics"]) > 0.12, run["metrics"]


def test_shipped_head_in_compiled_mode(smollm2):
    # Default vLLM mode (torch.compile): the hook that feeds the exit layer's KV must survive compilation.
    # Compiled kernels round differently from eager ones, so the reference is plain decoding compiled too.
    compiled = {k: v for k, v in ENGINE.items() if k != "enforce_eager"}
    batch = greedy_batch(max_tokens=[min(m, 48) for m in MAX_TOKENS])
    plain = run_engine({"model": smollm2, "engine": compiled, "batches": [batch]})["batches"][0]["runs"][0]
    engine = {k: v for k, v in head_engine().items() if k != "enforce_eager"}
    run = run_engine({"model": smollm2, "engine": engine, "batches": [batch]})["batches"][0]["runs"][0]
    assert_identical(run, plain)
    assert accept_rate(run["metrics"]) > 0.12, run["metrics"]


def test_default_settings_are_lossless_and_the_guard_measures(smollm2, plain_greedy):
    # Defaults: shipped head, speed guard on. The guard climbs from cap 0 (plain) on pure decode steps; requests it
    # switches to plain stop feeding the exit layer's KV (holes in it) and must stay lossless.
    res = run_engine({"model": smollm2, "engine": head_engine(guard=True), "batches": [greedy_batch()]})
    run = res["batches"][0]["runs"][0]
    assert_identical(run, plain_greedy["mixed"])
    caps = run["adaspec"]["cap_steps"]
    assert len(caps) == 4 and caps[0] > 0 and caps[1] > 0, caps
    # Either drafting kept paying (the climb went on) or the guard settled on plain and switched requests over.
    assert caps[2] > 0 or run["adaspec"]["plain_switches"] > 0, run["adaspec"]
