"""vLLM's paged KV cache as its GPU backends lay it out (FlashAttention, Triton): a layer's cache is logically
[num_blocks, kv_heads, block_size, 2 * D] and K, V are the two halves of the last dimension of its (block, slot)
transpose, [num_blocks, block_size, kv_heads, D] each (any physical stride order: everything here goes through
strides). Plain torch on device tensors: views, gathers and the slot moves of tree KV compaction, none of which
waits for the device."""

from __future__ import annotations

import torch


def kv_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_blocks, H, block_size, 2 * D] -> K, V views [num_blocks, block_size, H, D] (as the backends split it)."""
    return kv_cache.transpose(1, 2).split(kv_cache.shape[-1] // 2, dim=-1)


def gather_kv_at(kv_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                 isa: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [*shape, H, D] of the tokens at (blocks, offsets) [*shape] (block id, position inside the block)."""
    k, v = kv_views(kv_cache)
    return k[blocks, offsets], v[blocks, offsets]


def compaction_moves(starts: torch.Tensor, sizes: torch.Tensor, path: torch.Tensor,
                     count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the forward to copy for R tree requests: starts [R] (each root's row), sizes [R] (nodes, branch rows
    included), path [R, N] (the accepted node at depth d + 1 in column d), count [R] (nodes accepted) ->
    (src, dst) [R * N] long. Node at depth d moves from row start + 1 + node to start + d; rows past the accepted
    depth copy onto themselves and padding onto the root's row: every destination is written once (no two moves
    race) and every write that is not a move rewrites what is there, so the moves need no host-side filtering."""
    n = path.shape[1]
    d = torch.arange(1, n + 1, device=path.device)[None]  # [1, N]
    in_tree = d <= sizes[:, None]
    moved = d <= count[:, None]
    src = torch.where(moved, 1 + path.clamp(min=0), torch.where(in_tree, d, 0))
    dst = torch.where(in_tree, d, 0)
    return (starts[:, None] + src).flatten(), (starts[:, None] + dst).flatten()


def move_slots(kv_caches: list[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Copy each source slot's K and V to its destination slot in every layer's cache; all sources are read before
    any destination is written (the index read makes a copy). A slot's K and V lie side by side in the last dimension
    of the [num_blocks, block_size, H, 2 D] view (kv_views splits it): one gather and one scatter per layer move both."""
    where = {}  # block size -> (source block, offset, destination block, offset): shared by every layer
    for cache in kv_caches:
        bs = cache.shape[2]
        if bs not in where:
            where[bs] = (src_slots // bs, src_slots % bs, dst_slots // bs, dst_slots % bs)
        sb, so, db, do = where[bs]
        kv = cache.transpose(1, 2)  # [num_blocks, block_size, H, 2 D]
        kv[db, do] = kv[sb, so]
