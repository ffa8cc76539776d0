"""Token-tree verification on vLLM's GPU paged KV layout, with nothing in a step's path waiting for the device.

The same step as the CPU runtime (runtime/base.py and runtime/cpu.py: planning, node positions at root + depth, tree
attention per layer, the tree sampler, KV compaction), done on the device:

1. `prepare` (host, once per step, after planning): every index the step needs (the trees' rows and ancestor
   bits for the kernel, the node positions and the cut seq_lens, the padded trees of plain greedy requests, where
   each tree's rows lie in the logits, vLLM's chain indices) goes to the device in one copy from a pinned buffer.
2. `attend` (every attention layer, after vLLM's kernel wrote every row): the Triton kernel
   (kernels/tree_attention.py) writes the tree requests' rows of the layer's output, reading the paged cache where
   vLLM's kernel just wrote the rows' keys and values; no copy of any request's KV.
3. `verify_batched` (the tree sampler): plain trees verified together (trees/batch.py): greedy ones by the argmax
   of their rows, sampled ones (temperature, top-k, top-p, no seed) by sample-and-match, one draw at every row
   (on a GPU both from one launch over the logits in place, kernels/row_draws.py, unless top-k / top-p are set);
   their committed tokens are written into vLLM's sampled-token tensor on the device. Other tree requests
   (seeds, penalties, grammars, log-probs, min_p, bias) go through the tree sampler one by one, as on CPU (those
   wait for the device).
4. `finish_step`: the accepted nodes' KV moves to root + 1 .. root + a in every layer (gpu_kv.compaction_moves).
   The drafter's results are read from the device only at its next propose call (`take_results`), after vLLM's
   own wait for the step's sampled tokens.

Where tree attention is computed on CPU tensors (the suite emulates this path with vLLM's Triton backend under
the Triton interpreter), the same code runs there.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from vllm_adaspec.kernels import kv_compaction, row_draws, tree_verify
from vllm_adaspec.kernels import tree_attention as kernels
from vllm_adaspec.runtime.base import TreeRuntime, TreeStep, chain_indices
from vllm_adaspec.runtime.gpu_kv import compaction_moves, gather_kv_at, kv_views, move_slots
from vllm_adaspec.trees import step_plan
from vllm_adaspec.trees.batch import TreeBatch, draw_rows, pack_words, representative_rows, walk_order
from vllm_adaspec.trees.tree import ancestor_rows, split_words

MAX_HELD_VIEWS = 1024  # layers' K, V views a runtime keeps (`_kv_views`)
ALIGN_BYTES = 16  # Triton specializes a pointer argument on 16-byte alignment: every staged array starts on one


def int32_words(words: np.ndarray) -> np.ndarray:
    """32-bit words held in int64 (0 .. 2^32 - 1) as the int32 the kernel reads (the same bits)."""
    return words.astype(np.uint32).view(np.int32)


def _padded_trees(trees, verified: list[int], bits: list[np.ndarray], width: int) -> list:
    """trees/batch.pack_trees' six arrays (tokens, parent rows, depths, valid, ancestors, order) from the trees' host
    lists and their ancestor words already computed (`bits` [n + 1, W] each), padded to `width` nodes."""
    tokens, parent_rows, depths, valid, order = [], [], [], [], []
    ancestors = np.zeros((len(trees), width + 1, bits[0].shape[1]), dtype=np.int64)
    for b, (tree, m, a) in enumerate(zip(trees, verified, bits)):
        n = len(tree)
        pad = [0] * (width - n)
        rank, walk = walk_order(tree.parent_list)
        tokens += tree.token_list + pad
        parent_rows += representative_rows(tree, order=walk) + pad
        depths += tree.depth_list + pad
        valid += [1] * m + [0] * (width - m)
        order += rank + pad
        ancestors[b, :n + 1] = a
    return [tokens, parent_rows, depths, valid, ancestors, order]


class StagingBuffer:
    """Host arrays to the device in one copy, from a pinned buffer kept across steps (a copy from pageable memory
    would first wait for everything queued on the device). Each array starts 16-byte aligned, so a kernel reading
    one sees the same alignment every step (kernels/tree_attention.py: no new compile). Two buffers alternate: the
    copy of step t + 1 does not overwrite host memory the copy of step t may still be reading."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = torch.device(device), dtype
        self.host, self.dev, self.flat = [None, None], [None, None], [None, None]
        self.dev32 = [None, None]  # an int64 buffer's device memory as int32 (the plan's int32 arrays)
        self.cap = [0, 0]
        self.views = [{}, {}]  # per turn: the plan's device views by place and shape (GPUTreeRuntime._plan_views)
        self.prefixes = [{}, {}]  # per turn: n -> (host, device) views of the buffer's first n elements (`send_prefix`)
        self.turn = 0
        self.align = max(1, ALIGN_BYTES // torch.empty(0, dtype=dtype).element_size())

    def reserve(self, size: int) -> np.ndarray:
        """The next turn's host buffer (numpy, at least `size` elements) to fill, then `send`."""
        total = max(1, size)
        self.turn ^= 1
        t = self.turn
        if self.cap[t] < total:
            cap = 1 << math.ceil(math.log2(total))
            self.host[t] = torch.empty(cap, dtype=self.dtype, pin_memory=self.device.type == "cuda")
            self.dev[t] = torch.empty(cap, dtype=self.dtype, device=self.device)
            self.flat[t] = self.host[t].numpy()
            self.dev32[t] = self.dev[t].view(torch.int32) if self.dtype == torch.int64 else None
            self.cap[t] = cap
            self.views[t], self.prefixes[t] = {}, {}
        return self.flat[t]

    def send_prefix(self, size: int) -> torch.Tensor:
        """The reserved buffer's first `size` elements on the device in one copy. The host and device views of each
        size are kept (the plan's sizes are its layouts' ends: a few dozen), so the copy is the step's one torch call
        here."""
        t = self.turn
        pair = self.prefixes[t].get(size)
        if pair is None:
            pair = self.prefixes[t][size] = (self.host[t][:size], self.dev[t][:size])
        pair[1].copy_(pair[0], non_blocking=True)
        return pair[1]

    def send(self, size: int) -> torch.Tensor:
        """The first `size` elements of the reserved buffer on the device (one copy), as one flat tensor."""
        t = self.turn
        self.dev[t][:max(1, size)].copy_(self.host[t][:max(1, size)], non_blocking=True)
        return self.dev[t][:size]

    def upload(self, arrays: list) -> list[torch.Tensor]:
        """Each array's device copy, all from one transfer: numpy arrays keep their shape, Python lists are 1-D. In the
        buffer the lists come first, laid out as one Python list and converted once, then each numpy array; the device
        views come from one split (a numpy array and a device slice per small piece cost more than the copy)."""
        a_ = self.align
        lists = [i for i, a in enumerate(arrays) if not isinstance(a, np.ndarray)]
        arrs = [i for i, a in enumerate(arrays) if isinstance(a, np.ndarray)]
        flat, spans = [], []
        for i in lists:
            a = arrays[i]
            pad = -len(a) % a_
            flat += a
            if pad:
                flat += _ZEROS[:pad]
            spans += (len(a), pad)
        at = len(flat)
        starts = []
        for i in arrs:
            n = arrays[i].size
            starts.append(at)
            spans += (n, -n % a_)
            at += n + spans[-1]
        host = self.reserve(at)
        host[:len(flat)] = flat
        for i, s in zip(arrs, starts):
            host[s:s + arrays[i].size] = arrays[i].reshape(-1)
        parts = self.send(at).split_with_sizes(spans)[::2]
        out = [None] * len(arrays)
        for i, p in zip(lists + arrs, parts):
            a = arrays[i]
            out[i] = p.view(a.shape) if isinstance(a, np.ndarray) and a.ndim != 1 else p
        return out


_ZEROS = [0] * 64  # alignment padding


@dataclass
class DeviceStep:
    """A tree step's device side (TreeStep.device). R trees, of which the plain ones (`batched`, host indices into
    the step's requests: the greedy ones, then the sampled ones) are verified in one batch; N = the most nodes of a
    tree."""
    launch: kernels.TreeAttentionLaunch
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

    @property
    def kernel_cold(self) -> int:
        return kernels.VARIANTS.cold

    def __init__(self, device, observers=(), faults=None, plain=None, max_rows: int = 6, block_size: int = 16,
                 max_blocks: int | None = None, top_k_top_p=None):
        """max_rows: the most rows of one tree (K + 1), block_size: the KV cache's page, max_blocks: the width of
        vLLM's block table: what fixes the kernel variants the engine launches (compiled at start-up). top_k_top_p:
        vLLM's `apply_top_k_top_p` (sampled trees with top-k / top-p draw from what it keeps)."""
        super().__init__(observers, faults)
        self.device = torch.device(device)
        self.top_k_top_p = top_k_top_p
        self.plain = plain or (lambda req_id: None)
        self._plan = StagingBuffer(self.device, torch.int64)  # the compiled plan's arrays, the int32 ones after
        self._long = StagingBuffer(self.device, torch.int64)  # the Python plan's and other uploads
        self._int = StagingBuffer(self.device, torch.int32)
        self._draft_int = StagingBuffer(self.device, torch.int32)
        self._rows = StagingBuffer(self.device, torch.int64)  # host-verified requests' committed tokens
        self.pending = None  # (step, BatchVerdict) until the drafter's next propose reads them
        self._draft_on_device = (None, None)
        self.heads = (0, 0, 0)  # query heads, kv heads, head size of the model's attention layers (this rank's)
        self.max_rows, self.block_size, self.max_blocks = max_rows, block_size, max_blocks
        self.block_q = None  # the engine's tile (kernels.tile_rows), fixed once the heads are known
        self.kernel_fallbacks = 0  # layers computed by the torch fallback after a failed launch
        self.block_nodes = tree_verify.block_nodes(max_rows)  # the verification kernel's tile (fixed per engine)
        # the rows' argmax and draws in one launch (kernels/row_draws.py) where the logits are on a GPU: Triton's
        # interpreter, which stands in for one on CPU, takes ~0.1 s a row over a 49k vocabulary (tests turn it on)
        self.draw_kernel = self.device.type == "cuda"
        self._layers = (None, None)  # (the caches' key, kv_compaction.layer_offsets of them): built at start-up
        self._views: dict[int, tuple] = {}  # id(a layer's cache) -> (the cache, its K view, its V view)
        self.compiled_plan, self._plan_checked = step_plan.compiled(), False  # `plan_ready`

    def attached(self, impls: list, dtype: torch.dtype) -> None:
        """The model's layers are built: their heads, and every kernel variant a step can launch compiled and checked
        on this device in the model's dtype (a kernel that cannot compile or computes wrong here fails start-up, not
        a request; nothing compiles while serving)."""
        shapes = {(impl.num_heads, impl.num_kv_heads, impl.head_size) for impl in impls}
        if len(shapes) != 1:  # one launch plan serves every layer of a forward
            raise ValueError(f"tree attention needs one head layout across the model's layers, got {sorted(shapes)}")
        self.heads, self.dtype = shapes.pop(), dtype
        self.block_q = kernels.tile_rows(self.max_rows, self.heads[0], self.heads[1])
        try:
            err = kernels.warm_up(self.device, dtype, *self.heads, block_size=self.block_size, max_rows=self.max_rows,
                                  max_blocks=self.max_blocks)
        except Exception as e:
            raise RuntimeError(f"the tree-attention kernel failed its start-up check on {self.device} "
                               f"({type(e).__name__}: {e})") from e
        if not err <= kernels.TOLERANCE[dtype]:
            raise RuntimeError(f"the tree-attention kernel is off by {err:.3g} on {self.device} in {dtype} at its "
                               f"start-up check (at most {kernels.TOLERANCE[dtype]} allowed)")
        self.plan_ready()

    def plan_ready(self) -> bool:
        """The host's compiled plan (trees/step_plan.py) compiled now, at start-up, so that nothing compiles while
        serving; where numba is missing or fails here, steps are planned by the Python reference (the same arrays).
        Whether plans run compiled."""
        if self.compiled_plan and not self._plan_checked:
            self._plan_checked = True
            try:
                step_plan.warm_up()
            except Exception as e:
                self.compiled_plan = False
                logging.getLogger("vllm_adaspec").warning(
                    "vllm_adaspec: the compiled tree-step plan failed at start-up (%s: %s); steps are planned in "
                    "Python", type(e).__name__, e)
        return self.compiled_plan

    def ready(self, kv_caches: list, block_table: torch.Tensor) -> None:
        """vLLM allocated the KV cache and the block table: the kernel's variants launched once more on the engine's
        own tensors (their page size, strides and alignment), still at start-up."""
        if not kv_caches:
            return
        k, v = kv_views(kv_caches[0])
        self.block_size = k.shape[1]
        kernels.warm_up(self.device, self.dtype, *self.heads, block_size=self.block_size, max_rows=self.max_rows,
                        k_cache=k, v_cache=v, block_table=block_table)
        self._warm_up_step_kernels(kv_caches)
        if self.faults.sync is not None:  # tensor parallelism: every rank draws with the kernel, or none does
            self.draw_kernel = not self.faults.sync([int(not self.draw_kernel)])[0]

    def _warm_up_step_kernels(self, kv_caches: list) -> None:
        """The verification and compaction kernels compiled at start-up on the engine's caches: a one-node tree
        verified into a scratch row, and a compaction that moves nothing (count 0) over every layer."""
        dev = self.device
        one = torch.zeros((1, 1), dtype=torch.long, device=dev)
        batch = TreeBatch(one, one, one + 1, one + 1,  # valid as a step stages it: int64
                          torch.ones((1, 2, 1), dtype=torch.long, device=dev) * 3, one)
        out = torch.full((1, self.max_rows), -1, dtype=torch.int32, device=dev)
        tree_verify.verify_trees(batch, torch.zeros((1, 2), dtype=torch.long, device=dev), out,
                                 torch.zeros(1, dtype=torch.long, device=dev), self.block_nodes)
        if self.draw_kernel:  # the logits as vLLM's sampler gets them (float32) and in the model's dtype
            self._warm_up_draws({torch.float32, self.dtype})
        offsets = self.layers_ready(kv_caches)
        if offsets is not None:
            zero = torch.zeros(1, dtype=torch.long, device=dev)
            kv_compaction.compact(kv_caches, offsets, torch.zeros(2, dtype=torch.long, device=dev), zero,
                                  torch.full_like(one, -1), zero, zero)

    def _warm_up_draws(self, dtypes) -> None:
        """The row-draw kernel compiled at start-up for each logits dtype and both row strides Triton tells apart (a
        multiple of 16 tokens or not: vLLM's logits rows are its padded vocabulary apart), and checked: a greedy row's
        argmax is torch's. Where it fails the rows' draws stay torch ops (a warning, not a failed start)."""
        dev = self.device
        try:
            for dtype, width in ((dtype, width) for dtype in dtypes for width in (1024, 1000)):
                logits = torch.randn(3, width, device=dev).to(dtype)
                rows = torch.tensor([[2, 0]], dtype=torch.long, device=dev)  # one tree's two logits rows
                temperature = torch.ones(1, dtype=torch.float32, device=dev)
                tree_rows = torch.zeros(1, dtype=torch.long, device=dev)  # the tree's batch row: temperature[0]
                for first_sampled in (0, 1):
                    argmax, _ = row_draws.row_draws(logits, rows, tree_rows, temperature, first_sampled)
                    if not torch.equal(argmax, logits.argmax(-1)[rows]):
                        raise RuntimeError(f"argmax of {dtype} logits differs from torch's")
        except Exception as e:
            logging.getLogger("vllm_adaspec").warning(
                "vllm_adaspec: the row-draw kernel failed its start-up check on %s (%s): the trees' draws are torch "
                "ops", dev, e)
            self.draw_kernel = False

    def layers_ready(self, kv_caches: list):
        """The compaction kernel's table of the layers' caches (a copy to the device: built at start-up, `ready`, and
        again only if vLLM's caches were to change), or None where the layers differ in layout."""
        key = (len(kv_caches), kv_caches[0].data_ptr(), kv_caches[-1].data_ptr())
        held, offsets = self._layers
        if held != key:
            offsets = kv_compaction.layer_offsets(kv_caches)
            self._layers = (key, offsets)
        return offsets

    # --- planning ---
    def prepare(self, step: TreeStep | None) -> TreeStep | None:
        if step is None:
            return None
        if self.compiled_plan:
            return self._prepare_compiled(step)
        return self.prepare_reference(step)

    def _prepare_compiled(self, step: TreeStep) -> TreeStep:
        """`prepare_reference`'s arrays from one compiled pass over the trees (trees/step_plan.py), written straight
        into the staging buffers: the host's Python is a few list joins and views."""
        reqs = step.requests
        parents, tokens, sizes, verified, starts, roots, rows, greedy, sampled = [], [], [], [], [], [], [], [], []
        for k, r in enumerate(reqs):
            tree = r.tree
            parents += tree.parent_list
            tokens += tree.token_list
            sizes.append(len(tree.parent_list))
            verified.append(r.num_verified)
            starts.append(r.start)
            roots.append(r.root_pos)
            rows.append(r.row)
            kind = self.plain(r.req_id)
            if kind == "greedy":
                greedy.append(k)
            elif kind == "sampled":
                sampled.append(k)
        batched = greedy + sampled
        width = max(sizes)
        words = max(1, -(-(width + 1) // 32))
        num_drafts = np.asarray(step.num_drafts, dtype=np.int64)
        n, r, rb, b = len(parents), len(reqs), len(batched), len(num_drafts)
        layout = step_plan.plan_layout(r, rb, b, int(num_drafts.sum()), n, width, words, ALIGN_BYTES)
        host = self._plan.reserve(layout[-1])
        nodes = np.array(parents + tokens, dtype=np.int64)  # (two conversions, not eight: views of them)
        per = np.array(sizes + verified + starts + roots + rows + batched, dtype=np.int64)
        long_lens, _, num = step_plan.plan_arrays(
            nodes[:n], nodes[n:], per[:r], per[r:2 * r], per[2 * r:3 * r], per[3 * r:4 * r], per[4 * r:5 * r],
            per[5 * r:], num_drafts, width, words, host, layout)
        self._plan.send_prefix(layout[-1])
        ints, longs, trees = self._plan_views(layout, r, rb, b, int(long_lens[7]), n, width, words)
        longest = max(root + n + 1 for root, n in zip(roots, sizes))
        return self._device_step(step, ints, longs, trees, width, batched, len(greedy), longest, num.tolist())

    def _plan_views(self, layout: tuple, r: int, rb: int, b: int, d: int, n: int, width: int, words: int) -> tuple:
        """The compiled plan's arrays on the device, shaped, where `layout` put them in the staging buffer: (the
        int32 arrays, the int64 arrays before the padded trees, the padded trees or None). Views are kept by the
        arrays' place and shape in groups of one size (the trees' count, the batch's, the nodes', ...), so that a
        group seen before costs one lookup, not a torch call an array: each costs the host a few us a step, more
        when cold, as it is once a step (batch 8's steps seldom repeat every size, but each group's often)."""
        key, int_at, _, long_at, _, _ = layout
        buf = self._plan
        t = buf.turn
        views = buf.views[t]
        if len(views) > 1024:  # (a bound; an engine meets a few hundred groups)
            views.clear()
        dev, dev32 = buf.dev[t], buf.dev32[t]
        la, ia = long_at, int_at  # (read only for a group not seen before)

        def at(x, o, *shape):  # [shape] at element o of x, contiguous
            stride = [1] * len(shape)
            for k in range(len(shape) - 2, -1, -1):
                stride[k] = stride[k + 1] * shape[k + 1]
            return x.as_strided(shape, stride, int(o))

        g_r = views.get(("r", key, r, rb))
        if g_r is None:  # cu; roots, rows, seq (int32); rows, starts, sizes, batched, firsts, batched_rows
            g_r = views[("r", key, r, rb)] = (
                at(dev32, ia[1], r + 1), at(dev32, ia[2], r), at(dev32, ia[3], r), at(dev32, ia[5], r),
                at(dev, la[2], r), at(dev, la[3], r), at(dev, la[4], r), at(dev, la[5], rb), at(dev, la[10], r),
                at(dev, la[11], rb))
        g_b = views.get(("b", key, b))
        if g_b is None:  # cu_draft, cu_sampled
            g_b = views[("b", key, b)] = (at(dev, la[8], b), at(dev, la[9], b))
        g_t = views.get(("t", key, n + r, words))
        if g_t is None:  # q_rows, bits (int32)
            g_t = views[("t", key, n + r, words)] = (at(dev32, ia[0], n + r), at(dev32, ia[4], n + r, words))
        g_n = views.get(("n", key, n))
        if g_n is None:  # node_rows, node_pos
            g_n = views[("n", key, n)] = (at(dev, la[0], n), at(dev, la[1], n))
        g_d = views.get(("d", key, d))
        if g_d is None:  # keep
            g_d = views[("d", key, d)] = at(dev, la[7], d)
        g_w = views.get(("w", key, rb, width, words))
        if g_w is None:  # logit_rows, the padded trees
            trees = None
            if rb:
                trees = TreeBatch(*(at(dev, la[p], rb, width) for p in (12, 13, 14, 15)),
                                  at(dev, la[17], rb, width + 1, words), at(dev, la[16], rb, width))
            g_w = views[("w", key, rb, width, words)] = (at(dev, la[6], rb, width + 1), trees)
        cu, roots, rows32, seq, rows, starts, sizes, batched, firsts, batched_rows = g_r
        ints = [g_t[0], cu, roots, rows32, g_t[1], seq]
        longs = [g_n[0], g_n[1], rows, starts, sizes, batched, g_w[0], g_d, g_b[0], g_b[1], firsts, batched_rows]
        return ints, longs, g_w[1]

    def prepare_reference(self, step: TreeStep) -> TreeStep:
        """The step's device arrays built per tree in Python: the definition `_prepare_compiled` must equal (its
        tests), and the plan where numba is missing."""
        reqs = step.requests
        sizes = [len(r.tree) for r in reqs]
        width = max(sizes)
        words = max(1, -(-(width + 1) // 32))
        rows = [r.row for r in reqs]
        # one pass over the trees (host lists; an array each at the end): every tree row in the forward, the nodes'
        # rows and positions (root + depth), each row's ancestor bits (its parent's plus its own)
        q_rows, node_rows, node_pos, anc = [], [], [], []
        for r, n in zip(reqs, sizes):
            s, root = r.start, r.root_pos
            q_rows.extend(range(s, s + n + 1))
            node_rows.extend(range(s + 1, s + n + 1))
            node_pos.extend([root + d for d in r.tree.depth_list])
            anc += ancestor_rows(r.tree.parent_list)
        cu = [0]
        for n in sizes:
            cu.append(cu[-1] + n + 1)
        words64 = split_words(anc, words)  # [T, W] int64 in 0 .. 2^32 - 1
        # plain trees, greedy then sampled: verified together; where their rows' logits are (per batch row: drafts + 1)
        kinds = [self.plain(r.req_id) for r in reqs]
        greedy = [k for k, kind in enumerate(kinds) if kind == "greedy"]
        batched = greedy + [k for k, kind in enumerate(kinds) if kind == "sampled"]
        num_drafts = step.num_drafts
        logit_start = [0]  # each batch row's first logits row (its drafts, then its bonus row)
        for n in num_drafts.tolist():
            logit_start.append(logit_start[-1] + n + 1)
        logit_rows = []  # [Rb * (N + 1)]: a tree's rows, then its last row again as padding
        for k in batched:
            s, n = logit_start[rows[k]], sizes[k]
            logit_rows += range(s, s + n)
            logit_rows += [s + n] * (width + 1 - n)
        keep, num, cu_draft, cu_sampled = chain_indices(num_drafts, rows)
        firsts = [logit_start[i] - i for i in rows]  # their roots' draft rows (drafts before them)
        longs = [node_rows, node_pos, rows, [r.start for r in reqs], sizes, batched, logit_rows, keep, cu_draft,
                 cu_sampled, firsts, [rows[k] for k in batched]]
        shapes = [None] * len(longs)
        shapes[6] = (len(batched), width + 1)
        if batched:
            longs += _padded_trees([reqs[k].tree for k in batched], [reqs[k].num_verified for k in batched],
                                   [words64[cu[k]:cu[k + 1]] for k in batched], width)
            shapes += [(len(batched), width)] * 4 + [(len(batched), width + 1, words), (len(batched), width)]
        dev = self._long.upload([a if shape is None else np.asarray(a, dtype=np.int64).reshape(shape)
                                 for a, shape in zip(longs, shapes)])
        ints = self._int.upload([q_rows, cu, [r.root_pos for r in reqs], rows, int32_words(words64),
                                 [n + 1 for n in sizes]])
        longest = max(r.root_pos + n + 1 for r, n in zip(reqs, sizes))
        trees = TreeBatch(*dev[12:]) if batched else None
        return self._device_step(step, ints, dev[:12], trees, width, batched, len(greedy), longest, num)

    def _device_step(self, step: TreeStep, ints: list, longs: list, trees: TreeBatch | None, width: int,
                     batched: list[int], greedy: int, longest: int, num: list[int]) -> TreeStep:
        """step.device from the staged arrays (their device views, shaped, in trees/step_plan.py's order: the int32
        ones, the int64 ones before the padded trees, the trees) and the kernel's launch plan."""
        d_q_rows, d_cu, d_roots, d_bt_rows, d_bits, d_seq = ints
        (d_node_rows, d_node_pos, d_rows, d_starts, d_sizes, d_batched, d_logit_rows, d_keep, d_cu_draft,
         d_cu_sampled, d_firsts, d_batched_rows) = longs
        hq, hkv, d = self.heads
        plan = kernels.plan_launch(d_roots, d_cu, d_bits, d_q_rows, d_bt_rows, hq, hkv, d,
                                   max_rows=width + 1, longest=longest, tree_lens=d_seq, block_q=self.block_q,
                                   scratch="tree verification")  # (one verification plan a step)
        step.device = DeviceStep(plan, d_node_rows, d_node_pos, d_rows, d_seq, d_starts, d_sizes, width, batched,
                                 greedy, d_batched, d_batched_rows, d_logit_rows, trees,
                                 (d_keep, d_cu_draft, d_cu_sampled, d_rows, d_firsts, num))
        return step

    def write_step(self, step: TreeStep, positions: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """The nodes' positions (root + depth) and the trees' cut seq_lens into vLLM's buffers (rows unique: one
        index_copy_ each, without item assignment's Python indexing; 3.6 -> 2.9 us a write on this CPU)."""
        dev = step.device
        positions.index_copy_(0, dev.node_rows, dev.node_positions.to(positions.dtype))
        seq_lens.index_copy_(0, dev.seq_rows, dev.seq_lens.to(seq_lens.dtype))

    def write_rows(self, tokens: torch.Tensor, rows: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        at = sorted(rows)
        host = np.full((len(at), tokens.shape[1]), -1, dtype=np.int64)
        for j, i in enumerate(at):
            host[j, :len(rows[i])] = rows[i]
        d_at, d_rows = self._rows.upload([np.array(at, dtype=np.int64), host])
        tokens[d_at] = d_rows.to(tokens.dtype)
        return {i: tokens[i] for i in at}

    def staged_chains(self, step: TreeStep):
        return step.device.chains

    def held_copy_tokens(self) -> int:
        return 0  # no copies: the kernel reads the paged cache

    # --- attention (TreeRuntime.attend dispatches) ---
    def verify_layer(self, step: TreeStep, isa, scale: float, query, key, value, kv_cache, block_table,
                     output) -> None:
        step.kv_caches.append(kv_cache)
        self._launch(step.device.launch, query, kv_cache, block_table, scale, output)

    def _launch(self, plan, query, kv_cache, block_table, scale: float, output) -> None:
        """One layer's tree rows by the kernel; a launch that fails is contained: the layer's rows are computed by the
        torch fallback (the same attention; it waits for the device), and the fault is counted."""
        k, v = self._kv_views(kv_cache)
        try:
            self.faults.point("tree_kernel")
            kernels.launch(plan, query, k, v, block_table, scale, output)
        except Exception as e:
            self.faults.record("launching the tree-attention kernel (this layer's tree rows computed in torch)", e)
            self.kernel_fallbacks += 1
            kernels.launch_reference(plan, query, k, v, block_table, scale, output)

    def _kv_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K, V views of a layer's cache, made once per cache: vLLM keeps each layer's cache tensor for the
        engine's life, and making the two views (a transpose and a split) was half of a layer's launch on the host
        (~4 of 8 us here, every layer of every tree step). Held by the tensor's identity, the tensor with them (an
        id is not reused while it lives)."""
        held = self._views.get(id(kv_cache))
        if held is None or held[0] is not kv_cache:
            if len(self._views) >= MAX_HELD_VIEWS:  # (engines have one cache a layer; tests make many)
                self._views.clear()
            held = self._views[id(kv_cache)] = (kv_cache, *kv_views(kv_cache))
        return held[1], held[2]

    def on_device(self, draft):
        """A draft step of tree drafting as a kernel launch plan (its rows, the trees' prefixes and the nodes run so
        far, each row's ancestors-or-self as bits), staged to the device in one copy, once per draft step: the
        kernel reads the paged cache in place (no gathered prefix K/V: no memory vLLM's profile did not see)."""
        held, moved = self._draft_on_device
        if held is draft:
            return moved
        pre = draft.prefix
        valid = draft.valid.cpu().numpy()
        rows = draft.rows.cpu().numpy()
        counts = valid.sum(1)
        lens = draft.tree_lens.numpy().astype(np.int64)
        p = draft.visible.shape[2] - draft.node_pos.shape[1]  # prefix columns of the mask
        n = max(1, int(lens.max()))
        vis = draft.visible[:, :, p:p + n]  # [R, M, n]: each row's tree keys
        bits = int32_words(pack_words(vis[draft.valid]).numpy())  # [rows, W]
        words = bits.shape[1]
        q_rows = rows[valid]
        cu = np.concatenate([[0], np.cumsum(counts)])
        prefix_lens = draft.roots.numpy().astype(np.int64) + 1
        blocks = pre.block_rows.numpy() if pre.block_rows.device.type == "cpu" else None
        arrays = [q_rows, cu, prefix_lens, lens, bits, draft.trees.numpy()]
        if blocks is not None:  # the prefix outlives the step: its block rows go to the device once
            arrays.append(blocks)
        staged = self._draft_int.upload([np.ascontiguousarray(a).astype(np.int32) for a in arrays])
        d_q_rows, d_cu, d_plen, d_tlen, d_bits, d_trees = staged[:6]
        if blocks is not None:
            pre.block_rows = staged[6].clone()  # (a device copy: the staging buffer is reused next step)
        hq, hkv, d = self.heads
        plan = kernels.plan_launch(d_plen, d_cu, d_bits.view(len(q_rows), words), d_q_rows, d_trees, hq, hkv, d,
                                   max_rows=int(counts.max()), longest=int((prefix_lens + lens).max()),
                                   tree_lens=d_tlen, block_q=self.block_q)
        moved = (plan, pre.block_rows)
        self._draft_on_device = (draft, moved)
        return moved

    def _attend_draft(self, draft, isa: str, scale: float, query, kv_cache, output) -> None:
        plan, block_rows = draft  # (on_device's)
        self._launch(plan, query, kv_cache, block_rows, scale, output)

    # --- verification (the tree sampler) ---
    def batched(self, step: TreeStep) -> list[int]:
        return step.device.batched

    def verify_batched(self, step: TreeStep, logits: torch.Tensor, tokens: torch.Tensor,
                       sampling_metadata) -> BatchVerdict:
        """The plain trees' verdict; their committed tokens (accepted nodes, then the bonus) go into vLLM's sampled
        tokens tokens [B, width] (-1 padded) on the device. Greedy trees walk their rows' argmax; sampled trees walk
        one draw at each of their rows from vLLM's distribution there (temperature, then top-k / top-p with vLLM's own
        op on its per-row tensors): the argmax and draws from one launch (kernels/row_draws.py; without top-k /
        top-p), then one launch of the verification kernel for all of them (kernels/tree_verify.py); the torch ops
        where a launch fails."""
        dev = step.device
        g = dev.greedy
        sm = sampling_metadata
        argmax, key = None, None
        if self.draw_kernel and (g == len(dev.batched) or (sm.top_k is None and sm.top_p is None)):
            # the launch's key drawn before the launch, so that the default generator advances alike whether the
            # kernel or its fallback draws (tensor-parallel ranks keep one random stream: a fault on one rank alone)
            key = row_draws.new_seed(logits.device) if g < len(dev.batched) else None
            try:
                self.faults.point("draw_kernel")
                argmax, draws = row_draws.row_draws(logits, dev.logit_rows, dev.batched_rows,
                                                    None if g == len(dev.batched) else sm.temperature, g, seed=key)
            except Exception as e:
                self.faults.record("launching the row-draw kernel (the rows' argmax and draws by torch ops)", e)
                self.kernel_fallbacks += 1
                argmax = None
        if argmax is None:
            argmax = logits.argmax(dim=-1)[dev.logit_rows]  # [Rb, N + 1] (the sampled trees' read-only rows too)
            generator = None
            if key is not None:  # the fallback of a launch: its draws from the launch's key (a read of the device)
                generator = torch.Generator(logits.device)
                generator.manual_seed(int(key) & ((1 << 63) - 1))
            draws = (argmax if g == len(dev.batched)
                     else torch.cat([argmax[:g], self._draws(dev, logits, sm, generator)]))
        try:
            self.faults.point("verify_kernel")
            path, count, bonus = tree_verify.verify_trees(dev.trees, draws, tokens, dev.batched_rows,
                                                          self.block_nodes)
        except Exception as e:
            self.faults.record("launching the tree-verification kernel (the trees verified by torch ops)", e)
            self.kernel_fallbacks += 1
            path, count, bonus = tree_verify.verify_trees_reference(dev.trees, draws, tokens, dev.batched_rows)
        return BatchVerdict(path, count, bonus, argmax)

    def _draws(self, dev: DeviceStep, logits: torch.Tensor, sm, generator: torch.Generator | None = None) -> torch.Tensor:
        """[Rs, N + 1]: one draw from vLLM's processed distribution at every row of the sampled trees (from
        `generator`, default the device's default generator)."""
        g = dev.greedy
        rows = dev.batched_rows[g:]
        logit_rows = dev.logit_rows[g:]
        per_row = logit_rows.shape[1]
        temperature = sm.temperature[rows].to(torch.float32).repeat_interleave(per_row)[:, None]
        x = logits[logit_rows.flatten()].to(torch.float32).div_(temperature)  # [Rs * (N + 1), V], a new tensor
        if sm.top_k is not None or sm.top_p is not None:
            if self.top_k_top_p is None:
                raise RuntimeError("sampled trees with top-k / top-p need vLLM's apply_top_k_top_p (top_k_top_p)")
            x = self.top_k_top_p(x, None if sm.top_k is None else sm.top_k[rows].repeat_interleave(per_row),
                                 None if sm.top_p is None else sm.top_p[rows].repeat_interleave(per_row))
        return draw_rows(x, generator).view(len(rows), per_row)

    def fail_step(self, step: TreeStep, first_tokens: torch.Tensor) -> None:
        self.pending = None
        super().fail_step(step, first_tokens)

    def finish_step(self, step: TreeStep, results: dict[int, tuple], verdict: BatchVerdict | None = None) -> None:
        """Compaction on the device: the batched trees' paths stay there; the others' (verified one by one, on the
        host) are copied in."""
        dev = step.device
        r_count = len(step.requests)
        host = [k for k, r in enumerate(step.requests) if r.row in results]
        trees = None  # path row j: the tree of request j
        if verdict is not None and not host and len(dev.batched) == r_count:
            # every tree verified in the batch (the usual step): the verdict's own tensors in its order (greedy trees
            # first), no scatter into the step's (four device ops fewer)
            path, count, trees = verdict.path, verdict.count, dev.batched_index
        else:
            path = torch.full((r_count, dev.width), -1, dtype=torch.long, device=self.device)
            count = torch.zeros(r_count, dtype=torch.long, device=self.device)
            if verdict is not None:
                path[dev.batched_index] = verdict.path
                count[dev.batched_index] = verdict.count
            if host:  # their paths, staged (pinned, no wait for the device)
                hp = np.full((len(host), dev.width), -1, dtype=np.int64)
                for j, k in enumerate(host):
                    nodes = results[step.requests[k].row][0]
                    hp[j, :len(nodes)] = nodes
                at, d_hp, d_count = self._long.upload([np.array(host, dtype=np.int64), hp, (hp >= 0).sum(1)])
                path[at] = d_hp
                count[at] = d_count
        self._compact(step, path, count, trees)
        self.faults.point("compaction")
        self.results, self.kv_moves = dict(results), sum(_moves(p) for p, *_ in results.values())
        self.pending = (step, verdict) if verdict is not None else None

    def _compact(self, step: TreeStep, path: torch.Tensor, count: torch.Tensor, trees=None) -> None:
        """Every layer's accepted K / V moved into place: one launch of the compaction kernel (kernels/kv_compaction.py)
        where the layers share a layout, else (or where the launch fails) one gather and scatter per layer. trees:
        each path row's request (default: row j is request j)."""
        dev = step.device
        offsets = self.layers_ready(step.kv_caches) if step.kv_caches else None
        if offsets is not None:
            try:
                self.faults.point("compaction_kernel")
                kv_compaction.compact(step.kv_caches, offsets, step.slot_mapping, dev.starts, path, count, trees)
                return
            except Exception as e:
                self.faults.record("launching the KV compaction kernel (the moves made layer by layer)", e)
                self.kernel_fallbacks += 1
        starts, sizes = (dev.starts, dev.sizes) if trees is None else (dev.starts[trees], dev.sizes[trees])
        src, dst = compaction_moves(starts, sizes, path, count)
        move_slots(step.kv_caches, step.slot_mapping[src], step.slot_mapping[dst])

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


def tree_kernel_shape(vllm_config) -> dict:
    """What fixes the tree kernel's compiled variants before the KV cache exists: the largest tree (K + 1 rows),
    the page size and the block table's width as vLLM will likely make them (GPUTreeRuntime.ready launches them again
    on the real ones)."""
    k = vllm_config.speculative_config.num_speculative_tokens
    block_size = vllm_config.cache_config.block_size or 16
    return {"max_rows": k + 1, "block_size": block_size,
            "max_blocks": -(-vllm_config.model_config.max_model_len // block_size)}


def _moves(path: list[int]) -> int:
    """KV slots a path's compaction moves (nodes not already at root + depth)."""
    return sum(1 for d, node in enumerate(path, start=1) if node + 1 != d)
