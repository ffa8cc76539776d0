"""Medusa heads inside vLLM: the checkpoint's blocks on the target's device and dtype, and the target's own LM head
rows of the draft vocabulary (vLLM model internals: `lm_head`, `embed_input_ids`, parameter names for the weights
fingerprint)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from vllm_adaspec.engine.vllm_surface import vllm_object


@dataclass
class MedusaHeads:
    w: torch.Tensor  # [K, H, H or 2H]
    b: torch.Tensor  # [K, H]
    vocab: torch.Tensor  # [V'] full ids
    lm_rows: torch.Tensor  # [V', H] the target's LM head rows of V'
    accuracy: list[list[float]]  # held-out accuracy by head and rank (the sparse tree's estimates)
    folder: str
    embed: Callable[[torch.Tensor], torch.Tensor] | None = None  # token ids [R] -> [R, H]; token-conditioned heads
    # CPU: the two matmuls through vLLM's oneDNN GEMM on bfloat16 copies of the weights (the heads stream ~20 MB of
    # float32 weights per step, a few % of a SmolLM2 step; bfloat16 halves it and oneDNN's small-M path is 3x
    # torch's here). The heads only propose candidates the target verifies: their precision never reaches the
    # output. None: torch in the model's dtype.
    onednn: tuple | None = None

    def logits(self, h: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor:
        """h [R, H] final hidden states (e [R, H] embeddings of their tokens) -> [R, K, V'] draft logits."""
        from vllm_adaspec.heads.medusa import head_logits

        if self.onednn is None:
            return head_logits(h.to(self.w.dtype), self.w, self.b, self.lm_rows, None if e is None else e.to(self.w.dtype))
        ops = vllm_object("custom_ops")

        blocks, lm = self.onednn
        k, hidden = self.b.shape
        x = h if e is None else torch.cat([h, e.to(h.dtype)], dim=-1)
        z = ops.onednn_mm(blocks, x.to(torch.bfloat16), None).float().view(-1, k, hidden)  # [R, K, H]
        states = h.float()[:, None, :] + torch.nn.functional.silu(z + self.b.float())
        return ops.onednn_mm(lm, states.view(-1, hidden).to(torch.bfloat16), None).view(len(h), k, -1)


def load_medusa_heads(target_model, vllm_config, folder: str) -> MedusaHeads:
    from vllm_adaspec.heads.medusa import check_weights, load_medusa, reads_token

    hf = vllm_config.model_config.hf_text_config
    # tensor_parallel_size 1 is a start-up check (engine/startup.py): the pool is not run otherwise
    meta, t = load_medusa(folder)
    params = dict(target_model.named_parameters())
    check_weights(meta, folder, hf, params.__getitem__)  # raises when the target's weights are not the trained-on ones
    device, dtype = next(target_model.parameters()).device, vllm_config.model_config.dtype
    vocab = t["draft_vocab"].to(device)
    rows = target_model.lm_head.weight[: hf.vocab_size][vocab].detach().clone()  # [V', H] contiguous: one GEMM
    embed = target_model.embed_input_ids if reads_token(t["w"]) else None  # the target's own table: no copy
    heads = MedusaHeads(t["w"].to(device, dtype), t["b"].to(device, dtype), vocab, rows.to(dtype),
                        meta["accuracy_by_rank"], folder, embed)
    heads.onednn = _onednn_handlers(heads, device)
    return heads


def _onednn_handlers(heads: MedusaHeads, device) -> tuple | None:
    """vLLM's oneDNN GEMM handlers for the heads' blocks [K * H, in] and LM rows [V', H] in bfloat16 (CPU only)."""
    ops = vllm_object("custom_ops")

    if device.type != "cpu" or not getattr(ops, "_supports_onednn", False):
        return None
    k, hidden, inputs = heads.w.shape
    try:
        blocks = ops.create_onednn_mm(heads.w.reshape(k * hidden, inputs).to(torch.bfloat16).t(), 32)
        lm = ops.create_onednn_mm(heads.lm_rows.to(torch.bfloat16).t(), 32)
    except RuntimeError:  # a oneDNN build without bfloat16 matmul: torch it is
        return None
    return blocks, lm
