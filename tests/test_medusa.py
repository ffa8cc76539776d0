"""Medusa heads (heads/medusa.py), their sparse tree and pool (pools/medusa.py): pure torch / Python, no vLLM."""

import json

import numpy as np
import pytest
import torch

from vllm_adaspec.config import AdaspecConfigError
from vllm_adaspec.heads.medusa import (export_vllm_medusa, find_medusa, head_logits, init_heads, load_medusa,
                                       save_medusa)
from vllm_adaspec.pools.medusa import propose_medusa, sparse_tree


def test_head_logits_are_each_heads_residual_block_then_the_shared_rows():
    g = torch.Generator().manual_seed(0)
    r, k, h, v = 3, 4, 8, 11
    x, w, b = torch.randn(r, h, generator=g), torch.randn(k, h, h, generator=g), torch.randn(k, h, generator=g)
    rows = torch.randn(v, h, generator=g)
    got = head_logits(x, w, b, rows)
    assert got.shape == (r, k, v)
    for j in range(k):  # one head at a time, as vLLM's ResidualBlock + LM head compute it
        z = x + torch.nn.functional.silu(torch.nn.functional.linear(x, w[j], b[j]))
        torch.testing.assert_close(got[:, j], z @ rows.T)
    zero = init_heads(k, h)  # Medusa's init: every head is the LM head on the hidden state itself
    torch.testing.assert_close(head_logits(x, zero["w"], zero["b"], rows), (x @ rows.T)[:, None].expand(r, k, v))


def test_token_conditioned_heads_read_the_hidden_state_and_the_last_tokens_embedding():
    g = torch.Generator().manual_seed(1)
    r, k, h, v = 3, 2, 8, 11
    x, e = torch.randn(r, h, generator=g), torch.randn(r, h, generator=g)
    w, b, rows = torch.randn(k, h, 2 * h, generator=g), torch.randn(k, h, generator=g), torch.randn(v, h, generator=g)
    got = head_logits(x, w, b, rows, e)
    for j in range(k):  # W_k [h; e] = A_k h + B_k e: the two halves of the block's input
        z = x + torch.nn.functional.silu(x @ w[j, :, :h].T + e @ w[j, :, h:].T + b[j])
        torch.testing.assert_close(got[:, j], z @ rows.T)
    assert init_heads(k, h, token_input=True)["w"].shape == (k, h, 2 * h)
    with pytest.raises(ValueError, match="need token embeddings"):
        head_logits(x, w, b, rows)
    with pytest.raises(ValueError, match="take no token embeddings"):
        head_logits(x, w[:, :, :h], b, rows, e)


def test_sparse_tree_takes_the_paths_of_highest_accuracy_product():
    acc = [[0.6, 0.2, 0.1], [0.5, 0.3, 0.0], [0.4, 0.1, 0.0]]
    t = sparse_tree(acc, budget=5)
    # values: (0) .6, (0,0) .3, (1) .2, (0,1) .18, (0,0,0) .12, (2) .1, (1,0) .1 ...
    paths = []
    for i in range(len(t)):
        p, node = [], i
        while node >= 0:
            p.append(t.rank[node])
            node = t.parents[node]
        paths.append(tuple(reversed(p)))
    assert paths == [(0,), (0, 0), (1,), (0, 1), (0, 0, 0)]
    assert t.estimate == pytest.approx((0.6, 0.3, 0.2, 0.18, 0.12))
    assert all(t.parents[i] < i for i in range(len(t)))  # parents first
    assert t.depth == (1, 2, 1, 2, 3) and t.max_rank == 2
    assert len(sparse_tree(acc, budget=100)) == 3 + 3 * 2 + 3 * 2 * 2  # ranks of accuracy 0 are never drafted


def test_propose_medusa_fills_the_tree_with_each_heads_ranked_tokens():
    t = sparse_tree([[0.6, 0.2], [0.5, 0.3]], budget=4)  # (0), (0,0), (1), (0,1)
    ids = np.array([[10, 11], [20, 21]])
    probs = np.array([[0.7, 0.2], [0.55, 0.25]])
    c = propose_medusa(t, ids, probs)
    assert c.tokens == [10, 20, 11, 21] and c.parents == [-1, 0, -1, 0]
    assert c.probs == pytest.approx([0.7, 0.55, 0.2, 0.25])
    assert c.pool == "medusa" and c.evidence == [1, 2, 1, 2]  # evidence: the head (depth)


