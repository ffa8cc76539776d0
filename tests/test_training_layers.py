"""The plain-torch decoder stack used for training matches the real model (transformers), float32."""

import torch

from vllm_adaspec.training.layers import ExitHead, LayerShape, load_layer, rms_norm, target_prefix_layers


def test_prefix_stack_reproduces_transformers_logits(smollm2):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 504, 3458, 282, 4, 7863, 28, 253, 1345, 30, 2000, 42]])
    pos = torch.arange(ids.shape[1])[None]
    L = hf.config.num_hidden_layers
    stack = target_prefix_layers(smollm2, L)
    with torch.no_grad():
        h = stack(ids, pos, capture=(4, L))
        ours = rms_norm(h[L], hf.model.norm.weight, hf.config.rms_norm_eps) @ hf.lm_head.weight.T
        ref = hf(ids).logits
    assert torch.allclose(ours, ref, atol=2e-3, rtol=1e-4), (ours - ref).abs().max()
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    # Right padding does not change earlier positions (causal attention): what batching in the trainer relies on.
    padded = torch.cat([ids, torch.zeros(1, 5, dtype=ids.dtype)], 1)
    with torch.no_grad():
        hp = stack(padded, torch.arange(padded.shape[1])[None], capture=(4,))
    # (SmolLM2's hidden states reach ~770 at layer 4: GEMMs blocked for 17 rows instead of 12 round differently, by
    # ~4e-4 on an AVX-512 Xeon; a padding token leaking into earlier positions would move them by whole units)
    torch.testing.assert_close(hp[4][:, : ids.shape[1]], h[4], rtol=1e-5, atol=1e-5 * float(h[4].abs().max()))


def test_exit_head_initialised_from_last_layer_is_that_layer(smollm2):
    import json, os

    cfg = json.load(open(os.path.join(smollm2, "config.json")))
    s = LayerShape.from_hf_config(cfg)
    head = ExitHead(s)
    load_layer(head.layers[0], smollm2, cfg["num_hidden_layers"] - 1)
    stack = target_prefix_layers(smollm2, 2)
    ids = torch.tensor([[1, 20, 300, 4000]])
    pos = torch.arange(4)[None]
    with torch.no_grad():
        h2 = stack(ids, pos, capture=(2,))[2]
        out = head(h2, pos)
        ref = rms_norm(head.layers[0](h2, pos), head.norm.weight, s.eps)
    assert torch.allclose(out, ref)
    assert not torch.allclose(out, rms_norm(h2, head.norm.weight, s.eps))
