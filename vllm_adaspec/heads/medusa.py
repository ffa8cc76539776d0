"""Medusa-1 heads (Cai et al. 2024, paper 002): K residual blocks on the target's final hidden state, each followed
by the target's own LM head restricted to a draft vocabulary. Head k (1-based) at position t predicts the token at
t + k + 1: the target's LM head at t predicts t + 1, which becomes the request's last committed token, so head k
drafts depth k of the tree below it. Pure torch: no vLLM.

Token-conditioned heads (the default the trainer writes): token t + 1 is already known when the heads draft (it is
the request's last committed token), so each block also reads its embedding, as Hydra's and EAGLE's drafters do:
h + SiLU(W_k [h; e] + b_k) with W_k [H, 2H]. Plain Medusa blocks are W_k [H, H]; the shape says which.

Checkpoint (`adaspec train medusa`): OUT/medusa.safetensors (w [K, H, H or 2H], b [K, H], draft_vocab [V'] int64) and
OUT/medusa.json (base model, K, per-head held-out accuracy by rank: the calibrated accuracies the sparse tree is
built from). `export_vllm_medusa` writes the layout vLLM's built-in `medusa` method loads.
"""

from __future__ import annotations

import json
import os

import torch

from vllm_adaspec.errors import SECTION, AdaspecConfigError

FORMAT = "vllm-adaspec/medusa/1"


