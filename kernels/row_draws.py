"""What a batch of draft trees is verified against, in one launch: at every verification row the target's argmax and,
at the sampled trees' rows, one draw from vLLM's distribution there (softmax of logits / temperature), read from the
logits in place.

Programs per verification row (R trees x P rows: tree i's rows at logit_rows[i]): one per chunk of the vocabulary
(`num_chunks`: 15 over Llama-3's 128k tokens). Each streams its chunk once, keeping the first maximum (torch.argmax's
tie rule: greedy verification stays identical to vLLM's) per lane (a lane sees its tokens in increasing order and
takes only a strictly larger value; the lanes are reduced once, at the chunk's end, to the earliest token holding the
maximum: no reduction and no barrier inside the loop, whose whole tiles load unmasked in 16-byte vectors where the
rows are a multiple of 16 tokens apart) and, for a sampled tree, the exponential race vLLM's sampler runs:
argmax_v (x_v / T - log E_v), E_v ~ Exp(1) (the same law as trees/batch.draw_rows; -log E is a Gumbel variable,
-log(-log U)), kept per lane alike; the row's last chunk to finish combines the chunks' bests (an atomic count per row,
as the tree-attention kernel's fused reduction). The uniforms come from Philox keyed by a seed drawn per launch from
torch's default generator on the device (`new_seed`: in step on every tensor-parallel rank) and counted by
(row, token / 4), four per round (`randint4x`): no two draws of a launch share a number, and the draws do
not depend on the chunking. Sampled trees with top-k / top-p are not drawn here (the runtime keeps vLLM's op).

The torch ops this replaces: an argmax over every logits row and its gather, then for the sampled trees a gather
of their rows' logits, the division by temperature, an exponential draw, its log, negation and sum, an argmax and a
concatenation (about ten launches and three [rows, V] buffers a step). An H200, 8 trees x 17 rows over 128k
tokens (benchmarks/device_runs/2026-11-28-h200/): the verification's host time 0.62 -> 0.25 ms; GPU time 36 us
against torch's 47 (greedy), 69 against 205 (half the trees sampled), with the reductions in the loop and scalar
loads (the per-lane form compiles for sm_90 to a greedy loop of 4 vector loads, no barrier, where that one had 16
scalar loads, 16 barriers and 32 shuffles a tile: `benchmarks/kernel_ir.py --row-draws`; its GPU time is not yet
measured: benchmarks/device_check.py times it against the kernel with block reductions in its loop, kept as
benchmarks/baselines/row_draws_block_reductions.py). Contents: `_row_draws_kernel`, `row_draws` (launcher),
`row_draws_reference` (torch).
"""

from __future__ import annotations

import torch

from vllm_adaspec.kernels import kept

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

__all__ = ["BLOCK_V", "row_draws", "row_draws_reference", "new_seed"]

BLOCK_V = 4096  # logits a program reads per iteration (four Philox streams of BLOCK_V / 4)
NUM_WARPS = 8
# A row's vocabulary in chunks of at least CHUNK_TILES tiles, each its own program, at most MAX_CHUNKS. An H200
# (benchmarks/device_runs/2026-11-28-h200/run3), 8 trees x 17 rows over Llama-3's 128k tokens, GPU alone: 1 chunk 67.8
# us greedy / 160.1 us half sampled, 7 chunks 39.0 / 76.2, 15 chunks 35.9 / 69.4, 16 chunks 38.2 / 70.9; torch's ops
# 47.0 / 205.3
CHUNK_TILES = 2
MAX_CHUNKS = 16


def new_seed(device) -> torch.Tensor:
    """A launch's Philox key, [1] int64 on `device`, drawn there from torch's default generator: the generator
    vLLM's own sampling draws from, seeded alike on every tensor-parallel rank and advanced alike by the same ops, so
    every rank draws the same tokens and compacts its KV alike (a key from a host generator would not be in step with
    it); the kernel reads it, so nothing waits for the device."""
    return torch.randint(1 << 62, (1,), dtype=torch.int64, device=device)


