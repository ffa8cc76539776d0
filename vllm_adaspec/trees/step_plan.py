"""Every index array of a GPU tree step, in one compiled pass (numba, which vLLM itself depends on): what
`GPUTreeRuntime.prepare` uploads, written straight into its staging buffer.

The same arrays built per tree in Python (`GPUTreeRuntime.prepare_reference`, kept as the definition the tests
compare with, and the plan where numba is missing) cost the host ~20-30 us a tree: at 8 trees x 16 nodes the plan
was 0.3 ms on the project's CPU (0.14 compiled: benchmarks/plan_cost.py) and 0.6 ms on an H200's host (the target
for plan, verification and compaction together: 5% of an 8B step, ~0.35 ms at batch 8). A step of R trees (N nodes
in all, T = N + R rows) over B batch rows, Rb of its trees verified in one batch (`batched`), the most nodes of a
tree `width`, `words` 32-bit words of ancestor bits a row, the arrays by their part number:

    int64: node_rows [N], node_pos [N], rows [R], starts [R], sizes [R], batched [Rb], logit_rows [Rb, width + 1],
        keep [D], cu_draft [B], cu_sampled [B], firsts [R], batched_rows [Rb], and where Rb > 0 the padded trees:
        tokens, parent_rows, depths, valid, order [Rb, width], ancestors [Rb, width + 1, words]
    int32: q_rows [T], cu [R + 1], roots [R], rows [R], bits [T, words], seq [R]

All in one buffer, each where `plan_layout` puts it (a room per array sized by the step's dimensions rounded up to
powers of two, starting on a 16-byte boundary: a Triton kernel reading one sees the same alignment every step), so
that steps of similar sizes lay their arrays out alike and the device views of them are made once. What each array
means: trees/batch.py (`pack_trees`, `walk_order`, `representative_rows`), trees/tree.py (`ancestor_rows`),
engine/tree_sampler.py (`chain_indices`).
"""

from __future__ import annotations

import numpy as np

from vllm_adaspec.compiled import compiled as _compiled
from vllm_adaspec.compiled import njit  # (None without numba: the Python plan, slower, the same arrays)

ALIGN_BYTES = 16  # where each array starts
LONG_PARTS, INT_PARTS = 18, 6


# Where each array lies in the buffer: the int32 arrays first (cu, roots, rows, seq, then q_rows, bits), then the
# int64 ones (rows, starts, sizes, firsts, batched, batched_rows, cu_draft, cu_sampled, node_rows, node_pos, keep,
# logit_rows, the five padded trees' arrays, ancestors): the arrays of few sizes first, so that an array's place
# depends on few of the step's dimensions and its device view is made once and found again (`plan_layout`)
INT_ORDER = (1, 2, 3, 5, 0, 4)
LONG_ORDER = (2, 3, 4, 10, 5, 11, 8, 9, 0, 1, 7, 6, 12, 13, 14, 15, 16, 17)
_LAYOUTS: dict = {}


def _holds(x: int) -> int:
    """The power of two that holds x (1 for 0 and 1)."""
    return 1 << max(0, int(x) - 1).bit_length()


