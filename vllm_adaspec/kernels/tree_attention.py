"""Tree-mask attention over a paged KV cache: the attention of a verification pass over a tree of drafts.

Each request verifies `rows` query rows: row 0 is its root (the last committed token), rows 1.. its draft nodes.
Their keys/values were written to the paged cache in this pass at positions P .. P + rows - 1 (P = the request's
cached prefix length). Row i sees every prefix position (< P) and tree row j iff j is i or an ancestor of i:
`tree_mask[row0 + i, j]`. GQA: query head h reads kv head h // (Hq / Hkv). fp16 / bf16 / fp32 in, fp32 math.

Layouts (vLLM's GPU layout): q [T, Hq, D] (requests' rows packed, offsets `cu_rows` [B + 1]); k_cache, v_cache
[num_blocks, block_size, Hkv, D]; block_table [B, max_blocks]; prefix_lens [B]; tree_mask [T, max_rows] bool.

One program per (request, kv head, block of up to 128 / group query rows): its query rows x the kv head's query
heads form the M side of each tile, so a key tile loaded once serves all of them (the prefix is read once per
program, not once per query row and head). Online softmax as in flash attention.

Contents: `_tree_attention_kernel`, `tree_attention_triton` (launcher), `tree_attention_reference` (torch, any
dtype; float64 in the tests).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

__all__ = ["tree_attention_reference", "tree_attention_triton"]


def tree_attention_reference(q, k_cache, v_cache, block_table, prefix_lens, cu_rows, tree_mask, scale,
                             dtype=torch.float64) -> torch.Tensor:
    """Plain torch, request by request: gather the request's keys, build its mask, softmax(QK^T) V."""
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    bs = k_cache.shape[1]
    out = torch.zeros(t, hq, d, dtype=dtype, device=q.device)
    for b in range(len(prefix_lens)):
        r0, r1 = int(cu_rows[b]), int(cu_rows[b + 1])
        n, p = r1 - r0, int(prefix_lens[b])
        pos = torch.arange(p + n, device=q.device)
        slots = block_table[b, pos // bs].long() * bs + pos % bs
        k = k_cache.reshape(-1, hkv, d)[slots].to(dtype)  # [p + n, Hkv, D]
        v = v_cache.reshape(-1, hkv, d)[slots].to(dtype)
        rep = hq // hkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [p + n, Hq, D]
        visible = torch.cat([torch.ones(n, p, dtype=torch.bool, device=q.device), tree_mask[r0:r1, :n].bool()], 1)
        s = torch.einsum("ihd,jhd->hij", q[r0:r1].to(dtype), k) * scale  # [Hq, n, p + n]
        s = s.masked_fill(~visible[None], float("-inf"))
        out[r0:r1] = torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v)
    return out


if triton is not None:

    @triton.jit
    def _tree_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, plen_ptr, cu_ptr, mask_ptr, scale,
                               stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                               stride_vh, stride_ot, stride_oh, stride_bt, stride_mt,
                               BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                               BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                               DOT_F32: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        qb = tl.program_id(2)
        row0 = tl.load(cu_ptr + b)
        n_rows = tl.load(cu_ptr + b + 1) - row0
        if qb * BLOCK_Q < n_rows:
            p_len = tl.load(plen_ptr + b)
            offs_m = tl.arange(0, BLOCK_Q * GROUP_P)
            qi = qb * BLOCK_Q + offs_m // GROUP_P  # query row within the request
            g = offs_m % GROUP_P
            head = kvh * GROUP + g
            m_valid = (qi < n_rows) & (g < GROUP)
            offs_d = tl.arange(0, BLOCK_D)
            d_valid = offs_d < D
            q = tl.load(q_ptr + (row0 + qi)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                        mask=m_valid[:, None] & d_valid[None, :], other=0.0)
            if DOT_F32:
                q = q.to(tl.float32)
            m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
            acc = tl.zeros([BLOCK_Q * GROUP_P, BLOCK_D], tl.float32)
            total = p_len + n_rows
            for start in range(0, total, BLOCK_N):
                pos = start + tl.arange(0, BLOCK_N)
                valid = pos < total
                page = tl.load(bt_ptr + b * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
                k_off = page * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kvh * stride_kh
                v_off = page * stride_vb + (pos % BLOCK_SIZE) * stride_vs + kvh * stride_vh
                kv_mask = valid[:, None] & d_valid[None, :]
                k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
                v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
                if DOT_F32:
                    k, v = k.to(tl.float32), v.to(tl.float32)
                s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [M, N]
                j = pos - p_len  # tree row of a key position (>= 0 inside the tree)
                in_tree = j >= 0
                anc = tl.load(mask_ptr + (row0 + qi)[:, None] * stride_mt + j[None, :],
                              mask=m_valid[:, None] & (in_tree & valid)[None, :], other=0)
                visible = valid[None, :] & ((j < 0)[None, :] | (anc != 0))
                s = tl.where(visible, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
                m_i = m_new
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(o_ptr + (row0 + qi)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])


def tree_attention_triton(q, k_cache, v_cache, block_table, prefix_lens, cu_rows, tree_mask, scale,
                          max_rows: int | None = None, block_n: int = 32) -> torch.Tensor:
    """Launch the kernel; returns o [T, Hq, D] in q's dtype. max_rows: the most rows of one request (host int)."""
    if triton is None:
        raise RuntimeError("tree_attention_triton needs Triton")
    t, hq, d = q.shape
    nb, bs, hkv, dk = k_cache.shape
    if dk != d or v_cache.shape != k_cache.shape:
        raise ValueError(f"q head size {d} and caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit")
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    if tree_mask.shape[0] != t:
        raise ValueError(f"tree_mask has {tree_mask.shape[0]} rows for {t} query rows")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous last dimension")
    if max_rows is None:
        max_rows = int((cu_rows[1:] - cu_rows[:-1]).max())
    group = hq // hkv
    group_p = triton.next_power_of_2(group)
    # M = block_q * group_p rows per program: >= 16 for tl.dot, and up to 128 so that a whole tree's rows share each
    # key tile (the prefix is read once per program).
    block_q = max(1, max(16, min(128, triton.next_power_of_2(max_rows * group_p))) // group_p)
    mask = tree_mask.to(torch.uint8).contiguous()
    o = torch.empty_like(q)
    grid = (len(prefix_lens), hkv, triton.cdiv(max_rows, block_q))
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, o, block_table, prefix_lens, cu_rows, mask, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), o.stride(0), o.stride(1),
        block_table.stride(0), mask.stride(0),
        BLOCK_SIZE=bs, GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, BLOCK_N=block_n, D=d,
        BLOCK_D=triton.next_power_of_2(d),
        # Triton's interpreter multiplies bf16 tl.dot operands wrongly (as of 3.9); it gets fp32 operands there.
        DOT_F32=os.environ.get("TRITON_INTERPRET") == "1" and q.dtype == torch.bfloat16)
    return o
