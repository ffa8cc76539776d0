"""Tree verification glue on synthetic tensors (no engine): paged CPU-layout gathers, tree-mask attention
against per-path causal attention, KV compaction, depth positions, the tree mask of tree drafting."""

import math

import numpy as np
import pytest
import torch

from vllm_adaspec.runtime.cpu_kv import compact_kv_cpu, gather_cpu_kv, gather_cpu_kv_at, paged_index
from vllm_adaspec.runtime.base import TreeRequest, TreeStep, plan_step
from vllm_adaspec.runtime.cpu import CPUTreeRuntime as TreeRuntime, masked_attention_batch
from vllm_adaspec.runtime.base import shrink_tree_seq_lens
from vllm_adaspec.engine.tree_sampler import (RowSampling, chain_indices, needs_own_sampler, row_histories, row_logits,
                                              tree_verifiable, verify_tree_request)
from vllm_adaspec.step import DraftPlan
from vllm_adaspec.trees import DraftTree, ancestor_mask, paths

BS, HKV, HQ, D = 32, 2, 6, 64


def write_op():
    """vLLM's CPU cache-write op: the runtime discovers vLLM's CPU KV layout with it (the worker hands it in)."""
    from vllm import _custom_ops as ops

    return ops.cpu_attn_reshape_and_cache


