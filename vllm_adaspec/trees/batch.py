"""Many draft trees as padded tensors, verified together without leaving the device.

The per-tree verifiers (trees/verify.py) walk a tree in Python; on a GPU each walk would wait for the device. Here
R trees of up to N nodes become [R, N] tensors once on the host (`pack_trees`, when the step is planned), and
verification is a handful of batched tensor ops on the device: greedy (`verify_greedy_batch`, the same result as
`verify_greedy` tree by tree) and sample-and-match (`verify_sample_batch`, the same rule as `verify_sample_match`:
every row drawn once, up front, then the greedy walk over the draws). Equal siblings are pooled as the per-tree
verifiers pool them: a node is compared with the output of the first node (in preorder) equal to its parent. Plain
torch: no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_adaspec.trees.tree import DraftTree, ancestor_words


@dataclass
class TreeBatch:
    """R trees, padded to N nodes (N + 1 verification rows: row 0 = the root, row 1 + j = node j).

    tokens [R, N] long; parent_rows [R, N] long: the row whose output node j must equal (its parent's, or the
    first node equal to its parent); depths [R, N] long; valid [R, N] bool (a GPU step's: int64, nonzero):
    verified nodes (not padding, not read-only branch rows); ancestors [R, N + 1, W] int64: bit c of word c // 32
    of row r's entry is set iff row c is row r or an ancestor of it (32 bits per word, as the tree-attention kernel
    reads them)."""
    tokens: torch.Tensor
    parent_rows: torch.Tensor
    depths: torch.Tensor
    valid: torch.Tensor
    ancestors: torch.Tensor
    order: torch.Tensor  # [R, N] long: each node's `preorder` rank (which of equally deep accepted nodes is taken)

    def rows(self, which: slice) -> "TreeBatch":
        """The trees `which` selects (views)."""
        return TreeBatch(*(t[which] for t in (self.tokens, self.parent_rows, self.depths, self.valid, self.ancestors,
                                              self.order)))


def pack_words(mask: torch.Tensor) -> torch.Tensor:
    """[..., C] bool -> [..., ceil(C / 32)] int64 words in 0 .. 2^32 - 1 (bit c % 32 of word c // 32)."""
    c = mask.shape[-1]
    words = max(1, -(-c // 32))
    padded = torch.zeros(*mask.shape[:-1], words * 32, dtype=torch.int64, device=mask.device)
    padded[..., :c] = mask.to(torch.int64)
    shifts = torch.arange(32, device=mask.device)
    return (padded.view(*mask.shape[:-1], words, 32) << shifts).sum(-1)


def preorder(parents: list[int]) -> list[int]:
    """Each node's rank in depth-first order, children in node order: the order of the nodes' root paths (as node
    lists) compared lexicographically, which is the order verify_greedy's frontier keeps."""
    return walk_order(parents)[0]


def walk_order(parents: list[int]) -> tuple[list[int], list[int]]:
    """(rank, order): `preorder`'s ranks and the nodes in that order (the root paths sorted as tuples: one C-level
    sort instead of a walk in Python)."""
    paths: list[tuple] = []
    for j, q in enumerate(parents):
        paths.append(paths[q] + (j,) if q >= 0 else (j,))
    order = sorted(range(len(parents)), key=paths.__getitem__)
    rank = [0] * len(parents)
    for r, j in enumerate(order):
        rank[j] = r
    return rank, order


def representative_rows(tree: DraftTree, rank: list[int] | None = None, order: list[int] | None = None) -> list[int]:
    """For each node, the row whose output it must equal: its parent's, or, where siblings are equal (the same
    tokens from the root: the same text), the first such node's in `preorder` (verify_greedy's frontier[0]). 0 = the
    root's row. (order: the nodes by rank, when known.)"""
    parents, tokens = tree.parent_list, tree.token_list
    if len(set(zip(parents, tokens))) == len(parents):  # no equal siblings (a trie's nodes): each its own parent's
        return [q + 1 for q in parents]
    if order is None:
        rank = preorder(parents) if rank is None else rank
        order = sorted(range(len(parents)), key=rank.__getitem__)
    first: dict[tuple[int, int], int] = {}
    rep = [0] * len(parents)  # rep[j]: the representative node of node j
    for j in order:  # parents before children, the first first
        q = parents[j]
        rep[j] = first.setdefault((rep[q] if q >= 0 else -1, tokens[j]), j)
    return [0 if q < 0 else rep[q] + 1 for q in parents]


def pack_trees(trees: list[DraftTree], verified: list[int] | None = None, width: int | None = None,
               words: list[np.ndarray] | None = None) -> TreeBatch:
    """Host tensors for `trees` (verified[r]: how many of tree r's first nodes are verified; the rest are read-only
    rows; width: N, at least the largest tree; words: their tree.ancestor_words, when already computed). Numpy
    arrays filled row by row, one tensor each at the end: a step's planning stays cheap at 64-node trees."""
    r = len(trees)
    n = max([len(t) for t in trees] + [width or 0, 1])
    w = max(1, -(-(n + 1) // 32))
    verified = [len(t) for t in trees] if verified is None else verified
    tokens = np.zeros((r, n), dtype=np.int64)
    parent_rows = np.zeros((r, n), dtype=np.int64)
    depths = np.zeros((r, n), dtype=np.int64)
    valid = np.zeros((r, n), dtype=bool)
    order = np.zeros((r, n), dtype=np.int64)
    ancestors = np.zeros((r, n + 1, w), dtype=np.int64)
    for i, (tree, m) in enumerate(zip(trees, verified)):
        k = len(tree)
        parents = tree.parent_list
        tokens[i, :k] = tree.token_list
        rank, walk = walk_order(parents)
        order[i, :k] = rank
        parent_rows[i, :k] = representative_rows(tree, order=walk)
        depths[i, :k] = tree.depth_list
        valid[i, :m] = True
        a = ancestor_words(parents) if words is None else words[i]
        ancestors[i, :k + 1, :a.shape[1]] = a
    return TreeBatch(*(torch.from_numpy(x) for x in (tokens, parent_rows, depths, valid, ancestors, order)))


def unpack_rows(words: torch.Tensor, rows: int) -> torch.Tensor:
    """[..., W] int64 words -> [..., rows] bool."""
    shifts = torch.arange(32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(-2)[..., :rows]


def verify_greedy_batch(batch: TreeBatch, argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """argmax [R, N + 1]: the target's argmax at every verification row -> (path [R, N] long: the accepted node at
    depth d + 1 in column d, -1 past the accepted depth; count [R] long: nodes accepted; bonus [R] long: the
    target's token after the last accepted node). Batched tensor ops only: nothing waits for the device."""
    r, n = batch.tokens.shape
    # a node matches when its token is the target's argmax at its parent's (representative's) row
    match = batch.valid & (batch.tokens == argmax.gather(1, batch.parent_rows))  # [R, N]
    matched = torch.cat([torch.ones(r, 1, dtype=torch.bool, device=argmax.device), match], 1)  # the root stays
    # accepted: every row on the way from the root (ancestors-or-self) matched
    missing = batch.ancestors & ~pack_words(matched)[:, None, :]  # [R, N + 1, W]
    accepted = batch.valid & (missing == 0).all(-1)[:, 1:]  # [R, N]
    # the deepest accepted node, the first of its depth in preorder (verify_greedy's frontier[0]); the root when none
    score = torch.where(accepted, batch.depths * (n + 1) + (n - batch.order), torch.zeros_like(batch.depths))
    best, chosen = score.max(-1)
    chosen = torch.where(best > 0, chosen, torch.full_like(chosen, -1))  # [R] node, -1 = the root
    bonus = argmax.gather(1, (chosen + 1)[:, None])[:, 0]
    path, count = _path_to(batch, chosen)
    return path, count, bonus


def _path_to(batch: TreeBatch, node: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """node [R] (-1 = the root) -> (path [R, N]: its ancestors-or-self, each in the column of its depth, -1 past it;
    count [R]: its depth)."""
    r, n = batch.tokens.shape
    words = batch.ancestors.gather(1, (node + 1)[:, None, None].expand(-1, 1, batch.ancestors.shape[-1]))[:, 0]
    on_path = unpack_rows(words, n + 1)[:, 1:] & (node >= 0)[:, None]  # [R, N] (row 0 is the root)
    path = torch.full((r, n + 1), -1, dtype=torch.long, device=node.device)
    column = torch.where(on_path, batch.depths - 1, torch.full_like(batch.depths, n))  # off the path: a spare column
    path.scatter_(1, column, torch.arange(n, device=node.device).expand(r, n).contiguous())
    count = torch.where(node >= 0, batch.depths.gather(1, node.clamp(min=0)[:, None])[:, 0], torch.zeros_like(node))
    return path[:, :n], count


def draw_rows(row_logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """row_logits [..., V]: each row's log-probabilities up to a constant (-inf where a token is excluded) -> [...]
    one independent draw per row, by the exponential race vLLM's sampler uses: argmax_v p_v / E_v with E_v ~ Exp(1),
    here argmax_v (x_v - log E_v) (the same draw, no softmax)."""
    e = torch.empty_like(row_logits, dtype=torch.float32).exponential_(generator=generator)
    return e.log_().neg_().add_(row_logits).argmax(-1)  # in place: one [..., V] buffer besides the input


def verify_sample_batch(batch: TreeBatch, row_logits: torch.Tensor,
                        generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample-and-match for R trees at once (the rule of `verify_sample_match`). row_logits [R, N + 1, V]: the
    target's (processed) log-probabilities, up to a constant, at every verification row. The walk from the root draws
    a token at its row and moves into the first child (preorder) carrying it, until a draw matches no child (the draw
    is the bonus). The walk reads each row's draw at most once, so drawing every row up front, independently, gives
    the walk the same law as drawing as it goes; and with every row's draw known the walk is verify_greedy_batch's
    with the draws in place of the argmax (equal siblings pooled alike). One draw over all rows and the greedy ops:
    no round per depth, nothing waits for the device. Returns (path [R, N], count [R], bonus [R])."""
    return verify_greedy_batch(batch, draw_rows(row_logits, generator))
