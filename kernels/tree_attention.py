"""Tree-mask attention over a paged KV cache, for the decode shape: the attention of a verification pass over a
tree of drafts (and of early exit's draft steps over a growing tree), split over the keys (flash-decoding) and
reduced.

Each request has `rows` query rows and `prefix_len + tree_len` keys in its paged cache. Every row sees every prefix
key (positions < prefix_len); tree key j (position prefix_len + j) is seen by row i iff bit j of
`ancestor_bits[row0 + i]` is set (int32 words, bit j % 32 of word j // 32). Verification: row 0 is the root (the
last committed token), rows 1.. the draft nodes, and the tree keys are the rows' own keys, written in this pass
(tree_len = rows, bits = ancestors-or-self). A draft step of tree drafting: the rows are the nodes run now, the tree
keys every node run so far (the root is the prefix's last key). GQA: query head h reads kv head h // (Hq / Hkv).
fp16 / bf16 / fp32 in, fp32 math; fp32 products are exact IEEE (`input_precision="ieee"`), never TF32.

Layouts (vLLM's GPU layout, FlashAttention / Triton backends: a layer's cache is [2, num_blocks, block_size, Hkv, D],
K = cache[0], V = cache[1]): q [T, Hq, D] (requests' rows packed, offsets `cu_rows` [B + 1], at rows `q_rows` of the
layer's q and output); k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_table [*, max_blocks] (request b
reads row `bt_rows[b]`); prefix_lens, tree_lens [B]; ancestor_bits [T, W] int32.

Work split: one program per (request, kv head, block of query rows, split of the keys). The M side of a tile is the
request's query rows x the kv head's query heads (all of a tree's rows where they fit one tile, `MAX_TILE_M`), so a
key tile is read once and serves every row of the tree and every query head that reads it (rows x heads packed, the
whole padded to a power of two, `tile_m`). Prefix keys are visible to every row: their loop reads no mask (whole
tiles: none on their loads either, `EVEN`), and each tile's pages are loaded a tile ahead (`PREFETCH`) so that Triton
pipelines the K / V copies (two tiles in flight at 3 stages: benchmarks/kernel_ir.py); only the last tile(s) over the
tree keys read the ancestor bits. The keys are cut into `splits` contiguous chunks when the batch alone would leave
the device idle (as many programs as SMs, not more); each program keeps flash attention's online softmax and writes
its unnormalised partial output, running max and sum, which `_tree_attention_reduce_kernel` combines per (row, head)
(or, at 2 .. `FUSED_MAX_SPLITS` chunks, the tile's last split program to finish: `fuse_reduction`). With one split
the split kernel writes the output itself.

Compiled variants: an engine fixes the dtype, the heads, the page size, `BLOCK_N` and the tile (`tile_rows`, from
its largest tree), so a step launches one of four kernels (split writing the output, split reducing its own
partials, split writing partials, the reduction); every integer that changes from step to step is kept out of
Triton's specialization (`do_not_specialize`) and every index array is 16-byte aligned
(engine/gpu_tree_runtime.StagingBuffer). `warm_up` compiles and checks each variant at start-up; `VARIANTS` records
what was compiled and counts launches of anything else (`cold`): a compile in the middle of serving.

Contents: `_tree_attention_split_kernel`, `_tree_attention_reduce_kernel`, `plan_launch` / `launch` (launcher),
`launch_reference` (the torch fallback a runtime uses when a launch fails), `warm_up`, `ancestor_bits` (bool mask ->
bits), `tree_attention_reference` (torch, any dtype; float64 in the tests).
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from dataclasses import dataclass, field

import torch

from vllm_adaspec.kernels import kept
from vllm_adaspec.trees.tree import DraftTree, ancestor_mask

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

__all__ = ["MAX_TILE_M", "TOLERANCE", "TreeAttentionLaunch", "VARIANTS", "ancestor_bits", "check_on_device",
           "choose_splits", "fuse_reduction", "launch", "launch_reference", "plan_launch", "programs_per_sm",
           "reduce_kernel_args", "split_kernel_args", "tile_rows", "tree_attention_reference", "tree_attention_triton",
           "warm_up"]

MAX_TILE_M = 128  # query rows x query heads of one tile (FlashAttention's M for head size 128, 8 warps)
MAX_SPLITS = 64  # key chunks of one request
# Splits the reduction reads at a time: 16 (Llama-3-8B at batch 1 on 132 SMs: 15-16 splits) in one tile of 56
# registers a thread for sm_90 (benchmarks/kernel_ir.py --reduce)
REDUCE_BLOCK_S = 16
BLOCK_N = 64  # keys per tile
# Software-pipelining stages of the split kernel's key loop, and whether a prefix tile's pages are loaded a tile ahead.
# Compiled for sm_90 (Triton 3.6, benchmarks/kernel_ir.py): with the pages loaded in the tile's own iteration the loop
# waits for every copy at its top whatever num_stages is (one tile in flight); loaded a tile ahead, 3 stages keep two
# tiles in flight, 4 three. An H100 sweep (benchmarks/device_runs/2026-11-27-h100-a/, pages in the iteration) found 2
# stages 0.95x the GPU time of 3: with nothing in flight either way, the smaller shared-memory footprint won.
NUM_STAGES = 3
PREFETCH = True
# Whole prefix tiles loaded and scored without masks, the rest (at most one tile) with them. An H100 sweep
# (benchmarks/device_runs/2026-11-27-h100-b/), 8 warps, 3 stages, pages a tile ahead: 0.91-0.98x the masked loop's GPU
# time on 5 of 6 shapes (1.08x at batch 1 over an 8k prefix)
EVEN = True
# Where the keys are split into 2 .. FUSED_MAX_SPLITS chunks, each tile's last split program to finish combines the
# partials (an atomic count per tile) instead of a second launch: one launch a layer. H100 sweeps
# (benchmarks/device_runs/2026-11-27-h100-c/, bf16): at 2 chunks of up to 4k keys 0.49-0.92x the GPU time of the split
# kernel plus the reduce launch on every shape of the benchmark (the reduce launch, one program per row and head, costs
# most where the rows are many), at 4-5 chunks 0.71-0.94x, at 7-16 chunks 1.2-1.9x (one program per tile reads every
# partial alone while the rest of the device idles: batch 1); at 2 chunks of 16k keys (batch 8, 32k prefixes, as many
# tiles as SMs or fewer) 1.08-1.18x: chunks longer than FUSED_MAX_CHUNK are reduced by the second launch unless the
# tiles outnumber the SMs (there: 0.74x). FUSED_MAX_SPLITS 0: never fused.
FUSED_MAX_SPLITS = 4
FUSED_MAX_CHUNK = 8192
# Output columns the reducing program sums at a time. Its whole [BLOCK_M, BLOCK_D] sum live beside a partial's tile
# took the 8-warp 128-row tile of head size 128 to 255 registers and 44 bytes of spills for sm_90 (Triton 3.6,
# benchmarks/kernel_ir.py --fused), where the two-launch variant spills none; 64 columns at a time: 252, none
FUSED_TAIL_D = 64
# More tiles than SMs (one 128-row tile per SM): the keys are cut into up to FUSED_MAX_SPLITS chunks of at least
# REFILL_MIN_CHUNK keys where that fills the last wave better (an H100, device_runs/2026-11-27-h100-c, fused: 0.74-0.82x
# at batch 8 over 8k-32k prefixes with 64 nodes; 1.07-1.52x with chunks of 0.7-2.7k keys, and with SmolLM2's 64-row
# tiles, several to an SM, 1.27-1.61x: not cut there)
REFILL_MIN_CHUNK = 4096
# Tiles smaller than FlashAttention's 128 x 128 leave an SM room for more than one program, and a kernel that streams
# the keys needs them in flight: the slots `choose_splits` fills are SMs x `programs_per_sm`, SLOT_ELEMS / (M x head
# size) of them, 1 to MAX_PROGRAMS_PER_SM. An H200 sweep (benchmarks/device_runs/2026-11-27-h200/run3, GPU alone):
# Llama-3-8B's heads, 5 rows (32 x 128) at batch 8 over 32k: 4 chunks 298 us against 2 (one per SM) 435 us; over 8k 91
# against 122; SmolLM2's, 5 rows (16 x 64) over 32k: 20 chunks 62 us against 5 124, 21 rows (64 x 64) over 8k: 10 chunks
# 34 us against 5 38 (and 20: 45). 128-row tiles of head size 128: one program per SM (an H100,
# device_runs/2026-11-27-h100-a: two per SM cost 7-18%)
SLOT_ELEMS = 8192
MAX_PROGRAMS_PER_SM = 4
# No chunk shorter than MIN_CHUNK_TILES key tiles (each chunk's partials cost a reduction). An H200 sweep
# (device_runs/2026-11-27-h200), SmolLM2's heads, batch 1, 64 nodes over 512 keys (6 tiles): 2 chunks 29 us, 4 21 us, 22
# 20 us (4 tiles a chunk: 2)
MIN_CHUNK_TILES = 2
# The split programs reduce their own partials only where the tiles are at least FUSED_MIN_TILES_PER_SM of the SMs: with
# fewer, the last program of a tile reads every partial while the device idles. An H200 sweep
# (device_runs/2026-11-27-h200): 6 tiles (batch 1) fused 1.0-1.4x the reduce launch's time, 24 tiles (SmolLM2 at batch
# 8) 1.25-1.5x, 64 tiles (Llama-3-8B at batch 8) 0.91-1.04x (an H100, device_runs/2026-11-27-h100-c, 64 tiles at 2k-8k
# keys: 0.63-0.88x)
FUSED_MIN_TILES_PER_SM = 0.25
# Integer arguments that change from step to step, kept out of Triton's specialization (a new value would compile a
# new kernel): per kernel, the names given to `do_not_specialize` and read by `_arg_key`
NO_SPECIALIZE = {
    "split": ("chunk", "n_qb", "stride_as", "stride_at", "stride_ms", "stride_mt", "stride_bits"),
    "reduce": ("splits", "stride_as", "stride_at", "stride_ms", "stride_mt"),
}


def ancestor_bits(tree_mask: torch.Tensor) -> torch.Tensor:
    """tree_mask [T, max_keys] bool (row i sees tree key j) -> [T, ceil(max_keys / 32)] int32 words."""
    t, n = tree_mask.shape
    words = max(1, math.ceil(n / 32))
    padded = torch.zeros(t, words * 32, dtype=torch.int64, device=tree_mask.device)
    padded[:, :n] = tree_mask.to(torch.int64)
    weights = torch.ones(32, dtype=torch.int64, device=tree_mask.device) << torch.arange(32, device=tree_mask.device)
    packed = (padded.view(t, words, 32) * weights).sum(-1)  # [T, W] in 0 .. 2^32 - 1
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def tree_attention_reference(q, k_cache, v_cache, block_table, prefix_lens, cu_rows, bits, scale,
                             dtype=torch.float64, tree_lens=None) -> torch.Tensor:
    """Plain torch, request by request: gather the request's keys, unpack its rows' ancestor bits,
    softmax(QK^T) V. tree_lens: tree keys per request (default: its rows)."""
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    bs = k_cache.shape[1]
    out = torch.zeros(t, hq, d, dtype=dtype, device=q.device)
    shifts = torch.arange(32, device=q.device)
    for b in range(len(prefix_lens)):
        r0, r1 = int(cu_rows[b]), int(cu_rows[b + 1])
        n, p = r1 - r0, int(prefix_lens[b])
        if n == 0:
            continue
        nt = n if tree_lens is None else int(tree_lens[b])
        pos = torch.arange(p + nt, device=q.device)
        slots = block_table[b, pos // bs].long() * bs + pos % bs
        k = k_cache.reshape(-1, hkv, d)[slots].to(dtype)  # [p + nt, Hkv, D]
        v = v_cache.reshape(-1, hkv, d)[slots].to(dtype)
        rep = hq // hkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [p + nt, Hq, D]
        tree = ((bits[r0:r1].long().unsqueeze(-1) >> shifts) & 1).bool().reshape(n, -1)[:, :nt]
        visible = torch.cat([torch.ones(n, p, dtype=torch.bool, device=q.device), tree], 1)
        s = torch.einsum("ihd,jhd->hij", q[r0:r1].to(dtype), k) * scale  # [Hq, n, p + nt]
        s = s.masked_fill(~visible[None], float("-inf"))
        out[r0:r1] = torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), v)
    return out


if triton is not None:

    @triton.jit
    def _attend_tile(q, acc, m_i, l_i, start, end, table, k_ptr, v_ptr, kvh, bits_ptr, bits_rows, m_valid, p_len,
                     stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bits, scale,
                     TREE: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     D: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr, FULL: tl.constexpr = False,
                     page_ids=None):
        """One tile of keys start .. start + BLOCK_N (those < end) into the online softmax of the tile's rows. Prefix
        tiles (TREE False) are visible to every row; tree tiles read each row's ancestor bits. FULL: a prefix tile
        whose every key is < end: no mask on its loads or its scores (padding rows score against zeros and are
        never written). page_ids: the tile's keys' pages, loaded by the caller a tile ahead (`_pages`); None: loaded
        here, which makes the K / V loads wait on a load of the same iteration."""
        pos = start + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        if not FULL:
            valid = pos < end
        if page_ids is not None:
            page = page_ids.to(tl.int64)
        elif FULL:
            page = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
        else:
            page = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        k_off = page * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kvh * stride_kh
        v_off = page * stride_vb + (pos % BLOCK_SIZE) * stride_vs + kvh * stride_vh
        if FULL:
            if BLOCK_D == D:
                k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :])
                v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :])
            else:
                d_mask = (offs_d < D)[None, :]
                k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=d_mask, other=0.0)
                v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=d_mask, other=0.0)
        else:
            kv_mask = valid[:, None] & (offs_d < D)[None, :]
            k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale  # [M, N]
        if TREE:
            j = pos - p_len  # the tree key's index
            word = tl.load(bits_ptr + bits_rows[:, None] * stride_bits + (j // 32)[None, :],
                           mask=m_valid[:, None] & valid[None, :], other=0)
            visible = valid[None, :] & (((word >> (j % 32)[None, :]) & 1) != 0)
            s = tl.where(visible, s, float("-inf"))
        elif not FULL:
            visible = valid[None, :] & m_valid[:, None]
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        return acc, m_new, l_i

    @triton.jit
    def _pages(table, start, end, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
        """The pages of keys start .. start + BLOCK_N (0 past `end`): [BLOCK_N] int32."""
        pos = start + tl.arange(0, BLOCK_N)
        return tl.load(table + pos // BLOCK_SIZE, mask=pos < end, other=0)

    @triton.jit
    def _attend_prefix(q, acc, m_i, l_i, first, last, prefix_end, table, k_ptr, v_ptr, kvh, bits_ptr, bits_rows,
                       m_valid, p_len, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bits,
                       scale, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       D: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr, FULL: tl.constexpr,
                       PREFETCH: tl.constexpr):
        """Prefix tiles first, first + BLOCK_N, .. below `last` (keys below prefix_end) into the online softmax.
        PREFETCH: each tile's pages loaded a tile ahead (loop-carried), so its K / V loads depend on nothing loaded in
        their own iteration."""
        if PREFETCH:
            ahead = _pages(table, first, last, BLOCK_SIZE, BLOCK_N)
        for start in range(first, last, BLOCK_N):
            pages = None
            if PREFETCH:
                pages = ahead
                ahead = _pages(table, start + BLOCK_N, last, BLOCK_SIZE, BLOCK_N)
            acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, start, prefix_end, table, k_ptr, v_ptr, kvh, bits_ptr,
                                         bits_rows, m_valid, p_len, stride_kb, stride_ks, stride_kh, stride_vb,
                                         stride_vs, stride_vh, stride_bits, scale, False, BLOCK_SIZE, BLOCK_N,
                                         BLOCK_D, D, DOT_F32, PRECISION, FULL, pages)
        return acc, m_i, l_i

    @triton.jit(do_not_specialize=list(NO_SPECIALIZE["split"]))
    def _tree_attention_split_kernel(
            q_ptr, k_ptr, v_ptr, acc_ptr, m_ptr, l_ptr, o_ptr, bt_ptr, plen_ptr, tlen_ptr, cu_ptr, bits_ptr,
            qrows_ptr, btrows_ptr, done_ptr, scale, chunk, n_qb,
            stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            stride_as, stride_at, stride_ah, stride_ms, stride_mt, stride_bt, stride_bits, stride_ot, stride_oh,
            DIRECT: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
            DOT_F32: tl.constexpr, PRECISION: tl.constexpr, EVEN: tl.constexpr = False,
            PREFETCH: tl.constexpr = False, FUSED: tl.constexpr = False, TAIL_D: tl.constexpr = 64,
            TREE_ONLY: tl.constexpr = False):
        b = tl.program_id(0)
        kvh = tl.program_id(1) // n_qb
        qb = tl.program_id(1) % n_qb
        split = tl.program_id(2)
        row0 = tl.load(cu_ptr + b)
        n_rows = tl.load(cu_ptr + b + 1) - row0
        if qb * BLOCK_Q < n_rows:
            p_len = tl.load(plen_ptr + b)
            total = p_len + tl.load(tlen_ptr + b)
            lo = split * chunk
            hi = tl.minimum(lo + chunk, total)
            if TREE_ONLY:  # (a cascade's tree part: the tree's own keys, one split; the prefix is a dense kernel's)
                lo = p_len
                hi = total
            # the tile's M side: BLOCK_Q rows x GROUP query heads, packed without padding the group to a power of
            # two (GQA 3 or 7: 17 rows x 3 heads fit 64, not 128 as 17 x 4 would), padded as a whole to BLOCK_M
            offs_m = tl.arange(0, BLOCK_M)
            qi = qb * BLOCK_Q + offs_m // GROUP  # query row within the request
            g = offs_m % GROUP
            head = kvh * GROUP + g
            m_valid = (qi < n_rows) & (offs_m < BLOCK_Q * GROUP)  # (past it: the next block's rows, or padding)
            offs_d = tl.arange(0, BLOCK_D)
            d_valid = offs_d < D
            q_at = tl.load(qrows_ptr + row0 + qi, mask=m_valid, other=0).to(tl.int64)  # the row in q / out
            table = bt_ptr + tl.load(btrows_ptr + b).to(tl.int64) * stride_bt  # the request's block-table row
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            if lo < total:
                q = tl.load(q_ptr + q_at[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                            mask=m_valid[:, None] & d_valid[None, :], other=0.0)
                if DOT_F32:
                    q = q.to(tl.float32)
                bits_rows = (row0 + qi).to(tl.int64)
                prefix_end = tl.minimum(hi, p_len)
                tail = lo
                # prefix keys: no mask to read. PREFETCH: each tile's pages are loaded a tile ahead, so its K / V
                # loads depend on nothing loaded in their own iteration: Triton's pipeliner then keeps num_stages - 1
                # tiles in flight (with the pages loaded in the same iteration it waits for every copy at the top of
                # each iteration: one tile in flight, the loop bound by memory latency; two tiles ahead, compiled
                # for sm_90, it copies nothing asynchronously)
                if EVEN:  # whole prefix tiles without masks, then the rest (at most one tile) as below
                    tail = lo + (tl.maximum(prefix_end - lo, 0) // BLOCK_N) * BLOCK_N
                    acc, m_i, l_i = _attend_prefix(q, acc, m_i, l_i, lo, tail, prefix_end, table, k_ptr, v_ptr, kvh,
                                                   bits_ptr, bits_rows, m_valid, p_len, stride_kb, stride_ks,
                                                   stride_kh, stride_vb, stride_vs, stride_vh, stride_bits, scale,
                                                   BLOCK_SIZE, BLOCK_N, BLOCK_D, D, DOT_F32, PRECISION, True, PREFETCH)
                acc, m_i, l_i = _attend_prefix(q, acc, m_i, l_i, tail, prefix_end, prefix_end, table, k_ptr, v_ptr,
                                               kvh, bits_ptr, bits_rows, m_valid, p_len, stride_kb, stride_ks,
                                               stride_kh, stride_vb, stride_vs, stride_vh, stride_bits, scale,
                                               BLOCK_SIZE, BLOCK_N, BLOCK_D, D, DOT_F32, PRECISION, False, PREFETCH)
                for start in range(tl.maximum(lo, p_len), hi, BLOCK_N):  # tree keys: ancestors-or-self
                    acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, start, hi, table, k_ptr, v_ptr, kvh,
                                                 bits_ptr, bits_rows, m_valid, p_len, stride_kb, stride_ks, stride_kh,
                                                 stride_vb, stride_vs, stride_vh, stride_bits, scale, True,
                                                 BLOCK_SIZE, BLOCK_N, BLOCK_D, D, DOT_F32, PRECISION)
            if DIRECT:  # one split holds every key: the output itself, no partials and no reduce launch
                out = acc / tl.maximum(l_i, 1e-30)[:, None]
                tl.store(o_ptr + q_at[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                         out.to(o_ptr.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])
            else:
                rows_at = (row0 + qi).to(tl.int64)
                tl.store(acc_ptr + split * stride_as + rows_at[:, None] * stride_at + head[:, None] * stride_ah
                         + offs_d[None, :], acc, mask=m_valid[:, None] & d_valid[None, :])
                tl.store(m_ptr + split * stride_ms + rows_at * stride_mt + head, m_i, mask=m_valid)
                tl.store(l_ptr + split * stride_ms + rows_at * stride_mt + head, l_i, mask=m_valid)
                if FUSED:  # the tile's last split program to finish combines the partials: no reduce launch
                    tl.debug_barrier()  # the program's partial stores before its release (cumulative)
                    counter = done_ptr + b * tl.num_programs(1) + tl.program_id(1)
                    if tl.atomic_add(counter, 1, sem="acq_rel") == tl.num_programs(2) - 1:
                        # the max and the sum over the splits first ([BLOCK_M] each), then the output TAIL_D columns
                        # at a time: a [BLOCK_M, TAIL_D] sum live, not [BLOCK_M, BLOCK_D] (registers the loop keeps)
                        m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
                        l_all = tl.zeros([BLOCK_M], tl.float32)
                        for s in range(0, tl.num_programs(2)):  # L2 reads (.cg): other SMs wrote them
                            m_s = tl.load(m_ptr + s * stride_ms + rows_at * stride_mt + head, mask=m_valid,
                                          other=float("-inf"), cache_modifier=".cg")
                            l_s = tl.load(l_ptr + s * stride_ms + rows_at * stride_mt + head, mask=m_valid,
                                          other=0.0, cache_modifier=".cg")
                            m_new = tl.maximum(m_all, m_s)
                            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                            l_all = l_all * tl.exp(m_all - m_safe) + l_s * tl.exp(m_s - m_safe)
                            m_all = m_new
                        m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
                        inv_l = 1.0 / tl.maximum(l_all, 1e-30)
                        for c in tl.static_range(0, BLOCK_D, TAIL_D):
                            offs_c = c + tl.arange(0, TAIL_D)
                            c_valid = m_valid[:, None] & (offs_c < D)[None, :]
                            acc_all = tl.zeros([BLOCK_M, TAIL_D], tl.float32)
                            for s in range(0, tl.num_programs(2)):
                                m_s = tl.load(m_ptr + s * stride_ms + rows_at * stride_mt + head, mask=m_valid,
                                              other=float("-inf"), cache_modifier=".cg")
                                acc_s = tl.load(acc_ptr + s * stride_as + rows_at[:, None] * stride_at
                                                + head[:, None] * stride_ah + offs_c[None, :], mask=c_valid,
                                                other=0.0, cache_modifier=".cg")
                                acc_all += acc_s * tl.exp(m_s - m_safe)[:, None]
                            tl.store(o_ptr + q_at[:, None] * stride_ot + head[:, None] * stride_oh + offs_c[None, :],
                                     (acc_all * inv_l[:, None]).to(o_ptr.dtype.element_ty), mask=c_valid)
                        tl.store(counter, 0)  # zero again for the next layer's launch

    @triton.jit(do_not_specialize=list(NO_SPECIALIZE["reduce"]))
    def _tree_attention_reduce_kernel(acc_ptr, m_ptr, l_ptr, o_ptr, qrows_ptr, splits, stride_as, stride_at, stride_ah,
                                      stride_ms, stride_mt, stride_ot, stride_oh,
                                      D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
        """One program per (tree row, query head): out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, written at
        the row's place in the output (q_rows). The splits are read BLOCK_S at a time (REDUCE_BLOCK_S), merged by
        their running max: a [BLOCK_S, BLOCK_D] tile of registers, not [MAX_SPLITS, BLOCK_D] (which took 255
        registers a thread for sm_90: two programs of 4 warps to an SM, the launch latency-bound at many rows)."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs_d = tl.arange(0, BLOCK_D)
        d_valid = offs_d < D
        m_run = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
        l_run = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
        acc_run = tl.zeros([BLOCK_D], tl.float32)
        for s0 in range(0, splits, BLOCK_S):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            s_valid = offs_s < splits
            m = tl.load(m_ptr + offs_s * stride_ms + t * stride_mt + h, mask=s_valid, other=float("-inf"))
            l_s = tl.load(l_ptr + offs_s * stride_ms + t * stride_mt + h, mask=s_valid, other=0.0)
            acc = tl.load(acc_ptr + offs_s[:, None] * stride_as + t * stride_at + h * stride_ah + offs_d[None, :],
                          mask=s_valid[:, None] & d_valid[None, :], other=0.0)
            m_new = tl.maximum(m_run, tl.max(m, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_run - m_safe)  # (0 while nothing was seen)
            w = tl.where(m > float("-inf"), tl.exp(m - m_safe), 0.0)  # [S]
            acc_run = acc_run * alpha + tl.sum(acc * w[:, None], 0)
            l_run = l_run * alpha + tl.sum(l_s * w, 0)
            m_run = m_new
        out = acc_run / tl.maximum(l_run, 1e-30)
        o_row = tl.load(qrows_ptr + t).to(tl.int64)
        tl.store(o_ptr + o_row * stride_ot + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_valid)


def choose_splits(batch: int, kv_heads: int, q_blocks: int, longest: int, block_n: int, programs: int,
                  refill: bool = True) -> int:
    """How many chunks to cut the keys into, for `programs` slots (one per SM). Fewer tiles than slots: as many
    chunks as fill the slots once, not more (a few SMs running a second program would double the kernel's time for
    the rest to wait on). More tiles than slots and `refill` (tiles of one program per SM): up to FUSED_MAX_SPLITS
    chunks of at least REFILL_MIN_CHUNK keys where they fill the last wave at least 10% better, the fewest of the
    best (8 trees of 64 nodes of Llama-3-8B on 132 SMs: 192 tiles, 2 waves of whole tiles or 3 of half ones: 2
    chunks). Never a chunk shorter than MIN_CHUNK_TILES key tiles, at most MAX_SPLITS."""
    base = batch * kv_heads * q_blocks
    most = int(min(max(1, longest // (MIN_CHUNK_TILES * block_n)), MAX_SPLITS))
    if base <= programs:
        return int(min(programs // base, most))
    if not refill:
        return 1

    def waves_per_key(s):  # waves of programs, each over 1 / s of the keys
        return _cdiv(base * s, programs) / s

    cuts = [s for s in range(2, min(FUSED_MAX_SPLITS, most) + 1)
            if _cdiv(_cdiv(longest, s), block_n) * block_n >= REFILL_MIN_CHUNK
            and waves_per_key(s) <= 0.9 * waves_per_key(1)]  # (a gain to cover the reduction's cost)
    return min(cuts, key=lambda s: (waves_per_key(s), s), default=1)


def fuse_reduction(splits: int, chunk: int, tiles: int, programs: int) -> bool:
    """Whether the split programs reduce their own partials (no second launch): FUSED_MAX_SPLITS, FUSED_MAX_CHUNK,
    FUSED_MIN_TILES_PER_SM (`programs`: the device's SMs)."""
    return (2 <= splits <= FUSED_MAX_SPLITS and tiles >= FUSED_MIN_TILES_PER_SM * programs
            and (chunk <= FUSED_MAX_CHUNK or tiles > programs))


def programs_per_sm(tile: int, head_size: int) -> int:
    """Programs of a `tile`-row x `head_size` tile an SM runs at once, as `choose_splits` counts its slots:
    SLOT_ELEMS / (tile x head size), 1 to MAX_PROGRAMS_PER_SM."""
    return max(1, min(MAX_PROGRAMS_PER_SM, SLOT_ELEMS // (tile * head_size)))


@functools.lru_cache(maxsize=None)
def device_programs(device: torch.device) -> int:
    """The slots `choose_splits` fills: the device's SMs (8 on CPU, for the interpreter's tests). Asked once per
    device: every step's plan reads it."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def tile_m(block_q: int, group: int) -> int:
    """A tile's M side for `block_q` rows of `group` query heads each: the power of two that holds them, at least
    16 (tl.dot's smallest M)."""
    return max(16, _next_pow2(block_q * group))


def tile_rows(max_rows: int, num_heads: int, num_kv_heads: int) -> int:
    """Query rows of one tile (BLOCK_Q): all of a tree's rows (up to `max_rows`) x the kv head's query heads in one
    tile where they fit MAX_TILE_M, at least 16 (tl.dot's smallest M). An engine fixes it from its largest tree:
    every step then launches the same compiled kernel."""
    group = num_heads // num_kv_heads
    return max(1, max(16, min(MAX_TILE_M, _next_pow2(max_rows * group))) // group)


@dataclass
class TreeAttentionLaunch:
    """What every attention layer of one forward shares: the trees' rows and masks, the work split, the scratch.
    Built once per step (`plan_launch`), launched per layer (`launch`) with no host work beyond the two launches.

    prefix_lens, tree_lens [B], cu_rows [B + 1] (request b's query rows are cu_rows[b] .. cu_rows[b + 1] - 1),
    bits [T, W] ancestor bits, q_rows [T] (each row's row in the layer's q and output), bt_rows [B] (each request's
    row of the layer's block table): int32, on the device. acc [splits, T, Hq, D], m / l [splits, T, Hq]: fp32."""
    prefix_lens: torch.Tensor
    tree_lens: torch.Tensor
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
    variant_checked: bool = False  # its launches' variant recorded in VARIANTS (the first layer: the rest are alike)
    num_warps: int | None = None  # the split kernel's launch options (None: launch's defaults)
    num_stages: int | None = None
    even: bool = True  # whole prefix tiles without masks (EVEN)
    prefetch: bool = True  # each prefix tile's pages loaded a tile ahead (PREFETCH)
    done: torch.Tensor | None = None  # [B * Hkv * q_blocks] int32 zeros: split programs finished per tile (fused)
    partials: bool = False  # the trees' own keys only, as partials (acc, m, l), not the output: a cascade merges them
    compiled: dict = field(default_factory=dict)  # layer key -> its ready launches (`launch`, `_ready_launch`)


def plan_launch(prefix_lens, cu_rows, bits, q_rows, bt_rows, num_heads: int, num_kv_heads: int, head_size: int,
                max_rows: int, longest: int, block_n: int = BLOCK_N, splits: int | None = None, tree_lens=None,
                block_q: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None, even: bool | None = None, prefetch: bool | None = None,
                fused: bool | None = None, partials: bool = False, scratch: str | None = None) -> TreeAttentionLaunch:
    """max_rows: the most query rows of one request, longest: the most keys of one (prefix + tree keys): host ints,
    so nothing here waits for the device. splits: key chunks (default `choose_splits` for the device's SM count).
    tree_lens: tree keys per request (default: its rows, as in verification). block_q: the engine's tile
    (`tile_rows` of its largest tree; default: this step's). num_warps / num_stages: the split kernel's (default: 4
    warps for tiles of up to 64 rows x heads, else 8; NUM_STAGES). even: whole prefix tiles without masks (default
    EVEN). prefetch: a prefix tile's pages loaded a tile ahead (default PREFETCH) or in its own iteration. fused:
    the split programs combine their partials themselves, no reduce launch (default `fuse_reduction`). partials:
    the rows' attention over their trees' own keys alone (keys prefix_lens .. + tree_lens, one split) written as
    partials, no output and no reduction (kernels/tree_cascade.py merges them with a dense kernel's attention over
    the prefix). scratch: the partials' buffers are views of this owner's kept scratch (kept.scratch: an engine's one
    plan a step), not new tensors."""
    if triton is None:
        raise RuntimeError("tree attention needs Triton")
    num_stages = NUM_STAGES if num_stages is None else num_stages
    prefetch = PREFETCH if prefetch is None else prefetch
    even = EVEN if even is None else even
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    t = q_rows.shape[0]
    if bits.shape[0] != t or bits.dtype != torch.int32:
        raise ValueError(f"ancestor_bits must be int32 [{t}, words]; got {bits.dtype} {tuple(bits.shape)}")
    if tree_lens is None:
        if bits.shape[1] * 32 < max_rows:
            raise ValueError(f"ancestor_bits has {bits.shape[1]} words for trees of {max_rows} rows")
        tree_lens = cu_rows[1:] - cu_rows[:-1]
    block_q = block_q or tile_rows(max_rows, num_heads, num_kv_heads)
    q_blocks = _cdiv(max_rows, block_q)
    sms = device_programs(bits.device)
    batch = prefix_lens.shape[0]  # (not len(): torch's __len__ is Python, ~1.5 us)
    tiles = batch * num_kv_heads * q_blocks
    if splits is None:
        # the slots filled once, rounded down: on an H100 (benchmarks/kernel_sweep.py) one 128-row program per SM
        # rounded up cut the GPU time of two per SM 7-18% (device_runs/2026-11-27-h100-a); rounded down (132 SMs: 16
        # splits for 8 kv heads, not 17) cut it another 15-22% at batch 1 and 8 over 2k-32k prefixes
        # (device_runs/2026-11-27-h100-b); smaller tiles: several programs to an SM (`programs_per_sm`,
        # device_runs/2026-11-27-h200)
        m = tile_m(block_q, num_heads // num_kv_heads)
        splits = choose_splits(batch, num_kv_heads, q_blocks, longest, block_n,
                               sms * programs_per_sm(m, head_size), refill=m >= MAX_TILE_M)
    splits = 1 if partials else min(int(splits), MAX_SPLITS)
    chunk = _cdiv(_cdiv(longest, splits), block_n) * block_n
    splits = _cdiv(longest, chunk)
    fused = False if partials else fuse_reduction(splits, chunk, tiles, sms) if fused is None else fused
    rows = t if splits > 1 or partials else 1  # one split writes the output directly: no scratch
    if scratch is None:
        acc = torch.empty(splits, rows, num_heads, head_size, dtype=torch.float32, device=bits.device)
        m = torch.empty(splits, rows, num_heads, dtype=torch.float32, device=bits.device)
        l_ = torch.empty_like(m)
    else:  # three views of one kept buffer at multiples of 256 bytes into it (the 16-byte alignment compiled for)
        n_acc, n_m = splits * rows * num_heads * head_size, splits * rows * num_heads
        at_m = -(-n_acc // 64) * 64
        at_l = at_m + -(-n_m // 64) * 64
        flat = kept.scratch(scratch, at_l + n_m, bits.device)
        acc = flat.as_strided((splits, rows, num_heads, head_size), (rows * num_heads * head_size,
                                                                     num_heads * head_size, head_size, 1), 0)
        m = flat.as_strided((splits, rows, num_heads), (rows * num_heads, num_heads, 1), at_m)
        l_ = flat.as_strided((splits, rows, num_heads), (rows * num_heads, num_heads, 1), at_l)
    done = None
    if fused and splits > 1:  # zeroed once: each launch's reducing programs zero their counters again
        done = kept.zeros("tree attention", tiles, bits.device)
    return TreeAttentionLaunch(prefix_lens, tree_lens, cu_rows, bits, q_rows, bt_rows, num_heads, num_kv_heads,
                               head_size, block_q, q_blocks, block_n, chunk, splits, acc, m, l_,
                               num_warps=num_warps, num_stages=num_stages, even=even, prefetch=prefetch, done=done,
                               partials=partials)


# --- compiled variants ------------------------------------------------------------------------------------------

LAUNCH_OPTIONS = ("num_warps", "num_stages")


def _arg_key(name: str, value, kernel: str):
    """What Triton specializes a launch on for one argument (its rules as of 3.x): a tensor by dtype and 16-byte
    alignment, an integer by width and, unless kept out (`do_not_specialize`), whether it is 1 or a multiple of 16;
    a constexpr by its value."""
    if isinstance(value, torch.Tensor):
        return (name, str(value.dtype), value.data_ptr() % 16 == 0)
    if isinstance(value, bool) or value is None or isinstance(value, str) or name.isupper() or name in LAUNCH_OPTIONS:
        return (name, value)  # constexprs (upper-case here) and launch options: a kernel per value
    if isinstance(value, int):
        width = "i32" if -2**31 <= value < 2**31 else "i64"
        if name in NO_SPECIALIZE[kernel]:
            return (name, width)
        return (name, width, value == 1, value % 16 == 0)
    if isinstance(value, float):
        return (name, "fp32")
    return (name, repr(value))


@dataclass
class KernelVariants:
    """The kernel variants compiled at start-up (`warm_up`) and every launch's variant since: `cold` counts launches
    of a variant start-up did not compile (on a GPU: a compile inside a forward)."""
    warm: set = field(default_factory=set)
    launched: set = field(default_factory=set)
    cold: int = 0
    warming: bool = False

    def seen(self, key: tuple) -> None:
        if self.warming:
            self.warm.add(key)
        elif key not in self.warm:
            self.cold += 1
        self.launched.add(key)


VARIANTS = KernelVariants()


FAST_LAUNCH = True  # a plan's later layers launch the compiled kernels its first layer resolved (off: Triton's JIT
# dispatch every launch; turned off for good if a compiled kernel's launch ever fails)
LAYER_ARGS = ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "bt_ptr")  # what differs from one layer's launch to the next


def _launch_kernel(kernel, name: str, grid, args: dict, record: bool):
    """Launch through Triton's dispatch; `record`: first note the launch's variant (about 15 us of Python: once per
    plan, not per layer, whose tensors share their dtypes, strides and alignment). Returns what the dispatch returns:
    on a GPU the compiled kernel (`_ready_launch`), in the interpreter nothing."""
    if record:
        VARIANTS.seen((name, tuple(_arg_key(k, v, name) for k, v in args.items())))
    return kernel[grid](**args)


def _is_compiled(got) -> bool:
    return hasattr(got, "run") and hasattr(got, "__getitem__")  # a CompiledKernel


def _ready_launch(kernel, compiled, grid, args: dict) -> tuple:
    """One kernel's launch as the layers after the first make it: the compiled kernel's launcher for the grid
    (it reads grid[0..2]; Triton's dispatch pads a shorter grid with 1s), every argument in the kernel's order with
    pointers as ints (the launcher takes an int as readily as a tensor, without a data_ptr() call and a driver query
    each), and where the layer's own tensors go (slot, index in LAYER_ARGS)."""
    names = kernel.arg_names
    values = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in (args[n] for n in names)]
    slots = tuple((i, LAYER_ARGS.index(n)) for i, n in enumerate(names) if n in LAYER_ARGS)
    return compiled[tuple(grid) + (1,) * (3 - len(grid))], values, slots


def _launch_ready(ready: list, ptrs: tuple) -> None:
    """The plan's kernels for one more layer: its tensors' pointers (LAYER_ARGS' order) into their slots, nothing
    else recomputed."""
    for runner, values, slots in ready:
        args = values.copy()
        for i, j in slots:
            args[i] = ptrs[j]
        runner(*args)


def _layer_key(q, k_cache, v_cache, block_table, out, scale, ptrs: tuple) -> tuple:
    """What of one layer's launch Triton specializes on or the ready launch holds, besides its tensors' pointers
    (`ptrs`, LAYER_ARGS' order: only their 16-byte alignment): a layer whose key differs from the first's goes
    through the dispatch again."""
    return (q.dtype, k_cache.dtype, out.dtype, block_table.dtype, q.stride(), k_cache.stride(), v_cache.stride(),
            out.stride(), block_table.stride(0), scale) + tuple(p % 16 for p in ptrs)


def split_kernel_args(plan: TreeAttentionLaunch, q, k_cache, v_cache, block_table, scale: float, out,
                      interpret: bool = False) -> dict:
    """The split kernel's arguments for one layer, by name (constexprs upper-case, launch options last), as `launch`
    passes them (and benchmarks/kernel_ir.py compiles them). interpret: for Triton's interpreter."""
    _, bs, hkv, d = k_cache.shape
    acc, m, l_ = plan.acc, plan.m, plan.l
    group = plan.num_heads // hkv
    return dict(
        q_ptr=q, k_ptr=k_cache, v_ptr=v_cache, acc_ptr=acc, m_ptr=m, l_ptr=l_, o_ptr=out, bt_ptr=block_table,
        plen_ptr=plan.prefix_lens, tlen_ptr=plan.tree_lens, cu_ptr=plan.cu_rows, bits_ptr=plan.bits,
        qrows_ptr=plan.q_rows, btrows_ptr=plan.bt_rows,
        done_ptr=plan.cu_rows if plan.done is None else plan.done,  # (FUSED only; any int32 tensor otherwise)
        scale=scale, chunk=plan.chunk, n_qb=plan.q_blocks,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kb=k_cache.stride(0), stride_ks=k_cache.stride(1),
        stride_kh=k_cache.stride(2), stride_vb=v_cache.stride(0), stride_vs=v_cache.stride(1),
        stride_vh=v_cache.stride(2), stride_as=acc.stride(0), stride_at=acc.stride(1), stride_ah=acc.stride(2),
        stride_ms=m.stride(0), stride_mt=m.stride(1), stride_bt=block_table.stride(0),
        stride_bits=plan.bits.stride(0), stride_ot=out.stride(0), stride_oh=out.stride(1),
        DIRECT=plan.splits == 1 and not plan.partials, BLOCK_SIZE=bs, GROUP=group,
        BLOCK_M=tile_m(plan.block_q, group), BLOCK_Q=plan.block_q, BLOCK_N=plan.block_n, D=d, BLOCK_D=_next_pow2(d),
        # Triton's interpreter multiplies bf16 tl.dot operands wrongly (as of 3.9); it gets fp32 operands there
        DOT_F32=interpret and q.dtype == torch.bfloat16,
        # fp32 products exact: TF32 (NVIDIA's default for fp32 tl.dot) keeps 10 mantissa bits
        PRECISION="ieee" if q.dtype == torch.float32 or interpret else None, EVEN=plan.even,
        PREFETCH=plan.prefetch, FUSED=plan.done is not None, TAIL_D=min(FUSED_TAIL_D, _next_pow2(d)),
        TREE_ONLY=plan.partials,
        num_warps=plan.num_warps or (4 if tile_m(plan.block_q, group) <= 64 else 8),
        **({"num_stages": plan.num_stages} if plan.num_stages else {}))


def reduce_kernel_args(plan: TreeAttentionLaunch, out) -> dict:
    """The reduction's arguments for one layer, by name (as `launch` passes them and benchmarks/kernel_ir.py
    compiles them)."""
    acc, m = plan.acc, plan.m
    return dict(acc_ptr=acc, m_ptr=m, l_ptr=plan.l, o_ptr=out, qrows_ptr=plan.q_rows, splits=plan.splits,
                stride_as=acc.stride(0), stride_at=acc.stride(1), stride_ah=acc.stride(2), stride_ms=m.stride(0),
                stride_mt=m.stride(1), stride_ot=out.stride(0), stride_oh=out.stride(1), D=plan.head_size,
                BLOCK_D=_next_pow2(plan.head_size), BLOCK_S=REDUCE_BLOCK_S)


def launch(plan: TreeAttentionLaunch, q, k_cache, v_cache, block_table, scale: float, out) -> torch.Tensor:
    """Tree attention of one layer: q [*, Hq, D] (the rows at plan.q_rows), k_cache / v_cache [num_blocks,
    block_size, Hkv, D] (any strides, the last dimension contiguous), block_table [*, max_blocks]; the plan's rows of
    `out` [*, Hq, D] are written, nothing else.

    A step's first layer launches through Triton's dispatch (binding and specializing ~45 arguments: ~50 us of Python
    a launch on an H100's host, more than the kernel's GPU time at short prefixes), which returns the compiled
    kernels; the plan keeps them with their arguments (`_ready_launch`), and every later layer whose dtypes, strides,
    alignment and scale are the first's launches them with its own pointers put in (`_launch_ready`). A `partials`
    plan writes each split's partials into plan.acc / m / l and no output (kernels/tree_cascade.py)."""
    global FAST_LAUNCH
    nb, bs, hkv, d = k_cache.shape
    if (q.shape[1], hkv, d) != (plan.num_heads, plan.num_kv_heads, plan.head_size) or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} and caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit "
                         f"the plan ({plan.num_heads} / {plan.num_kv_heads} heads of {plan.head_size})")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("q, out and the caches need a contiguous last dimension")
    layer = ready = None
    if FAST_LAUNCH:
        ptrs = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), block_table.data_ptr())
        layer = _layer_key(q, k_cache, v_cache, block_table, out, scale, ptrs)
        ready = plan.compiled.get(layer)
    if ready is not None:
        try:
            _launch_ready(ready, ptrs)
            return out
        except Exception as e:  # a Triton whose compiled kernels launch otherwise: its dispatch from now on
            FAST_LAUNCH = False
            plan.compiled.clear()
            warnings.warn(f"tree attention: launching a compiled kernel directly failed ({type(e).__name__}: {e}); "
                          "Triton's dispatch launches every layer from now on", RuntimeWarning)
    grid = (len(plan.prefix_lens), hkv * plan.q_blocks, plan.splits)
    direct = plan.splits == 1 and not plan.partials
    record = not plan.variant_checked or VARIANTS.warming
    plan.variant_checked = True
    split_args = split_kernel_args(plan, q, k_cache, v_cache, block_table, scale, out,
                                   os.environ.get("TRITON_INTERPRET") == "1")
    launches = [(_tree_attention_split_kernel, grid, split_args,
                 _launch_kernel(_tree_attention_split_kernel, "split", grid, split_args, record))]
    if not direct and plan.done is None and not plan.partials:
        reduce_grid = (plan.q_rows.shape[0], plan.num_heads)
        reduce_args = reduce_kernel_args(plan, out)
        launches.append((_tree_attention_reduce_kernel, reduce_grid, reduce_args,
                         _launch_kernel(_tree_attention_reduce_kernel, "reduce", reduce_grid, reduce_args, record)))
    if FAST_LAUNCH and all(_is_compiled(got) for *_, got in launches):
        plan.compiled[layer] = [_ready_launch(kernel, got, g, args) for kernel, g, args, got in launches]
    return out


def launch_reference(plan: TreeAttentionLaunch, q, k_cache, v_cache, block_table, scale: float, out) -> torch.Tensor:
    """What `launch` computes, in torch (float32): the fallback of a runtime whose launch failed. It reads the plan's
    indices on the host (a wait for the device: a fault path only)."""
    q_rows, bt_rows = plan.q_rows.long(), plan.bt_rows.long()
    got = tree_attention_reference(q[q_rows], k_cache, v_cache, block_table[bt_rows], plan.prefix_lens.cpu(),
                                   plan.cu_rows.cpu(), plan.bits, scale, dtype=torch.float32,
                                   tree_lens=plan.tree_lens.cpu())
    out[q_rows] = got.to(out.dtype)
    return out


def tree_attention_triton(q, k_cache, v_cache, block_table, prefix_lens, cu_rows, bits, scale,
                          max_rows: int | None = None, longest: int | None = None, block_n: int = BLOCK_N,
                          splits: int | None = None, q_rows=None, bt_rows=None, out=None, tree_lens=None,
                          block_q: int | None = None, even: bool | None = None, prefetch: bool | None = None,
                          fused: bool | None = None) -> torch.Tensor:
    """Plan and launch in one call. Without q_rows / bt_rows, q holds exactly the plan's rows (packed as cu_rows) and
    block_table one row per request; returns the output [T, Hq, D] in q's dtype (`out`, or a new tensor). max_rows /
    longest are computed from the tensors when not given (a device sync)."""
    t = int(cu_rows[-1]) if q_rows is None else q_rows.shape[0]
    rows = cu_rows[1:] - cu_rows[:-1]
    keys = rows if tree_lens is None else tree_lens
    if max_rows is None:
        max_rows = int(rows.max())
    if longest is None:
        longest = int((prefix_lens + keys).max())
    if q_rows is None:
        q_rows = torch.arange(t, dtype=torch.int32, device=q.device)
    if bt_rows is None:
        bt_rows = torch.arange(len(prefix_lens), dtype=torch.int32, device=q.device)
    _, _, hkv, d = k_cache.shape
    if d != q.shape[2]:
        raise ValueError(f"q head size {q.shape[2]} and caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do "
                         "not fit")
    plan = plan_launch(prefix_lens, cu_rows, bits, q_rows, bt_rows, q.shape[1], hkv, d, max_rows, longest,
                       block_n=block_n, splits=splits, tree_lens=tree_lens, block_q=block_q, even=even,
                       prefetch=prefetch, fused=fused)
    return launch(plan, q, k_cache, v_cache, block_table, scale, torch.empty_like(q) if out is None else out)


# --- start-up -----------------------------------------------------------------------------------------------------

def _small_case(g, device, dtype, num_heads, num_kv_heads, head_size, block_size, plens, nodes, blocks):
    """A random case in vLLM's layouts: q a view of a fused qkv buffer, K / V views of one [blocks, Hkv,
    block_size, 2 D] cache (engine/gpu_kv.kv_views)."""
    rows = [n + 1 for n in nodes]
    cu = torch.tensor([0] + torch.tensor(rows).cumsum(0).tolist(), dtype=torch.int32)
    table = torch.randperm(blocks, generator=g).view(len(rows), -1).to(torch.int32)
    cache = torch.randn(blocks, num_kv_heads, block_size, 2 * head_size, generator=g).to(dtype).to(device)
    k, v = cache.transpose(1, 2).split(head_size, dim=-1)
    qkv = torch.randn(sum(rows), (num_heads + 2 * num_kv_heads) * head_size, generator=g).to(dtype).to(device)
    q = qkv[:, :num_heads * head_size].view(sum(rows), num_heads, head_size)
    words = max(1, -(-max(rows) // 32))
    mask = torch.zeros(sum(rows), words * 32, dtype=torch.bool)
    for b, n in enumerate(nodes):
        parents = [-1] + [int(torch.randint(i + 1, (), generator=g)) - 1 for i in range(n - 1)] if n else []
        m = ancestor_mask(DraftTree(torch.zeros(n, dtype=torch.long), torch.tensor(parents, dtype=torch.long)))
        c = int(cu[b])
        mask[c:c + n + 1, :n + 1] = m
    return q, k, v, table.to(device), torch.tensor(plens, dtype=torch.int32, device=device), cu.to(device), \
        ancestor_bits(mask).to(device)


def warm_up(device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_size: int, block_size: int = 16,
            max_rows: int = 6, block_n: int = BLOCK_N, max_blocks: int | None = None, k_cache=None, v_cache=None,
            block_table=None) -> float:
    """Compile every variant a step of this engine can launch (the tile `tile_rows(max_rows)` writing the output,
    reducing its own partials, writing partials; the reduction) on `device` in `dtype`, run each on a small random
    case (trees over paged prefixes in vLLM's layouts, the engine's page size, a block table `max_blocks` wide as
    the engine's) and return the largest difference from the float32 reference (TOLERANCE[dtype] bounds a correct
    kernel). Given the engine's own caches and block table (after vLLM allocated them), the same variants are
    launched once more on those (read only; the output is scratch), so their strides and alignment are what steps
    will meet. The variants are recorded in VARIANTS.warm: any later launch of another is counted as cold."""
    g = torch.Generator().manual_seed(0)
    block_q = tile_rows(max_rows, num_heads, num_kv_heads)
    nodes = [max(0, min(max_rows - 1, 5)), max(0, min(max_rows - 1, 2))]
    plens = [block_n * 4 + 7, 5]
    longest = max(p + n + 1 for p, n in zip(plens, nodes))
    if block_table is not None:
        max_blocks = block_table.shape[1]
    per_req = _cdiv(longest, block_size)
    if max_blocks is not None and max_blocks < per_req:  # a short max_model_len: shorter prefixes
        plens = [max(1, max_blocks * block_size - n - 1) for n in nodes]
        longest = max(p + n + 1 for p, n in zip(plens, nodes))
        per_req = _cdiv(longest, block_size)
    width = max(per_req, max_blocks or 0)
    q, k, v, table, plen, cu, bits = _small_case(g, device, dtype, num_heads, num_kv_heads, head_size, block_size,
                                                 plens, nodes, 2 * per_req)
    wide = torch.zeros(2, width, dtype=torch.int32, device=table.device)  # the engine's block-table stride
    wide[:, :per_req] = table
    scale = head_size ** -0.5
    want = tree_attention_reference(q, k, v, table, plen, cu, bits, scale, dtype=torch.float32)
    err = 0.0
    VARIANTS.warming = True
    try:
        # one chunk, fused, partials and the reduction: `fused` named, not left to `fuse_reduction`, whose choice
        # for this small case's 2 tiles depends on the device's SMs (on 132 it would not fuse, and a step's first
        # fused launch compiled mid-request: an H200 run, device_runs/2026-11-28-h200)
        for splits, fused in ((1, False), (2, True), (FUSED_MAX_SPLITS + 1, False)):
            got = tree_attention_triton(q, k, v, wide, plen, cu, bits, scale, max_rows=max(nodes) + 1,
                                        longest=longest, block_n=block_n, splits=splits, block_q=block_q,
                                        out=torch.empty_like(q), fused=fused)
            err = max(err, float((got.float() - want).abs().max()))
            if k_cache is not None:  # the engine's own tensors (its block table's first rows: zeros at start-up)
                tree_attention_triton(q, k_cache, v_cache, block_table[:2], plen, cu, bits, scale,
                                      max_rows=max(nodes) + 1, longest=longest, block_n=block_n, splits=splits,
                                      block_q=block_q, out=torch.empty_like(q), fused=fused)
    finally:
        VARIANTS.warming = False
    return err


def check_on_device(device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_size: int) -> float:
    """`warm_up` for a small engine (6-row trees, 16-token pages): the kernel compiles and computes on this device
    for these heads."""
    return warm_up(device, dtype, num_heads, num_kv_heads, head_size, block_size=16, max_rows=6)


TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}
