"""Adaptive draft-length policies inside vLLM with the shipped exit head: lossless, and actually adaptive."""

import pytest

from conftest import ENGINE, MAX_TOKENS, PROMPTS, SPEC, assert_identical, greedy_batch

pytestmark = pytest.mark.engine
K = 5


@pytest.mark.parametrize("policy", ["thompson-beta", "thompson-cali", {"name": "adaedl", "lambda0": 0.6},
                                    "max-confidence"])
def test_policy_is_lossless_and_varies_the_draft_length(smollm2, plain_greedy, policy, engines):
    # thompson-cali reads the target's hidden state at the row that sampled each request's last token: with greedy
    # decoding that row must give the same token again under the LM head (the drafter counts mismatches).
    engine = {**ENGINE, "speculative_config": {"model": SPEC, "num_speculative_tokens": K},
              "additional_config": {"adaspec": {"policy": policy, "cost_model": "off"}}}
    # the mixed batch's first six prompts, at most 48 tokens each: 20+ rounds per policy
    short = [min(m, 48) for m in MAX_TOKENS[:6]]
    run = engines.run({"model": smollm2, "engine": engine, "batches": [greedy_batch(PROMPTS[:6], short)],
                       "env": {"VLLM_ADASPEC_CHECK_TARGET_ROWS": "1"}})["batches"][0]["runs"][0]
    assert_identical(run, {"token_ids": [t[:m] for t, m in zip(plain_greedy["mixed"]["token_ids"], short)]})
    stats = run["adaspec"]
    lengths = stats["round_lengths"]
    name = policy if isinstance(policy, str) else policy["name"]
    assert stats["policy"] == name and len(lengths) == K + 1
    assert sum(lengths) > 20, lengths
    # Fixed K would put (nearly) every round at K; these stop early on the drafter's own evidence.
    assert sum(lengths[:K]) > 0.2 * sum(lengths), lengths
    assert run["metrics"]["vllm:spec_decode_num_draft_tokens"] < K * sum(lengths), lengths
    if name == "thompson-cali":
        assert stats["row_checks"] > 20 and stats["row_mismatches"] == 0, stats
