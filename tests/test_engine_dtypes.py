"""float32 and bfloat16 draft as the shipped head was trained to: the engine's drafts equal a plain-torch
reference of the same head in that dtype, and half-precision acceptance stays near float32's.

(The first bfloat16 report: 1 of 249 drafts accepted against 13 of 210 in float32. The exit layer was built after
the model, under float32 as torch's default dtype, so its GEMMs were prepared for float32 weights and fed bfloat16
activations; engine/exit_head._new_decoder_layer.)"""

import pytest
import torch

from conftest import ENGINE, SPEC

pytestmark = pytest.mark.engine

# float16 takes bfloat16's path (half-precision exit-layer GEMMs); dropped from the suite for its minutes.
DTYPES = ["float32", "bfloat16"]


@pytest.fixture(scope="module")
def prompts(smollm2):
    from transformers import AutoTokenizer

    from vllm_adaspec.data.prompts import load_prompts

    tok = AutoTokenizer.from_pretrained(smollm2)
    return load_prompts("humaneval", 2, tokenizer=tok) + load_prompts("mtbench", 2, tokenizer=tok)


@pytest.fixture(scope="module")
def dtype_runs(smollm2, engines, tree_engines, prompts):
    """Chains in every dtype; in bfloat16 also tree drafting (its root draft is the head's argmax too) under
    thompson-cali, whose predictor reads the target's and the drafter's hidden states."""
    out = {}
    batch = {"prompts": prompts, "params": [{"temperature": 0.0, "max_tokens": 64}]}
    for dtype in DTYPES + ["bfloat16-tree"]:
        tree = dtype.endswith("-tree")
        settings = {"cost_model": "off",
                    **({"tree": {"budget": 4, "top_k": 2}, "policy": "thompson-cali"} if tree else {})}
        engine = {**ENGINE, "dtype": dtype.removesuffix("-tree"), "additional_config": {"adaspec": settings},
                  "speculative_config": {"model": SPEC, "num_speculative_tokens": 4 if tree else 3}}
        res = (tree_engines if tree else engines).run({"model": smollm2, "engine": engine, "batches": [batch],
                                                       "env": {"VLLM_ADASPEC_RECORD_DRAFTS": "1",
                                                               "VLLM_ADASPEC_CHECK_TARGET_ROWS": "1"}})
        out[dtype] = res["batches"][0]["runs"][0]
    return out


@pytest.mark.parametrize("dtype", DTYPES + ["bfloat16-tree"])
def test_drafts_equal_a_plain_torch_reference_of_the_head(smollm2, dtype_runs, dtype):
    from vllm_adaspec.training.layers import exit_head_drafts

    st = dtype_runs[dtype]["adaspec"]
    head = st["config"]["exit_head"]
    agree = total = 0
    for rec in st["first_drafts"].values():
        ref = exit_head_drafts(smollm2, head, rec["tokens"], dtype=getattr(torch, dtype.removesuffix("-tree")))
        for n, token in rec["drafts"]:
            agree, total = agree + (ref[n - 1] == token), total + 1
    assert total > (50 if dtype.endswith("-tree") else 100), total
    # float32: the same maths in another order; half precision: rounding flips near-ties between GEMM libraries.
    assert agree / total > (0.97 if dtype == "float32" else 0.85), (agree, total)


def test_half_precision_acceptance_stays_near_float32(dtype_runs):
    def rate(run):
        m = run["metrics"]
        return m["vllm:spec_decode_num_accepted_tokens"] / m["vllm:spec_decode_num_draft_tokens"]

    f32 = rate(dtype_runs["float32"])
    assert f32 > 0.12, f32
    for dtype in DTYPES[1:]:
        # Different text in each dtype (near-ties) makes a few hundred drafts a noisy sample: the benchmark checks
        # the 15% target on more prompts; this catches a broken head (1 in 249 accepted in the first report).
        assert rate(dtype_runs[dtype]) > 0.6 * f32, (dtype, rate(dtype_runs[dtype]), f32)


def test_thompson_cali_reads_exact_rows_and_drafts_in_bfloat16(dtype_runs):
    # The predictor's target side: the row that sampled each request's last token re-produces that token under the
    # LM head in bfloat16 too (same logits op as the sampler), and the policy still drafts.
    st = dtype_runs["bfloat16-tree"]["adaspec"]
    assert st["policy"] == "thompson-cali", st["policy"]
    assert st["row_checks"] > 20 and st["row_mismatches"] == 0, st
    assert st["tree_verified"] > 10, st
