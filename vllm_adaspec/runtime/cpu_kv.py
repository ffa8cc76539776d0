"""vLLM's CPU paged KV cache, read and written from Python: where a token's K and V live per ISA, gathers of a
request's positions, and slot-to-slot copies (tree KV compaction). Plain torch; the layout is discovered once per
(ISA, block, head size, dtype) by writing known values through vLLM's own cache-write op (`write`:
`cpu_attn_reshape_and_cache`, handed in by the glue), so a vLLM release that changes the layout is followed."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def cpu_kv_index(isa: str, block_size: int, head_size: int, dtype: torch.dtype,
                 write) -> tuple[torch.Tensor, torch.Tensor]:
    """Where vLLM's CPU attention stores token t, dim d of a block, per ISA: (k_idx, v_idx), each [block_size, D],
    offsets into one (block, kv head) slab of 2 * block_size * D elements ("vec" stores K transposed, V row-major).
    Found by writing known values through vLLM's own `cpu_attn_reshape_and_cache` (`write`), three base-64 digits at
    a time so that every value is exact in bf16 too."""

    bs, d = block_size, head_size
    ids = torch.arange(bs * d).view(bs, 1, d)  # token t, dim d -> t * D + d
    found = [torch.zeros(2 * bs * d, dtype=torch.long) for _ in range(2)]
    for digit in range(3):
        cache = torch.zeros(1, 1, bs, 2 * d, dtype=dtype)
        kc, vc = cache.view(1, 1, 2 * bs, d).chunk(2, dim=2)
        x = ((ids // 64 ** digit) % 64 + 1).to(dtype)
        write(x, -x, kc, vc, torch.arange(bs), isa, k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")
        flat = cache.view(-1).float()
        found[0] += (flat.clamp(min=0).long() - (flat > 0).long()) * 64 ** digit
        found[1] += ((-flat).clamp(min=0).long() - (flat < 0).long()) * 64 ** digit
    k_pos, v_pos = found[0], found[1]  # per slab offset: the t * D + d stored there (garbage where unused)
    k_idx = torch.full((bs * d,), -1, dtype=torch.long)
    v_idx = torch.full((bs * d,), -1, dtype=torch.long)
    slab = torch.arange(2 * bs * d)
    cache_probe = torch.zeros(1, 1, bs, 2 * d, dtype=dtype)  # which offsets hold K and which V
    kc, vc = cache_probe.view(1, 1, 2 * bs, d).chunk(2, dim=2)
    one = torch.ones(bs, 1, d, dtype=dtype)
    write(one, -one, kc, vc, torch.arange(bs), isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    sign = cache_probe.view(-1)
    k_idx[k_pos[sign > 0]] = slab[sign > 0]
    v_idx[v_pos[sign < 0]] = slab[sign < 0]
    if (k_idx < 0).any() or (v_idx < 0).any():
        raise RuntimeError(f"vllm_adaspec: could not map vLLM's CPU KV layout (isa={isa}, block={bs}, head={d})")
    return k_idx.view(bs, d), v_idx.view(bs, d)


def _slab_view(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, kv_heads, block_size, 2 * D] -> [num_blocks, 2 * block_size * D, kv_heads] (a view)."""
    nb, h, bs, d2 = cache.shape
    return cache.view(nb, h, bs * d2).permute(0, 2, 1)


def gather_cpu_kv(cache: torch.Tensor, block_row: torch.Tensor, length: int,
                  isa: str, write, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions start..length-1 from vLLM's CPU paged cache [num_blocks, kv_heads, block_size,
    2 * D] (layout per `isa`, see cpu_kv_index); block_row [max_blocks] of the request. K, V [length - start, H, D]."""
    bs = cache.shape[2]
    pos = torch.arange(start, length)
    return gather_cpu_kv_at(cache, block_row[pos // bs].long(), pos % bs, isa, write)


def paged_index(block_rows: torch.Tensor, positions: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """block_rows [R, max_blocks], positions [R, S] -> (block id, offset inside the block), each [R, S]."""
    return torch.gather(block_rows, 1, positions // block_size).long(), positions % block_size


def gather_cpu_kv_at(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                     isa: str, write) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [*shape, H, D] of the tokens at (blocks, offsets) [*shape] (block id, position inside the block)."""
    _, _, bs, d2 = cache.shape
    k_idx, v_idx = cpu_kv_index(isa, bs, d2 // 2, cache.dtype, write)
    slabs = _slab_view(cache)
    b = blocks.unsqueeze(-1)  # [*shape, 1]
    k = slabs[b, k_idx[offsets]]  # [*shape, D, H]
    v = slabs[b, v_idx[offsets]]
    return k.transpose(-1, -2), v.transpose(-1, -2)


def compact_kv_cpu(caches: list[tuple[torch.Tensor, str]], src_slots: list[int], dst_slots: list[int],
                   write) -> None:
    """Copy each src slot's K and V to its dst slot in every (CPU cache, isa); all sources are read first."""
    if not src_slots:
        return
    src, dst = torch.tensor(src_slots), torch.tensor(dst_slots)
    where = {}  # (block size, D, dtype, isa) -> (source, destination) indices into a slab view, K and V at once
    for cache, isa in caches:
        _, _, bs, d2 = cache.shape
        shape = (bs, d2, cache.dtype, isa)
        if shape not in where:  # every layer of a model shares it: computed once per step
            k_idx, v_idx = cpu_kv_index(isa, bs, d2 // 2, cache.dtype, write)
            offsets = lambda slots: torch.cat([k_idx[slots % bs], v_idx[slots % bs]], dim=1)  # [M, 2D]
            where[shape] = (((src // bs)[:, None], offsets(src)), ((dst // bs)[:, None], offsets(dst)))
        (sb, so), (db, do) = where[shape]
        slabs = _slab_view(cache)
        slabs[db, do] = slabs[sb, so]  # advanced indexing reads every source before writing
