"""Token-tree verification inside vLLM's V1 runner: depth positions, tree-mask attention, tree sampling, KV
compaction. The tree algorithms live in `vllm_adaspec.trees`; this module is the glue, installed by
engine/worker.py when the `adaspec` config has a `tree` section.

A tree request hands vLLM its n nodes as ordinary draft tokens (breadth-first), so the scheduler allocates
n + 1 contiguous slots (root + nodes) and verifies n + 1 rows. Per step:

1. `plan_step` (after the runner's `_prepare_inputs`): for each request whose scheduled drafts are the tree the
   drafter proposed, rewrite its node rows' positions to root + depth (RoPE at depth; slots stay contiguous,
   they were computed before) and publish the step's tree plan.
2. inside CPU attention (every layer, exit layers included): vLLM's kernel skips most of a tree request's work
   (its seq_len is cut to its rows: `shrink_tree_seq_lens`), and the rows of each tree request are computed in one
   SDPA call (`verify_attention`): the prefix fully visible (a contiguous copy of the request's KV that each step
   extends: `sequence_kv`) and, among the rows, only ancestors-or-self (their keys and values straight from the
   layer's inputs).
3. `TreeRejectionSampler` (the runner's rejection sampler, wrapped): vLLM's output stands for chain requests;
   tree requests are verified node by node against their parent's row (trees/verify.py: greedy, or lossless
   sample-and-match), and get the accepted path + the bonus token from the last accepted node's row.
4. `compact_kv_cpu`: the accepted nodes' KV moves to the slots root + 1 .. root + a in every attention layer,
   so the next step sees a plain sequence. vLLM's own rollback (num_computed_tokens -= rejected) is then right.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from vllm_adaspec.trees import DraftTree, ancestor_mask, verify_greedy, verify_sample_match, verify_typical
from vllm_adaspec.trees.tree import is_chain


@dataclass
class TreeRequest:
    row: int  # batch row (input_batch order)
    req_id: str
    start: int  # flattened index of the root's row; nodes follow at start + 1 + i
    root_pos: int
    tree: DraftTree
    mask: torch.Tensor  # [n + 1, n + 1] bool ancestor-or-self over verification rows
    visible: torch.Tensor | None = None  # [1, 1, n + 1, root + n + 1] bool, built by the first layer
    branch_rows: int = 0  # the last nodes are draft-branch rows (pools/branches.py): read, not verified

    @property
    def num_verified(self) -> int:
        return len(self.tree) - self.branch_rows


@dataclass
class TreeStep:
    num_tokens: int  # flattened tokens of the target forward (what attention metadata must show)
    requests: list[TreeRequest]
    slot_mapping: torch.Tensor | None = None  # the forward's slots, seen by attention (for compaction)
    kv_caches: list = field(default_factory=list)  # (cache, isa) of every attention layer in the forward


_STEP: TreeStep | None = None


@dataclass
class DraftPrefix:
    """The prefixes (through the root) of the trees of one propose call. They do not change while the trees are
    drafted, so their K, V are gathered once per attention layer and reused by every depth."""
    block_rows: torch.Tensor  # [T, max_blocks] each tree's block row
    positions: torch.Tensor  # [T, P] key positions 0..root (padding: position 0, masked off)
    kv: dict = field(default_factory=dict)  # cache address -> (K, V) [T, P, H, D]


@dataclass
class DraftMask:
    """A draft step of tree drafting over R of the call's trees: row m of tree r is the flattened row rows[r, m]
    (valid[r, m]); its keys are the tree's prefix (P columns) then its node slots root + 1 .. (node_pos), and it
    sees key c iff visible[r, m, c] (the prefix, the root and its own ancestors-or-self among drafted nodes)."""
    num_tokens: int
    prefix: DraftPrefix
    trees: torch.Tensor  # [R] index into prefix's trees
    rows: torch.Tensor  # [R, M] (padding repeats the tree's first row)
    valid: torch.Tensor  # [R, M] bool
    node_pos: torch.Tensor  # [R, N] slot positions of the tree's drafted nodes (padding: the root, masked off)
    visible: torch.Tensor  # [R, M, P + N] bool


_DRAFT: DraftMask | None = None


@contextlib.contextmanager
def draft_mask(mask: DraftMask | None):
    """Active while the drafter runs one step over tree nodes (engine/drafting.py)."""
    global _DRAFT
    _DRAFT = mask
    try:
        yield
    finally:
        _DRAFT = None


def active_step() -> TreeStep | None:
    return _STEP


def set_step(step: TreeStep | None) -> None:
    global _STEP
    _STEP = step


def tree_compatible(sp) -> bool:
    """Trees are verified from raw logits with temperature / top-k / top-p only. Anything vLLM's sampler applies
    on top (penalties, logits processors, grammars, logprobs) is chain-only: such requests draft chains."""
    if sp is None:
        return False
    return (sp.presence_penalty == 0 and sp.frequency_penalty == 0 and sp.repetition_penalty == 1
            and sp.min_p == 0 and sp.min_tokens == 0 and sp.logprobs is None and sp.prompt_logprobs is None
            and not sp.logit_bias and not sp.allowed_token_ids and not sp.bad_words
            and sp.structured_outputs is None and not getattr(sp, "watermarking", None)
            and getattr(sp, "thinking_token_budget", None) is None and not getattr(sp, "logprob_token_ids", None))


def plan_step(req_ids: list[str], query_start: np.ndarray, positions: torch.Tensor, spec_tokens: dict,
              pending: dict[str, tuple], num_tokens: int) -> TreeStep | None:
    """Match the scheduled drafts against the proposed trees and write depth positions in place.

    req_ids: batch order; query_start [num_reqs + 1] flattened row starts; positions [num_tokens] (rewritten);
    spec_tokens: the scheduler's req_id -> scheduled draft ids; pending: req_id -> (tokens, parents) proposed, or
    (tokens, parents, verified) where only the first `verified` nodes are verified and the rest are draft-branch
    rows (pools/branches.py). A tree whose drafts the scheduler trimmed keeps its first nodes (breadth-first order
    keeps it a tree; branch rows come last, so they go first).
    """
    requests = []
    for row, req_id in enumerate(req_ids):
        spec = spec_tokens.get(req_id)
        proposed = pending.get(req_id)
        if not spec or proposed is None:
            continue
        tokens, parents = proposed[0], proposed[1]
        n = len(spec)
        verified = min(proposed[2], n) if len(proposed) > 2 else n
        if list(spec) != tokens[:n] or (verified == n and is_chain(parents[:n])):
            continue
        tree = DraftTree(torch.tensor(tokens[:n]), torch.tensor(parents[:n]))
        start = int(query_start[row])
        root_pos = int(positions[start])
        positions[start + 1:start + 1 + n] = root_pos + tree.depths.to(positions.dtype)
        requests.append(TreeRequest(row, req_id, start, root_pos, tree, ancestor_mask(tree), branch_rows=n - verified))
    return TreeStep(num_tokens, requests) if requests else None


# --- draft-branch slots: a debug check that no committed position is ever read from a branch row's KV ---------

# req_id -> sequence positions whose KV was last written by a draft-branch row (VLLM_ADASPEC_CHECK_BRANCH_SLOTS=1)
_BRANCH_DIRTY: dict[str, set[int]] = {}
BRANCH_SLOT_CHECKS = {"checked": 0, "violations": 0}


def check_branch_slots(req_ids: list[str], query_start: np.ndarray, positions: torch.Tensor,
                       step: TreeStep | None) -> None:
    """Before a forward (every scheduled request, tree or not): a position a branch row wrote must not be part of
    the request's committed prefix (positions below its first row, which this forward reads as final). Then: this
    forward's rows overwrite their positions, and its branch rows leave theirs dirty. Compaction only ever moves
    verified nodes to root + 1 .. root + accepted, below every branch position (branch rows come after the nodes)."""
    branch_rows = {r.req_id: r for r in step.requests if r.branch_rows} if step is not None else {}
    for row, req_id in enumerate(req_ids):
        start, end = int(query_start[row]), int(query_start[row + 1])
        if end <= start:
            continue
        root = int(positions[start])  # not rewritten by plan_step: the first row keeps its sequence position
        dirty = _BRANCH_DIRTY.get(req_id, set())
        BRANCH_SLOT_CHECKS["checked"] += 1
        BRANCH_SLOT_CHECKS["violations"] += sum(p < root for p in dirty)
        dirty = {p for p in dirty if p >= end - start + root}
        r = branch_rows.get(req_id)
        if r is not None:
            dirty |= set(range(root + 1 + r.num_verified, root + 1 + len(r.tree)))
        if dirty:
            _BRANCH_DIRTY[req_id] = dirty
        else:
            _BRANCH_DIRTY.pop(req_id, None)


def forget_branch_slots(req_ids) -> None:
    for r in req_ids:
        _BRANCH_DIRTY.pop(r, None)


def live_branch_slots() -> int:
    return len(_BRANCH_DIRTY)


def drop_requests(req_ids) -> None:
    """Finished or aborted requests: their KV copies and branch-slot records go."""
    gone = set(req_ids)
    for key in [key for key in _SEQ_KV if key[0] in gone]:
        del _SEQ_KV[key]
    forget_branch_slots(gone)


def shrink_tree_seq_lens(step: TreeStep, seq_lens: torch.Tensor) -> None:
    """Cut each tree request's seq_len (the runner's buffer, read when the step's attention metadata is built) to
    its own rows: vLLM's kernel then attends only over those few keys, work verify_attention overwrites anyway,
    instead of the whole prefix. The KV cache writes go by slot mapping and are unaffected."""
    for r in step.requests:
        seq_lens[r.row] = len(r.tree) + 1


# --- attention -------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def cpu_kv_index(isa: str, block_size: int, head_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Where vLLM's CPU attention stores token t, dim d of a block, per ISA: (k_idx, v_idx), each [block_size, D],
    offsets into one (block, kv head) slab of 2 * block_size * D elements ("vec" stores K transposed, V row-major).
    Found by writing known values through vLLM's own `cpu_attn_reshape_and_cache`, three base-64 digits at a time
    so that every value is exact in bf16 too."""
    from vllm import _custom_ops as ops

    bs, d = block_size, head_size
    ids = torch.arange(bs * d).view(bs, 1, d)  # token t, dim d -> t * D + d
    found = [torch.zeros(2 * bs * d, dtype=torch.long) for _ in range(2)]
    for digit in range(3):
        cache = torch.zeros(1, 1, bs, 2 * d, dtype=dtype)
        kc, vc = cache.view(1, 1, 2 * bs, d).chunk(2, dim=2)
        x = ((ids // 64 ** digit) % 64 + 1).to(dtype)
        ops.cpu_attn_reshape_and_cache(x, -x, kc, vc, torch.arange(bs), isa, k_scale=1.0, v_scale=1.0,
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
    ops.cpu_attn_reshape_and_cache(one, -one, kc, vc, torch.arange(bs), isa, k_scale=1.0, v_scale=1.0,
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
                  isa: str, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions start..length-1 from vLLM's CPU paged cache [num_blocks, kv_heads, block_size,
    2 * D] (layout per `isa`, see cpu_kv_index); block_row [max_blocks] of the request. K, V [length - start, H, D]."""
    bs = cache.shape[2]
    pos = torch.arange(start, length)
    return gather_cpu_kv_at(cache, block_row[pos // bs].long(), pos % bs, isa)


def paged_index(block_rows: torch.Tensor, positions: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """block_rows [R, max_blocks], positions [R, S] -> (block id, offset inside the block), each [R, S]."""
    return torch.gather(block_rows, 1, positions // block_size).long(), positions % block_size


def gather_cpu_kv_at(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                     isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [*shape, H, D] of the tokens at (blocks, offsets) [*shape] (block id, position inside the block)."""
    _, _, bs, d2 = cache.shape
    k_idx, v_idx = cpu_kv_index(isa, bs, d2 // 2, cache.dtype)
    slabs = _slab_view(cache)
    b = blocks.unsqueeze(-1)  # [*shape, 1]
    k = slabs[b, k_idx[offsets]]  # [*shape, D, H]
    v = slabs[b, v_idx[offsets]]
    return k.transpose(-1, -2), v.transpose(-1, -2)


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


@dataclass
class SequenceKV:
    """One tree request's K, V in one attention layer, contiguous: positions 0..final-1 are final (committed and
    compacted: never written again), so a step gathers from the paged cache only what came after them (nothing when
    the request's last step was a tree: `advance_copies` kept its accepted rows); the rows of the current forward
    (root + nodes) are written right after the prefix, as scratch."""
    k: torch.Tensor  # [capacity, H, D]
    v: torch.Tensor
    final: int = 0


# (request id, cache address) -> SequenceKV. Kept while the drafter keeps a request admitted to tree mode (chain
# steps in between only make the next tree step gather more); dropped when it leaves (finished, preempted, capped).
_SEQ_KV: dict[tuple[str, int], SequenceKV] = {}


def copy_capacity(length: int) -> int:
    """Positions a request's copy holds once it reaches `length`: room for a few steps, at most ~1.25x its KV."""
    return length + length // 4 + 64


def held_copy_tokens() -> int:
    """Positions held by all requests' copies, counted once per request (every layer holds the same)."""
    held: dict[str, int] = {}
    for (req_id, _), seq in _SEQ_KV.items():
        held[req_id] = max(held.get(req_id, 0), seq.k.shape[0])
    return sum(held.values())


def retain_sequence_kv(keep: set[str], stale: set[str] = frozenset()) -> None:
    """Keep the copies of requests in `keep` (the drafter's tree-mode requests), drop the others' and those in
    `stale` (resumed after preemption: their KV was recomputed)."""
    for key in [key for key in _SEQ_KV if key[0] not in keep or key[0] in stale]:
        del _SEQ_KV[key]


def sequence_kv(cache: torch.Tensor, block_row: torch.Tensor, req_id: str, root: int, rows: int,
                isa: str) -> SequenceKV:
    """The request's copy with positions 0..root-1 final and room for `rows` more (gathering from the paged cache
    only positions not yet copied)."""
    key = (req_id, cache.data_ptr())
    seq = _SEQ_KV.get(key)
    start = 0 if seq is None else min(seq.final, root)
    if seq is None or seq.k.shape[0] < root + rows:
        _, h, _, d2 = cache.shape
        cap = copy_capacity(root + rows)
        k = cache.new_empty((cap, h, d2 // 2))
        v = cache.new_empty((cap, h, d2 // 2))
        if seq is not None:
            k[:start], v[:start] = seq.k[:start], seq.v[:start]
        seq = _SEQ_KV[key] = SequenceKV(k, v)
    if start < root:
        seq.k[start:root], seq.v[start:root] = gather_cpu_kv(cache, block_row, root, isa, start=start)
    seq.final = root
    return seq


def verify_attention(step: TreeStep, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     output: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, isa: str,
                     scale: float) -> None:
    """The tree rows of one attention layer of a verification forward, written into `output` [T, Hq, D]: for each
    tree request, its rows' queries (query [T, Hq, D]) attend to the prefix (its contiguous copy) and to the rows'
    own keys and values of this forward (key, value [T, Hkv, D]) under the ancestor mask, in one SDPA call."""
    for r in step.requests:
        n1 = len(r.tree) + 1
        rows = slice(r.start, r.start + n1)
        seq = sequence_kv(cache, block_table[r.row], r.req_id, r.root_pos, n1, isa)
        end = r.root_pos + n1
        seq.k[r.root_pos:end], seq.v[r.root_pos:end] = key[rows], value[rows]
        if r.visible is None:  # [1, 1, n1, root + n1]: the whole prefix, then ancestors-or-self among the rows
            vis = torch.ones(n1, end, dtype=torch.bool)
            vis[:, r.root_pos:] = r.mask
            r.visible = vis[None, None]
        out = F.scaled_dot_product_attention(
            query[rows].transpose(0, 1)[None], seq.k[:end].transpose(0, 1)[None], seq.v[:end].transpose(0, 1)[None],
            attn_mask=r.visible, scale=scale, enable_gqa=query.shape[1] != key.shape[1])  # [1, Hq, n1, D]
        output[rows] = out[0].transpose(0, 1).to(output.dtype)


def install_cpu_attention_patch() -> None:
    """Wrap vLLM's CPU attention so tree rows get the tree mask (idempotent)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    original = CPUAttentionBackendImpl.forward
    if getattr(original, "_adaspec_tree", False):
        return

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        out = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        draft = _DRAFT
        if draft is not None and attn_metadata is not None and attn_metadata.num_actual_tokens == draft.num_tokens:
            bs, pre = kv_cache.shape[2], draft.prefix
            if kv_cache.data_ptr() not in pre.kv:
                pre.kv[kv_cache.data_ptr()] = gather_cpu_kv_at(
                    kv_cache, *paged_index(pre.block_rows, pre.positions, bs), layer.isa)
            pk, pv = pre.kv[kv_cache.data_ptr()]
            nk, nv = gather_cpu_kv_at(kv_cache, *paged_index(pre.block_rows[draft.trees], draft.node_pos, bs),
                                      layer.isa)
            k, v = torch.cat([pk[draft.trees], nk], dim=1), torch.cat([pv[draft.trees], nv], dim=1)
            new = masked_attention_batch(query[draft.rows], k, v, draft.visible, self.scale)
            output[draft.rows[draft.valid]] = new[draft.valid].to(output.dtype)
            return out
        step = _STEP
        if step is None or attn_metadata is None or attn_metadata.num_actual_tokens != step.num_tokens:
            return out  # not the target's verification forward (warm-up, profiling, draft steps)
        if step.slot_mapping is None:
            step.slot_mapping = attn_metadata.slot_mapping[:step.num_tokens].clone()
        step.kv_caches.append((kv_cache, layer.isa))
        verify_attention(step, query, key, value, output, kv_cache, attn_metadata.block_table, layer.isa, self.scale)
        return out

    forward._adaspec_tree = True  # type: ignore[attr-defined]
    CPUAttentionBackendImpl.forward = forward


# --- KV compaction -----------------------------------------------------------------------------------------

def compact_kv_cpu(caches: list[tuple[torch.Tensor, str]], src_slots: list[int], dst_slots: list[int]) -> None:
    """Copy each src slot's K and V to its dst slot in every (CPU cache, isa); all sources are read first."""
    if not src_slots:
        return
    src, dst = torch.tensor(src_slots), torch.tensor(dst_slots)
    where = {}  # (block size, D, dtype, isa) -> (source, destination) indices into a slab view, K and V at once
    for cache, isa in caches:
        _, _, bs, d2 = cache.shape
        shape = (bs, d2, cache.dtype, isa)
        if shape not in where:  # every layer of a model shares it: computed once per step
            k_idx, v_idx = cpu_kv_index(isa, bs, d2 // 2, cache.dtype)
            offsets = lambda slots: torch.cat([k_idx[slots % bs], v_idx[slots % bs]], dim=1)  # [M, 2D]
            where[shape] = (((src // bs)[:, None], offsets(src)), ((dst // bs)[:, None], offsets(dst)))
        (sb, so), (db, do) = where[shape]
        slabs = _slab_view(cache)
        slabs[db, do] = slabs[sb, so]  # advanced indexing reads every source before writing


def advance_copies(step: TreeStep, paths: dict[int, list[int]]) -> None:
    """After verification: in every tree request's contiguous copies, the accepted nodes' K, V move to root + 1 ..
    root + a, as compaction moves them in the paged cache, and root .. root + a become final. The next step of a
    request that stays a tree then gathers nothing from the paged cache (the copy already holds what it committed)."""
    for r in step.requests:
        path = paths.get(r.row, ())
        moves = [(r.root_pos + 1 + node, r.root_pos + d) for d, node in enumerate(path, start=1) if node + 1 != d]
        src = torch.tensor([a for a, _ in moves]) if moves else None
        dst = torch.tensor([b for _, b in moves]) if moves else None
        for cache, _ in step.kv_caches:
            seq = _SEQ_KV.get((r.req_id, cache.data_ptr()))
            if seq is None or seq.final != r.root_pos:
                continue
            if moves:
                seq.k[dst], seq.v[dst] = seq.k[src], seq.v[src]
            seq.final = r.root_pos + 1 + len(path)


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


# --- sampling ----------------------------------------------------------------------------------------------

def verify_tree_request(tree: DraftTree, logits: torch.Tensor, temperature: float, top_k: int | None,
                        top_p: float | None, generator: torch.Generator | None,
                        acceptance=None) -> tuple[list[int], int]:
    """logits [n + 1, V] at the request's verification rows -> (accepted nodes, bonus token).

    Sampling uses sample-and-match, not recursive rejection sampling: the drafters pick a node's children
    deterministically (top-k), and for a fixed set S of distinct children no lossless rule can move on with
    probability above p(S), which sample-and-match reaches. RRS (trees.verify_rrs) pays only for children drawn
    i.i.d. from the draft distribution."""
    if temperature <= 0:  # vLLM's greedy marker
        return verify_greedy(tree, logits.argmax(dim=-1))
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    x = logits.float() / temperature
    rows = x.shape[0]
    k = None if top_k is None else torch.full((rows,), top_k, dtype=torch.int32)
    p = None if top_p is None else torch.full((rows,), top_p, dtype=torch.float32)
    if k is not None or p is not None:
        x = apply_top_k_top_p(x, k, p)
    if acceptance is not None and acceptance.name == "typical":
        return verify_typical(tree, torch.softmax(x, dim=-1), acceptance.epsilon, acceptance.delta, generator)
    return verify_sample_match(tree, torch.softmax(x, dim=-1), generator)


class TreeRejectionSampler:
    """Stands in for the runner's rejection sampler: vLLM's for chain rows, tree verification for tree rows."""

    def __init__(self, stock, on_paths=None, on_logits=None, acceptance=None):
        self.stock = stock
        self.acceptance = acceptance  # config.Acceptance: "exact" (lossless) or "typical" (lossy, opt-in)
        # callback({row: (path, bonus, branch predictions)}, kv slot moves): statistics, and the argmax at each
        # draft-branch row for the drafter
        self.on_paths = on_paths
        self.on_logits = on_logits  # callback(logits [rows, V], metadata): every verified row, for drafters

    def __call__(self, metadata, draft_probs, logits, sampling_metadata):
        out = self._verify(metadata, draft_probs, logits, sampling_metadata)
        if self.on_logits is not None:
            self.on_logits(logits, metadata)
        return out

    def __getattr__(self, name):  # everything else (warm-up hooks, logprobs helpers) is vLLM's
        return getattr(self.stock, name)

    def _verify(self, metadata, draft_probs, logits, sampling_metadata):
        out = self.stock(metadata, draft_probs, logits, sampling_metadata)
        step = _STEP
        if step is None:
            return out
        set_step(None)
        tokens = out.sampled_token_ids  # [B, max_spec_len + 1] int32, -1 padded
        cu = metadata.cu_num_draft_tokens.tolist()
        target_idx, bonus_idx = metadata.target_logits_indices, metadata.bonus_logits_indices
        temps = sampling_metadata.temperature
        results, paths = {}, {}
        for r in step.requests:
            i = r.row
            first = cu[i - 1] if i else 0
            rows = torch.cat([target_idx[first:cu[i]], bonus_idx[i:i + 1]])
            t = 0.0 if sampling_metadata.all_greedy or temps is None else float(temps[i])
            k = None if sampling_metadata.top_k is None else int(sampling_metadata.top_k[i])
            p = None if sampling_metadata.top_p is None else float(sampling_metadata.top_p[i])
            m = r.num_verified  # the verified nodes; rows past them are draft branches, only read
            tree = r.tree if m == len(r.tree) else DraftTree(r.tree.tokens[:m], r.tree.parents[:m])
            path, bonus = verify_tree_request(tree, logits[rows[:m + 1]], t, k, p,
                                              sampling_metadata.generators.get(i), self.acceptance)
            predicted = logits[rows[m + 1:]].argmax(dim=-1).tolist() if m < len(r.tree) else []
            node_tokens = r.tree.tokens[path].tolist()
            tokens[i].fill_(-1)
            tokens[i, :len(path) + 1] = torch.tensor(node_tokens + [bonus], dtype=tokens.dtype)
            paths[i], results[i] = path, (path, bonus, predicted)
        src, dst = compaction_slots(step, paths)
        compact_kv_cpu(step.kv_caches, src, dst)
        advance_copies(step, paths)
        if self.on_paths is not None:
            self.on_paths(results, len(src))
        return out