def plan_layout(num_trees: int, num_batched: int, num_rows: int, total_drafts: int, num_nodes: int, width: int,
                words: int, align_bytes: int = ALIGN_BYTES) -> tuple:
    """The buffer's layout for a step of these dimensions: (key, int_at [6], int_cap [6], long_at [18],
    long_cap [18], total), each array's first element (int32 arrays: in int32 elements of the same buffer) and
    its room, each room its dimensions rounded up to powers of two and starting on `align_bytes`; total: int64
    elements in all. Steps of similar sizes share a layout (made once: a few dozen in an engine's life), so each
    array's place and device view repeat (GPUTreeRuntime._plan_views); the copy holds the rooms' padding too (17.5 KB
    at 8 trees of 60 nodes in all, against 10 KB of arrays)."""
    r, b, d, n = _holds(num_trees), _holds(num_rows), _holds(total_drafts), _holds(num_nodes)
    t, w = _holds(num_nodes + num_trees), _holds(width + 1)
    rb = r if num_batched else 0
    key = (r, rb, b, d, n, t, w, words, align_bytes)
    got = _LAYOUTS.get(key)
    if got is None:
        int_cap = [t, r + 1, r, r, t * words, r]
        long_cap = [n, n, r, r, r, rb, rb * w, d, b, b, r, rb] + [rb * w] * 5 + [rb * w * words]
        ia, la = max(1, align_bytes // 4), max(1, align_bytes // 8)
        int_at, o = [0] * INT_PARTS, 0
        for part in INT_ORDER:
            int_at[part] = o
            o += -(-int_cap[part] // ia) * ia
        long_at, o = [0] * LONG_PARTS, -(-o // (2 * la)) * la  # (after the int32 arrays, in int64 elements)
        for part in LONG_ORDER:
            long_at[part] = o
            o += -(-long_cap[part] // la) * la
        a = lambda x: np.array(x, np.int64)  # noqa: E731
        got = _LAYOUTS[key] = (key, a(int_at), a(int_cap), a(long_at), a(long_cap), o)
    return got


def _plan(parents, tokens, sizes, verified, starts, roots, rows, batched, num_drafts, width, words, out_long,
          out_int, long_at, long_cap, int_at, int_cap, long_lens, int_lens, num):
    """The step's arrays into out_long / out_int (the same buffer as int64 and as int32) where `plan_layout` puts
    them; long_lens [18], int_lens [6]: each array's length (unused: 0); num [B]: drafts per batch row, tree rows' 0.
    An array longer than its room raises IndexError. Plain loops over plain arrays, for numba."""
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
    part = 0
    o = long_at[part]
    for k in range(r):  # node_rows
        for i in range(sizes[k]):
            out_long[o] = starts[k] + 1 + i
            o += 1
    part = _close(long_lens, long_cap, part, n_all)
    o = long_at[part]
    for k in range(r):  # node_pos
        for i in range(sizes[k]):
            out_long[o] = roots[k] + depth[first[k] + i]
            o += 1
    part = _close(long_lens, long_cap, part, n_all)
    for src in (rows, starts, sizes):
        o = long_at[part]
        for k in range(r):
            out_long[o] = src[k]
            o += 1
        part = _close(long_lens, long_cap, part, r)
    o = long_at[part]
    for j in range(rb):
        out_long[o] = batched[j]
        o += 1
    part = _close(long_lens, long_cap, part, rb)
    o = long_at[part]
    for j in range(rb):  # logit_rows: a tree's rows, then its last row again as padding
        k = batched[j]
        s, n = logit_start[rows[k]], sizes[k]
        for c in range(width + 1):
            out_long[o] = s + c if c < n else s + n
            o += 1
    part = _close(long_lens, long_cap, part, rb * (width + 1))
    o = long_at[part]
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
    part = _close(long_lens, long_cap, part, kept)
    o = long_at[part]
    d = 0
    for b in range(b_rows):  # cu_draft
        d += num[b]
        out_long[o] = d
        o += 1
    part = _close(long_lens, long_cap, part, b_rows)
    o = long_at[part]
    s = 0
    for b in range(b_rows):  # cu_sampled
        s += num[b] + 1
        out_long[o] = s
        o += 1
    part = _close(long_lens, long_cap, part, b_rows)
    o = long_at[part]
    for k in range(r):  # firsts: each root's draft row (the drafts before it)
        out_long[o] = logit_start[rows[k]] - rows[k]
        o += 1
    part = _close(long_lens, long_cap, part, r)
    o = long_at[part]
    for j in range(rb):  # batched_rows
        out_long[o] = rows[batched[j]]
        o += 1
    part = _close(long_lens, long_cap, part, rb)
    if rb > 0:
        rank = np.zeros(width, np.int64)
        walk = np.zeros(width, np.int64)
        rep = np.zeros(width, np.int64)
        head = np.zeros(width + 1, np.int64)
        nxt = np.zeros(width, np.int64)
        stack = np.zeros(width, np.int64)
        at_tok, at_par, at_dep = long_at[part], long_at[part + 1], long_at[part + 2]  # the five [Rb, width] arrays
        at_val, at_ord, at_anc = long_at[part + 3], long_at[part + 4], long_at[part + 5]  # and the ancestors
        size = rb * width
        a_size = rb * (width + 1) * words
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
            part = _close(long_lens, long_cap, part, size)
        part = _close(long_lens, long_cap, part, a_size)

    # --- int32 ---
    part = 0
    o = int_at[part]
    for k in range(r):  # q_rows: every tree row of the forward
        for i in range(sizes[k] + 1):
            out_int[o] = starts[k] + i
            o += 1
    part = _close(int_lens, int_cap, part, t_all)
    o = int_at[part]
    out_int[o] = 0  # cu
    o += 1
    c = 0
    for k in range(r):
        c += sizes[k] + 1
        out_int[o] = c
        o += 1
    part = _close(int_lens, int_cap, part, r + 1)
    for src in (roots, rows):
        o = int_at[part]
        for k in range(r):
            out_int[o] = src[k]
            o += 1
        part = _close(int_lens, int_cap, part, r)
    o = int_at[part]
    for i in range(t_all):  # bits: the words as the int32 the kernel reads (the same bits)
        for wd in range(words):
            v = anc[i, wd]
            out_int[o] = v - (np.int64(1) << 32) if v >= (np.int64(1) << 31) else v
            o += 1
    part = _close(int_lens, int_cap, part, t_all * words)
    o = int_at[part]
    for k in range(r):  # seq: each tree's rows
        out_int[o] = sizes[k] + 1
        o += 1
    part = _close(int_lens, int_cap, part, r)
    return 0


def _close(lens, cap, part, length):
    """Array `part` is written, `length` elements: its length into lens (past its room: IndexError)."""
    if length > cap[part]:
        raise IndexError("a plan's array is longer than its room in the layout")
    lens[part] = length
    return part + 1


if njit is not None:  # (GPUTreeRuntime compiles it at start-up: `warm_up`)
    _close = _compiled(_close)
    _plan = _compiled(_plan)


def plan_arrays(parents: np.ndarray, tokens: np.ndarray, sizes: np.ndarray, verified: np.ndarray, starts: np.ndarray,
                roots: np.ndarray, rows: np.ndarray, batched: np.ndarray, num_drafts: np.ndarray, width: int,
                words: int, out: np.ndarray, layout: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The step's arrays into out (int64, at least the layout's total elements; the int32 arrays in the same memory)
    where `layout` (`plan_layout` of the step's dimensions) puts them. parents, tokens [N]: the trees' nodes
    concatenated (parents tree-local, -1 = the root); sizes, verified, starts (each root's row of the forward), roots
    (its position), rows (its batch row) [R]; batched [Rb]; num_drafts [B] (int64 arrays). Returns (long lengths
    [18], int lengths [6], num [B]): each array's length, and drafts per batch row with the tree rows' taken out."""
    _, int_at, int_cap, long_at, long_cap, _ = layout
    long_lens = np.zeros(LONG_PARTS, np.int64)
    int_lens = np.zeros(INT_PARTS, np.int64)
    num = np.zeros(num_drafts.shape[0], np.int64)
    _plan(parents, tokens, sizes, verified, starts, roots, rows, batched, num_drafts, width, words, out,
          out.view(np.int32), long_at, long_cap, int_at, int_cap, long_lens, int_lens, num)
    return long_lens, int_lens, num


def compiled() -> bool:
    """Whether plans run compiled (numba importable)."""
    return njit is not None


def warm_up() -> None:
    """Compile the plan now (start-up), not in a request's first tree step: one step of one two-node tree. numba
    caches the machine code on disk, so later starts load it (~0.3 s) instead of compiling it (~4.5 s here)."""
    a = lambda *x: np.array(x, np.int64)  # noqa: E731
    layout = plan_layout(1, 1, 1, 2, 2, 2, 1)
    plan_arrays(a(-1, 0), a(5, 6), a(2), a(2), a(0), a(9), a(0), a(0), a(2), 2, 1, np.zeros(layout[-1], np.int64),
                layout)