def row_draws_reference(logits: torch.Tensor, logit_rows: torch.Tensor, tree_rows: torch.Tensor,
                        temperature: torch.Tensor | None, first_sampled: int,
                        generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same results with torch ops: (argmax [R, P], draws [R, P]) long; trees first_sampled.. draw (their own
    random numbers: equal in law, not in value, to the kernel's)."""
    from vllm_adaspec.trees.batch import draw_rows

    argmax = logits.argmax(dim=-1)[logit_rows]
    if first_sampled >= len(logit_rows):
        return argmax, argmax
    rows = logit_rows[first_sampled:]
    t = temperature[tree_rows[first_sampled:]].to(torch.float32)[:, None, None]
    drawn = draw_rows(logits[rows].to(torch.float32) / t, generator)
    return argmax, torch.cat([argmax[:first_sampled], drawn])


if triton is not None:

    @triton.jit
    def _lanes(x, v, best, best_v):
        """Each lane's running first maximum: x [Q] at tokens v [Q], later than every token the lane has seen."""
        take = x > best
        return tl.where(take, x, best), tl.where(take, v, best_v)

    @triton.jit
    def _tile(base, start, hi, offs, i, vocab, seed, inv_t, sampled, best, best_v, race, race_v, Q: tl.constexpr,
              MASKED: tl.constexpr):
        """One tile of BLOCK_V = 4 Q tokens from `start` into the lanes' running bests: the argmax's (x) and, for a
        sampled row, the race's (x / T - log(-log U)). MASKED: the row's ragged last tile (tokens from `hi` on are
        -inf, never taken); the others load whole, unmasked, in vectors."""
        v0 = start + offs
        v1 = v0 + Q
        v2 = v1 + Q
        v3 = v2 + Q
        if MASKED:
            x0 = tl.load(base + v0, mask=v0 < hi, other=float("-inf")).to(tl.float32)
            x1 = tl.load(base + v1, mask=v1 < hi, other=float("-inf")).to(tl.float32)
            x2 = tl.load(base + v2, mask=v2 < hi, other=float("-inf")).to(tl.float32)
            x3 = tl.load(base + v3, mask=v3 < hi, other=float("-inf")).to(tl.float32)
        else:
            x0 = tl.load(base + v0).to(tl.float32)
            x1 = tl.load(base + v1).to(tl.float32)
            x2 = tl.load(base + v2).to(tl.float32)
            x3 = tl.load(base + v3).to(tl.float32)
        # a lane's tokens in increasing order, each taken only if strictly larger: the lane's first maximum
        best, best_v = _lanes(x0, v0, best, best_v)
        best, best_v = _lanes(x1, v1, best, best_v)
        best, best_v = _lanes(x2, v2, best, best_v)
        best, best_v = _lanes(x3, v3, best, best_v)
        if sampled:
            # counters (row, token / 4): unique over the launch, the same however the vocabulary is chunked; one
            # Philox round gives the four quarters (u = 0: -inf, never drawn; u < 1 always: finite)
            r0, r1, r2, r3 = tl.randint4x(seed, i.to(tl.int64) * vocab + start // 4 + offs)
            race, race_v = _lanes(x0 * inv_t - tl.log(-tl.log(tl.uint_to_uniform_float(r0))), v0, race, race_v)
            race, race_v = _lanes(x1 * inv_t - tl.log(-tl.log(tl.uint_to_uniform_float(r1))), v1, race, race_v)
            race, race_v = _lanes(x2 * inv_t - tl.log(-tl.log(tl.uint_to_uniform_float(r2))), v2, race, race_v)
            race, race_v = _lanes(x3 * inv_t - tl.log(-tl.log(tl.uint_to_uniform_float(r3))), v3, race, race_v)
        return best, best_v, race, race_v

    @triton.jit
    def _first_max(best, best_v, vocab):
        """The lanes' bests -> (the maximum, its first token): the earliest token holding it over every lane."""
        m = tl.max(best, 0)
        return m, tl.min(tl.where(best == m, best_v, vocab), 0)

    # stride_l and chunk are left to Triton's specialization: a multiple of 16 (chunk always: BLOCK_V's; stride_l,
    # the logits' row stride, in every engine whose vocabulary is padded so) lets the whole tiles load in vectors of
    # 16 bytes. Neither changes from step to step: one variant an engine (start-up compiles both strides' variants:
    # engine/gpu_tree_runtime.GPUTreeRuntime._warm_up_draws)
    @triton.jit(do_not_specialize=["vocab", "per_tree", "first_sampled"])
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
        # per lane, not per tile: one reduction over the lanes at the chunk's end, none in the loop
        best = tl.full([Q], float("-inf"), tl.float32)
        best_v = tl.zeros([Q], tl.int32)
        race = tl.full([Q], float("-inf"), tl.float32)
        race_v = tl.zeros([Q], tl.int32)
        lo = c * chunk  # (a multiple of BLOCK_V: the launcher's)
        hi = tl.minimum(lo + chunk, vocab)
        whole = lo + (hi - lo) // BLOCK_V * BLOCK_V  # the chunk's whole tiles end here; only a row's last is ragged
        for start in range(lo, whole, BLOCK_V):
            best, best_v, race, race_v = _tile(base, start, hi, offs, i, vocab, seed, inv_t, sampled, best, best_v,
                                               race, race_v, Q, False)
        if whole < hi:
            best, best_v, race, race_v = _tile(base, whole, hi, offs, i, vocab, seed, inv_t, sampled, best, best_v,
                                               race, race_v, Q, True)
        best, best_v = _first_max(best, best_v, vocab)
        race, race_v = _first_max(race, race_v, vocab)
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


def _seed(seed, sampled: bool, device) -> torch.Tensor:
    """The key the kernel reads: `seed` as [1] int64 on `device`, a new one where a tree is sampled, else any int64."""
    if seed is None:
        return new_seed(device) if sampled else kept.ones(device, torch.int64)
    return seed if isinstance(seed, torch.Tensor) else torch.tensor([seed], dtype=torch.int64, device=device)


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


def num_chunks(vocab: int) -> int:
    """Programs a row's vocabulary is cut into: chunks of at least CHUNK_TILES tiles, at most MAX_CHUNKS."""
    return max(1, min(MAX_CHUNKS, vocab // (CHUNK_TILES * BLOCK_V)))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
