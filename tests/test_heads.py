"""Exit-head checkpoints: identity of the base model, N, and the shipped head."""

import json
import os

import pytest
import torch

from vllm_adaspec.config import AdaspecConfigError
from vllm_adaspec.heads import (check_against_model, config_hash, find_shipped, fingerprint_mismatch,
                                fingerprint_names, load_exit_head, save_exit_head, weights_fingerprint)

SMOL = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
        "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 100000.0}, "tie_word_embeddings": True}


def test_config_hash_sees_shape_fields_only():
    assert config_hash(SMOL) == config_hash({**SMOL, "transformers_version": "9", "use_cache": False})
    assert config_hash(SMOL) == config_hash({**SMOL, "rope_theta": 100000.0})  # old and new rope spelling
    for k, v in (("num_hidden_layers", 24), ("hidden_size", 896), ("vocab_size", 151936), ("rope_theta", 1e6)):
        assert config_hash(SMOL) != config_hash({**SMOL, k: v}), k


def test_weights_fingerprint_is_dtype_and_padding_independent():
    g = torch.Generator().manual_seed(0)
    h = 1024  # thousands of values per chunk, as in a real model: rounding averages out
    t = {"model.embed_tokens.weight": torch.randn(1000, h, generator=g) * 0.02,
         "model.norm.weight": 1 + 0.1 * torch.randn(h, generator=g)}
    for i in range(2):
        t[f"model.layers.{i}.input_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        t[f"model.layers.{i}.post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    fp = weights_fingerprint(t.__getitem__, 2, 1000)
    for dtype in (torch.bfloat16, torch.float16):  # float16 -> bfloat16 is not float32 -> bfloat16: no exact hash
        low = {k: v.to(dtype) for k, v in t.items()}
        assert fingerprint_mismatch(fp, weights_fingerprint(low.__getitem__, 2, 1000)) is None, dtype
    padded = dict(t, **{"model.embed_tokens.weight": torch.cat([t["model.embed_tokens.weight"], torch.ones(6, h)])})
    assert fingerprint_mismatch(fp, weights_fingerprint(padded.__getitem__, 2, 1000)) is None
    changed = dict(t, **{"model.layers.1.input_layernorm.weight": t["model.layers.1.input_layernorm.weight"] * 1.02})
    assert fingerprint_mismatch(fp, weights_fingerprint(changed.__getitem__, 2, 1000)) > 1
    tuned = dict(t, **{"model.embed_tokens.weight": t["model.embed_tokens.weight"] * 1.01})
    assert fingerprint_mismatch(fp, weights_fingerprint(tuned.__getitem__, 2, 1000)) > 1


def test_the_shipped_head_fingerprint_matches_the_checkpoint_in_every_dtype(smollm2):
    from vllm_adaspec.heads import find_shipped, legacy_fingerprint, load_exit_head
    from vllm_adaspec.training.layers import read_hf_tensors

    meta, _ = load_exit_head(find_shipped(json.load(open(f"{smollm2}/config.json"))), tensors=False)
    t = read_hf_tensors(smollm2, fingerprint_names(30))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        low = {k: v.to(dtype) for k, v in t.items()}
        assert fingerprint_mismatch(meta["base_model"]["weights_fingerprint"],
                                    weights_fingerprint(low.__getitem__, 30, 49152)) is None, dtype
    # the sha256 format of older heads still works for the loads it could tell apart
    assert len(legacy_fingerprint(t.__getitem__, 30, 49152)) == 16


def _meta(n=4):
    return {"base_model": {"name": "smol", "architectures": ["LlamaForCausalLM"], "config_hash": config_hash(SMOL),
                           "weights_fingerprint": "abc"}, "exit_layer": n, "num_exit_layers": 1, "lm_head": "shared",
            "draft_vocab_size": 3}


def test_check_against_model_names_what_does_not_match():
    g = torch.Generator().manual_seed(1)
    weights = {n: torch.randn(SMOL["vocab_size"] if "embed" in n else 576, *((576,) if "embed" in n else ()),
                              generator=g) for n in fingerprint_names(30)}
    meta = _meta()
    meta["base_model"]["weights_fingerprint"] = weights_fingerprint(weights.__getitem__, 30, SMOL["vocab_size"])
    check_against_model(meta, "F", SMOL, None)
    check_against_model(meta, "F", SMOL, 4, get_weights=weights.__getitem__)
    with pytest.raises(AdaspecConfigError, match=r"\['exit_layer'\] = 6, but exit head F was trained on the first 4"):
        check_against_model(_meta(), "F", SMOL, 6)
    with pytest.raises(AdaspecConfigError, match="not for this model"):
        check_against_model(_meta(), "F", {**SMOL, "num_hidden_layers": 24}, None)
    other = dict(weights, **{"model.norm.weight": weights["model.norm.weight"] + 1})
    with pytest.raises(AdaspecConfigError, match="different weights"):
        check_against_model(meta, "F", SMOL, None, get_weights=other.__getitem__)
    with pytest.raises(AdaspecConfigError, match="different weights"):  # a head with the old sha256 format
        check_against_model(_meta(), "F", SMOL, None, get_weights=weights.__getitem__)


def test_save_load_roundtrip(tmp_path):
    t = {"layers.0.mlp.up_proj.weight": torch.randn(3, 2), "norm.weight": torch.ones(2),
         "draft_vocab": torch.tensor([5, 7, 9])}
    save_exit_head(str(tmp_path), t, _meta())
    meta, got = load_exit_head(str(tmp_path))
    assert meta["exit_layer"] == 4 and meta["format"].startswith("vllm-adaspec/exit-head/")
    assert got["draft_vocab"].dtype == torch.int64 and got["draft_vocab"].tolist() == [5, 7, 9]
    assert got["layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    with pytest.raises(AdaspecConfigError, match="not an exit-head checkpoint folder"):
        load_exit_head(str(tmp_path / "nope"))


def test_a_head_ships_for_smollm2_and_matches_its_config(smollm2):
    cfg = json.load(open(os.path.join(smollm2, "config.json")))
    folder = find_shipped(cfg)
    assert folder is not None
    meta, tensors = load_exit_head(folder)
    assert meta["base_model"]["config_hash"] == config_hash(cfg)
    assert meta["lm_head"] == "shared" and "lm_head.weight" not in tensors  # small: the LM head is the target's
    assert os.path.getsize(os.path.join(folder, "exit_head.safetensors")) < 16 * 2**20
    assert find_shipped(cfg, exit_layer=meta["exit_layer"] + 1) is None
    from vllm_adaspec.heads import fingerprint_names
    from vllm_adaspec.training.layers import read_hf_tensors

    t = read_hf_tensors(smollm2, fingerprint_names(cfg["num_hidden_layers"]))
    assert fingerprint_mismatch(meta["base_model"]["weights_fingerprint"],
                                weights_fingerprint(t.__getitem__, cfg["num_hidden_layers"], cfg["vocab_size"])) is None


def test_the_shipped_head_agrees_with_the_target(smollm2):
    """Measured, not read back from the head's own record: on text it was not trained on (HumanEval and MT-Bench
    prompts; training prompts come from the standard library's sources), the head's draft at each position equals
    the full model's argmax there for more than a fifth of the positions (measured: 0.24 here; its record says 0.41
    on held-out text of its training kind). A head that does not fit the model scores near 0."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_adaspec.data.prompts import load_prompts
    from vllm_adaspec.training.layers import exit_head_drafts

    folder = find_shipped(json.load(open(os.path.join(smollm2, "config.json"))))
    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    agree = total = 0
    for prompt in load_prompts("humaneval", 3, tokenizer=tok) + load_prompts("mtbench", 3, tokenizer=tok):
        ids = tok(prompt).input_ids
        with torch.no_grad():
            target = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()  # the full model's next token
        drafts = exit_head_drafts(smollm2, folder, ids)  # the head's, at the same positions
        agree += sum(d == t for d, t in zip(drafts, target, strict=True))
        total += len(ids)
    assert total > 400
    assert agree / total > 0.2, (agree, total)
