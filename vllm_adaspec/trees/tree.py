"""A token tree of drafts, as the target verifies it in one forward pass.

Nodes 0..n-1 are drafts, a parent always before its children (proposers emit them breadth-first; draft-branch
rows, pools/branches.py, follow the nodes as chains off the root, so depths may fall there); parent -1 is the
root, the last committed token, which the target also processes (row 0 of its verification rows). So the target
runs n + 1 rows: row 0 = root, row 1 + i = node i. Everything here is plain torch on small tensors: no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor  # [n] long: draft token ids
    parents: torch.Tensor  # [n] long: parent node index, -1 = the root

    def __post_init__(self):
        n = self.tokens.shape[0]
        if self.parents.shape != (n,):
            raise ValueError(f"parents {tuple(self.parents.shape)} must match tokens {tuple(self.tokens.shape)}")
        self._check_parents()

    def _check_parents(self) -> None:
        p = self.parent_list
        bad = [i for i, q in enumerate(p) if not -1 <= q < i]
        if bad:
            raise ValueError(f"node {bad[0]} has parent {p[bad[0]]}: a parent must come before its children "
                             "(-1 <= parent < node)")

    @classmethod
    def of(cls, tokens, parents) -> "DraftTree":
        """From host sequences (a plan's tuples), keeping them as host lists; the tensors are made when first read.
        Planning a GPU step reads only the tree's shape, in Python: two tensors per tree and their tolist each
        time cost more than the work."""
        tree = _HostTree.__new__(_HostTree)
        tree.__dict__["token_list"], tree.__dict__["parent_list"] = list(tokens), list(parents)
        if len(tree.token_list) != len(tree.parent_list):
            raise ValueError(f"parents ({len(tree.parent_list)}) must match tokens ({len(tree.token_list)})")
        tree._check_parents()
        return tree

    # host copies, computed once (the tensors of a frozen tree never change)
    @cached_property
    def token_list(self) -> list[int]:
        return self.tokens.tolist()

    @cached_property
    def parent_list(self) -> list[int]:
        return self.parents.tolist()

    @cached_property
    def depth_list(self) -> list[int]:
        return depths_of(self.parent_list)

    def __len__(self) -> int:
        return len(self.parent_list)  # (read at construction: no device read, whatever device `tokens` is on)

    @property
    def depths(self) -> torch.Tensor:
        """[n] depth of each node; the root's children are depth 1."""
        return torch.tensor(self.depth_list, dtype=torch.long)

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 = the root), in node order."""
        return [i for i, q in enumerate(self.parents.tolist()) if q == node]


class _HostTree(DraftTree):
    """A DraftTree made from host lists (DraftTree.of): its tensors are built when first read."""

    @cached_property
    def tokens(self) -> torch.Tensor:  # noqa: F811 (the field, computed)
        return torch.tensor(self.token_list, dtype=torch.long)

    @cached_property
    def parents(self) -> torch.Tensor:  # noqa: F811
        return torch.tensor(self.parent_list, dtype=torch.long)


def is_chain(parents) -> bool:
    """Whether breadth-first parents [-1, 0, 1, ...] describe a chain (each node the child of the one before)."""
    return all(q == i - 1 for i, q in enumerate(parents))


def depths_of(parents: list[int]) -> list[int]:
    d: list[int] = []
    for q in parents:
        d.append(1 if q < 0 else d[q] + 1)
    return d


def ancestor_mask(tree: DraftTree) -> torch.Tensor:
    """[n + 1, n + 1] bool over verification rows (0 = root): row r may attend to row c iff c is r or an ancestor
    of r. The root is an ancestor of every node."""
    n = len(tree)
    mask = torch.eye(n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for i, q in enumerate(tree.parents.tolist()):
        mask[i + 1] |= mask[q + 1]  # parents come first, so their rows are complete
    return mask


def ancestor_words(parents: list[int], words: int | None = None) -> np.ndarray:
    """ancestor_mask as 32-bit words, without the dense mask: [n + 1, W] int64 in 0 .. 2^32 - 1, bit c % 32 of word
    c // 32 of row r set iff row c is r or an ancestor of it (W: words per row, at least ceil((n + 1) / 32))."""
    n = len(parents)
    return split_words(ancestor_rows(parents), max(1, -(-(n + 1) // 32)) if words is None else words)


def ancestor_rows(parents: list[int]) -> list[int]:
    """[n + 1] Python ints, bit c of row r set iff row c is r or an ancestor of it. Breadth-first parents come before
    their children, so each row is its parent's plus its own bit (O(n))."""
    rows = [1]
    for i, q in enumerate(parents):
        rows.append(rows[q + 1] | (2 << i))
    return rows


def split_words(rows: list[int], words: int) -> np.ndarray:
    """Bit rows (Python ints) -> [len(rows), words] int64 in 0 .. 2^32 - 1, bit c % 32 of word c // 32."""
    if words == 1:
        return np.array(rows, dtype=np.int64).reshape(-1, 1)
    return np.array([[(b >> (32 * j)) & 0xFFFFFFFF for b in rows] for j in range(words)], dtype=np.int64).T


def ancestor_bits(tree: DraftTree) -> torch.Tensor:
    """[n + 1] int64 bitmask form of ancestor_mask (bit c of row r), for trees of up to 63 nodes: what a kernel
    reads per query instead of a dense mask."""
    n = len(tree)
    if n + 1 > 63:
        raise ValueError(f"ancestor bitmasks hold up to 62 nodes, the tree has {n}")
    mask = ancestor_mask(tree).long()
    return (mask << torch.arange(n + 1)).sum(1)


def depth_positions(tree: DraftTree, root_position: int) -> torch.Tensor:
    """[n + 1] position of each verification row: the root's, then root + depth (RoPE sees each node at its depth,
    not at its row)."""
    return torch.cat([torch.tensor([root_position]), root_position + tree.depths])


def paths(tree: DraftTree) -> list[list[int]]:
    """Root-to-leaf node lists, leaves in node order."""
    parents = tree.parents.tolist()
    has_child = set(q for q in parents if q >= 0)
    out = []
    for leaf in range(len(parents)):
        if leaf in has_child:
            continue
        path, q = [], leaf
        while q >= 0:
            path.append(q)
            q = parents[q]
        out.append(path[::-1])
    return out
