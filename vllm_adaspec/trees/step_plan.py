"""Every index array of a GPU tree step, in one compiled pass (numba, which vLLM itself depends on): what
`GPUTreeRuntime.prepare` uploads, written straight into its two staging buffers.

The same arrays built per tree in Python (`GPUTreeRuntime.prepare_reference`, kept as the definition the tests
compare with, and the plan where numba is missing) cost the host ~20-30 us a tree: at 8 trees x 16 nodes the plan
was 0.3 ms on the project's CPU (0.14 compiled: benchmarks/plan_cost.py) and 0.6 ms on an H200's host (issue 41,
whose target for plan, verification and compaction together is 5% of an 8B step: ~0.35 ms at batch 8). A step of R
trees (N nodes in all, T = N + R rows) over B batch rows, Rb of its trees verified in one batch (`batched`), the
most nodes of a tree `width`, `words` 32-bit words of ancestor bits a row:

    int64 buffer, in order: node_rows [N], node_pos [N], rows [R], starts [R], sizes [R], batched [Rb],
        logit_rows [Rb, width + 1], keep [D], cu_draft [B], cu_sampled [B], firsts [R], batched_rows [Rb], and where
        Rb > 0 the padded trees: tokens, parent_rows, depths, valid, order [Rb, width] (alike in length and padding:
        one strided view of the five), ancestors [Rb, width + 1, words]
    int32 buffer: q_rows [T], cu [R + 1], roots [R], rows [R], bits [T, words], seq [R]

Each array starts on a 16-byte boundary (`ALIGN_BYTES`: a Triton kernel reading one sees the same alignment every
step); `spans` gives (length, padding) pairs, the layout `torch.split_with_sizes` takes. What each array means:
trees/batch.py (`pack_trees`, `walk_order`, `representative_rows`), trees/tree.py (`ancestor_rows`),
engine/tree_sampler.py (`chain_indices`).
"""

from __future__ import annotations

import numpy as np

from vllm_adaspec.compiled import compiled as _compiled
from vllm_adaspec.compiled import njit  # (None without numba: the Python plan, slower, the same arrays)

ALIGN_BYTES = 16  # where each array starts
LONG_PARTS, INT_PARTS = 18, 6