def init_heads(num_heads: int, hidden: int, token_input: bool = False, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Zero blocks (Medusa's init): every head starts as the LM head on the target's own hidden state."""
    inputs = 2 * hidden if token_input else hidden
    return {"w": torch.zeros(num_heads, hidden, inputs, dtype=dtype), "b": torch.zeros(num_heads, hidden, dtype=dtype)}


def reads_token(w: torch.Tensor) -> bool:
    """w [K, H, H] reads the hidden state only; w [K, H, 2H] also the embedding of the last committed token."""
    return w.shape[2] == 2 * w.shape[1]


def head_states(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor, e: torch.Tensor | None = None) -> torch.Tensor:
    """h [R, H] final hidden states, e [R, H] embeddings of the tokens they produced (token-conditioned heads
    only); w [K, H, H or 2H] (out x in), b [K, H] -> [R, K, H]: h + SiLU(W_k x + b_k) per head, x = h or [h; e]."""
    if reads_token(w) != (e is not None):
        raise ValueError(f"heads of input width {w.shape[2]} (hidden {w.shape[1]}) "
                         f"{'need' if reads_token(w) else 'take no'} token embeddings")
    x = h if e is None else torch.cat([h, e], dim=-1)
    return h[:, None, :] + torch.nn.functional.silu(torch.einsum("ri,kgi->rkg", x, w) + b)


def head_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor, lm_rows: torch.Tensor,
                e: torch.Tensor | None = None) -> torch.Tensor:
    """h [R, H] (and e [R, H] for token-conditioned heads), lm_rows [V', H] (the LM head's rows of the draft
    vocabulary) -> logits [R, K, V'], all heads in one matmul."""
    return head_states(h, w, b, e) @ lm_rows.T


def save_medusa(folder: str, w: torch.Tensor, b: torch.Tensor, draft_vocab: torch.Tensor, meta: dict) -> None:
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    save_file({"w": w.detach().float().contiguous(), "b": b.detach().float().contiguous(),
               "draft_vocab": draft_vocab.to(torch.int64).contiguous()}, os.path.join(folder, "medusa.safetensors"))
    with open(os.path.join(folder, "medusa.json"), "w") as f:
        json.dump({"format": FORMAT, **meta}, f, indent=1, sort_keys=True)


def load_medusa(folder: str, tensors: bool = True) -> tuple[dict, dict[str, torch.Tensor] | None]:
    from vllm_adaspec.heads import load_checkpoint

    key = f"additional_config['{SECTION}']['medusa']"
    return load_checkpoint(folder, "medusa", FORMAT, tensors,
                           f"{key}: {folder!r} holds no Medusa heads (no medusa.json); train them with "
                           "`adaspec train medusa`", key=key)


def find_medusa(hf_config, setting: str = "auto") -> str:
    """The Medusa heads folder for this model: "auto" = the one shipped for it; else a folder, whose heads must
    have been trained for this model's config. Raises AdaspecConfigError naming what is missing or mismatched."""
    from vllm_adaspec.heads import SHIPPED_DIR, config_hash

    want = config_hash(hf_config)
    if setting != "auto":
        meta, _ = load_medusa(setting, tensors=False)
        base = meta["base_model"]
        if base["config_hash"] != want:
            raise AdaspecConfigError(
                f"additional_config['{SECTION}']['medusa']: {setting} was trained for {base.get('name')} (config hash "
                f"{base['config_hash']}), not for this model (config hash {want}); train heads for it with "
                "`adaspec train medusa --model MODEL`")
        return setting
    for name in sorted(os.listdir(SHIPPED_DIR)):
        folder = os.path.join(SHIPPED_DIR, name)
        if os.path.isfile(os.path.join(folder, "medusa.json")):
            if load_medusa(folder, tensors=False)[0]["base_model"]["config_hash"] == want:
                return folder
    raise AdaspecConfigError(
        f"additional_config['{SECTION}']['pools']: 'medusa' has no heads shipped for this model (config hash {want}); "
        "train them with `adaspec train medusa --model MODEL` and pass the folder as 'medusa', or drop 'medusa'")


def check_weights(meta: dict, folder: str, hf_config, get_weights) -> None:
    """The loaded target's weights are the ones the heads were trained on (tolerant fingerprint, any dtype)."""
    from vllm_adaspec.heads import fingerprint_mismatch, hf_num_layers, weights_fingerprint

    base = meta["base_model"]
    off = fingerprint_mismatch(base["weights_fingerprint"],
                               weights_fingerprint(get_weights, hf_num_layers(hf_config), hf_config.vocab_size))
    if off is not None:
        raise AdaspecConfigError(
            f"Medusa heads {folder} were trained for {base.get('name')} with other weights (its weights fingerprint is "
            f"{off:.3g}x the tolerance away); train heads for these weights with `adaspec train medusa`")


def export_vllm_medusa(folder: str, out: str, lm_head: torch.Tensor, vocab_size: int) -> str:
    """Write `folder`'s heads in the layout vLLM's `medusa` method loads (config.json + model.safetensors: one
    residual layer per head with bias, one LM head shared by all heads).

    vLLM 0.32 cannot load a truncated vocabulary (its loader registers `token_map` as a parameter and then reports
    it as never loaded), so the shared head spans the whole vocabulary with the rows outside the draft vocabulary
    zeroed: a token outside it scores 0, so vLLM's top-1 equals ours whenever the best draft-vocabulary logit is
    positive."""
    from safetensors.torch import save_file

    meta, t = load_medusa(folder)
    if reads_token(t["w"]):
        raise ValueError(f"{folder}: token-conditioned heads (they read the last token's embedding) have no vLLM "
                         "`medusa` layout, whose heads read the hidden state only; train plain heads for vLLM with "
                         "`adaspec train medusa --no-token-input --export-vllm DIR`")
    k, hidden = t["w"].shape[0], t["w"].shape[1]
    tensors = {f"blocks.{i}.layers.0.weight": t["w"][i].contiguous() for i in range(k)}
    tensors.update({f"blocks.{i}.layers.0.bias": t["b"][i].contiguous() for i in range(k)})
    head = torch.zeros(vocab_size, hidden)
    head[t["draft_vocab"]] = lm_head[:vocab_size][t["draft_vocab"]].detach().float()
    tensors["lm_heads.0.weight"] = head
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    cfg = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": hidden, "vocab_size": vocab_size,
           "num_heads": k, "num_hidden_layers": 1, "medusa_fc_bias": True, "original_lm_head": True,
           "truncated_vocab_size": vocab_size, "torch_dtype": "float32",
           "adaspec_source": {"folder": os.path.abspath(folder), "base_model": meta["base_model"].get("name")}}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return out
