"""The GPU tree step's two small kernels under TRITON_INTERPRET=1 against their torch paths: batched verification
(kernels/tree_verify.py: the walk of trees/batch.py and the write into vLLM's sampled tokens, one launch) and KV
compaction over every layer (kernels/kv_compaction.py: one launch for the caches vLLM allocates layer by layer)."""

import torch

from conftest import load_interpreted, random_trees
from vllm_adaspec.runtime.gpu_kv import compaction_moves, move_slots
from vllm_adaspec.trees import pack_trees


def test_the_verification_kernel_equals_the_batched_torch_walk(triton_interpret):
    """Random trees (equal siblings, read-only branch rows, up to 100 nodes: four ancestor words) under random draws
    (3 tokens: long accepted paths): path, count, bonus and the rows written into vLLM's sampled tokens equal the
    torch ops', rows not verified untouched."""
    tv = load_interpreted("tree_verify")
    g = torch.Generator().manual_seed(0)
    accepted = 0
    for most, block, cases in ((40, 64, 20), (100, 128, 6)):
        for _ in range(cases):
            trees = random_trees(int(torch.randint(1, 6, (), generator=g)), g, most, vocab=3)
            verified = [max(0, len(t) - int(torch.randint(0, 3, (), generator=g))) for t in trees]
            batch = pack_trees(trees, verified, width=max(len(t) for t in trees))
            n = batch.tokens.shape[1]
            draws = torch.randint(0, 3, (len(trees), n + 1), generator=g)
            for width in (17, min(block, n + 1)):
                rows = torch.randperm(9, generator=g)[:len(trees)]
                got, want = (torch.full((9, width), 7, dtype=torch.int32) for _ in range(2))
                a = tv.verify_trees(batch, draws, got, rows, block_n=block)
                b = tv.verify_trees_reference(batch, draws, want, rows)
                for x, y in zip(a, b):
                    assert torch.equal(x, y)
                assert torch.equal(got, want)
                accepted += int(a[1].sum())
    assert accepted > 200  # the walks went deep, not only to the root


def test_the_compaction_kernel_moves_what_the_per_layer_moves_move(triton_interpret):
    """Layers allocated apart (as vLLM allocates them), in vLLM's GPU layout, paths from real verifications: the one
    launch over every layer leaves each cache as the per-layer gathers and scatters (runtime/gpu_kv.py) leave it,
    also given the paths in another order than the step's trees (`trees`)."""
    kc = load_interpreted("kv_compaction")
    tv = load_interpreted("tree_verify")
    g = torch.Generator().manual_seed(1)
    moved = 0
    for dtype in (torch.float32, torch.bfloat16):
        for it in range(8):
            layers, blocks, heads, bs, d = 3, 16, 2, 4, 8
            caches = [torch.randn(blocks, bs, heads, 2 * d, generator=g).to(dtype).transpose(1, 2)
                      for _ in range(layers)]  # logical [blocks, H, block_size, 2 D], (block, slot) strides first
            want = [c.clone() for c in caches]
            trees = random_trees(3, g, 10, vocab=3)
            batch = pack_trees(trees, width=max(1, max(len(t) for t in trees)))
            n = batch.tokens.shape[1]
            draws = torch.randint(0, 3, (len(trees), n + 1), generator=g)
            path, count, _ = tv.verify_trees_reference(batch, draws, torch.zeros(3, n + 1, dtype=torch.int32),
                                                       torch.arange(3))
            sizes = torch.tensor([len(t) for t in trees])
            starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(sizes + 1, 0)[:-1]])
            slots = torch.randperm(blocks * bs, generator=g)[:int((sizes + 1).sum())]
            offsets = kc.layer_offsets(caches)
            assert offsets is not None
            if it % 2:  # the paths in another order (a verdict's: greedy trees first), each row naming its tree
                order = torch.randperm(3, generator=g)
                kc.compact(caches, offsets, slots, starts, path[order], count[order], order)
            else:
                kc.compact(caches, offsets, slots, starts, path, count)
            src, dst = compaction_moves(starts, sizes, path, count)
            move_slots(want, slots[src], slots[dst])
            for c, w in zip(caches, want):
                assert torch.equal(c, w)
            moved += int((path[:, :n] != torch.arange(n)).logical_and(path >= 0).sum())
    assert moved > 5  # nodes actually moved


def test_layers_of_different_layouts_have_no_compaction_table():
    """The kernel needs one dtype, shape and stride set for every layer; otherwise the runtime moves layer by layer."""
    from vllm_adaspec.kernels.kv_compaction import layer_offsets

    a = torch.zeros(4, 2, 4, 16)
    assert layer_offsets([a, torch.zeros(4, 2, 4, 16)]) is not None
    assert layer_offsets([a, torch.zeros(4, 2, 4, 16, dtype=torch.bfloat16)]) is None
    assert layer_offsets([a, torch.zeros(4, 4, 2, 16).transpose(1, 2)]) is None
