"""Verification of a batch of padded draft trees in one launch: the walk of trees/batch.verify_greedy_batch (which
is also sample-and-match's, over the rows' draws) and the committed tokens written into vLLM's sampled tokens.

One program per tree. Inputs are a TreeBatch's tensors (R trees padded to N nodes, N + 1 rows: row 0 the root, row
1 + j node j) and `draws` [R, N + 1]: the target's argmax (greedy) or one draw (sampled) at every row. A node matches
when its token is the draw at its parent's (representative's) row; it is accepted when every row from the root to
it matched (its ancestor words against the matched rows' words); the chosen node is the deepest accepted one, the
first of its depth in preorder (the root when none). Outputs: path [R, N] (the chosen node's ancestors-or-self, the
node at depth d + 1 in column d, -1 past it), count [R] (its depth), bonus [R] (the draw at its row), and row
`out_rows[r]` of `out` [B, width] (vLLM's sampled tokens): the accepted nodes' tokens, the bonus, then -1.

The torch ops this replaces are ~20 launches per step (0.43-0.78 ms eager on an H100 at 8 trees of 16-64 nodes);
every integer that changes per step (R, N's padding is fixed by the engine's largest tree) stays out of Triton's
specialization. Contents: `_tree_verify_kernel`, `verify_trees` (launcher), `verify_trees_reference` (torch: the
batch ops of trees/batch.py and the token write the GPU runtime did before).
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_adaspec.trees.batch import TreeBatch, verify_greedy_batch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

__all__ = ["block_nodes", "verify_trees", "verify_trees_reference"]


def verify_trees_reference(batch: TreeBatch, draws: torch.Tensor, out: torch.Tensor, out_rows: torch.Tensor):
    """The same results with torch ops: (path [R, N], count [R], bonus [R]); out[out_rows] written."""
    if batch.valid.dtype != torch.bool:  # (a GPU step stages it as int64: no conversion launch a step)
        batch = dataclasses.replace(batch, valid=batch.valid != 0)
    path, count, bonus = verify_greedy_batch(batch, draws)
    width = out.shape[1]
    cols = torch.arange(width, device=out.device)
    n = min(path.shape[1], width)
    committed = batch.tokens.gather(1, path.clamp(min=0))[:, :n]
    rows = torch.full((len(path), width), -1, dtype=out.dtype, device=out.device)
    rows[:, :n] = torch.where(cols[:n] < count[:, None], committed, -1).to(out.dtype)
    rows.scatter_(1, count[:, None].clamp(max=width - 1), bonus[:, None].to(out.dtype))
    out[out_rows] = rows
    return path, count, bonus


if triton is not None:

    @triton.jit(do_not_specialize=["num_nodes", "words", "width", "stride_out"])
    def _tree_verify_kernel(tokens, parent_rows, depths, valid, order, ancestors, draws, path_out, count_out,
                            bonus_out, out, out_rows, num_nodes, words, width, stride_out, BLOCK_N: tl.constexpr):
        r = tl.program_id(0)
        j = tl.arange(0, BLOCK_N)  # node j (row 1 + j)
        jm = j < num_nodes
        base = r * num_nodes
        # int32 math throughout (token ids, depths, ranks and 32-bit words all fit; integer reductions in int32)
        tok = tl.load(tokens + base + j, mask=jm, other=0).to(tl.int32)
        prow = tl.load(parent_rows + base + j, mask=jm, other=0)
        dep = tl.load(depths + base + j, mask=jm, other=0).to(tl.int32)
        val = tl.load(valid + base + j, mask=jm, other=0) != 0
        rank = tl.load(order + base + j, mask=jm, other=0).to(tl.int32)
        rows = num_nodes + 1
        match = val & (tok == tl.load(draws + r * rows + prow, mask=jm, other=-1).to(tl.int32))
        # accepted: no ancestor-or-self row of the node is unmatched, word by word (the root's row 0 always matches)
        row = j + 1
        accepted = val
        bit = tl.full([BLOCK_N], 1, tl.int32) << (row % 32)  # bit 31 is the sign bit: a sum of distinct bits is their OR
        for w in range(words):
            in_word = jm & ((row // 32) == w)
            matched = tl.sum(tl.where(in_word & match, bit, 0), 0) | (1 >> w)  # the root: bit 0 of word 0
            anc = tl.load(ancestors + (r * rows + row) * words + w, mask=jm, other=0).to(tl.int32)  # the low 32 bits
            accepted = accepted & ((anc & ~matched) == 0)
        score = tl.where(accepted, dep * rows + (num_nodes - rank), 0)
        best = tl.max(score, 0)
        chosen = tl.where(best > 0, tl.argmax(score, 0), -1)  # -1: the root
        count = tl.sum(tl.where(j == chosen, dep, 0), 0)
        bonus = tl.load(draws + r * rows + chosen + 1)
        # the chosen row's ancestors-or-self: node j is on the path iff bit row(j) of its words is set
        words_c = tl.load(ancestors + (r * rows + chosen + 1) * words + row // 32, mask=jm, other=0)
        on_path = jm & (chosen >= 0) & (((words_c >> (row % 32)) & 1) != 0)
        # column c holds the path's node of depth c + 1: a [column, node] tile, one node per column
        c = tl.arange(0, BLOCK_N)
        at = on_path[None, :] & (dep[None, :] == (c[:, None] + 1))
        node = tl.where(c < count, tl.sum(tl.where(at, j[None, :], 0), 1), -1)
        tl.store(path_out + base + c, node, mask=c < num_nodes)
        tl.store(count_out + r, count)
        tl.store(bonus_out + r, bonus)
        committed = tl.sum(tl.where(at, tok[None, :], 0), 1)
        bonus_col = tl.minimum(count, width - 1)
        text = tl.where(c == bonus_col, bonus, tl.where(c < count, committed, -1))
        dst = tl.load(out_rows + r)
        tl.store(out + dst * stride_out + c, text.to(out.dtype.element_ty), mask=c < width)


def block_nodes(max_rows: int) -> int:
    """The kernel's tile for an engine whose trees have at most max_rows - 1 nodes and whose sampled tokens are at
    most max_rows wide (K + 1): fixed per engine, so a step never compiles a new variant."""
    return max(16, 1 << (max_rows - 1).bit_length())


def verify_trees(batch: TreeBatch, draws: torch.Tensor, out: torch.Tensor, out_rows: torch.Tensor,
                 block_n: int | None = None):
    """One launch: (path [R, N] long, count [R] long, bonus [R] long) of the R trees of `batch` under `draws`
    [R, N + 1] (long), and row out_rows[r] of out [B, width] (vLLM's sampled tokens) written with tree r's accepted
    tokens, its bonus, then -1. block_n: the engine's `block_nodes` (at least N and width)."""
    r, n = batch.tokens.shape
    device = batch.tokens.device
    path = torch.empty((r, n), dtype=torch.long, device=device)
    count = torch.empty(r, dtype=torch.long, device=device)
    bonus = torch.empty(r, dtype=torch.long, device=device)
    if r == 0:
        return path, count, bonus
    block_n = block_nodes(max(n, out.shape[1])) if block_n is None else block_n
    if max(n, out.shape[1]) > block_n:
        raise ValueError(f"trees of {n} nodes / {out.shape[1]} sampled tokens exceed the kernel's tile {block_n}")
    valid = batch.valid.view(torch.int8) if batch.valid.dtype == torch.bool else batch.valid
    _tree_verify_kernel[(r, )](batch.tokens, batch.parent_rows, batch.depths, valid,
                               batch.order, batch.ancestors, draws.contiguous(), path, count, bonus, out, out_rows,
                               n, batch.ancestors.shape[-1], out.shape[1], out.stride(0), BLOCK_N=block_n)
    return path, count, bonus