def _paged_cache(seq: int, g: torch.Generator, isa: str = "vec", bs: int = BS, d: int = D):
    """A CPU cache holding K/V for positions 0..seq-1 in shuffled blocks, written by vLLM's own CPU op (its
    ISA-specific layout). Returns cache, block row, K, V [seq, HKV, d]."""
    from vllm import _custom_ops as ops

    nblocks = seq // bs + 3
    cache = torch.zeros(nblocks, HKV, bs, 2 * d)
    block_row = torch.randperm(nblocks, generator=g)
    k = torch.randn(seq, HKV, d, generator=g)
    v = torch.randn(seq, HKV, d, generator=g)
    pos = torch.arange(seq)
    kc, vc = cache.view(nblocks, HKV, 2 * bs, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, block_row[pos // bs] * bs + pos % bs, isa, k_scale=1.0,
                                   v_scale=1.0, kv_cache_dtype="auto")
    return cache, block_row, k, v


def _causal(q, k, v, scale):  # q [Hq, D] one query over k, v [L, Hkv, D]
    kk = k.repeat_interleave(HQ // HKV, 1)
    vv = v.repeat_interleave(HQ // HKV, 1)
    w = torch.softmax(torch.einsum("hd,lhd->hl", q, kk) * scale, -1)
    return torch.einsum("hl,lhd->hd", w, vv)


@pytest.mark.parametrize("isa,bs,d", [("vec", 32, 64), ("vec", 128, 64), ("vec16", 16, 48)])
def test_gather_reads_the_paged_cpu_layout(isa, bs, d):
    g = torch.Generator().manual_seed(0)
    cache, row, k, v = _paged_cache(77, g, isa, bs, d)
    gk, gv = gather_cpu_kv(cache, row, 77, isa, write_op())
    assert torch.equal(gk, k) and torch.equal(gv, v)


@pytest.mark.parametrize("root_pos", [0, 5, 70, 600])
def test_tree_rows_equal_causal_attention_along_each_path(root_pos):
    """verify_attention for one request: its rows' keys and values come from the layer's inputs, the prefix from
    the paged cache; each row must equal causal attention over the prefix, the root and its own path (from 512
    prefix tokens on, the query heads folded into the rows: runtime/cpu.FOLD_FROM)."""
    g = torch.Generator().manual_seed(root_pos)
    tree = DraftTree(torch.arange(7), torch.tensor([-1, -1, 0, 0, 1, 2, 4]))
    n1 = len(tree) + 1
    cache, row, k, v = _paged_cache(root_pos + n1, g)
    q = torch.randn(n1, HQ, D, generator=g)
    req = TreeRequest(0, "r", 0, root_pos, tree)
    runtime = TreeRuntime(cache_write=write_op())
    output = torch.zeros(n1, HQ, D)
    runtime.verify_attention(TreeStep(n1, [req]), q, k[root_pos:], v[root_pos:], output, cache, row[None], "vec",
                             1 / math.sqrt(D))
    _check_tree_rows(output, q, req, k, v, scale=1 / math.sqrt(D))
    # A chain is plain causal attention.
    chain = DraftTree(torch.arange(3), torch.tensor([-1, 0, 1]))
    causal = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    assert torch.equal(ancestor_mask(chain), causal)


def _write(cache, block_row, positions, k, v):
    from vllm import _custom_ops as ops

    nblocks = cache.shape[0]
    kc, vc = cache.view(nblocks, HKV, 2 * BS, D).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, block_row[positions // BS] * BS + positions % BS, "vec",
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")


def _check_tree_rows(output, query, req, kk, vv, scale=0.125):
    """Every row of a tree request == causal attention over the prefix, the root and the node's own path."""
    rows_of = {-1: [req.root_pos]}
    for path in paths(req.tree):
        for i, node in enumerate(path):
            rows_of[node] = [req.root_pos] + [req.root_pos + 1 + p for p in path[:i + 1]]
    for node, rows in rows_of.items():
        keys = list(range(req.root_pos)) + rows
        want = _causal(query[req.start + 1 + node], kk[keys], vv[keys], scale)
        torch.testing.assert_close(output[req.start + 1 + node], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fold_from", [0, 10 ** 9])
def test_tree_rows_of_several_requests_over_consecutive_steps_equal_causal_attention_along_each_path(fold_from,
                                                                                                    monkeypatch):
    """What the CPU attention patch runs per layer (verify_attention): tree requests of different lengths and tree
    sizes packed between other rows; each request's prefix copied once and extended step by step (a second step
    must see what changed after the first, and must not re-read final positions), the rows' own keys and values
    taken from the layer's inputs; vLLM's seq_lens of tree requests cut to their rows. With the query heads folded
    into the rows and without (fold_from: runtime/cpu.FOLD_FROM)."""
    import vllm_adaspec.runtime.cpu as cpu_runtime

    monkeypatch.setattr(cpu_runtime, "FOLD_FROM", fold_from)
    g = torch.Generator().manual_seed(11)
    trees = [DraftTree(torch.arange(7), torch.tensor([-1, -1, 0, 0, 1, 2, 4])),
             DraftTree(torch.arange(2), torch.tensor([-1, -1])),
             DraftTree(torch.arange(4), torch.tensor([-1, 0, 0, 1]))]
    root_pos, batch_rows, starts = [70, 3, 33], [0, 2, 3], [0, 12, 15]  # row 1 is a chain request (rows 8..11)
    nblocks, width = 16, 4
    cache = torch.full((nblocks, HKV, BS, 2 * D), float("nan"))  # unwritten slots must never leak into results
    table = torch.randperm(nblocks, generator=g)[:width * 4].view(4, width)
    kv = []
    for b, (tree, rp) in enumerate(zip(trees, root_pos)):
        n = rp + len(tree) + 1
        k, v = torch.randn(n + 20, HKV, D, generator=g), torch.randn(n + 20, HKV, D, generator=g)
        _write(cache, table[batch_rows[b]], torch.arange(n), k[:n], v[:n])
        kv.append((k, v))
    runtime = TreeRuntime(cache_write=write_op())
    for step_no in range(2):
        reqs = [TreeRequest(row, f"req-{row}", start, rp, tree)
                for row, start, rp, tree in zip(batch_rows, starts, root_pos, trees)]
        step = TreeStep(20, reqs)
        runtime.retain({r.req_id for r in reqs})
        seq_lens = torch.full((4,), 500)
        shrink_tree_seq_lens(step, seq_lens)
        assert seq_lens.tolist() == [8, 500, 3, 5]
        query, key, value = (torch.randn(20, h, D, generator=g) for h in (HQ, HKV, HKV))
        for req, (kk, vv) in zip(reqs, kv):  # the layer's own keys and values of the tree rows
            n1 = len(req.tree) + 1
            key[req.start:req.start + n1], value[req.start:req.start + n1] = kk[req.root_pos:req.root_pos + n1], \
                vv[req.root_pos:req.root_pos + n1]
        output = torch.zeros_like(query)
        runtime.verify_attention(step, query, key, value, output, cache, table, "vec", 0.125)
        assert not output.isnan().any()
        for req, (kk, vv) in zip(reqs, kv):
            _check_tree_rows(output, query, req, kk, vv)
        assert output[8:12].abs().sum() == 0  # the chain request's rows are not touched
        assert {key[0] for key in runtime.copies} == {"req-0", "req-2", "req-3"}
        # Next step: each request accepted 2 tokens, so its root moves 3 on; the old nodes' slots and the new
        # ones get new K, V (verification rewrote them; the positions up to the old root stay as they were).
        for b in range(3):
            new_root = root_pos[b] + 3
            pos = torch.arange(root_pos[b] + 1, new_root + len(trees[b]) + 1)
            kk, vv = kv[b]
            kk[pos], vv[pos] = torch.randn(len(pos), HKV, D, generator=g), torch.randn(len(pos), HKV, D, generator=g)
            _write(cache, table[batch_rows[b]], pos, kk[pos], vv[pos])
            if step_no == 0:  # position 0 is final: the next step must not read it from the paged cache again
                _write(cache, table[batch_rows[b]], torch.tensor([0]), torch.full((1, HKV, D), float("nan")),
                       torch.full((1, HKV, D), float("nan")))
        root_pos = [r + 3 for r in root_pos]
    runtime.retain({"req-0"}, stale={"req-0"})  # resumed after preemption: its copy is dropped too
    assert not runtime.copies


def test_compaction_moves_accepted_nodes_to_consecutive_slots():
    g = torch.Generator().manual_seed(1)
    cache, row, k, v = _paged_cache(100, g)
    before = cache.clone()
    # Root at position 40 with slots = positions (block row mapping applied); accepted path nodes 1 then 4.
    slot = lambda p: int(row[p // BS]) * BS + p % BS  # noqa: E731
    root = 40
    src = [slot(root + 1 + 1), slot(root + 1 + 4)]
    dst = [slot(root + 1), slot(root + 2)]
    compact_kv_cpu([(cache, "vec")], src, dst, write_op())
    gk, gv = gather_cpu_kv(cache, row, 100, "vec", write_op())
    assert torch.equal(gk[root + 1], k[root + 2]) and torch.equal(gk[root + 2], k[root + 5])
    assert torch.equal(gv[root + 1], v[root + 2]) and torch.equal(gv[root + 2], v[root + 5])
    untouched = [p for p in range(100) if p not in (root + 1, root + 2)]
    assert torch.equal(gk[untouched], k[untouched]) and torch.equal(gv[untouched], v[untouched])
    assert not torch.equal(cache, before)


def write_positions(step, positions):
    rows, pos = step.depth_positions()
    positions[torch.from_numpy(rows)] = torch.from_numpy(pos)


def test_plan_step_writes_depth_positions_and_skips_chains_and_changed_drafts():
    # Batch: req a (tree of 4 nodes, root at 10), b (chain), c (tree whose scheduled drafts differ), d no drafts.
    req_ids = ["a", "b", "c", "d"]
    sched = {"a": [5, 6, 7, 8], "b": [1, 2], "c": [3, 4]}
    pending = {"a": DraftPlan((5, 6, 7, 8), (-1, -1, 0, 0)), "b": DraftPlan((1, 2), (-1, 0)),
               "c": DraftPlan((3, 9), (-1, -1))}
    qs = np.array([0, 5, 8, 11, 12])
    roots = np.array([10, 20, 30, 40])  # each request's computed tokens: its first row's position
    positions = torch.cat([torch.arange(10, 15), torch.arange(20, 23), torch.arange(30, 33), torch.tensor([40])])
    step = plan_step(req_ids, qs, roots, sched, pending, num_tokens=12)
    assert [r.row for r in step.requests] == [0] and step.requests[0].root_pos == 10
    write_positions(step, positions)
    assert positions[:5].tolist() == [10, 11, 11, 12, 12]
    assert positions[5:].tolist() == [20, 21, 22, 30, 31, 32, 40]
    # The scheduler may trim drafts: the first nodes of a breadth-first tree are still a tree.
    positions = torch.arange(10, 13)
    step = plan_step(["a"], np.array([0, 3]), np.array([10]), {"a": [5, 6]}, pending, num_tokens=3)
    write_positions(step, positions)
    assert positions.tolist() == [10, 11, 11] and len(step.requests[0].tree) == 2
    assert plan_step(["b"], np.array([0, 3]), np.array([0]), {"b": [1, 2]}, pending, 3) is None


def test_chain_indices_take_the_tree_rows_drafts_out_of_vllms_chain_layout():
    """vLLM lays a step's drafts out row after row; tree rows (verified apart) leave it: the kept draft rows are the
    chain rows' own, in order, and the cumulative counts are the chain rows' drafts (sampled rows: drafts + 1)."""
    drafts, trees = [3, 0, 2, 4, 1], {2, 3}
    keep, num, cu_draft, cu_sampled = chain_indices(np.array(drafts), trees)
    assert keep == [0, 1, 2, 9] and num == [3, 0, 0, 0, 1]
    assert cu_draft == [3, 3, 3, 3, 4] and cu_sampled == [4, 5, 6, 7, 9]
    rng = np.random.default_rng(0)
    for _ in range(200):
        d = rng.integers(0, 6, size=rng.integers(1, 9)).tolist()
        t = {i for i in range(len(d)) if rng.random() < 0.4}
        starts = np.concatenate([[0], np.cumsum(d)])
        want = [r for i in range(len(d)) if i not in t for r in range(starts[i], starts[i + 1])]
        got = chain_indices(d, t)
        assert got[0] == want and got[2] == np.cumsum(got[1]).tolist()


def test_which_requests_the_tree_sampler_verifies():
    from vllm import SamplingParams

    for ok in ({"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 3},
               {"repetition_penalty": 1.1}, {"presence_penalty": 0.5}, {"logprobs": 2}, {"min_tokens": 4},
               {"min_p": 0.1}, {"logit_bias": {3: 1.0}}, {"allowed_token_ids": [1, 2]}, {"bad_words": ["x"]}):
        assert tree_verifiable(SamplingParams(**ok)), ok
    assert not tree_verifiable(SamplingParams(thinking_token_budget=8)) and not tree_verifiable(None)
    # vLLM's chain verification ignores these two: only the tree sampler may verify such requests' drafts
    assert needs_own_sampler(SamplingParams(min_p=0.1)) and needs_own_sampler(SamplingParams(logit_bias={3: 1.0}))
    assert not needs_own_sampler(SamplingParams(repetition_penalty=1.3)) and not needs_own_sampler(None)


def test_each_tree_row_sees_the_settings_of_its_own_path():
    """root -> A (5), B (6); A -> C (7); committed output [1, 2]: every row is processed with the output followed by
    its own path (vLLM's chain processing would give B's row A's token, and C's row B's)."""
    tree = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, -1, 0]))
    assert row_histories(tree, [1, 2]) == [[1, 2], [1, 2, 5], [1, 2, 6], [1, 2, 5, 7]]
    V = 12
    s = RowSampling(0.0, output=[1, 2], prompt=torch.tensor([3, V]), penalties=(0.0, 0.0, 2.0),
                    bad_words=[[5, 9]], logit_bias={8: 3.0}, min_tokens=4, stop_ids=(0,))
    x = row_logits(torch.ones(4, V), tree, s)
    seen = [{1, 2, 3}, {1, 2, 3, 5}, {1, 2, 3, 6}, {1, 2, 3, 5, 7}]  # prompt 3 and the path's output tokens
    for r in range(4):
        for t in range(1, V):
            want = 4.0 if t == 8 else (0.5 if t in seen[r] else 1.0)
            if t == 9 and r == 1:  # bad word [5, 9]: after 5 only (row A)
                want = -math.inf
            assert x[r, t] == want, (r, t, float(x[r, t]), want)
        assert math.isinf(x[r, 0]) == (r < 3), r  # min_tokens 4: the stop token is masked while fewer are out


def test_grammar_rows_mask_and_greedy_follows_the_masked_argmax():
    from vllm_adaspec.engine.grammar import unpack_bitmask

    bits = torch.tensor([[0b1010, 0], [-1, 1]], dtype=torch.int32)  # row 0: tokens 1, 3; row 1: 0..31 and 32
    allowed = unpack_bitmask(bits, 40)
    assert allowed[0].nonzero().flatten().tolist() == [1, 3]
    assert allowed[1].nonzero().flatten().tolist() == list(range(33))
    tree = DraftTree(torch.tensor([3]), torch.tensor([-1]))
    logits = torch.zeros(2, 40)
    logits[0, 7] = 5.0  # the unconstrained argmax is forbidden at the root: 3 is the best allowed token
    logits[0, 3] = 1.0
    path, bonus, _ = verify_tree_request(tree, logits, RowSampling(0.0, grammar=allowed))
    assert path == [0] and bonus == 0


def test_draft_mask_shows_each_node_its_prefix_and_own_ancestors():
    from vllm_adaspec.proposers.early_exit import EarlyExitDrafter
    from vllm_adaspec.trees import GrowingTree, add_children

    g = torch.Generator().manual_seed(4)
    r, r2 = 40, 9  # root positions; nodes that ran take slots root + 1, root + 2, ... in the order they ran
    t = GrowingTree()
    add_children(t, -1, [5, 6], [0.6, 0.3])  # A = 0, B = 1 (both ran: slots r + 1, r + 2)
    add_children(t, 0, [7, 8], [0.5, 0.4])  # C = 2, D = 3 under A
    add_children(t, 1, [9, 10], [0.9, 0.1])  # E = 4, F = 5 under B
    t2 = GrowingTree()  # a second tree: only its first child X = 0 (slot r2 + 1) runs now
    add_children(t2, -1, [3, 4], [0.7, 0.2])
    slot_of = [{0: 1, 1: 2, 2: 3, 4: 4}, {0: 1}]  # tree 0: C and E run now
    feed = [(0, 2), (1, 0), (0, 4)]
    cache, block_row, k, v = _paged_cache(r + 5, g)
    nblocks = cache.shape[0]
    block_rows = torch.stack([block_row, block_row.roll(1)])  # tree 1 lives in other blocks of the same cache
    k2, v2 = torch.randn(r2 + 2, HKV, D, generator=g), torch.randn(r2 + 2, HKV, D, generator=g)
    from vllm import _custom_ops as ops
    kc, vc = cache.view(nblocks, HKV, 2 * BS, D).chunk(2, dim=2)
    pos2 = torch.arange(r2 + 2)
    ops.cpu_attn_reshape_and_cache(k2, v2, kc, vc, block_rows[1][pos2 // BS] * BS + pos2 % BS, "vec",
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    k, v = gather_cpu_kv(cache, block_row, r + 5, "vec", write_op())  # tree 0 as the cache holds it now
    prefix = EarlyExitDrafter._draft_prefix(np.array([r, r2]), block_rows)
    assert prefix.positions.shape == (2, r + 1) and prefix.positions[1, r2 + 1:].eq(0).all()
    mask = EarlyExitDrafter._draft_mask(feed, [t, t2], slot_of, np.array([r, r2]), prefix)
    assert mask.num_tokens == 3 and mask.trees.tolist() == [0, 1]
    assert mask.rows.tolist() == [[0, 2], [1, 1]] and mask.valid.tolist() == [[True, True], [True, False]]
    assert mask.node_pos.tolist() == [[r + 1, r + 2, r + 3, r + 4], [r2 + 1, r2, r2, r2]]
    p = r + 1
    want = torch.zeros(2, 2, p + 4, dtype=torch.bool)
    want[0, :, :r + 1] = True
    want[0, 0, [p + 0, p + 2]] = True  # C: A, itself
    want[0, 1, [p + 1, p + 3]] = True  # E: B, itself
    want[1, :, :r2 + 1] = True
    want[1, 0, p] = True  # X: itself (row 1 of tree 1 is padding: prefix only)
    assert torch.equal(mask.visible, want)
    # Through the paged cache (as the attention patch runs it), each row equals causal attention over its path.
    pk, pv = gather_cpu_kv_at(cache, *paged_index(prefix.block_rows, prefix.positions, BS), "vec",
                              write_op())
    nk, nv = gather_cpu_kv_at(cache, *paged_index(prefix.block_rows[mask.trees], mask.node_pos, BS), "vec",
                              write_op())
    kk, vv = torch.cat([pk[mask.trees], nk], 1), torch.cat([pv[mask.trees], nv], 1)
    q = torch.randn(3, HQ, D, generator=g)
    got = masked_attention_batch(q[mask.rows], kk, vv, mask.visible, 0.125)
    for (tr, i), keys, (kx, vx) in [((0, 0), list(range(r + 1)) + [r + 1, r + 3], (k, v)),
                                    ((0, 1), list(range(r + 1)) + [r + 2, r + 4], (k, v)),
                                    ((1, 0), list(range(r2 + 2)), (k2, v2))]:
        f = int(mask.rows[tr, i])
        torch.testing.assert_close(got[tr, i], _causal(q[f], kx[keys], vx[keys], 0.125), rtol=1e-5, atol=1e-5)


def _vllm_like_sampler(bonus_bias: dict):
    """Stands in for vLLM's rejection sampler (greedy): each request's drafts verified as a chain at its target rows
    with no logit bias (vLLM's chain verification applies none), its bonus row argmaxed with the bias of its batch
    row (`bonus_bias` {row: {token: bias}}: the logits processor the plugin gives vLLM's sampler back). Records the
    metadata it was called with."""
    from types import SimpleNamespace

    calls = []

    def stock(meta, draft_probs, logits, sm):
        calls.append(meta)
        n_req = len(meta.num_draft_tokens)
        out = torch.full((n_req, meta.max_spec_len + 1), -1, dtype=torch.int32)
        drafts, target = meta.draft_token_ids.tolist(), meta.target_logits_indices.tolist()
        at = 0
        for i, n in enumerate(meta.num_draft_tokens):
            k = 0
            while k < n and int(logits[target[at + k]].argmax()) == drafts[at + k]:
                out[i, k] = drafts[at + k]
                k += 1
            if k < n:
                out[i, k] = int(logits[target[at + k]].argmax())
            else:
                row = logits[int(meta.bonus_logits_indices[i])].clone()
                for t, b in bonus_bias.get(i, {}).items():
                    row[t] += b
                out[i, k] = int(row.argmax())
            at += n
        return SimpleNamespace(sampled_token_ids=out, logprobs_tensors=None)

    return stock, calls


def _two_greedy_requests_step():
    """(spec-decode metadata, sampling metadata) of a greedy step: request 0 with drafts [3, 4], request 1 with [7]."""
    from types import SimpleNamespace

    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    metadata = SpecDecodeMetadata(i32(3, 4, 7), [2, 1], i32(2, 3), i32(3, 5), i32(0, 1, 3), i32(2, 4),
                                  i32(0, 1, 2, 3, 4))
    sm = SimpleNamespace(all_greedy=True, temperature=None, top_k=None, top_p=None, generators={}, no_penalties=True,
                         prompt_token_ids=None, allowed_token_ids_mask=None, bad_words_token_ids={},
                         max_num_logprobs=None, spec_token_ids=None)
    return metadata, sm


def _tree_only_case(sampling_params=None):
    """Request a (logit_bias bans token 3; only the tree sampler may verify its drafts) drafted [3, 4] as a chain
    (its tree was not planned: a fault in planning); request b drafted [7] and is an ordinary chain. a's root row's
    argmax is 3, banned; its best allowed token is 9."""
    from types import SimpleNamespace

    from vllm import SamplingParams

    from vllm_adaspec.runtime.cpu import CPUTreeRuntime as TreeRuntime
    from vllm_adaspec.engine.tree_sampler import TreeRejectionSampler

    V = 16
    logits = torch.zeros(5, V)  # rows: a's root, a's node 3, a's bonus, b's root, b's bonus
    logits[0, 3], logits[0, 9] = 5.0, 4.0
    logits[1, 4] = 5.0
    logits[3, 7] = 5.0
    logits[4, 8] = 5.0
    params = {"a": SamplingParams(temperature=0.0, logit_bias={3: -100.0}), "b": SamplingParams(temperature=0.0)}
    port = SimpleNamespace(runner=SimpleNamespace(input_batch=SimpleNamespace(req_ids=["a", "b"])),
                           sampling_params=sampling_params or params.get, output=lambda row: [1, 2])
    stock, calls = _vllm_like_sampler({0: {3: -100.0}})
    sampler = TreeRejectionSampler(stock, TreeRuntime(), port=port, tree_only=lambda r: r == "a")
    metadata, sm = _two_greedy_requests_step()
    return sampler, calls, metadata, logits, sm


def test_drafts_only_the_tree_sampler_may_verify_never_reach_vllms_chain_verification():
    """A request with logit_bias whose drafts reached vLLM as a chain (a fault in planning its tree) is taken out of
    vLLM's chain verification: to vLLM's sampler it has no drafts and its bonus row is its root row, where vLLM
    applies every setting (the bias too), so it commits one allowed token. vLLM's chain verdict would have been
    [3, 4, ...]: the banned token, from a row vLLM verifies without the bias. b keeps vLLM's chain verdict."""
    sampler, calls, metadata, logits, sm = _tree_only_case()
    out = sampler(metadata, None, logits, sm)
    assert list(calls[0].num_draft_tokens) == [0, 1] and int(calls[0].bonus_logits_indices[0]) == 0
    assert out.sampled_token_ids.tolist() == [[9, -1, -1], [7, 8, -1]]
    assert sampler.runtime.faults.count == 0 and sampler.runtime.failed == {}


def test_when_even_taking_the_drafts_out_fails_the_root_row_is_resampled_or_the_request_fails(monkeypatch):
    """Taking the trees out of vLLM's chain verification raises: vLLM verifies every draft as a chain ([3, 4, 4]
    for a), and a keeps one token sampled here from its root row with its bias (9), never vLLM's chain verdict.
    When even that fails (its settings cannot be read), a commits nothing and is failed with an error for its client
    (runtime.failed: the worker hands it to the scheduler); b is untouched either way."""
    import vllm_adaspec.engine.tree_sampler as ts

    def broken(*a, **k):
        raise RuntimeError("chains_only broke")

    monkeypatch.setattr(ts, "chains_only", broken)
    sampler, calls, metadata, logits, sm = _tree_only_case()
    out = sampler(metadata, None, logits, sm)
    assert list(calls[0].num_draft_tokens) == [2, 1]  # vLLM saw every draft
    assert out.sampled_token_ids.tolist() == [[9, -1, -1], [7, 8, -1]]
    assert sampler.runtime.faults.count == 1 and sampler.runtime.failed == {}

    def unreadable(req_id):
        if req_id == "a":
            raise RuntimeError("no sampling params")
        return None

    sampler, calls, metadata, logits, sm = _tree_only_case(unreadable)
    out = sampler(metadata, None, logits, sm)
    assert out.sampled_token_ids.tolist() == [[-1, -1, -1], [7, 8, -1]]
    assert list(sampler.runtime.take_failed()) == ["a"] and sampler.runtime.failed == {}
    # the same with a's drafts planned as a tree (root -> 3, root -> 4): the step's tree requests keep the first
    # token sampled again with the bias (9), not vLLM's chain verdict's first token (3), and their results say so
    sampler, calls, metadata, logits, sm = _tree_only_case()
    sampler.runtime.step = plan_step(["a", "b"], np.array([0, 3, 5]), np.array([10, 20]), {"a": [3, 4], "b": [7]},
                                     {"a": DraftPlan((3, 4), (-1, -1))}, 5)
    assert sampler.runtime.step is not None
    out = sampler(metadata, None, logits, sm)
    assert out.sampled_token_ids.tolist() == [[9, -1, -1], [7, 8, -1]]
    assert sampler.runtime.take_results()[0] == {0: ([], 9, [])}


def test_vllms_dummy_sampler_run_at_start_up_passes_through_the_tree_sampler_and_the_logits_tap():
    """vLLM's profile run (every GPU start, and a CPU engine in compiled mode) calls the rejection sampler with
    dummy drafts `[[0]] * num_reqs` (SpecDecodeMetadata.make_dummy) while the input batch is empty: the tree sampler
    returns vLLM's result, touches no plan and taps nothing (it used to index the empty batch: IndexError, the
    worker died at start-up)."""
    from types import SimpleNamespace

    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from vllm_adaspec.engine.runner_hooks import LogitsTap
    from vllm_adaspec.runtime.cpu import CPUTreeRuntime as TreeRuntime
    from vllm_adaspec.engine.tree_sampler import TreeRejectionSampler

    num_reqs, V = 4, 32
    metadata = SpecDecodeMetadata.make_dummy([[0]] * num_reqs, torch.device("cpu"))
    logits = torch.randn(2 * num_reqs, V)
    verdict = torch.full((num_reqs, 2), 5, dtype=torch.int32)
    stock = lambda *a: SimpleNamespace(sampled_token_ids=verdict.clone(), logprobs_tensors=None)  # noqa: E731
    batch = SimpleNamespace(req_ids=[], num_reqs=0, token_ids_cpu=np.zeros((0, 8), dtype=np.int64),
                            num_tokens_no_spec=np.zeros(0, dtype=np.int64))
    runner = SimpleNamespace(input_batch=batch)
    taps = SimpleNamespace(logits_topk=[])
    port = SimpleNamespace(runner=runner, taps=taps, sampling_params=lambda r: None)
    runtime = TreeRuntime()
    tap = LogitsTap(runner, port, 4)
    sampler = TreeRejectionSampler(stock, runtime, on_logits=tap, port=port, tree_only=lambda r: True)
    sm = SimpleNamespace(all_greedy=True, temperature=None, top_k=None, top_p=None, generators={}, no_penalties=True,
                         prompt_token_ids=None, allowed_token_ids_mask=None, bad_words_token_ids={},
                         max_num_logprobs=None, spec_token_ids=None)
    for _ in range(2):  # vLLM calls it twice (mixed sampling, then all greedy)
        out = sampler(metadata, None, logits, sm)
        assert torch.equal(out.sampled_token_ids, verdict)
    tap(logits[:num_reqs], None)  # the plain sampler's warm-up call
    assert taps.logits_topk == [] and runtime.faults.count == 0 and runtime.results == {}


@pytest.mark.parametrize("k, p", [(40, 0.95), (None, 0.9), (5, None), (None, 0.999999), (1, 0.5), (0, None)])
def test_top_k_top_p_keeps_what_vllms_sort_keeps(k, p):
    """The tree sampler's top-k / top-p (topk instead of a sort of the vocabulary) keeps exactly vLLM's set, flat
    and peaked rows alike (a flat row makes top-p alone fall back to the sort)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    from vllm_adaspec.engine.tree_sampler import top_k_top_p

    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(3, 5000, generator=g) * 4, torch.randn(2, 5000, generator=g) * 0.01])
    kk = None if k is None else torch.full((5,), k, dtype=torch.int32)
    pp = None if p is None else torch.full((5,), p, dtype=torch.float32)
    want = apply_top_k_top_p(x.clone(), kk, pp) if (k or p) else x.clone()
    got = top_k_top_p(x.clone(), k, p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got[~torch.isinf(got)], x[~torch.isinf(want)])


def test_a_forward_that_does_not_have_the_planned_layout_is_a_contained_fault():
    """The planned step's tree rows had their seq_lens cut before the forward: if attention meets a forward of
    another token count, no row of the step's tree requests can be trusted, not even the root's. That is a counted
    fault, and the sampler gives those requests nothing (they are finished with an error), never a token; other
    requests keep vLLM's result. Planning itself refuses a layout whose rows do not match the trees."""
    from types import SimpleNamespace

    from vllm import SamplingParams

    from vllm_adaspec.engine.tree_sampler import TreeRejectionSampler
    from vllm_adaspec.runtime.cpu import CPUTreeRuntime

    with pytest.raises(ValueError, match="rows in the forward"):  # request a schedules 2 rows, its tree needs 3
        plan_step(["a"], np.array([0, 2]), np.array([10]), {"a": [3, 4]}, {"a": DraftPlan((3, 4), (-1, -1))}, 2)
    rt = CPUTreeRuntime()
    rt.step = plan_step(["a", "b"], np.array([0, 3, 5]), np.array([10, 20]), {"a": [3, 4], "b": [7]},
                        {"a": DraftPlan((3, 4), (-1, -1))}, 5)
    out = torch.zeros(4, HQ, D)
    rt.attend("vec", 0.125, torch.zeros(4, HQ, D), torch.zeros(4, HKV, D), torch.zeros(4, HKV, D), None,
              SimpleNamespace(num_actual_tokens=4, slot_mapping=torch.arange(4), block_table=None), out)
    assert rt.step.broken and rt.faults.count == 1 and out.abs().sum() == 0  # nothing written from the bad plan
    stock = lambda *a: SimpleNamespace(sampled_token_ids=torch.tensor([[5, -1, -1], [7, 8, -1]], dtype=torch.int32),
                                       logprobs_tensors=None)  # noqa: E731
    params = {"a": SamplingParams(temperature=0.0), "b": SamplingParams(temperature=0.0)}
    port = SimpleNamespace(runner=SimpleNamespace(input_batch=SimpleNamespace(req_ids=["a", "b"])),
                           sampling_params=params.get)
    sampler = TreeRejectionSampler(stock, rt, port=port)
    metadata, sm = _two_greedy_requests_step()
    got = sampler(metadata, None, torch.zeros(5, 16), sm).sampled_token_ids
    assert got.tolist() == [[-1, -1, -1], [7, 8, -1]] and list(rt.take_failed()) == ["a"]
