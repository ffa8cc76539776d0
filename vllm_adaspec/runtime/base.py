"""What a worker keeps for token-tree verification, whatever its device: one `TreeRuntime` per worker owns a step's
tree plan and the draft mask of tree drafting (no module state), and is driven by the runner hooks
(engine/runner_hooks.py), the tree attention backends (engine/tree_backend.py) and the tree sampler
(engine/tree_sampler.py). The device's part (how tree rows attend, how accepted nodes' KV move) is a subclass's:
runtime/cpu.py on vLLM's CPU KV layout, runtime/gpu.py on its GPU layout with the Triton kernels. No vLLM here: the
glue hands in the few vLLM ops a runtime calls.

A tree request hands vLLM its n nodes as ordinary draft tokens (breadth-first), so the scheduler allocates
n + 1 contiguous slots (root + nodes) and verifies n + 1 rows. Per step:

1. `begin_step` (after the runner's `_prepare_inputs`): for each request whose scheduled drafts are the tree the
   drafter planned, rewrite its node rows' positions to root + depth (RoPE at depth; slots stay contiguous, they
   were computed before) and cut its seq_len to its own rows (vLLM's kernel then skips the prefix for them).
2. `attend` (every attention layer, exit layers included, after vLLM's kernel): the rows of each tree request are
   recomputed over the prefix (fully visible) and, among the rows, their ancestors-or-self only (`verify_layer`).
3. the tree sampler verifies tree rows node by node and calls `finish_step` with the accepted paths: the accepted
   nodes' KV moves to root + 1 .. root + a in every attention layer, so the next step sees a plain sequence; vLLM's
   own rollback (num_computed_tokens -= rejected) is then right.
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass, field
from typing import Collection

import numpy as np
import torch

from vllm_adaspec.config import DEFAULT_FAULT_LIMIT
from vllm_adaspec.faults import FaultGuard
from vllm_adaspec.step import DraftMask
from vllm_adaspec.trees import DraftTree, ancestor_mask


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


def chain_indices(num_draft_tokens, tree_rows: Collection[int]) -> tuple[list[int], list[int], list[int], list[int]]:
    """Host side of `chains_only` (known when the step is planned): (the draft rows kept [D], drafts per batch row
    with the tree rows' taken out, their cumulative sums for drafts and for sampled rows). Python lists: a step's
    batch is a few rows, where each numpy call costs more than the loop."""
    drafts = num_draft_tokens.tolist() if hasattr(num_draft_tokens, "tolist") else list(num_draft_tokens)
    trees = set(tree_rows)
    keep, num, cu_draft, cu_sampled = [], [], [], []
    at = d = s = 0
    for i, n in enumerate(drafts):
        m = 0 if i in trees else int(n)  # a tree row's drafts leave vLLM's chain verification
        keep += range(at, at + m)  # the chain rows' draft rows, in order
        at += int(n)
        d += m
        s += m + 1
        num.append(m)
        cu_draft.append(d)
        cu_sampled.append(s)
    return keep, num, cu_draft, cu_sampled


class TreeRuntime:
    """A worker's tree path, the part every device shares: the step being verified (its plan, its results), the draft
    mask while a drafter grows trees, the requests a verification could give no allowed token. Observers (tests'
    instrumentation, vllm_adaspec/observers.py) see each forward's plan before it runs. A device's runtime adds how
    tree rows attend (`verify_layer`, `_attend_draft`) and how accepted nodes' KV move (`finish_step`)."""

    keeps_copies = False  # each tree request's KV copied contiguously (the CPU runtime: capped by tree.kv_copy_tokens)
    kernel_cold = kernel_fallbacks = 0  # a device kernel's launches of a variant not compiled at start-up, fallbacks

    def __init__(self, observers=(), faults: FaultGuard | None = None):
        self.step: TreeStep | None = None
        # the driver's fault guard (faults.py): planning and verification faults are contained and counted there
        self.faults = faults if faults is not None else FaultGuard(DEFAULT_FAULT_LIMIT)
        self.draft: DraftMask | None = None
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
        """Finished or aborted requests: whatever the runtime keeps of them goes."""

    def retain(self, keep: set[str], stale: set[str] = frozenset()) -> None:
        """Keep what the runtime holds for `keep` only, and nothing of `stale` requests (their KV was recomputed)."""

    def held_copy_tokens(self) -> int:
        """Positions held in KV copies outside vLLM's cache (none here)."""
        return 0

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
        """The tree rows of one attention layer of the verification forward, written into `output`."""
        raise NotImplementedError

    def _attend_draft(self, draft: DraftMask, isa: str, scale: float, query, kv_cache, output) -> None:
        """The tree nodes of a draft step, written into `output`."""
        raise NotImplementedError

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
        """Every tree request of the step keeps only its first token (first_tokens [B], by batch row); positions past
        root + 1 are scratch."""
        firsts = first_tokens.tolist()
        self.results = {r.row: ([], int(firsts[r.row]), []) for r in step.requests}
        self.kv_moves = 0

    def finish_step(self, step: TreeStep, results: dict[int, tuple], verdict=None) -> None:
        """results {batch row: (accepted nodes, bonus, branch-row argmax)}: move the accepted paths' KV into place and
        keep the results for the drafter (`verdict`: a device runtime's batched verification)."""
        raise NotImplementedError

    def take_failed(self) -> dict[str, str]:
        """The requests the last verification failed (`failed`), once."""
        failed, self.failed = self.failed, {}
        return failed

    def take_results(self) -> tuple[dict[int, tuple], int]:
        """The last verification's tree results and KV slots moved, once."""
        out = (self.results, self.kv_moves)
        self.results, self.kv_moves = {}, 0
        return out
