"""Token-tree verification inside vLLM's V1 runner: one `TreeRuntime` per worker owns a step's tree plan, the
per-request contiguous KV copies and the draft mask of tree drafting (no module state). The tree algorithms live
in `vllm_adaspec.trees`; the runtime is driven by the runner hooks (engine/runner_hooks.py), the tree attention
backend (engine/tree_backend.py) and the tree sampler (engine/tree_sampler.py).

A tree request hands vLLM its n nodes as ordinary draft tokens (breadth-first), so the scheduler allocates
n + 1 contiguous slots (root + nodes) and verifies n + 1 rows. Per step:

1. `begin_step` (after the runner's `_prepare_inputs`): for each request whose scheduled drafts are the tree the
   drafter planned, rewrite its node rows' positions to root + depth (RoPE at depth; slots stay contiguous, they
   were computed before) and cut its seq_len to its own rows (vLLM's kernel then skips the prefix for them).
2. `attend` (every attention layer, exit layers included, after vLLM's kernel): the rows of each tree request are
   recomputed in one SDPA call: the prefix fully visible (a contiguous copy of the request's KV that each step
   extends) and, among the rows, only ancestors-or-self (their keys and values straight from the layer's inputs).
3. the tree sampler verifies tree rows node by node and calls `finish_step` with the accepted paths: the accepted
   nodes' KV moves to root + 1 .. root + a in every attention layer (and in the copies), so the next step sees a
   plain sequence; vLLM's own rollback (num_computed_tokens -= rejected) is then right.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from vllm_adaspec.config import DEFAULT_FAULT_LIMIT
from vllm_adaspec.engine.cpu_kv import compact_kv_cpu, gather_cpu_kv, gather_cpu_kv_at, paged_index
from vllm_adaspec.faults import FaultGuard
from vllm_adaspec.step import DraftMask
from vllm_adaspec.trees import DraftTree, ancestor_mask, copy_capacity


# Prefix length from which a tree request's query heads are folded into its rows (verify_attention): measured on
# the project's CPU with SmolLM2's heads (9 / 3), 8-16 nodes: unfolded 0.91-0.95 of the old path's time at 200-400
# keys (folded 0.91-1.07), folded 0.85-0.90 from 600 keys on (unfolded 0.94-0.96).
FOLD_FROM = 512


@dataclass
class TreeRequest:
    row: int  # batch row (input_batch order)
    req_id: str
    start: int  # flattened index of the root's row; nodes follow at start + 1 + i
    root_pos: int
    tree: DraftTree
    visible: torch.Tensor | None = None  # the rows' additive mask over their keys (0 / -inf), built by the first layer
    # ([1, 1, n + 1, root + n + 1], or its rows repeated per query head of a kv head where the heads are folded)
    branch_rows: int = 0  # the last nodes are draft-branch rows (pools/branches.py): read, not verified
    _mask: torch.Tensor | None = None

    @property
    def num_verified(self) -> int:
        return len(self.tree) - self.branch_rows

    @property
    def mask(self) -> torch.Tensor:
        """[n + 1, n + 1] bool ancestor-or-self over verification rows (built when first asked: the GPU path plans
        from ancestor words and never needs it)."""
        if self._mask is None:
            self._mask = ancestor_mask(self.tree)
        return self._mask


@dataclass
class TreeStep:
    num_tokens: int  # flattened tokens of the target forward (what attention metadata must show)
    requests: list[TreeRequest]
    slot_mapping: torch.Tensor | None = None  # the forward's slots, seen by attention (for compaction)
    kv_caches: list = field(default_factory=list)  # (cache, isa) of every attention layer in the forward
    num_drafts: np.ndarray | None = None  # [num_reqs] drafts scheduled per batch row (how vLLM lays out the logits)
    device: object = None  # what a device runtime keeps for the step (engine/gpu_tree_runtime.DeviceStep)
    broken: bool = False  # a forward ran the step with another token count than planned (`TreeRuntime.attend`)

    def digest(self) -> int:
        """A checksum of the planned trees (where they lie, their tokens and shapes): tensor-parallel ranks must
        plan the same."""
        parts = [np.array([r.row, r.start, r.root_pos, r.branch_rows, len(r.tree)], dtype=np.int64) for r in
                 self.requests]
        parts += [r.tree.tokens.numpy().astype(np.int64) for r in self.requests]
        parts += [r.tree.parents.numpy().astype(np.int64) for r in self.requests]
        return zlib.crc32(np.concatenate(parts).tobytes()) + 1  # > 0: a planned step

    def depth_positions(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, positions) of every tree node of the forward: its flattened row and root + depth."""
        rows = [np.arange(r.start + 1, r.start + 1 + len(r.tree)) for r in self.requests]
        pos = [r.root_pos + np.array(r.tree.depth_list, dtype=np.int64) for r in self.requests]
        return np.concatenate(rows), np.concatenate(pos)


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