def test_checkpoint_round_trip_lookup_and_errors(tmp_path, monkeypatch):
    from vllm_adaspec import heads

    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
           "num_key_value_heads": 1, "intermediate_size": 16, "vocab_size": 32}
    w = init_heads(2, 8)
    meta = {"base_model": {"name": "tiny", "config_hash": heads.config_hash(cfg), "weights_fingerprint": []},
            "num_heads": 2, "accuracy_by_rank": [[0.5, 0.1], [0.3, 0.1]]}
    folder = tmp_path / "shipped" / "tiny"
    save_medusa(str(folder), w["w"] + 1, w["b"], torch.arange(5), meta)
    got_meta, t = load_medusa(str(folder))
    assert got_meta["num_heads"] == 2 and torch.equal(t["w"], w["w"] + 1) and t["draft_vocab"].tolist() == [0, 1, 2, 3, 4]
    monkeypatch.setattr(heads, "SHIPPED_DIR", str(tmp_path / "shipped"))
    assert find_medusa(cfg) == str(folder)  # "auto": shipped for this config
    other = {**cfg, "hidden_size": 16}
    with pytest.raises(AdaspecConfigError, match=r"\['pools'\]: 'medusa' has no heads shipped for this model"):
        find_medusa(other)
    with pytest.raises(AdaspecConfigError, match=r"\['medusa'\]: .*tiny was trained for tiny .*not for this model"):
        find_medusa(other, str(folder))
    with pytest.raises(AdaspecConfigError, match=r"holds no Medusa heads \(no medusa.json\).*adaspec train medusa"):
        find_medusa(cfg, str(tmp_path))
    # vLLM's built-in `medusa` layout: one residual layer per head, the shared LM head, the draft vocabulary map.
    from safetensors.torch import load_file

    lm = torch.randn(32, 8)
    out = export_vllm_medusa(str(folder), str(tmp_path / "vllm"), lm, 32)
    c = json.load(open(f"{out}/config.json"))
    assert (c["model_type"], c["num_heads"], c["num_hidden_layers"], c["truncated_vocab_size"]) == ("medusa", 2, 1, 32)
    assert c["original_lm_head"] and c["medusa_fc_bias"]
    st = load_file(f"{out}/model.safetensors")
    assert sorted(st) == ["blocks.0.layers.0.bias", "blocks.0.layers.0.weight", "blocks.1.layers.0.bias",
                          "blocks.1.layers.0.weight", "lm_heads.0.weight"]
    assert torch.equal(st["blocks.1.layers.0.weight"], w["w"][1] + 1)
    assert torch.equal(st["lm_heads.0.weight"][:5], lm[:5]) and not st["lm_heads.0.weight"][5:].any()  # V' = 0..4
    tok = tmp_path / "token"  # token-conditioned heads have no vLLM layout: a clear refusal, nothing written
    save_medusa(str(tok), init_heads(2, 8, token_input=True)["w"], w["b"], torch.arange(5), meta)
    with pytest.raises(ValueError, match="token-conditioned heads .* --no-token-input"):
        export_vllm_medusa(str(tok), str(tmp_path / "vllm-tok"), lm, 32)
    assert not (tmp_path / "vllm-tok").exists()


def test_default_pools_drop_what_a_model_lacks_and_listed_pools_must_exist(smollm2):
    """usable_pools: the default set runs the pools a model has files for; a listed pool without its file fails."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from vllm_adaspec.config import parse_adaspec_config, resolve_config
    from vllm_adaspec.engine.startup import usable_pools

    def resolved(section, **hf_changes):
        hf = AutoConfig.from_pretrained(smollm2)
        for k, v in hf_changes.items():
            setattr(hf, k, v)
        vc = SimpleNamespace(model_config=SimpleNamespace(tokenizer=smollm2, hf_text_config=hf),
                             parallel_config=SimpleNamespace(tensor_parallel_size=1))
        cfg = resolve_config(parse_adaspec_config({"adaspec": section}, proposer="multi_branch"), architectures=None,
                             num_layers=30, num_speculative_tokens=16, proposer="multi_branch")
        return cfg, vc

    every = ["context", "suffix", "recycled", "corpus", "medusa"]
    assert usable_pools(*resolved({"pools": every})) == tuple(every)  # SmolLM2: table and heads ship
    # Another model (its config differs: no heads ship for it): the default set leaves medusa out ...
    cfg, vc = resolved({}, hidden_size=1024)
    assert "medusa" not in usable_pools(cfg, vc) and "context" in usable_pools(cfg, vc)
    # ... and listing it fails, naming the pool and what to do.
    with pytest.raises(AdaspecConfigError, match=r"'medusa' has no heads shipped for this model"):
        usable_pools(*resolved({"pools": ["context", "medusa"]}, hidden_size=1024))


def test_medusa_positions_label_head_k_with_the_targets_argmax_k_tokens_after_the_next():
    from vllm_adaspec.training.distill import Sequences
    from vllm_adaspec.training.medusa_trainer import medusa_positions

    # two sequences: prompt [1, 2] + generated [3, 4, 5]; prompt [7] + generated [8, 9]
    tokens = np.array([1, 2, 3, 4, 5, 7, 8, 9])
    argmax = np.array([30, 40, 50, 80, 90])  # the target's top token at each generated position (sampled text differs)
    seqs = Sequences(tokens=tokens, offsets=np.array([0, 5, 8]), prompt_lens=np.array([2, 1]),
                     sampled=np.array([True, False]), topk_ids=np.stack([argmax, argmax * 0], 1),
                     topk_logp=np.zeros((5, 2), np.float16))
    pos, lab = medusa_positions(seqs, np.array([0, 1]), num_heads=2)
    # t = last prompt token .. second-to-last token; head k labels position t + k + 1
    assert pos.tolist() == [1, 2, 3, 5, 6]
    assert lab.tolist() == [[40, 50], [50, -1], [-1, -1], [90, -1], [-1, -1]]
