"""Tree attention as a cascade (the alternative to one tree kernel over all keys): the tree rows' attention over the
prefix by a dense kernel that returns its log-sum-exp, their attention among the tree's own keys (the ancestor mask, at
most 65 keys) by the tree kernel writing partials, and one small launch merging the two per row and head.

Where the tree kernel's own pass over the prefix is slower than a dense kernel's (short prefixes, many trees,
64-node trees: up to 2.5x FlashAttention on an H200, `benchmarks/device_runs/2026-11-28-h200/`), the prefix part
of a cascade costs what the dense kernel costs; the tree part reads only the trees' own keys, in place (a partials
plan: `plan_launch(partials=True)`, keys prefix .. prefix + tree of each request's pages). In a vLLM CUDA engine the
dense kernel is vLLM's FlashAttention over the paged cache (`flash_attn_varlen_func(..., causal=False,
return_softmax_lse=True)`, keys below each tree's root; not wired: the device this project is lent has no vLLM CUDA
build); here, for the benchmark (`bench_tree_attention.py --cascade`) and the tests, torch's FlashAttention op over
contiguous K / V with the query heads of a kv head folded into the rows (what the benchmark's anchor runs).

The merge, per tree row t and query head h, from the prefix part's normalized output o_p and log-sum-exp lse_p and
the tree part's partials (acc_t = sum_j exp(s_j - m_t) v_j, m_t, l_t = sum_j exp(s_j - m_t)):

    M = max(lse_p, m_t);  out = (o_p exp(lse_p - M) + acc_t exp(m_t - M)) / (exp(lse_p - M) + l_t exp(m_t - M))

The prefix output and log-sum-exp are addressed by per-row and per-head element offsets (`folded_offsets`), so the
folded layout [B, Hkv, rows x group, D] and vLLM's [T, Hq, D] are read alike. Contents: `_cascade_merge_kernel`,
`merge` (launcher), `merge_reference` (torch), `folded_offsets`, `fold_rows` / `prefix_attention` (the folded
prefix part, torch's op or its float64 reference), `contiguous_keys` (a paged case's prefix as the dense kernel
reads it here).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

__all__ = ["contiguous_keys", "fold_rows", "folded_offsets", "merge", "merge_reference", "prefix_attention"]


def fold_rows(q: torch.Tensor, batch: int, rows: int, num_kv_heads: int) -> torch.Tensor:
    """q [B x rows, Hq, D] (every tree `rows` rows) -> [B, Hkv, rows x group, D], row r's head g of kv head k at
    r x group + g: the dense kernel's view of the tree rows (a copy)."""
    t, hq, d = q.shape
    group = hq // num_kv_heads
    return q.view(batch, rows, num_kv_heads, group, d).permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads,
                                                                                       rows * group, d)


