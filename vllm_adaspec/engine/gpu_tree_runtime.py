"""Token-tree verification on vLLM's GPU paged KV layout, with nothing in a step's path waiting for the device.

The same step as the CPU runtime (engine/tree_runtime.py: planning, node positions at root + depth, tree attention
per layer, the tree sampler, KV compaction), done on the device:

1. `prepare` (host, once per step, after planning): every index the step needs (the trees' rows and ancestor
   bits for the kernel, the node positions and the cut seq_lens, the padded trees of plain greedy requests, where
   each tree's rows lie in the logits, vLLM's chain indices) goes to the device in two copies from pinned buffers.
2. `attend` (every attention layer, after vLLM's kernel wrote every row): the Triton kernel
   (kernels/tree_attention.py) writes the tree requests' rows of the layer's output, reading the paged cache where
   vLLM's kernel just wrote the rows' keys and values; no copy of any request's KV.
3. `verify_batched` (the tree sampler): plain trees verified together (trees/batch.py): greedy ones by the argmax
   of their rows, sampled ones (temperature, top-k, top-p, no seed) by sample-and-match, one draw per depth for all
   of them; their committed tokens are written into vLLM's sampled-token tensor on the device. Other tree requests
   (seeds, penalties, grammars, log-probs, min_p, bias) go through the tree sampler one by one, as on CPU (those
   wait for the device).
4. `finish_step`: the accepted nodes' KV moves to root + 1 .. root + a in every layer (gpu_kv.compaction_moves).
   The drafter's results are read from the device only at its next propose call (`take_results`), after vLLM's
   own wait for the step's sampled tokens.

Where tree attention is computed on CPU tensors (the suite emulates this path with vLLM's Triton backend under
the Triton interpreter), the same code runs there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from vllm_adaspec.engine.gpu_kv import compaction_moves, gather_kv_at, kv_views, move_slots
from vllm_adaspec.engine.tree_runtime import TreeRuntime, TreeStep
from vllm_adaspec.engine.tree_sampler import chain_indices
from vllm_adaspec.kernels.tree_attention import TOLERANCE, TreeAttentionLaunch, check_on_device, launch, plan_launch
from vllm_adaspec.trees.batch import TreeBatch, pack_trees, pack_words, verify_greedy_batch, verify_sample_batch


class StagingBuffer:
    """Host arrays to the device in one copy, from a pinned buffer kept across steps (a copy from pageable memory
    would first wait for everything queued on the device)."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = torch.device(device), dtype
        self.host = self.dev = None

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Each array's device copy (same shape), all from one transfer."""
        sizes = [a.size for a in arrays]
        total = max(1, sum(sizes))
        if self.host is None or self.host.numel() < total:
            cap = 1 << math.ceil(math.log2(total))
            self.host = torch.empty(cap, dtype=self.dtype, pin_memory=self.device.type == "cuda")
            self.dev = torch.empty(cap, dtype=self.dtype, device=self.device)
        flat = self.host.numpy()
        at = 0
        for a, n in zip(arrays, sizes):
            flat[at:at + n] = a.reshape(-1)
            at += n
        self.dev[:at].copy_(self.host[:at], non_blocking=True)
        out, at = [], 0
        for a, n in zip(arrays, sizes):
            out.append(self.dev[at:at + n].view(a.shape))
            at += n
        return out


@dataclass
class DeviceStep:
    """A tree step's device side (TreeStep.device). R trees, of which the plain ones (`batched`, host indices into
    the step's requests: the greedy ones, then the sampled ones) are verified in one batch; N = the most nodes of a
    tree."""
    launch: TreeAttentionLaunch
    node_rows: torch.Tensor  # [nodes] long: every node's row of the forward
    node_positions: torch.Tensor  # [nodes] long: root + depth
    seq_rows: torch.Tensor  # [R] long: batch rows of the tree requests
    seq_lens: torch.Tensor  # [R] int32: their rows (root + nodes)
    starts: torch.Tensor  # [R] long: each root's row of the forward
    sizes: torch.Tensor  # [R] long: nodes per tree (branch rows included)
    width: int  # N
    batched: list[int]
    greedy: int  # how many of `batched` are greedy (they come first)
    batched_index: torch.Tensor  # [Rb] long: `batched` on the device
    batched_rows: torch.Tensor  # [Rb] long: their batch rows (rows of vLLM's sampled tokens)
    logit_rows: torch.Tensor  # [Rb, N + 1] long: where each tree row's logits are (padding: the root's)
    trees: TreeBatch | None  # the batched trees, padded to N
    sampled_depth: int  # the deepest node of the sampled trees (sample-and-match draws once more than that)
    chains: tuple  # tree_sampler.chains_only's staged indices


