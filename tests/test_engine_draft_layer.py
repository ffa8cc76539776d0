"""EarlyExitProposer with the shipped draft layer (an exit head on all of SmolLM2's layers that reads the target's
features: its final hidden state and, fused with it, the residual streams after some earlier layers, which vLLM returns
from the forward as EAGLE-3's auxiliary hidden states: training/draft_layer.py, engine/drafting.py `feed`), end to
end in vLLM's default compiled mode (the auxiliary outputs are part of the compiled graph): greedy output equals plain
decoding on the mixed batch (prefills, prefix caching) and on its next turn, and the engine's drafts are the torch
reference's: rounds and acceptance equal a torch replay of the same layer, its weights int8 as the engine's default
runs them, on the same text (a feature read one row off, a depth missing or out of order, a KV row fed from the wrong
feature or a wrong int8 row, drafts garbage)."""

import pytest

from conftest import ENGINE, NEXT_TURN, PROMPTS, SPEC, assert_identical, greedy_batch

pytestmark = pytest.mark.engine

K = 4


def draft_layer_folder() -> str:
    from vllm_adaspec.heads import SHIPPED_DIR

    import os

    return os.path.join(SHIPPED_DIR, "smollm2-135m-instruct-draft-layer")


def test_draft_layer_is_lossless_and_drafts_what_a_torch_replay_predicts(smollm2, plain_greedy,
                                                                                       engines):
    from transformers import AutoTokenizer

    from vllm_adaspec.training.draft_layer import load_draft_layer, with_int8_weights

    engine = {k: v for k, v in ENGINE.items() if k != "enforce_eager"}  # vLLM's default: compiled
    spec = {**engine, "speculative_config": {"model": SPEC, "num_speculative_tokens": K},
            # K drafts every round (no cost model, fixed length): the replay's chains of K
            "additional_config": {"adaspec": {"exit_head": draft_layer_folder(), "cost_model": "off",
                                              "policy": "fixed"}}}
    res = engines.run({"model": smollm2, "engine": spec, "batches": [greedy_batch(), NEXT_TURN]})
    run, next_turn = (b["runs"][0] for b in res["batches"])
    assert_identical(run, plain_greedy["mixed"])
    assert_identical(next_turn, plain_greedy["next_turn"])
    st = run["adaspec"]
    assert st["drafter_faults"] == 0 and st["config"]["exit_kv_layers"] == ["adaspec_exit.layers.30.self_attn.attn"]
    # the torch reference on the same text: from every position, a chain of K drafts, decoded K a round
    tok = AutoTokenizer.from_pretrained(smollm2)
    seqs = []
    for p, out, plen in zip(PROMPTS, run["token_ids"], run["prompt_lens"]):
        ids = tok(p)["input_ids"]
        assert len(ids) == plen
        seqs.append((plen, ids + list(out)))
    layer, vocab = load_draft_layer(smollm2, draft_layer_folder())
    # the default on this CPU: the layer's weights as int8 rows (kernels/int8_linear.py); the reference computes so
    assert st["config"]["draft_weights"] == "int8"
    layer = with_int8_weights(layer)
    assert len(layer.feature_layers) > 1  # the shipped layer fuses several depths: the auxiliary path is tested
    rounds, accepted = reference_rounds(smollm2, layer, vocab, seqs)
    engine_rounds = sum(st["round_lengths"][1:])
    # the engine's rounds are the reference's (K drafts from the same text), up to float32 noise between vLLM's
    # kernels and torch's and each request's first row (position 0 reads no feature)
    assert engine_rounds == pytest.approx(rounds, rel=0.05), (engine_rounds, rounds)
    assert st["accepted_drafts"] / engine_rounds == pytest.approx(accepted / rounds, rel=0.1), (st, accepted, rounds)
    assert accepted / rounds > 0.5, accepted / rounds  # a layer that drafts (0 = nothing accepted)
    # every decode step's first committed row was written by the step before's first draft pass and is not run
    # again (the acceptance above is what proves that KV right)
    assert st["feed_rows_reused"] >= 0.9 * engine_rounds, st


def reference_rounds(model_dir, layer, vocab, seqs) -> tuple[int, int]:
    """Greedy decoding of each (prompt length, prompt + output) with K drafts a round from the torch draft layer, as
    the engine runs it: the prefill commits the first output token, then each round drafts a chain of K from the
    feature of the row before the last committed token and commits the accepted drafts + 1. (rounds, accepted)."""
    import numpy as np
    import torch

    from vllm_adaspec.training.draft_layer import chain_drafts, target_features

    layer.vocab = torch.as_tensor(vocab, dtype=torch.long)
    rounds = accepted = 0
    for plen, ids in seqs:
        ids = np.asarray(ids)
        f, _ = target_features(model_dir, layer.feature_layers, ids)
        x = torch.from_numpy(np.concatenate([ids[1:], ids[-1:]]).astype(np.int64))
        drafts = layer.vocab[chain_drafts(layer, "layer", torch.from_numpy(f.astype(np.float32)), x, K)].numpy()
        c = plen + 1  # committed tokens after the prefill
        while c < len(ids):
            truth = ids[c:c + K]
            a = int(np.cumprod(drafts[c - 2, :len(truth)] == truth).sum())
            rounds, accepted = rounds + 1, accepted + min(a, len(truth) - 1)
            c += min(a, len(truth) - 1) + 1
    return rounds, accepted
