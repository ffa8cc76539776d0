"""Fused entropy, max probability and top-k of softmax(logits / T) per row, in one pass over the vocabulary
(plus, when asked, C2T's top-n entropy).

What adaptive draft-length policies need from a draft distribution each step: its entropy (AdaEDL), its top
probability (max-confidence), its top-k tokens and probabilities (tree drafting). Torch does that with a softmax,
a log-softmax, a product, a sum and a topk: five passes over [rows, vocab] and two [rows, vocab] temporaries. The
kernel reads each logit once: one program per row walks the vocabulary in blocks keeping an online softmax
(running max m, sum s of exp(x - m), sum t of exp(x - m) * x) and a running top-k, then

    entropy = m + log s - t / s,    max probability = 1 / s,    p_i = exp(x_i - m) / s.

C2T (trees/c2t.py, paper 004 Eq. 3) reads the entropy over the n most probable tokens only (n = 1000):
H_n = -sum over the top n of p_i log p_i, with p from the full softmax. With m and s known after the pass above,
the same program finds the threshold x* that exactly n logits reach by bisection between the smallest and the
largest logit (a count per probe; it stops as soon as the count is n, in practice 10-20 probes), then sums
-p log p over x >= x*. Rows with at most n finite logits get the full entropy.

Contents: `_entropy_topk_kernel` (Triton), `entropy_topk_triton` (its launcher), `entropy_topk_reference`
(plain torch, any dtype; float64 in the tests), and `entropy_topk`, which picks the kernel on CUDA and torch
elsewhere. Temperatures <= 0 (greedy requests) are treated as 1: the statistics then describe the raw model.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only environments without Triton use the torch path
    triton = None

__all__ = ["DraftStats", "entropy_topk", "entropy_topk_reference", "entropy_topk_triton"]


class DraftStats(NamedTuple):
    entropy: torch.Tensor  # [R] nats
    max_prob: torch.Tensor  # [R]
    top_ids: torch.Tensor  # [R, k] int64, best first
    top_probs: torch.Tensor  # [R, k]
    top_n_entropy: torch.Tensor | None  # [R]: -sum of p log p over the n most probable tokens (None: not asked)


def _temperatures(temperature, rows: int, device) -> torch.Tensor:
    t = torch.as_tensor(temperature, dtype=torch.float32, device=device).reshape(-1)
    if t.numel() == 1:
        t = t.expand(rows)
    if t.numel() != rows:
        raise ValueError(f"temperature has {t.numel()} values for {rows} rows")
    return torch.where(t > 0, t, torch.ones_like(t)).contiguous()


def _check_top_n(top_n: int | None) -> None:
    if top_n is not None and top_n < 1:
        raise ValueError(f"top_n must be >= 1 (or None), got {top_n}")


def entropy_topk_reference(logits: torch.Tensor, temperature=1.0, k: int = 1, dtype=torch.float64,
                           top_n: int | None = None) -> DraftStats:
    """[R, V] logits -> DraftStats computed in `dtype` (top_n_entropy when top_n is given)."""
    _check_top_n(top_n)
    x = logits.to(dtype) / _temperatures(temperature, logits.shape[0], logits.device).to(dtype)[:, None]
    logp = torch.log_softmax(x, dim=-1)
    p = logp.exp()
    plogp = p * torch.where(p > 0, logp, torch.zeros_like(logp))  # [R, V]
    entropy = -plogp.sum(-1)
    top_n_entropy = None
    if top_n is not None:
        _, best = p.topk(min(top_n, p.shape[-1]), dim=-1)  # [R, n]
        top_n_entropy = -plogp.gather(-1, best).sum(-1)
    top_probs, top_ids = p.topk(k, dim=-1)
    return DraftStats(entropy, top_probs[:, 0], top_ids, top_probs, top_n_entropy)


if triton is not None:

    @triton.jit
    def _entropy_topk_kernel(logits_ptr, stride_row, temp_ptr, ent_ptr, maxp_ptr, ids_ptr, probs_ptr, topn_ent_ptr,
                             V, TOP_N, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
                             WITH_TOP_N: tl.constexpr):
        row = tl.program_id(0)
        inv_t = 1.0 / tl.load(temp_ptr + row)
        cols = tl.arange(0, BLOCK)
        slots = tl.arange(0, KP)
        m = tl.full([], float("-inf"), tl.float32)  # running max of x = logits / T
        s = tl.zeros([], tl.float32)  # sum exp(x - m)
        t = tl.zeros([], tl.float32)  # sum exp(x - m) * x
        top_v = tl.full([KP], float("-inf"), tl.float32)  # running top-k (unordered; slots >= K unused)
        top_i = tl.zeros([KP], tl.int64)
        lo = tl.full([], float("inf"), tl.float32)  # smallest finite x (the top-n threshold search starts there)
        finite = tl.zeros([], tl.int32)  # how many x are finite
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
            if WITH_TOP_N:
                lo = tl.minimum(lo, tl.min(tl.where(x > float("-inf"), x, float("inf")), 0))
                finite += tl.sum((x > float("-inf")).to(tl.int32), 0)
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
        if WITH_TOP_N:
            # Bisection for x*: count(x >= lo) >= TOP_N > count(x >= hi); done when count(x >= lo) == TOP_N or
            # the interval cannot shrink (ties at the threshold are all kept).
            hi = m + 1.0
            c_lo = finite
            probes = tl.zeros([], tl.int32)
            while (c_lo > TOP_N) & (probes < 64):
                mid = lo + (hi - lo) * 0.5
                c = tl.zeros([], tl.int32)
                for start in range(0, V, BLOCK):
                    offs = start + cols
                    x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t
                    c += tl.sum((x >= mid).to(tl.int32), 0)
                stuck = (mid <= lo) | (mid >= hi)
                take = (c >= TOP_N) & ~stuck
                lo = tl.where(take, mid, lo)
                c_lo = tl.where(take, c, c_lo)
                hi = tl.where(take | stuck, hi, mid)
                probes = tl.where(stuck, 64, probes + 1)
            log_s = tl.log(s)
            h = tl.zeros([], tl.float32)
            for start in range(0, V, BLOCK):
                offs = start + cols
                x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t
                keep = (x >= lo) & (x > float("-inf"))
                logp = tl.where(keep, x - m - log_s, 0.0)
                h -= tl.sum(tl.where(keep, tl.exp(logp) * logp, 0.0), 0)
            tl.store(topn_ent_ptr + row, h)
        for j in tl.static_range(K):  # emit in descending order
            best = tl.argmax(tl.where(slots < K, top_v, float("-inf")), 0)
            v = tl.max(tl.where(slots == best, top_v, float("-inf")), 0)
            i = tl.sum(tl.where(slots == best, top_i, 0), 0)
            tl.store(ids_ptr + row * K + j, i)
            tl.store(probs_ptr + row * K + j, tl.exp(v - m) / s)
            top_v = tl.where(slots == best, float("-inf"), top_v)


def entropy_topk_triton(logits: torch.Tensor, temperature=1.0, k: int = 1, block: int = 4096,
                        top_n: int | None = None) -> DraftStats:
    """Launch the kernel: one program per row. logits [R, V] (fp32/bf16/fp16, unit stride along V)."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, vocab] with unit stride along vocab, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, {vocab}], got {k}")
    _check_top_n(top_n)
    temps = _temperatures(temperature, rows, logits.device)
    entropy = torch.empty(rows, dtype=torch.float32, device=logits.device)
    max_prob = torch.empty_like(entropy)
    top_ids = torch.empty(rows, k, dtype=torch.int64, device=logits.device)
    top_probs = torch.empty(rows, k, dtype=torch.float32, device=logits.device)
    top_n_entropy = torch.empty_like(entropy) if top_n is not None else entropy  # (unused pointer when not asked)
    block = min(block, triton.next_power_of_2(vocab))
    _entropy_topk_kernel[(rows,)](logits, logits.stride(0), temps, entropy, max_prob, top_ids, top_probs,
                                  top_n_entropy, vocab, top_n or 0, K=k, KP=triton.next_power_of_2(k), BLOCK=block,
                                  WITH_TOP_N=top_n is not None)
    return DraftStats(entropy, max_prob, top_ids, top_probs, top_n_entropy if top_n is not None else None)


def entropy_topk(logits: torch.Tensor, temperature=1.0, k: int = 1, top_n: int | None = None) -> DraftStats:
    """The kernel on CUDA, torch (float32) elsewhere; same outputs."""
    if logits.is_cuda and triton is not None:
        return entropy_topk_triton(logits, temperature, k, top_n=top_n)
    return entropy_topk_reference(logits, temperature, k, dtype=torch.float32, top_n=top_n)