@dataclass
class BatchVerdict:
    """Plain trees verified in one batch (device tensors, read by the host at the drafter's next call)."""
    path: torch.Tensor  # [Rb, N]
    count: torch.Tensor  # [Rb]
    bonus: torch.Tensor  # [Rb]
    argmax: torch.Tensor  # [Rb, N + 1]: every row's argmax (the read-only branch rows' outputs among them)


class GPUTreeRuntime(TreeRuntime):
    """A worker's tree path on vLLM's GPU backends (engine/gpu_tree_backend.py). No per-request KV copies: the
    kernel reads the paged cache. `plain(req_id)`: "greedy" or "sampled" where a request's trees may be verified in
    one batch, else None (the worker points it at the port's request traits)."""

    gather_at = staticmethod(gather_kv_at)
    keeps_copies = False

    def __init__(self, device, observers=(), faults=None, plain=None):
        super().__init__(observers, faults)
        self.device = torch.device(device)
        self.plain = plain or (lambda req_id: None)
        self._long = StagingBuffer(self.device, torch.int64)
        self._int = StagingBuffer(self.device, torch.int32)
        self.pending = None  # (step, BatchVerdict) until the drafter's next propose reads them
        self._draft_on_device = (None, None)
        self.heads = (0, 0, 0)  # query heads, kv heads, head size of the model's attention layers (this rank's)

    def attached(self, impls: list, dtype: torch.dtype) -> None:
        """The model's layers are built: their heads, and the kernel checked once on this device in the model's dtype
        (a kernel that cannot compile or computes wrong here fails start-up, not a request)."""
        shapes = {(impl.num_heads, impl.num_kv_heads, impl.head_size) for impl in impls}
        if len(shapes) != 1:  # one launch plan serves every layer of a forward
            raise ValueError(f"tree attention needs one head layout across the model's layers, got {sorted(shapes)}")
        self.heads = shapes.pop()
        try:
            err = check_on_device(self.device, dtype, *self.heads)
        except Exception as e:
            raise RuntimeError(f"the tree-attention kernel failed its start-up check on {self.device} "
                               f"({type(e).__name__}: {e})") from e
        if not err <= TOLERANCE[dtype]:
            raise RuntimeError(f"the tree-attention kernel is off by {err:.3g} on {self.device} in {dtype} at its "
                               f"start-up check (at most {TOLERANCE[dtype]} allowed)")

    # --- planning ---
    def prepare(self, step: TreeStep | None) -> TreeStep | None:
        if step is None:
            return None
        reqs = step.requests
        sizes = np.array([len(r.tree) for r in reqs], dtype=np.int64)
        width = int(sizes.max())
        starts = np.array([r.start for r in reqs], dtype=np.int64)
        rows = np.array([r.row for r in reqs], dtype=np.int64)
        roots = np.array([r.root_pos for r in reqs], dtype=np.int64)
        node_rows, node_pos = step.depth_positions()
        # the kernel: tree rows (root + nodes) packed, each with its ancestor bits
        q_rows = np.concatenate([np.arange(s, s + n + 1) for s, n in zip(starts, sizes)])
        cu = np.concatenate([[0], np.cumsum(sizes + 1)])
        words = max(1, -(-(width + 1) // 32))
        mask = torch.zeros(len(q_rows), words * 32, dtype=torch.bool)
        for r, c in zip(reqs, cu[:-1]):
            mask[c:c + len(r.tree) + 1, :len(r.tree) + 1] = r.mask
        bits = pack_words(mask).numpy()
        bits = np.where(bits >= 2**31, bits - 2**32, bits)  # as int32 words
        # plain trees, greedy then sampled: verified together; where their rows' logits are (per batch row: drafts + 1)
        kinds = [self.plain(r.req_id) for r in reqs]
        greedy = [k for k, kind in enumerate(kinds) if kind == "greedy"]
        batched = greedy + [k for k, kind in enumerate(kinds) if kind == "sampled"]
        sampled_depth = max((int(reqs[k].tree.depths.max()) for k in batched[len(greedy):]), default=0)
        logit_start = np.concatenate([[0], np.cumsum(step.num_drafts + 1)])
        logit_rows = np.stack([logit_start[reqs[k].row] + np.minimum(np.arange(width + 1), sizes[k])
                               for k in batched]) if batched else np.zeros((0, width + 1), dtype=np.int64)
        trees = pack_trees([reqs[k].tree for k in batched], [reqs[k].num_verified for k in batched], width=width,
                           masks=[reqs[k].mask for k in batched]) if batched else None
        keep, num, cu_draft, cu_sampled = chain_indices(step.num_drafts, set(rows.tolist()))
        firsts = (np.cumsum(step.num_drafts) - step.num_drafts)[rows]
        longs = [node_rows, node_pos, rows, starts, sizes, np.array(batched, dtype=np.int64), logit_rows,
                 keep, cu_draft, cu_sampled, firsts]
        if trees is not None:
            longs += [trees.tokens.numpy(), trees.parent_rows.numpy(), trees.depths.numpy(),
                      trees.valid.numpy().astype(np.int64), trees.ancestors.numpy(), trees.order.numpy()]
        dev = self._long.upload([np.ascontiguousarray(a, dtype=np.int64) for a in longs])
        ints = self._int.upload([q_rows.astype(np.int32), cu.astype(np.int32), roots.astype(np.int32),
                                 rows.astype(np.int32), bits.astype(np.int32), (sizes + 1).astype(np.int32)])
        d_q_rows, d_cu, d_roots, d_bt_rows, d_bits, d_seq = ints
        (d_node_rows, d_node_pos, d_rows, d_starts, d_sizes, d_batched, d_logit_rows, d_keep, d_cu_draft,
         d_cu_sampled, d_firsts) = dev[:11]
        d_trees = None
        if trees is not None:
            tok, par, dep, val, anc, order = dev[11:]
            d_trees = TreeBatch(tok, par, dep, val.bool(), anc, order)
        hq, hkv, d = self.heads
        plan = plan_launch(d_roots, d_cu, d_bits.view(len(q_rows), words), d_q_rows, d_bt_rows, hq, hkv, d,
                           max_rows=width + 1, longest=int((roots + sizes + 1).max()))
        step.device = DeviceStep(plan, d_node_rows, d_node_pos, d_rows, d_seq, d_starts, d_sizes, width, batched,
                                 len(greedy), d_batched, d_rows[d_batched] if batched else d_rows[:0], d_logit_rows,
                                 d_trees, sampled_depth, (d_keep, d_cu_draft, d_cu_sampled, d_rows, d_firsts, num))
        return step

    def write_step(self, step: TreeStep, positions: torch.Tensor, seq_lens: torch.Tensor) -> None:
        dev = step.device
        positions[dev.node_rows] = dev.node_positions.to(positions.dtype)
        seq_lens[dev.seq_rows] = dev.seq_lens.to(seq_lens.dtype)

    def staged_chains(self, step: TreeStep):
        return step.device.chains

    def held_copy_tokens(self) -> int:
        return 0  # no copies: the kernel reads the paged cache

    # --- attention (TreeRuntime.attend dispatches) ---
    def verify_layer(self, step: TreeStep, isa, scale: float, query, key, value, kv_cache, block_table,
                     output) -> None:
        step.kv_caches.append(kv_cache)
        k, v = kv_views(kv_cache)
        launch(step.device.launch, query, k, v, block_table, scale, output)

    def on_device(self, draft):
        """A draft step's mask (host tensors, built by the drafter) on the device, once per draft step."""
        held, moved = self._draft_on_device
        if held is draft:
            return moved
        pre = draft.prefix
        if pre.block_rows.device != self.device:  # the prefix outlives the step: moved in place, once
            pre.block_rows, pre.positions = pre.block_rows.to(self.device), pre.positions.to(self.device)
        moved = type(draft)(draft.num_tokens, pre, *(t.to(self.device) for t in (
            draft.trees, draft.rows, draft.valid, draft.node_pos, draft.visible)))
        self._draft_on_device = (draft, moved)
        return moved

    # --- verification (the tree sampler) ---
    def batched(self, step: TreeStep) -> list[int]:
        return step.device.batched

    def verify_batched(self, step: TreeStep, logits: torch.Tensor, tokens: torch.Tensor,
                       sampling_metadata) -> BatchVerdict:
        """The plain trees' verdict; their committed tokens (accepted nodes, then the bonus) go into vLLM's sampled
        tokens tokens [B, width] (-1 padded) on the device. Greedy trees by their rows' argmax; sampled trees by
        sample-and-match on their rows' distributions as vLLM's sampler makes them (temperature, then top-k / top-p
        with vLLM's own op on its per-row tensors)."""
        dev = step.device
        g = dev.greedy
        argmax = logits.argmax(dim=-1)[dev.logit_rows]  # [Rb, N + 1] (the sampled trees' read-only rows need it too)
        verdicts = []
        if g:
            verdicts.append(verify_greedy_batch(dev.trees.rows(slice(None, g)), argmax[:g]))
        if g < len(dev.batched):
            verdicts.append(self._sample(dev, logits, sampling_metadata))
        path, count, bonus = (torch.cat(parts) for parts in zip(*verdicts))
        width = tokens.shape[1]
        cols = torch.arange(width, device=tokens.device)
        n = min(path.shape[1], width)
        committed = dev.trees.tokens.gather(1, path.clamp(min=0))[:, :n]
        out = torch.full((len(dev.batched), width), -1, dtype=tokens.dtype, device=tokens.device)
        out[:, :n] = torch.where(cols[:n] < count[:, None], committed, -1).to(tokens.dtype)
        out.scatter_(1, count[:, None].clamp(max=width - 1), bonus[:, None].to(tokens.dtype))
        tokens[dev.batched_rows] = out
        return BatchVerdict(path, count, bonus, argmax)

    @staticmethod
    def _sample(dev: DeviceStep, logits: torch.Tensor, sm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        g = dev.greedy
        trees = dev.trees.rows(slice(g, None))
        rows = dev.batched_rows[g:]
        logit_rows = dev.logit_rows[g:]
        temperature = sm.temperature[rows].to(torch.float32)[:, None]
        top_k = None if sm.top_k is None else sm.top_k[rows]
        top_p = None if sm.top_p is None else sm.top_p[rows]

        def row_probs(at: torch.Tensor) -> torch.Tensor:  # at [Rs]: each tree's current row
            x = logits[logit_rows.gather(1, at[:, None])[:, 0]].to(torch.float32) / temperature
            return torch.softmax(apply_top_k_top_p(x, top_k, top_p), dim=-1)

        return verify_sample_batch(trees, row_probs, dev.sampled_depth)

    def fail_step(self, step: TreeStep, first_tokens: torch.Tensor) -> None:
        self.pending = None
        super().fail_step(step, first_tokens)

    def finish_step(self, step: TreeStep, results: dict[int, tuple], verdict: BatchVerdict | None = None) -> None:
        """Compaction on the device: the batched trees' paths stay there; the others' (verified one by one, on the
        host) are copied in."""
        dev = step.device
        r_count = len(step.requests)
        path = torch.full((r_count, dev.width), -1, dtype=torch.long, device=self.device)
        count = torch.zeros(r_count, dtype=torch.long, device=self.device)
        if verdict is not None:
            path[dev.batched_index] = verdict.path
            count[dev.batched_index] = verdict.count
        host = [k for k, r in enumerate(step.requests) if r.row in results]
        if host:
            hp = torch.full((len(host), dev.width), -1, dtype=torch.long)
            for j, k in enumerate(host):
                nodes = results[step.requests[k].row][0]
                hp[j, :len(nodes)] = torch.tensor(nodes, dtype=torch.long)
            at = torch.tensor(host, device=self.device)
            path[at] = hp.to(self.device)
            count[at] = (hp >= 0).sum(1).to(self.device)
        src, dst = compaction_moves(dev.starts, dev.sizes, path, count)
        move_slots(step.kv_caches, step.slot_mapping[src], step.slot_mapping[dst])
        self.faults.point("compaction")
        self.results, self.kv_moves = dict(results), sum(_moves(p) for p, *_ in results.values())
        self.pending = (step, verdict) if verdict is not None else None

    def take_results(self) -> tuple[dict[int, tuple], int]:
        """The batched verdict read back (vLLM has waited for the step's sampled tokens by now), merged with the
        trees verified one by one."""
        pending, self.pending = self.pending, None
        if pending is not None:
            step, v = pending
            paths, counts = v.path.tolist(), v.count.tolist()
            bonus, argmax = v.bonus.tolist(), v.argmax.tolist()
            for j, k in enumerate(step.device.batched):
                r = step.requests[k]
                path = paths[j][:counts[j]]
                predicted = argmax[j][r.num_verified + 1:len(r.tree) + 1]
                self.results[r.row] = (path, bonus[j], predicted)
                self.kv_moves += _moves(path)
            self.batched_total += len(step.device.batched)
            self.batched_sampled_total += len(step.device.batched) - step.device.greedy
        return super().take_results()


def _moves(path: list[int]) -> int:
    """KV slots a path's compaction moves (nodes not already at root + depth)."""
    return sum(1 for d, node in enumerate(path, start=1) if node + 1 != d)
