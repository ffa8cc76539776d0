"""The row-draw kernel as it was before each lane kept its own first maximum: a block reduction per quarter tile
inside its loop, masked scalar loads (the kernel an H200 timed in benchmarks/device_runs/2026-11-28-h200/). Kept only
as the baseline benchmarks/device_check.py times kernels/row_draws.py's kernel against in the same run, not part of
the package; it imports what did not change since (the tile, the chunking, the key) from kernels/row_draws.py. Its
own docstring: that file's history."""

from __future__ import annotations

import torch

from vllm_adaspec.kernels import kept
# what did not change since: the tile, the chunking, the key
from vllm_adaspec.kernels.row_draws import BLOCK_V, MAX_CHUNKS, NUM_WARPS, _cdiv, _seed, num_chunks  # noqa: F401

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

__all__ = ["row_draws", "num_chunks"]


if triton is not None:

    @triton.jit
    def _race(x, u, first_v, best, best_v):
        """One quarter tile of the race (x: logits / T, u: a uniform per token; first_v: its first token) -> the
        running best (value, token)."""
        score = x - tl.log(-tl.log(u))  # + a Gumbel variable (u = 0: -inf, never drawn; u < 1 always: finite)
        m = tl.max(score, 0)
        take = m > best
        return tl.where(take, m, best), tl.where(take, first_v + tl.argmax(score, 0), best_v)

    @triton.jit(do_not_specialize=["stride_l", "vocab", "per_tree", "first_sampled", "chunk"])
    def _row_draws_kernel(logits, stride_l, logit_rows, tree_rows, temperature, argmax_out, draws_out, partial,
                          counters, vocab, per_tree, first_sampled, seed_ptr, chunk, BLOCK_V: tl.constexpr,
                          BLOCK_C: tl.constexpr):
        i = tl.program_id(0)  # verification row i of tree i // per_tree
        c = tl.program_id(1)  # its chunk c of the vocabulary: tokens c * chunk ..
        chunks = tl.num_programs(1)
        tree = i // per_tree
        row = tl.load(logit_rows + i).to(tl.int64)
        base = logits + row * stride_l
        sampled = tree >= first_sampled
        inv_t = 1.0
        seed = tl.load(seed_ptr)  # (int64, on the device: drawn there, nothing waited for)
        if sampled:
            inv_t = 1.0 / tl.load(temperature + tl.load(tree_rows + tree)).to(tl.float32)
        Q: tl.constexpr = BLOCK_V // 4
        offs = tl.arange(0, Q)
        best = float("-inf")
        best_v = 0
        race = float("-inf")
        race_v = 0
        lo = c * chunk
        hi = tl.minimum(lo + chunk, vocab)
        for start in range(lo, hi, BLOCK_V):
            v0 = start + offs
            v1 = v0 + Q
            v2 = v1 + Q
            v3 = v2 + Q
            x0 = tl.load(base + v0, mask=v0 < hi, other=float("-inf")).to(tl.float32)
            x1 = tl.load(base + v1, mask=v1 < hi, other=float("-inf")).to(tl.float32)
            x2 = tl.load(base + v2, mask=v2 < hi, other=float("-inf")).to(tl.float32)
            x3 = tl.load(base + v3, mask=v3 < hi, other=float("-inf")).to(tl.float32)
            # the first maximum: a tile's first, kept only by a strictly larger later one
            m = tl.maximum(tl.maximum(tl.max(x0, 0), tl.max(x1, 0)), tl.maximum(tl.max(x2, 0), tl.max(x3, 0)))
            first = tl.minimum(tl.minimum(tl.min(tl.where(x0 == m, v0, vocab), 0),
                                          tl.min(tl.where(x1 == m, v1, vocab), 0)),
                               tl.minimum(tl.min(tl.where(x2 == m, v2, vocab), 0),
                                          tl.min(tl.where(x3 == m, v3, vocab), 0)))
            take = m > best
            best_v = tl.where(take, first, best_v)
            best = tl.where(take, m, best)
            if sampled:
                # counters (row, token / 4): unique over the launch, the same however the vocabulary is chunked; one
                # Philox round gives the four quarters
                r0, r1, r2, r3 = tl.randint4x(seed, i.to(tl.int64) * vocab + start // 4 + offs)
                race, race_v = _race(x0 * inv_t, tl.uint_to_uniform_float(r0), start, race, race_v)
                race, race_v = _race(x1 * inv_t, tl.uint_to_uniform_float(r1), start + Q, race, race_v)
                race, race_v = _race(x2 * inv_t, tl.uint_to_uniform_float(r2), start + 2 * Q, race, race_v)
                race, race_v = _race(x3 * inv_t, tl.uint_to_uniform_float(r3), start + 3 * Q, race, race_v)
        if chunks == 1:
            tl.store(argmax_out + i, best_v.to(tl.int64))
            tl.store(draws_out + i, tl.where(sampled, race_v, best_v).to(tl.int64))
        else:
            # the row's partials [4, rows, chunks] (tokens as float32: exact below 2 ** 24); the row's last chunk to
            # finish combines them (an atomic count per row, left at 0 for the next launch)
            rows = tl.num_programs(0)
            at = partial + i * chunks + c
            tl.store(at, best)
            tl.store(at + rows * chunks, best_v.to(tl.float32))
            tl.store(at + 2 * rows * chunks, race)
            tl.store(at + 3 * rows * chunks, race_v.to(tl.float32))
            tl.debug_barrier()  # the program's partial stores before its release
            if tl.atomic_add(counters + i, 1, sem="acq_rel") == chunks - 1:
                cs = tl.arange(0, BLOCK_C)
                ok = cs < chunks
                first = partial + i * chunks + cs  # L2 reads (.cg): other SMs wrote them
                b = tl.load(first, mask=ok, other=float("-inf"), cache_modifier=".cg")
                bv = tl.load(first + rows * chunks, mask=ok, other=0.0, cache_modifier=".cg")
                r = tl.load(first + 2 * rows * chunks, mask=ok, other=float("-inf"), cache_modifier=".cg")
                rv = tl.load(first + 3 * rows * chunks, mask=ok, other=0.0, cache_modifier=".cg")
                top = tl.max(b, 0)  # the first maximum: the earliest chunk holding it (its tokens come first)
                arg = tl.min(tl.where(ok & (b == top), bv, float(2 ** 24)), 0)
                top_r = tl.max(r, 0)
                draw = tl.min(tl.where(ok & (r == top_r), rv, float(2 ** 24)), 0)
                tl.store(argmax_out + i, arg.to(tl.int64))
                tl.store(draws_out + i, tl.where(sampled, draw, arg).to(tl.int64))
                tl.store(counters + i, 0)  # zero again for the next launch


def row_draws(logits: torch.Tensor, logit_rows: torch.Tensor, tree_rows: torch.Tensor,
              temperature: torch.Tensor | None, first_sampled: int, seed: int | torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, V] (rows strided, any float dtype), logit_rows [R, P] long: tree i's verification rows;
    tree_rows [R]: each tree's row in vLLM's per-request tensors (temperature [B], read for trees first_sampled..).
    One launch -> (argmax [R, P], draws [R, P]) long: a greedy tree's draws are its argmax. `out`: [2, R, P] long
    to write them into (else new). seed: the launch's Philox key, an int or [1] int64 on the device (default
    `new_seed`, drawn only where a tree is sampled)."""
    r, p = logit_rows.shape
    if out is None:
        out = torch.empty((2, r, p), dtype=torch.long, device=logits.device)
    if r == 0:
        return out[0], out[1]
    if logits.stride(1) != 1:
        raise ValueError(f"logits must be contiguous along the vocabulary; strides {tuple(logits.stride())}")
    if temperature is None:
        if first_sampled < r:
            raise ValueError("sampled trees need the batch's temperature")
        temperature = kept.ones(logits.device)  # (read by no program; a float32 pointer as always: one variant)
    rows = r * p
    chunks = num_chunks(logits.shape[1])
    chunk = _cdiv(_cdiv(logits.shape[1], chunks), BLOCK_V) * BLOCK_V
    chunks = _cdiv(logits.shape[1], chunk)
    # (one chunk: read by no program; the same dtypes either way, one compiled variant)
    partial = kept.ones(logits.device) if chunks == 1 else torch.empty(4 * rows * chunks, dtype=torch.float32,
                                                                   device=logits.device)
    counters = kept.zeros("row draws", rows, logits.device)
    _row_draws_kernel[(rows, chunks)](logits, logits.stride(0), logit_rows, tree_rows, temperature, out[0], out[1],
                                      partial, counters, logits.shape[1], p, first_sampled,
                                      _seed(seed, first_sampled < r, logits.device), chunk, BLOCK_V=BLOCK_V,
                                      BLOCK_C=MAX_CHUNKS, num_warps=NUM_WARPS)
    return out[0], out[1]
