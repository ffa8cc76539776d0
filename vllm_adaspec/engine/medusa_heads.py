"""Medusa heads inside vLLM: the checkpoint's blocks on the target's device and dtype, and the target's own LM head
rows of the draft vocabulary (vLLM model internals: `lm_head`, `embed_input_ids`, parameter names for the weights
fingerprint)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from vllm_adaspec.config import AdaspecConfigError


@dataclass
class MedusaHeads:
    w: torch.Tensor  # [K, H, H or 2H]
    b: torch.Tensor  # [K, H]
    vocab: torch.Tensor  # [V'] full ids
    lm_rows: torch.Tensor  # [V', H] the target's LM head rows of V'
    accuracy: list[list[float]]  # held-out accuracy by head and rank (the sparse tree's estimates)
    folder: str
    embed: Callable[[torch.Tensor], torch.Tensor] | None = None  # token ids [R] -> [R, H]; token-conditioned heads


def load_medusa_heads(target_model, vllm_config, folder: str) -> MedusaHeads:
    from vllm_adaspec.heads.medusa import check_weights, load_medusa, reads_token

    hf = vllm_config.model_config.hf_text_config
    if vllm_config.parallel_config.tensor_parallel_size > 1:
        raise AdaspecConfigError("vllm_adaspec: Medusa heads need tensor_parallel_size == 1 for now")
    meta, t = load_medusa(folder)
    params = dict(target_model.named_parameters())
    check_weights(meta, folder, hf, params.__getitem__)  # raises when the target's weights are not the trained-on ones
    device, dtype = next(target_model.parameters()).device, vllm_config.model_config.dtype
    vocab = t["draft_vocab"].to(device)
    rows = target_model.lm_head.weight[: hf.vocab_size][vocab].detach().clone()  # [V', H] contiguous: one GEMM
    embed = target_model.embed_input_ids if reads_token(t["w"]) else None  # the target's own table: no copy
    return MedusaHeads(t["w"].to(device, dtype), t["b"].to(device, dtype), vocab, rows.to(dtype),
                       meta["accuracy_by_rank"], folder, embed)