def folded_offsets(batch: int, rows: int, num_heads: int, num_kv_heads: int, out: torch.Tensor,
                   lse: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Element offsets of row t = b x rows + r and head h = k x group + g in a folded output [B, Hkv, rows x group,
    D] and log-sum-exp [B, Hkv, rows x group] (any strides): (out rows [T], out heads [Hq], lse rows, lse heads),
    int64 on their device."""
    group = num_heads // num_kv_heads
    dev = out.device
    b, r = torch.arange(batch, device=dev).repeat_interleave(rows), torch.arange(rows, device=dev).repeat(batch)
    k, g = torch.arange(num_kv_heads, device=dev).repeat_interleave(group), torch.arange(group, device=dev).repeat(
        num_kv_heads)
    so, sl = out.stride(), lse.stride()
    return (b * so[0] + r * group * so[2], k * so[1] + g * so[2], b * sl[0] + r * group * sl[2], k * sl[1] + g * sl[2])


def contiguous_keys(cache: torch.Tensor, table: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Keys start .. start + length - 1 of every request from a paged cache [blocks, block_size, Hkv, D] (table
    [B, pages]: each request's pages) -> [B, Hkv, length, D], contiguous (a copy)."""
    bs = cache.shape[1]
    pos = torch.arange(start, start + length, device=cache.device)
    slots = table[:, pos // bs].long() * bs + pos % bs  # [B, length]
    return cache.reshape(-1, *cache.shape[2:])[slots].permute(0, 2, 1, 3).contiguous()


def prefix_attention(fq: torch.Tensor, fk: torch.Tensor, fv: torch.Tensor, scale: float,
                     reference: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of folded rows fq [B, Hkv, M, D] over contiguous keys fk / fv [B, Hkv, P, D], no mask ->
    (out [B, Hkv, M, D], natural log-sum-exp of the scaled scores [B, Hkv, M] float32): torch's FlashAttention op
    (CUDA; its CPU kernel elsewhere), or float64 torch (`reference`)."""
    if reference:
        s = torch.einsum("bkmd,bkpd->bkmp", fq.double(), fk.double()) * scale
        return torch.einsum("bkmp,bkpd->bkmd", torch.softmax(s, -1), fv.double()), torch.logsumexp(s, -1)
    if fq.is_cuda:
        got = torch.ops.aten._scaled_dot_product_flash_attention(fq, fk, fv, 0.0, False, False, scale=scale)
    else:
        got = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(fq, fk, fv, 0.0, False, scale=scale)
    return got[0], got[1]


def merge_reference(o_p: torch.Tensor, lse_p: torch.Tensor, offsets: tuple, acc: torch.Tensor, m: torch.Tensor,
                    l_: torch.Tensor, q_rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The merge in float64 torch: out[q_rows[t], h] for every tree row t and head h (acc [1, T, Hq, D], m / l
    [1, T, Hq]: a partials plan's scratch)."""
    o_rows, o_heads, l_rows, l_heads = offsets
    d = acc.shape[-1]
    at_o = o_rows[:, None, None] + o_heads[None, :, None] + torch.arange(d, device=acc.device)  # [T, Hq, D]
    at_l = l_rows[:, None] + l_heads[None, :]  # [T, Hq]
    op = o_p.as_strided((int(at_o.max()) + 1,), (1,))[at_o]  # (the elements the offsets address, in memory order)
    lp = lse_p.as_strided((int(at_l.max()) + 1,), (1,))[at_l].double()
    mt, lt, at = m[0].double(), l_[0].double(), acc[0].double()
    big = torch.maximum(lp, mt)
    big = torch.where(big == float("-inf"), torch.zeros_like(big), big)
    wp, wt = torch.exp(lp - big), torch.exp(mt - big)
    merged = (op.double() * wp[..., None] + at * wt[..., None]) / (wp + lt * wt).clamp_min(1e-300)[..., None]
    out[q_rows.long()] = merged.to(out.dtype)
    return out


if triton is not None:

    @triton.jit
    def _cascade_merge_kernel(o_p, lse_p, o_rows, o_heads, l_rows, l_heads, acc, m, l_, out, q_rows,
                              stride_at, stride_ah, stride_mt, stride_ot, stride_oh, H: tl.constexpr,
                              D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0)  # tree row t: every head, every column
        h = tl.arange(0, BLOCK_H)
        c = tl.arange(0, BLOCK_D)
        hm = h < H
        mm = hm[:, None] & (c < D)[None, :]
        po = tl.load(o_rows + t) + tl.load(o_heads + h, mask=hm, other=0)  # [BLOCK_H] int64
        op = tl.load(o_p + po[:, None] + c[None, :], mask=mm, other=0.0).to(tl.float32)
        lp = tl.load(lse_p + tl.load(l_rows + t) + tl.load(l_heads + h, mask=hm, other=0), mask=hm,
                     other=float("-inf")).to(tl.float32)
        at = tl.load(acc + t * stride_at + h[:, None] * stride_ah + c[None, :], mask=mm, other=0.0)
        mt = tl.load(m + t * stride_mt + h, mask=hm, other=float("-inf"))
        lt = tl.load(l_ + t * stride_mt + h, mask=hm, other=0.0)
        big = tl.maximum(lp, mt)
        big = tl.where(big == float("-inf"), 0.0, big)
        wp = tl.exp(lp - big)
        wt = tl.exp(mt - big)
        merged = (op * wp[:, None] + at * wt[:, None]) / tl.maximum(wp + lt * wt, 1e-30)[:, None]
        row = tl.load(q_rows + t).to(tl.int64)
        tl.store(out + row * stride_ot + h[:, None] * stride_oh + c[None, :], merged.to(out.dtype.element_ty),
                 mask=mm)


def merge(o_p: torch.Tensor, lse_p: torch.Tensor, offsets: tuple, acc: torch.Tensor, m: torch.Tensor,
          l_: torch.Tensor, q_rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """One launch, one program per tree row: out[q_rows[t], h] = the merge of the prefix part (o_p, lse_p at
    `offsets`: `folded_offsets`) and the tree part's partials (acc [1, T, Hq, D], m / l [1, T, Hq]: a partials
    plan's scratch, kernels/tree_attention.plan_launch(partials=True))."""
    t, hq, d = acc.shape[1:]
    if t == 0:
        return out
    if out.stride(-1) != 1 or acc.stride(-1) != 1 or o_p.stride(-1) != 1:
        raise ValueError("out, acc and the prefix output need a contiguous last dimension")
    o_rows, o_heads, l_rows, l_heads = offsets
    _cascade_merge_kernel[(t,)](o_p, lse_p, o_rows, o_heads, l_rows, l_heads, acc, m, l_, out, q_rows,
                                acc.stride(1), acc.stride(2), m.stride(1), out.stride(0), out.stride(1), H=hq, D=d,
                                BLOCK_H=triton.next_power_of_2(hq), BLOCK_D=triton.next_power_of_2(d))
    return out
