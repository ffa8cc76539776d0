"""Fused entropy, max probability and top-k of softmax(logits / T) per row, in one pass over the vocabulary.

What adaptive draft-length policies need from a draft distribution each step: its entropy (AdaEDL), its top
probability (max-confidence), its top-k tokens and probabilities (tree drafting). Torch does that with a softmax,
a log-softmax, a product, a sum and a topk: five passes over [rows, vocab] and two [rows, vocab] temporaries. The
kernel reads each logit once: one program per row walks the vocabulary in blocks keeping an online softmax
(running max m, sum s of exp(x - m), sum t of exp(x - m) * x) and a running top-k, then

    entropy = m + log s - t / s,    max probability = 1 / s,    p_i = exp(x_i - m) / s.

Contents: `_entropy_topk_kernel` (Triton), `entropy_topk_triton` (its launcher), `entropy_topk_reference`
(plain torch, any dtype; float64 in the tests), and `entropy_topk`, which picks the kernel on CUDA and torch
elsewhere. Temperatures <= 0 (greedy requests) are treated as 1: the statistics then describe the raw model.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only environments without Triton use the torch path
    triton = None

__all__ = ["entropy_topk", "entropy_topk_reference", "entropy_topk_triton"]


def _temperatures(temperature, rows: int, device) -> torch.Tensor:
    t = torch.as_tensor(temperature, dtype=torch.float32, device=device).reshape(-1)
    if t.numel() == 1:
        t = t.expand(rows)
    if t.numel() != rows:
        raise ValueError(f"temperature has {t.numel()} values for {rows} rows")
    return torch.where(t > 0, t, torch.ones_like(t)).contiguous()


def entropy_topk_reference(logits: torch.Tensor, temperature=1.0, k: int = 1, dtype=torch.float64):
    """[R, V] logits -> (entropy [R], max_prob [R], top_ids [R, k] int64, top_probs [R, k]), computed in `dtype`."""
    x = logits.to(dtype) / _temperatures(temperature, logits.shape[0], logits.device).to(dtype)[:, None]
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    entropy = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)
    top_probs, top_ids = p.topk(k, dim=-1)
    return entropy, top_probs[:, 0], top_ids, top_probs


if triton is not None:

    @triton.jit
    def _entropy_topk_kernel(logits_ptr, stride_row, temp_ptr, ent_ptr, maxp_ptr, ids_ptr, probs_ptr, V,
                             K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        inv_t = 1.0 / tl.load(temp_ptr + row)
        cols = tl.arange(0, BLOCK)
        slots = tl.arange(0, KP)
        m = tl.full([], float("-inf"), tl.float32)  # running max of x = logits / T
        s = tl.zeros([], tl.float32)  # sum exp(x - m)
        t = tl.zeros([], tl.float32)  # sum exp(x - m) * x
        top_v = tl.full([KP], float("-inf"), tl.float32)  # running top-k (unordered; slots >= K unused)
        top_i = tl.zeros([KP], tl.int64)
        base = logits_ptr + row.to(tl.int64) * stride_row
        for start in range(0, V, BLOCK):
            offs = start + cols
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, tl.max(x, 0))
            e = tl.exp(x - m_new)  # 0 where x = -inf (padding or masked logits)
            scale = tl.exp(m - m_new)
            s = s * scale + tl.sum(e, 0)
            t = t * scale + tl.sum(e * tl.where(x > float("-inf"), x, 0.0), 0)  # no 0 * inf
            m = m_new
            # Merge the block's best K into the running top-k: each candidate replaces the current minimum.
            for _ in tl.static_range(K):
                bv = tl.max(x, 0)
                bi = tl.argmax(x, 0)
                low = tl.where(slots < K, top_v, float("inf"))
                slot = tl.where(bv > tl.min(low, 0), tl.argmin(low, 0), -1)  # -1: the candidate does not enter
                take = slots == slot
                top_v = tl.where(take, bv, top_v)
                top_i = tl.where(take, (start + bi).to(tl.int64), top_i)
                x = tl.where(cols == bi, float("-inf"), x)
        tl.store(ent_ptr + row, m + tl.log(s) - t / s)
        tl.store(maxp_ptr + row, 1.0 / s)
        for j in tl.static_range(K):  # emit in descending order
            best = tl.argmax(tl.where(slots < K, top_v, float("-inf")), 0)
            v = tl.max(tl.where(slots == best, top_v, float("-inf")), 0)
            i = tl.sum(tl.where(slots == best, top_i, 0), 0)
            tl.store(ids_ptr + row * K + j, i)
            tl.store(probs_ptr + row * K + j, tl.exp(v - m) / s)
            top_v = tl.where(slots == best, float("-inf"), top_v)


def entropy_topk_triton(logits: torch.Tensor, temperature=1.0, k: int = 1, block: int = 4096):
    """Launch the kernel: one program per row. logits [R, V] (fp32/bf16/fp16, unit stride along V)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, vocab] with unit stride along vocab, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, {vocab}], got {k}")
    temps = _temperatures(temperature, rows, logits.device)
    entropy = torch.empty(rows, dtype=torch.float32, device=logits.device)
    max_prob = torch.empty_like(entropy)
    top_ids = torch.empty(rows, k, dtype=torch.int64, device=logits.device)
    top_probs = torch.empty(rows, k, dtype=torch.float32, device=logits.device)
    block = min(block, triton.next_power_of_2(vocab))
    _entropy_topk_kernel[(rows,)](logits, logits.stride(0), temps, entropy, max_prob, top_ids, top_probs, vocab,
                                  K=k, KP=triton.next_power_of_2(k), BLOCK=block)
    return entropy, max_prob, top_ids, top_probs


def entropy_topk(logits: torch.Tensor, temperature=1.0, k: int = 1):
    """The kernel on CUDA, torch (float32) elsewhere; same outputs."""
    if logits.is_cuda and triton is not None:
        return entropy_topk_triton(logits, temperature, k)
    entropy, max_prob, ids, probs = entropy_topk_reference(logits, temperature, k, dtype=torch.float32)
    return entropy, max_prob, ids, probs