def buffer_sizes(num_nodes: int, num_trees: int, num_batched: int, num_rows: int, total_drafts: int, width: int,
                 words: int, align_bytes: int = ALIGN_BYTES) -> tuple[int, int]:
    """Elements the int64 and int32 buffers need at most (every array padded to `align_bytes`)."""
    r, rb, t = num_trees, num_batched, num_nodes + num_trees
    longs = 2 * num_nodes + 4 * r + 2 * rb + rb * (width + 1) + total_drafts + 2 * num_rows
    if rb:
        longs += 5 * rb * width + rb * (width + 1) * words
    ints = t + (r + 1) + 3 * r + t * words
    return longs + max(1, align_bytes // 8) * LONG_PARTS, ints + max(1, align_bytes // 4) * INT_PARTS


def _plan(parents, tokens, sizes, verified, starts, roots, rows, batched, num_drafts, width, words, out_long,
          out_int, long_spans, int_spans, num, long_align, int_align):
    """The step's arrays into out_long / out_int (layout: the module's docstring); long_spans [2 * 18], int_spans
    [2 * 6]: each array's (length, padding), unused arrays (0, 0); num [B]: drafts per batch row, tree rows' 0;
    long_align / int_align: where arrays start, in elements. Plain loops over plain arrays, for numba."""
    r = sizes.shape[0]
    rb = batched.shape[0]
    b_rows = num_drafts.shape[0]
    n_all = parents.shape[0]
    t_all = n_all + r
    first = np.zeros(r + 1, np.int64)  # each tree's first node in the concatenated arrays
    for k in range(r):
        first[k + 1] = first[k] + sizes[k]
    depth = np.zeros(n_all, np.int64)
    anc = np.zeros((t_all, words), np.int64)  # each row's ancestor-or-self bits (row 0 of a tree: its root)
    row0 = np.zeros(r, np.int64)  # each tree's root row among the T rows
    at = 0
    for k in range(r):
        f, n = first[k], sizes[k]
        row0[k] = at
        anc[at, 0] = 1
        for i in range(n):
            q = parents[f + i]
            depth[f + i] = 1 if q < 0 else depth[f + q] + 1
            src = at + q + 1
            for w in range(words):
                anc[at + i + 1, w] = anc[src, w]
            anc[at + i + 1, (i + 1) // 32] |= np.int64(1) << ((i + 1) % 32)
        at += n + 1
    logit_start = np.zeros(b_rows + 1, np.int64)  # each batch row's first logits row (its drafts, then its bonus)
    for b in range(b_rows):
        logit_start[b + 1] = logit_start[b] + num_drafts[b] + 1
    is_tree = np.zeros(b_rows, np.bool_)
    for k in range(r):
        is_tree[rows[k]] = True

    # --- int64 ---
    o = 0
    part = 0
    for k in range(r):  # node_rows
        for i in range(sizes[k]):
            out_long[o] = starts[k] + 1 + i
            o += 1
    o, part = _close(long_spans, part, o, n_all, long_align)
    for k in range(r):  # node_pos
        for i in range(sizes[k]):
            out_long[o] = roots[k] + depth[first[k] + i]
            o += 1
    o, part = _close(long_spans, part, o, n_all, long_align)
    for src in (rows, starts, sizes):
        for k in range(r):
            out_long[o] = src[k]
            o += 1
        o, part = _close(long_spans, part, o, r, long_align)
    for j in range(rb):
        out_long[o] = batched[j]
        o += 1
    o, part = _close(long_spans, part, o, rb, long_align)
    for j in range(rb):  # logit_rows: a tree's rows, then its last row again as padding
        k = batched[j]
        s, n = logit_start[rows[k]], sizes[k]
        for c in range(width + 1):
            out_long[o] = s + c if c < n else s + n
            o += 1
    o, part = _close(long_spans, part, o, rb * (width + 1), long_align)
    kept = 0  # keep: the chain rows' draft rows, in order
    row_at = 0
    for b in range(b_rows):
        m = 0 if is_tree[b] else num_drafts[b]
        for x in range(m):
            out_long[o] = row_at + x
            o += 1
        row_at += num_drafts[b]
        kept += m
        num[b] = m
    o, part = _close(long_spans, part, o, kept, long_align)
    d = 0
    for b in range(b_rows):  # cu_draft
        d += num[b]
        out_long[o] = d
        o += 1
    o, part = _close(long_spans, part, o, b_rows, long_align)
    s = 0
    for b in range(b_rows):  # cu_sampled
        s += num[b] + 1
        out_long[o] = s
        o += 1
    o, part = _close(long_spans, part, o, b_rows, long_align)
    for k in range(r):  # firsts: each root's draft row (the drafts before it)
        out_long[o] = logit_start[rows[k]] - rows[k]
        o += 1
    o, part = _close(long_spans, part, o, r, long_align)
    for j in range(rb):  # batched_rows
        out_long[o] = rows[batched[j]]
        o += 1
    o, part = _close(long_spans, part, o, rb, long_align)
    if rb > 0:
        rank = np.zeros(width, np.int64)
        walk = np.zeros(width, np.int64)
        rep = np.zeros(width, np.int64)
        head = np.zeros(width + 1, np.int64)
        nxt = np.zeros(width, np.int64)
        stack = np.zeros(width, np.int64)
        at_tok = o  # the five [Rb, width] arrays one after another, each padded alike (one strided view of the
        size = rb * width  # five on the device), then the ancestors
        pad = -size % long_align
        at_par = at_tok + size + pad
        at_dep = at_par + size + pad
        at_val = at_dep + size + pad
        at_ord = at_val + size + pad
        at_anc = at_ord + size + pad
        a_size = rb * (width + 1) * words
        a_pad = -a_size % long_align
        for j in range(rb):
            k = batched[j]
            f, n = first[k], sizes[k]
            # walk order: the nodes in preorder, children by index (root paths sorted as tuples: batch.walk_order)
            for i in range(n + 1):
                head[i] = -1
            for i in range(n - 1, -1, -1):  # children linked in increasing index
                q = parents[f + i]
                nxt[i] = head[q + 1]
                head[q + 1] = i
            sp = 0
            c = head[0]
            while c >= 0:  # the root's children, pushed last-first
                stack[sp] = c
                sp += 1
                c = nxt[c]
            for x in range(sp // 2):
                stack[x], stack[sp - 1 - x] = stack[sp - 1 - x], stack[x]
            w = 0
            while sp > 0:
                sp -= 1
                i = stack[sp]
                rank[i] = w
                walk[w] = i
                w += 1
                c = head[i + 1]
                top = sp
                while c >= 0:
                    stack[sp] = c
                    sp += 1
                    c = nxt[c]
                for x in range((sp - top) // 2):
                    stack[top + x], stack[sp - 1 - x] = stack[sp - 1 - x], stack[top + x]
            # representative rows: the first node in walk order with the same (parent's representative, token)
            for x in range(n):
                i = walk[x]
                q = parents[f + i]
                rp = rep[q] if q >= 0 else -1
                rep[i] = i
                for y in range(x):
                    m = walk[y]
                    qm = parents[f + m]
                    if tokens[f + m] == tokens[f + i] and (rep[qm] if qm >= 0 else -1) == rp:
                        rep[i] = rep[m]
                        break
            base = j * width
            for i in range(width):
                if i < n:
                    q = parents[f + i]
                    out_long[at_tok + base + i] = tokens[f + i]
                    out_long[at_par + base + i] = 0 if q < 0 else rep[q] + 1
                    out_long[at_dep + base + i] = depth[f + i]
                    out_long[at_ord + base + i] = rank[i]
                else:
                    out_long[at_tok + base + i] = 0
                    out_long[at_par + base + i] = 0
                    out_long[at_dep + base + i] = 0
                    out_long[at_ord + base + i] = 0
                out_long[at_val + base + i] = 1 if i < verified[k] else 0
            a0 = at_anc + j * (width + 1) * words
            for i in range(width + 1):
                for wd in range(words):
                    out_long[a0 + i * words + wd] = anc[row0[k] + i, wd] if i <= n else 0
        for x in range(5):
            long_spans[2 * part] = size
            long_spans[2 * part + 1] = pad
            part += 1
        long_spans[2 * part] = a_size
        long_spans[2 * part + 1] = a_pad
        part += 1
        o = at_anc + a_size + a_pad
    for x in range(part, LONG_PARTS):
        long_spans[2 * x] = 0
        long_spans[2 * x + 1] = 0

    # --- int32 ---
    o = 0
    part = 0
    for k in range(r):  # q_rows: every tree row of the forward
        for i in range(sizes[k] + 1):
            out_int[o] = starts[k] + i
            o += 1
    o, part = _close(int_spans, part, o, t_all, int_align)
    out_int[o] = 0  # cu
    o += 1
    c = 0
    for k in range(r):
        c += sizes[k] + 1
        out_int[o] = c
        o += 1
    o, part = _close(int_spans, part, o, r + 1, int_align)
    for src in (roots, rows):
        for k in range(r):
            out_int[o] = src[k]
            o += 1
        o, part = _close(int_spans, part, o, r, int_align)
    for i in range(t_all):  # bits: the words as the int32 the kernel reads (the same bits)
        for wd in range(words):
            v = anc[i, wd]
            out_int[o] = v - (np.int64(1) << 32) if v >= (np.int64(1) << 31) else v
            o += 1
    o, part = _close(int_spans, part, o, t_all * words, int_align)
    for k in range(r):  # seq: each tree's rows
        out_int[o] = sizes[k] + 1
        o += 1
    o, part = _close(int_spans, part, o, r, int_align)
    return 0


def _close(spans, part, o, length, align):
    """An array of `length` elements ends at `o`: its (length, padding) into spans, `o` moved past the padding."""
    pad = -length % align
    spans[2 * part] = length
    spans[2 * part + 1] = pad
    return o + pad, part + 1


if njit is not None:  # (GPUTreeRuntime compiles it at start-up: `warm_up`)
    _close = _compiled(_close)
    _plan = _compiled(_plan)


def plan_arrays(parents: np.ndarray, tokens: np.ndarray, sizes: np.ndarray, verified: np.ndarray, starts: np.ndarray,
                roots: np.ndarray, rows: np.ndarray, batched: np.ndarray, num_drafts: np.ndarray, width: int,
                words: int, out_long: np.ndarray, out_int: np.ndarray,
                align_bytes: int = ALIGN_BYTES) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The step's arrays into out_long (int64) and out_int (int32), at least `buffer_sizes` long. parents, tokens
    [N]: the trees' nodes concatenated (parents tree-local, -1 = the root); sizes, verified, starts (each root's row
    of the forward), roots (its position), rows (its batch row) [R]; batched [Rb]; num_drafts [B] (int64 arrays).
    Returns (long spans [36], int spans [12], num [B]): (length, padding) per array, and drafts per batch row with
    the tree rows' taken out."""
    long_spans = np.zeros(2 * LONG_PARTS, np.int64)
    int_spans = np.zeros(2 * INT_PARTS, np.int64)
    num = np.zeros(num_drafts.shape[0], np.int64)
    _plan(parents, tokens, sizes, verified, starts, roots, rows, batched, num_drafts, width, words, out_long, out_int,
          long_spans, int_spans, num, max(1, align_bytes // 8), max(1, align_bytes // 4))
    return long_spans, int_spans, num


def compiled() -> bool:
    """Whether plans run compiled (numba importable)."""
    return njit is not None


def warm_up() -> None:
    """Compile the plan now (start-up), not in a request's first tree step: one step of one two-node tree. numba
    caches the machine code on disk, so later starts load it (~0.3 s) instead of compiling it (~4.5 s here)."""
    a = lambda *x: np.array(x, np.int64)  # noqa: E731
    n_long, n_int = buffer_sizes(2, 1, 1, 1, 2, 2, 1)
    plan_arrays(a(-1, 0), a(5, 6), a(2), a(2), a(0), a(9), a(0), a(0), a(2), 2, 1, np.zeros(n_long, np.int64),
                np.zeros(n_int, np.int32))
