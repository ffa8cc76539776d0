"""Token trees on vLLM's CPU KV layout: each tree request's rows attend through a contiguous copy of its KV (the prefix
fully visible, each step extending the copy) and, among the rows, to their ancestors-or-self only, in one SDPA
call; accepted nodes' KV move slot to slot in every layer's paged cache and in the copies. No vLLM: vLLM's CPU
cache-write op, with which the KV layout is discovered once per layout (runtime/cpu_kv.py), is handed in by the
worker."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_adaspec.runtime.base import TreeRuntime, TreeStep, compaction_slots
from vllm_adaspec.runtime.cpu_kv import compact_kv_cpu, gather_cpu_kv, gather_cpu_kv_at, paged_index
from vllm_adaspec.step import DraftMask
from vllm_adaspec.trees import copy_capacity


# Prefix length from which a tree request's query heads are folded into its rows (verify_attention): measured on
# the project's CPU with SmolLM2's heads (9 / 3), 8-16 nodes: unfolded 0.91-0.95 of the old path's time at 200-400
# keys (folded 0.91-1.07), folded 0.85-0.90 from 600 keys on (unfolded 0.94-0.96).
FOLD_FROM = 512


@dataclass
class SequenceKV:
    """One tree request's K, V in one attention layer, contiguous: positions 0..final-1 are final (committed and
    compacted: never written again), so a step gathers from the paged cache only what came after them (nothing when
    the request's last step was a tree: `advance_copies` kept its accepted rows); the rows of the current forward
    (root + nodes) are written right after the prefix, as scratch. Head-major: each kv head's keys are one matrix,
    as SDPA reads them (a [capacity, H, D] copy made SDPA gather them, ~5% of its time)."""
    k: torch.Tensor  # [H, capacity, D]
    v: torch.Tensor
    final: int = 0


def masked_attention_batch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """q [R, rows, Hq, D], k, v [R, seq, Hkv, D], visible [R, rows, seq] bool -> [R, rows, Hq, D] in q's dtype.
    Query head h reads kv head h // (Hq / Hkv); every row must see at least one key."""
    r, rows, hq, d = q.shape
    hkv = k.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(acc).view(r, rows, hkv, hq // hkv, d)
    scores = torch.einsum("bnkgd,bskd->bkgns", qg, k.to(acc)) * scale  # [R, Hkv, G, rows, seq]
    scores = scores.masked_fill(~visible[:, None, None], -math.inf)
    out = torch.einsum("bkgns,bskd->bnkgd", torch.softmax(scores, dim=-1), v.to(acc))
    return out.reshape(r, rows, hq, d).to(q.dtype)


class CPUTreeRuntime(TreeRuntime):
    """The CPU path: vLLM's CPU KV layout, per-request contiguous KV copies keyed (request id, cache address), SDPA.
    cache_write: vLLM's `cpu_attn_reshape_and_cache` (the layout's discovery)."""

    keeps_copies = True  # each tree request's KV copied contiguously (capped by tree.kv_copy_tokens)

    def __init__(self, observers=(), faults=None, cache_write=None):
        super().__init__(observers, faults)
        self.cache_write = cache_write
        self.copies: dict[tuple[str, int], SequenceKV] = {}

    def gather_at(self, cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, isa: str):
        """K, V of (block, offset) pairs in this runtime's KV layout."""
        return gather_cpu_kv_at(cache, blocks, offsets, isa, self.cache_write)

    def drop(self, req_ids) -> None:
        """Finished or aborted requests: their KV copies go."""
        gone = set(req_ids)
        for key in [key for key in self.copies if key[0] in gone]:
            del self.copies[key]

    def retain(self, keep: set[str], stale: set[str] = frozenset()) -> None:
        for key in [key for key in self.copies if key[0] not in keep or key[0] in stale]:
            del self.copies[key]

    def held_copy_tokens(self) -> int:
        """Positions held by all requests' copies, counted once per request (every layer holds the same)."""
        held: dict[str, int] = {}
        for (req_id, _), seq in self.copies.items():
            held[req_id] = max(held.get(req_id, 0), seq.k.shape[1])
        return sum(held.values())

    def verify_layer(self, step: TreeStep, isa: str, scale: float, query, key, value, kv_cache, block_table,
                     output) -> None:
        """The tree rows of one attention layer of the verification forward; the layer's cache is kept for
        compaction."""
        step.kv_caches.append((kv_cache, isa))
        self.verify_attention(step, query, key, value, output, kv_cache, block_table, isa, scale)

    def _attend_draft(self, draft: DraftMask, isa: str, scale: float, query, kv_cache, output) -> None:
        bs, pre = kv_cache.shape[2], draft.prefix
        if kv_cache.data_ptr() not in pre.kv:
            pre.kv[kv_cache.data_ptr()] = self.gather_at(kv_cache, *paged_index(pre.block_rows, pre.positions, bs),
                                                         isa)
        pk, pv = pre.kv[kv_cache.data_ptr()]
        nk, nv = self.gather_at(kv_cache, *paged_index(pre.block_rows[draft.trees], draft.node_pos, bs), isa)
        k, v = torch.cat([pk[draft.trees], nk], dim=1), torch.cat([pv[draft.trees], nv], dim=1)
        new = masked_attention_batch(query[draft.rows], k, v, draft.visible, scale)
        output[draft.rows[draft.valid]] = new[draft.valid].to(output.dtype)

    def sequence_kv(self, cache: torch.Tensor, block_row: torch.Tensor, req_id: str, root: int, rows: int,
                    isa: str) -> SequenceKV:
        """The request's copy with positions 0..root-1 final and room for `rows` more (gathering from the paged
        cache only positions not yet copied)."""
        key = (req_id, cache.data_ptr())
        seq = self.copies.get(key)
        start = 0 if seq is None else min(seq.final, root)
        if seq is None or seq.k.shape[1] < root + rows:
            _, h, _, d2 = cache.shape
            cap = copy_capacity(root + rows)
            k = cache.new_empty((h, cap, d2 // 2))
            v = cache.new_empty((h, cap, d2 // 2))
            if seq is not None:
                k[:, :start], v[:, :start] = seq.k[:, :start], seq.v[:, :start]
            seq = self.copies[key] = SequenceKV(k, v)
        if start < root:
            k, v = gather_cpu_kv(cache, block_row, root, isa, self.cache_write, start=start)  # [root - start, H, D]
            seq.k[:, start:root], seq.v[:, start:root] = k.transpose(0, 1), v.transpose(0, 1)
        seq.final = root
        return seq

    def verify_attention(self, step: TreeStep, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         output: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, isa: str,
                         scale: float) -> None:
        """The tree rows of one attention layer of a verification forward, written into `output` [T, Hq, D]: for
        each tree request, its rows' queries (query [T, Hq, D]) attend to the prefix (its contiguous copy) and to
        the rows' own keys and values of this forward (key, value [T, Hkv, D]) under the ancestor mask, in one SDPA
        call. Over a long prefix the query heads of a kv head are folded into its rows (each key read once for all
        of them, not once a head: 10-15% less time from 600 keys on, slower under ~400: FOLD_FROM)."""
        _, hq, d = query.shape
        hkv = key.shape[1]
        group = hq // hkv
        for r in step.requests:
            n1 = len(r.tree) + 1
            rows = slice(r.start, r.start + n1)
            seq = self.sequence_kv(cache, block_table[r.row], r.req_id, r.root_pos, n1, isa)
            end = r.root_pos + n1
            seq.k[:, r.root_pos:end], seq.v[:, r.root_pos:end] = key[rows].transpose(0, 1), value[rows].transpose(0, 1)
            fold = group > 1 and r.root_pos >= FOLD_FROM
            if r.visible is None:  # the whole prefix, then ancestors-or-self among the rows (an additive mask)
                bias = torch.zeros(n1, end, dtype=query.dtype)
                bias[:, r.root_pos:].masked_fill_(~r.mask, -math.inf)
                r.visible = (bias.repeat_interleave(group, 0) if fold else bias)[None, None]
            k, v = seq.k[None, :, :end], seq.v[None, :, :end]  # [1, Hkv, end, D]
            if fold:  # [1, Hkv, n1 * group, D]: row i * group + j is row i's query head j of the kv head
                q = query[rows].view(n1, hkv, group, d).transpose(0, 1).reshape(1, hkv, n1 * group, d)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=r.visible, scale=scale)
                output[rows] = out.view(hkv, n1, group, d).transpose(0, 1).reshape(n1, hq, d).to(output.dtype)
            else:
                out = F.scaled_dot_product_attention(query[rows].transpose(0, 1)[None], k, v, attn_mask=r.visible,
                                                     scale=scale, enable_gqa=group > 1)  # [1, Hq, n1, D]
                output[rows] = out[0].transpose(0, 1).to(output.dtype)

    def fail_step(self, step: TreeStep, first_tokens: torch.Tensor) -> None:
        """Compaction failed: every tree request of the step keeps only its first token; positions past root + 1 are
        scratch, and the copies are rebuilt from the paged cache."""
        self.drop([r.req_id for r in step.requests])
        super().fail_step(step, first_tokens)

    def finish_step(self, step: TreeStep, results: dict[int, tuple], verdict=None) -> None:
        """results {batch row: (accepted nodes, bonus, branch-row argmax)}: compact the accepted paths' KV in the
        paged cache and in the copies, and keep the results for the drafter. (`verdict`: a device runtime's
        batched verification; none here.)"""
        paths = {row: path for row, (path, *_) in results.items()}
        src, dst = compaction_slots(step, paths)
        compact_kv_cpu(step.kv_caches, src, dst, self.cache_write)
        self.faults.point("compaction")
        self.advance_copies(step, paths)
        self.results, self.kv_moves = results, len(src)

    def advance_copies(self, step: TreeStep, paths: dict[int, list[int]]) -> None:
        """In every tree request's contiguous copies, the accepted nodes' K, V move to root + 1 .. root + a, as
        compaction moves them in the paged cache, and root .. root + a become final. The next step of a request that
        stays a tree then gathers nothing from the paged cache (the copy already holds what it committed)."""
        for r in step.requests:
            path = paths.get(r.row, ())
            moves = [(r.root_pos + 1 + node, r.root_pos + d) for d, node in enumerate(path, start=1) if node + 1 != d]
            src = torch.tensor([a for a, _ in moves]) if moves else None
            dst = torch.tensor([b for _, b in moves]) if moves else None
            for cache, _ in step.kv_caches:
                seq = self.copies.get((r.req_id, cache.data_ptr()))
                if seq is None or seq.final != r.root_pos:
                    continue
                if moves:
                    seq.k[:, dst], seq.v[:, dst] = seq.k[:, src], seq.v[:, src]
                seq.final = r.root_pos + 1 + len(path)
