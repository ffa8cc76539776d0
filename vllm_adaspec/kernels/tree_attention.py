"""Tree-mask attention over a paged KV cache, for the decode shape: the attention of a verification pass over a
tree of drafts, split over the prefix keys (flash-decoding) and reduced.

Each request verifies `rows` query rows: row 0 is its root (the last committed token), rows 1.. its draft nodes.
Their keys/values were written to the paged cache in this pass at positions P .. P + rows - 1 (P = the request's
cached prefix length). Row i sees every prefix position (< P) and tree row j iff j is i or an ancestor of i: bit j
of `ancestor_bits[row0 + i]` (int32 words, bit j % 32 of word j // 32). GQA: query head h reads kv head
h // (Hq / Hkv). fp16 / bf16 / fp32 in, fp32 math; fp32 products are exact IEEE (`input_precision="ieee"`), never
TF32.

Layouts (vLLM's GPU layout, FlashAttention / Triton backends: a layer's cache is [2, num_blocks, block_size, Hkv, D],
K = cache[0], V = cache[1]): q [T, Hq, D] (requests' rows packed, offsets `cu_rows` [B + 1]); k_cache, v_cache
[num_blocks, block_size, Hkv, D]; block_table [B, max_blocks]; prefix_lens [B]; ancestor_bits [T, W] int32.

Work split: one program per (request, kv head, block of query rows, split of the keys). The request's query rows x
the kv head's query heads form the M side of each tile (GQA: a key tile loaded once serves every query head that
reads it, and every row of the tree), so each key is read once per split. The keys 0 .. P + rows - 1 are cut into
`splits` contiguous chunks (more programs than requests x kv heads when the batch is small and the prefix long:
flash-decoding); each program keeps flash attention's online softmax and writes its unnormalised partial output,
running max and sum; `_tree_attention_reduce_kernel` combines the splits per (row, head). With one split (a full
batch, or short prefixes) the split kernel writes the output itself and there is no second launch.

Contents: `_tree_attention_split_kernel`, `_tree_attention_reduce_kernel`, `tree_attention_triton` (launcher),
`ancestor_bits` (bool mask -> bits), `tree_attention_reference` (torch, any dtype; float64 in the tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import os

import torch

from vllm_adaspec.trees.tree import DraftTree, ancestor_mask

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

__all__ = ["TOLERANCE", "TreeAttentionLaunch", "ancestor_bits", "check_on_device", "launch", "plan_launch",
           "tree_attention_reference", "tree_attention_triton"]


def ancestor_bits(tree_mask: torch.Tensor) -> torch.Tensor:
    """tree_mask [T, max_rows] bool (row i sees tree row j) -> [T, ceil(max_rows / 32)] int32 words."""
    t, n = tree_mask.shape
    words = max(1, math.ceil(n / 32))
    padded = torch.zeros(t, words * 32, dtype=torch.int64, device=tree_mask.device)
    padded[:, :n] = tree_mask.to(torch.int64)
    weights = torch.ones(32, dtype=torch.int64, device=tree_mask.device) << torch.arange(32, device=tree_mask.device)
    packed = (padded.view(t, words, 32) * weights).sum(-1)  # [T, W] in 0 .. 2^32 - 1
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def tree_attention_reference(q, k_cache, v_cache, block_table, prefix_lens, cu_rows, bits, scale,
                             dtype=torch.float64) -> torch.Tensor:
    """Plain torch, request by request: gather the request's keys, unpack its rows' ancestor bits,
    softmax(QK^T) V."""
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    bs = k_cache.shape[1]
    out = torch.zeros(t, hq, d, dtype=dtype, device=q.device)
    shifts = torch.arange(32, device=q.device)
    for b in range(len(prefix_lens)):
        r0, r1 = int(cu_rows[b]), int(cu_rows[b + 1])
        n, p = r1 - r0, int(prefix_lens[b])
        pos = torch.arange(p + n, device=q.device)
        slots = block_table[b, pos // bs].long() * bs + pos % bs
        k = k_cache.reshape(-1, hkv, d)[slots].to(dtype)  # [p + n, Hkv, D]
        v = v_cache.reshape(-1, hkv, d)[slots].to(dtype)
        rep = hq // hkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [p + n, Hq, D]
        tree = ((bits[r0:r1].long().unsqueeze(-1) >> shifts) & 1).bool().reshape(n, -1)[:, :n]
        visible = torch.cat([torch.ones(n, p, dtype=torch.bool, device=q.device), tree], 1)
        s = torch.einsum("ihd,jhd->hij", q[r0:r1].to(dtype), k) * scale  # [Hq, n, p + n]
        s = s.masked_fill(~visible[None], float("-inf"))
        out[r0:r1] = torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v)
    return out


if triton is not None:

    @triton.jit
    def _tree_attention_split_kernel(
            q_ptr, k_ptr, v_ptr, acc_ptr, m_ptr, l_ptr, o_ptr, bt_ptr, plen_ptr, cu_ptr, bits_ptr, qrows_ptr,
            btrows_ptr, scale, chunk,
            stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            stride_as, stride_at, stride_ah, stride_ms, stride_mt, stride_bt, stride_bits, stride_ot, stride_oh,
            DIRECT: tl.constexpr, QB: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
            BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
            DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1) // QB
        qb = tl.program_id(1) % QB
        split = tl.program_id(2)
        row0 = tl.load(cu_ptr + b)
        n_rows = tl.load(cu_ptr + b + 1) - row0
        if qb * BLOCK_Q < n_rows:
            p_len = tl.load(plen_ptr + b)
            total = p_len + n_rows
            lo = split * chunk
            hi = tl.minimum(lo + chunk, total)
            offs_m = tl.arange(0, BLOCK_Q * GROUP_P)
            qi = qb * BLOCK_Q + offs_m // GROUP_P  # query row within the request
            g = offs_m % GROUP_P
            head = kvh * GROUP + g
            m_valid = (qi < n_rows) & (g < GROUP)
            offs_d = tl.arange(0, BLOCK_D)
            d_valid = offs_d < D
            q_at = tl.load(qrows_ptr + row0 + qi, mask=m_valid, other=0).to(tl.int64)  # the row in q / out
            table = bt_ptr + tl.load(btrows_ptr + b).to(tl.int64) * stride_bt  # the request's block-table row
            m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
            acc = tl.zeros([BLOCK_Q * GROUP_P, BLOCK_D], tl.float32)
            if lo < total:
                q = tl.load(q_ptr + q_at[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                            mask=m_valid[:, None] & d_valid[None, :], other=0.0)
                if DOT_F32:
                    q = q.to(tl.float32)
                for start in range(lo, hi, BLOCK_N):
                    pos = start + tl.arange(0, BLOCK_N)
                    valid = pos < hi
                    page = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
                    k_off = page * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kvh * stride_kh
                    v_off = page * stride_vb + (pos % BLOCK_SIZE) * stride_vs + kvh * stride_vh
                    kv_mask = valid[:, None] & d_valid[None, :]
                    k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
                    v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
                    if DOT_F32:
                        k, v = k.to(tl.float32), v.to(tl.float32)
                    s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale  # [M, N]
                    j = pos - p_len  # tree row of a key position (>= 0 inside the tree)
                    in_tree = (j >= 0) & valid
                    word = tl.load(bits_ptr + (row0 + qi)[:, None] * stride_bits + (j // 32)[None, :],
                                   mask=m_valid[:, None] & in_tree[None, :], other=0)
                    anc = (word >> (j % 32)[None, :]) & 1
                    visible = valid[None, :] & ((j < 0)[None, :] | (anc != 0))
                    s = tl.where(visible, s, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(s, 1))
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                    p = tl.exp(s - m_safe[:, None])
                    alpha = tl.exp(m_i - m_safe)
                    l_i = l_i * alpha + tl.sum(p, 1)
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
                    m_i = m_new
            if DIRECT:  # one split holds every key: the output itself, no partials and no reduce launch
                out = acc / tl.maximum(l_i, 1e-30)[:, None]
                tl.store(o_ptr + q_at[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                         out.to(o_ptr.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])
            else:
                rows_at = row0 + qi
                tl.store(acc_ptr + split * stride_as + rows_at[:, None] * stride_at + head[:, None] * stride_ah
                         + offs_d[None, :], acc, mask=m_valid[:, None] & d_valid[None, :])
                tl.store(m_ptr + split * stride_ms + rows_at * stride_mt + head, m_i, mask=m_valid)
                tl.store(l_ptr + split * stride_ms + rows_at * stride_mt + head, l_i, mask=m_valid)

    @triton.jit
    def _tree_attention_reduce_kernel(acc_ptr, m_ptr, l_ptr, o_ptr, qrows_ptr, splits, stride_as, stride_at, stride_ah,
                                      stride_ms, stride_mt, stride_ot, stride_oh,
                                      D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
        """One program per (tree row, query head): out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, written at
        the row's place in the output (q_rows)."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        s_valid = offs_s < splits
        m = tl.load(m_ptr + offs_s * stride_ms + t * stride_mt + h, mask=s_valid, other=float("-inf"))
        l_s = tl.load(l_ptr + offs_s * stride_ms + t * stride_mt + h, mask=s_valid, other=0.0)
        m_max = tl.max(m, 0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.where(s_valid & (m > float("-inf")), tl.exp(m - m_max), 0.0)  # [S]
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < D
        acc = tl.load(acc_ptr + offs_s[:, None] * stride_as + t * stride_at + h * stride_ah + offs_d[None, :],
                      mask=s_valid[:, None] & d_valid[None, :], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.maximum(tl.sum(l_s * w, 0), 1e-30)
        o_row = tl.load(qrows_ptr + t).to(tl.int64)
        tl.store(o_ptr + o_row * stride_ot + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_valid)


def choose_splits(batch: int, kv_heads: int, q_blocks: int, longest: int, block_n: int, programs: int) -> int:
    """How many chunks to cut the keys into: enough programs to fill `programs` slots (about two per SM), never a
    chunk shorter than 4 key tiles, at most 64."""
    base = batch * kv_heads * q_blocks
    want = max(1, math.ceil(programs / base))
    most = max(1, longest // (4 * block_n))
    return int(min(want, most, 64))


@dataclass
class TreeAttentionLaunch:
    """What every attention layer of one forward shares: the trees' rows and masks, the work split, the scratch.
    Built once per step (`plan_launch`), launched per layer (`launch`) with no host work beyond the two launches.

    prefix_lens [B], cu_rows [B + 1] (tree rows packed: tree b's rows are cu_rows[b] .. cu_rows[b + 1] - 1),
    bits [T, W] ancestor bits, q_rows [T] (each tree row's row in the layer's q and output), bt_rows [B] (each tree's
    row of the layer's block table): int32, on the device. acc [splits, T, Hq, D], m / l [splits, T, Hq]: fp32."""
    prefix_lens: torch.Tensor
    cu_rows: torch.Tensor
    bits: torch.Tensor
    q_rows: torch.Tensor
    bt_rows: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_q: int
    q_blocks: int
    block_n: int
    chunk: int
    splits: int
    acc: torch.Tensor
    m: torch.Tensor
    l: torch.Tensor


def plan_launch(prefix_lens, cu_rows, bits, q_rows, bt_rows, num_heads: int, num_kv_heads: int, head_size: int,
                max_rows: int, longest: int, block_n: int = 64, splits: int | None = None) -> TreeAttentionLaunch:
    """max_rows: the most rows of one tree, longest: the most keys of one (prefix + rows): host ints, so nothing here
    waits for the device. splits: key chunks (default `choose_splits` for the device's SM count)."""
    if triton is None:
        raise RuntimeError("tree attention needs Triton")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    t = q_rows.shape[0]
    if bits.shape[0] != t or bits.dtype != torch.int32:
        raise ValueError(f"ancestor_bits must be int32 [{t}, words]; got {bits.dtype} {tuple(bits.shape)}")
    if bits.shape[1] * 32 < max_rows:
        raise ValueError(f"ancestor_bits has {bits.shape[1]} words for trees of {max_rows} rows")
    group_p = triton.next_power_of_2(num_heads // num_kv_heads)
    # M = block_q * group_p rows per program: >= 16 for tl.dot, up to 64 so that a whole tree's rows (and every
    # query head of the kv head) share each key tile
    block_q = max(1, max(16, min(64, triton.next_power_of_2(max_rows * group_p))) // group_p)
    q_blocks = triton.cdiv(max_rows, block_q)
    if splits is None:
        dev = bits.device
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
        splits = choose_splits(len(prefix_lens), num_kv_heads, q_blocks, longest, block_n, 2 * sms)
    chunk = triton.cdiv(triton.cdiv(longest, splits), block_n) * block_n
    splits = triton.cdiv(longest, chunk)
    rows = t if splits > 1 else 1  # one split writes the output directly: no scratch
    acc = torch.empty(splits, rows, num_heads, head_size, dtype=torch.float32, device=bits.device)
    m = torch.empty(splits, rows, num_heads, dtype=torch.float32, device=bits.device)
    return TreeAttentionLaunch(prefix_lens, cu_rows, bits, q_rows, bt_rows, num_heads, num_kv_heads, head_size,
                               block_q, q_blocks, block_n, chunk, splits, acc, m, torch.empty_like(m))


def launch(plan: TreeAttentionLaunch, q, k_cache, v_cache, block_table, scale: float, out) -> torch.Tensor:
    """Tree attention of one layer: q [*, Hq, D] (the tree rows at plan.q_rows), k_cache / v_cache [num_blocks,
    block_size, Hkv, D] (any strides, the last dimension contiguous), block_table [*, max_blocks]; the tree rows of
    `out` [*, Hq, D] are written, nothing else."""
    nb, bs, hkv, d = k_cache.shape
    if (q.shape[1], hkv, d) != (plan.num_heads, plan.num_kv_heads, plan.head_size) or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} and caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit "
                         f"the plan ({plan.num_heads} / {plan.num_kv_heads} heads of {plan.head_size})")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("q, out and the caches need a contiguous last dimension")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    acc, m, l_ = plan.acc, plan.m, plan.l
    grid = (len(plan.prefix_lens), hkv * plan.q_blocks, plan.splits)
    group = plan.num_heads // hkv
    direct = plan.splits == 1
    _tree_attention_split_kernel[grid](
        q, k_cache, v_cache, acc, m, l_, out, block_table, plan.prefix_lens, plan.cu_rows, plan.bits, plan.q_rows,
        plan.bt_rows, scale, plan.chunk,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), acc.stride(0), acc.stride(1), acc.stride(2),
        m.stride(0), m.stride(1), block_table.stride(0), plan.bits.stride(0), out.stride(0), out.stride(1),
        DIRECT=direct, QB=plan.q_blocks, BLOCK_SIZE=bs, GROUP=group, GROUP_P=triton.next_power_of_2(group), BLOCK_Q=plan.block_q,
        BLOCK_N=plan.block_n, D=d, BLOCK_D=triton.next_power_of_2(d),
        # Triton's interpreter multiplies bf16 tl.dot operands wrongly (as of 3.9); it gets fp32 operands there
        DOT_F32=interpret and q.dtype == torch.bfloat16,
        # fp32 products exact: TF32 (NVIDIA's default for fp32 tl.dot) keeps 10 mantissa bits
        PRECISION="ieee" if q.dtype == torch.float32 or interpret else None)
    if direct:
        return out
    _tree_attention_reduce_kernel[(plan.q_rows.shape[0], plan.num_heads)](
        acc, m, l_, out, plan.q_rows, plan.splits, acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0),
        m.stride(1), out.stride(0), out.stride(1), D=d, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_S=triton.next_power_of_2(plan.splits))
    return out


def tree_attention_triton(q, k_cache, v_cache, block_table, prefix_lens, cu_rows, bits, scale,
                          max_rows: int | None = None, longest: int | None = None, block_n: int = 64,
                          splits: int | None = None, q_rows=None, bt_rows=None, out=None) -> torch.Tensor:
    """Plan and launch in one call. Without q_rows / bt_rows, q holds exactly the tree rows (packed as cu_rows) and
    block_table one row per tree; returns the output [T, Hq, D] in q's dtype (`out`, or a new tensor). max_rows /
    longest are computed from the tensors when not given (a device sync)."""
    t = int(cu_rows[-1]) if q_rows is None else q_rows.shape[0]
    rows = cu_rows[1:] - cu_rows[:-1]
    if max_rows is None:
        max_rows = int(rows.max())
    if longest is None:
        longest = int((prefix_lens + rows).max())
    if q_rows is None:
        q_rows = torch.arange(t, dtype=torch.int32, device=q.device)
    if bt_rows is None:
        bt_rows = torch.arange(len(prefix_lens), dtype=torch.int32, device=q.device)
    _, _, hkv, d = k_cache.shape
    if d != q.shape[2]:
        raise ValueError(f"q head size {q.shape[2]} and caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do "
                         "not fit")
    plan = plan_launch(prefix_lens, cu_rows, bits, q_rows, bt_rows, q.shape[1], hkv, d, max_rows, longest,
                       block_n=block_n, splits=splits)
    return launch(plan, q, k_cache, v_cache, block_table, scale, torch.empty_like(q) if out is None else out)


def check_on_device(device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_size: int) -> float:
    """Run the kernel once on a small random case (two trees over paged prefixes, one split and three) on `device`
    in `dtype` and return the largest difference from the float32 reference: a start-up check that the kernel
    compiles and computes on this device for this model's heads (TOLERANCE[dtype] bounds a correct run)."""
    g = torch.Generator().manual_seed(0)
    bs, plens, nodes = 16, [70, 5], [5, 3]
    rows = [n + 1 for n in nodes]
    cu = torch.tensor([0, rows[0], rows[0] + rows[1]], dtype=torch.int32)
    table = torch.randperm(12, generator=g)[:12].view(2, 6).to(torch.int32)
    k = torch.randn(12, bs, num_kv_heads, head_size, generator=g)
    v = torch.randn(12, bs, num_kv_heads, head_size, generator=g)
    q = torch.randn(sum(rows), num_heads, head_size, generator=g)
    mask = torch.zeros(sum(rows), max(rows), dtype=torch.bool)
    for c, parents in ((0, [-1, 0, 0, 1, 3]), (rows[0], [-1, -1, 1])):
        m = ancestor_mask(DraftTree(torch.zeros(len(parents), dtype=torch.long), torch.tensor(parents)))
        mask[c:c + len(m), :len(m)] = m
    args = [x.to(device) for x in (q.to(dtype), k.to(dtype), v.to(dtype), table, torch.tensor(plens, dtype=torch.int32),
                                   cu, ancestor_bits(mask))]
    want = tree_attention_reference(*args, head_size ** -0.5, dtype=torch.float32)
    err = 0.0
    for splits in (1, 3):
        got = tree_attention_triton(*args, head_size ** -0.5, max_rows=max(rows), longest=max(p + r for p, r in
                                                                                               zip(plens, rows)),
                                    block_n=32, splits=splits)
        err = max(err, float((got.float() - want).abs().max()))
    return err


TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}