def plan_step(req_ids: list[str], query_start: np.ndarray, roots: np.ndarray, spec_tokens: dict,
              plans: dict, num_tokens: int) -> TreeStep | None:
    """Match the scheduled drafts against the planned trees (host data only: nothing waits for the device).

    req_ids: batch order; query_start [num_reqs + 1] flattened row starts; roots [num_reqs] each request's root
    position (its computed tokens: the position of its first scheduled row); spec_tokens: the scheduler's
    req_id -> scheduled draft ids; plans: req_id -> step.DraftPlan. A tree whose drafts the scheduler trimmed keeps
    its first nodes (DraftPlan.scheduled). Positions are written afterwards (`TreeStep.depth_positions`), once
    every tree is planned: a fault while planning leaves them as vLLM made them (the drafts verify as chains)."""
    requests = []
    num_drafts = np.zeros(len(req_ids), dtype=np.int64)
    for row, req_id in enumerate(req_ids):
        spec = spec_tokens.get(req_id)
        num_drafts[row] = len(spec) if spec else 0
        plan = plans.get(req_id)
        if not spec or plan is None or plan.parents is None:
            continue
        plan = plan.scheduled(len(spec))
        n = len(plan.tokens)
        if list(spec) != list(plan.tokens) or not plan.is_tree:
            continue
        tree = DraftTree.of(plan.tokens, plan.parents)
        start = int(query_start[row])
        if int(query_start[row + 1]) - start != n + 1:  # the forward's rows must be the root's and the nodes'
            raise ValueError(f"request {req_id} has {int(query_start[row + 1]) - start} rows in the forward, its "
                             f"tree {n + 1}")
        requests.append(TreeRequest(row, req_id, start, int(roots[row]), tree, branch_rows=n - plan.num_verified))
    if requests and int(query_start[len(req_ids)]) != num_tokens:
        raise ValueError(f"the forward's rows end at {int(query_start[len(req_ids)])}, its tokens number {num_tokens}")
    return TreeStep(num_tokens, requests, num_drafts=num_drafts) if requests else None


def shrink_tree_seq_lens(step: TreeStep, seq_lens: torch.Tensor) -> None:
    """Cut each tree request's seq_len (the runner's buffer, read when the step's attention metadata is built) to
    its own rows: vLLM's kernel then attends only over those few keys, work the tree attention overwrites anyway,
    instead of the whole prefix. The KV cache writes go by slot mapping and are unaffected."""
    for r in step.requests:
        seq_lens[r.row] = len(r.tree) + 1


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


def compaction_slots(step: TreeStep, paths: dict[int, list[int]]) -> tuple[list[int], list[int]]:
    """For each tree request's accepted path (node indices, root to deepest): node at depth d moves from its
    verification slot (root + 1 + node) to root + d. Returns (src, dst) slot lists, only moves that change."""
    src, dst = [], []
    slots = step.slot_mapping.tolist()
    for r in step.requests:
        for d, node in enumerate(paths.get(r.row, ()), start=1):
            if node + 1 != d:
                src.append(slots[r.start + 1 + node])
                dst.append(slots[r.start + d])
    return src, dst


class TreeRuntime:
    """A worker's tree path: the step being verified, the draft mask while a drafter grows trees, and the
    contiguous KV copies of the requests in tree mode, keyed (request id, cache address). Observers (tests'
    instrumentation, vllm_adaspec/observers.py) see each forward's plan before it runs. This class is the CPU
    path (vLLM's CPU KV layout, per-request copies, SDPA); engine/gpu_tree_runtime.py is the GPU one."""

    gather_at = staticmethod(gather_cpu_kv_at)  # K, V of (block, offset) pairs in this runtime's KV layout
    keeps_copies = True  # each tree request's KV copied contiguously (capped by tree.kv_copy_tokens)
    kernel_cold = kernel_fallbacks = 0  # a device kernel's launches of a variant not compiled at start-up, fallbacks

    def __init__(self, observers=(), faults: FaultGuard | None = None):
        self.step: TreeStep | None = None
        # the driver's fault guard (faults.py): planning and verification faults are contained and counted there
        self.faults = faults if faults is not None else FaultGuard(DEFAULT_FAULT_LIMIT)
        self.draft: DraftMask | None = None
        self.copies: dict[tuple[str, int], SequenceKV] = {}
        self.observers = list(observers)
        # the last verification's tree results {batch row: (accepted nodes, bonus, branch-row argmax)} and the KV
        # slots compaction moved, until the drafter's next propose reads them (take_results)
        self.results: dict[int, tuple] = {}
        self.kv_moves = 0
        self.batched_total = self.batched_sampled_total = 0  # trees verified on the device in one batch, so far
        # requests that commit nothing this step and must be finished with an error {req_id: why} (the tree sampler:
        # no token could be given them that their settings allow), until the worker hands them to the scheduler
        self.failed: dict[str, str] = {}

    def attached(self, impls: list, dtype: torch.dtype) -> None:
        """The attention impls that call this runtime (engine/tree_backend.attach_runtime), once the model is built
        (`dtype`: the model's)."""

    def ready(self, kv_caches: list, block_table) -> None:
        """vLLM allocated the KV cache (kv_caches: one per attention layer) and the block table, at start-up."""

    # --- planning (the runner's _prepare_inputs hook) ---
    def begin_step(self, req_ids: list[str], query_start: np.ndarray, roots: np.ndarray, positions: torch.Tensor,
                   spec_tokens: dict, plans: dict, num_tokens: int, seq_lens: torch.Tensor, holders: set[str],
                   resumed: set[str]) -> None:
        """Plan this forward's trees; keep the copies of `holders` (the drafter's tree-mode requests) and of this
        step's tree requests, drop the others' and those of `resumed` requests (their KV was recomputed)."""
        step, faulted = None, False
        if plans and spec_tokens:
            try:
                self.faults.point("tree_plan")
                step = self.prepare(plan_step(req_ids, query_start, roots, spec_tokens, plans, num_tokens))
            except Exception as e:  # nothing written yet: every scheduled draft verifies as a chain (lossless)
                self.faults.record("planning the step's token trees", e)
                step, faulted = None, True
        # tensor parallelism: every rank verifies the same trees or none (faults.py)
        digest = step.digest() if step is not None and self.faults.sync is not None else 0
        if self.faults.agree(faulted, "planning the step's token trees", digest):
            step = None
        keep = set(holders) | ({r.req_id for r in step.requests} if step else set())
        self.retain(keep, stale=resumed)
        for obs in self.observers:
            obs.before_forward(req_ids, query_start, roots, step)
        if step is not None:
            self.write_step(step, positions, seq_lens)
        self.step = step

    def prepare(self, step: TreeStep | None) -> TreeStep | None:
        """What a runtime builds for a planned step before anything is written (the GPU runtime: device metadata)."""
        return step

    def write_step(self, step: TreeStep, positions: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Node rows at root + depth, and each tree request's seq_len cut to its own rows (shrink_tree_seq_lens)."""
        rows, pos = step.depth_positions()
        positions[torch.from_numpy(rows)] = torch.from_numpy(pos).to(positions.dtype)
        shrink_tree_seq_lens(step, seq_lens)

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

    # --- attention (the tree backend, every layer) ---
    @contextlib.contextmanager
    def drafting(self, mask: DraftMask | None):
        """Active while a drafter runs one step over tree nodes (engine/drafting.py)."""
        self.draft = mask
        try:
            yield
        finally:
            self.draft = None

    def attend(self, isa: str, scale: float, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kv_cache: torch.Tensor, attn_metadata, output: torch.Tensor) -> None:
        """After vLLM's kernel wrote `output` [T, Hq, D] for a forward: overwrite the rows of tree nodes (a draft
        step's tree nodes, or a verification forward's tree requests) with tree-masked attention."""
        draft = self.draft
        if draft is not None and attn_metadata.num_actual_tokens == draft.num_tokens:
            self._attend_draft(self.on_device(draft), isa, scale, query, kv_cache, output)
            return
        step = self.step
        if step is None or step.broken:
            return  # not the target's verification forward (warm-up, profiling, draft steps)
        if attn_metadata.num_actual_tokens != step.num_tokens:
            # the forward does not lay its rows out as the step was planned, whose tree rows' seq_lens were already
            # cut: none of their rows (the roots' included) can be trusted. A contained fault: the step's tree
            # requests commit nothing and are finished with an error (the tree sampler), never a wrong token
            step.broken = True
            self.faults.record("attending over the step's token trees", RuntimeError(
                f"the forward has {attn_metadata.num_actual_tokens} tokens, the planned step {step.num_tokens}"))
            return
        if step.slot_mapping is None:
            step.slot_mapping = attn_metadata.slot_mapping[:step.num_tokens].clone()
        self.verify_layer(step, isa, scale, query, key, value, kv_cache, attn_metadata.block_table, output)

    def on_device(self, draft: DraftMask) -> DraftMask:
        """A draft step's mask where the layer's tensors are (the CPU's: as the drafter built it)."""
        return draft

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
            k, v = gather_cpu_kv(cache, block_row, root, isa, start=start)  # [root - start, H, D]
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

    # --- after sampling (the tree sampler) ---
    def take_step(self) -> TreeStep | None:
        step, self.step = self.step, None
        return step

    # verified on the device in one batch (engine/gpu_tree_runtime.py); here every tree request is verified by the
    # tree sampler one by one (the host holds the logits: nothing to wait for)
    def batched(self, step: TreeStep) -> list[int]:
        return []

    def write_rows(self, tokens: torch.Tensor, rows: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Committed tokens of requests verified on the host into vLLM's sampled tokens [B, width] (-1 padded), by
        batch row; each row's written tokens back (where tokens are)."""
        for i, row in rows.items():
            tokens[i].fill_(-1)
            tokens[i, :len(row)] = torch.tensor(row, dtype=tokens.dtype)
        return {i: tokens[i] for i in rows}

    def staged_chains(self, step: TreeStep):
        """tree_sampler.chains_only's indices already on the device (a device runtime stages them when it plans)."""
        return None

    def fail_step(self, step: TreeStep, first_tokens: torch.Tensor) -> None:
        """Compaction failed: every tree request of the step keeps only its first token (first_tokens [B], by batch
        row); positions past root + 1 are scratch, and the copies are rebuilt from the paged cache."""
        self.drop([r.req_id for r in step.requests])
        firsts = first_tokens.tolist()
        self.results = {r.row: ([], int(firsts[r.row]), []) for r in step.requests}
        self.kv_moves = 0

    def finish_step(self, step: TreeStep, results: dict[int, tuple], verdict=None) -> None:
        """results {batch row: (accepted nodes, bonus, branch-row argmax)}: compact the accepted paths' KV in the
        paged cache and in the copies, and keep the results for the drafter. (`verdict`: a device runtime's
        batched verification; none here.)"""
        paths = {row: path for row, (path, *_) in results.items()}
        src, dst = compaction_slots(step, paths)
        compact_kv_cpu(step.kv_caches, src, dst)
        self.faults.point("compaction")
        self.advance_copies(step, paths)
        self.results, self.kv_moves = results, len(src)

    def take_failed(self) -> dict[str, str]:
        """The requests the last verification failed (`failed`), once."""
        failed, self.failed = self.failed, {}
        return failed

    def take_results(self) -> tuple[dict[int, tuple], int]:
        """The last verification's tree results and KV slots moved, once."""
        out = (self.results, self.kv_moves)
        self.results, self.kv_moves = {}, 0
        return out

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
