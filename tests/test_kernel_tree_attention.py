"""Tree-mask attention kernel under the Triton interpreter against the float64 torch reference."""

import math

import pytest
import torch

from conftest import load_interpreted
from vllm_adaspec.trees import DraftTree, ancestor_mask

ta = load_interpreted("tree_attention")


def random_tree(n: int, g: torch.Generator) -> DraftTree:
    """n draft nodes, breadth-first: each node's parent drawn among the previous depth's nodes (or the root)."""
    parents, prev, cur = [], [-1], []
    for i in range(n):
        if cur and (not prev or torch.rand((), generator=g) < 0.4):  # start the next depth
            prev, cur = cur, []
        q = prev[int(torch.randint(len(prev), (), generator=g))]
        parents.append(q)
        cur.append(i)
    return DraftTree(torch.zeros(n, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


def make_case(prefix_lens, tree_sizes, hq, hkv, d, block_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = [n + 1 for n in tree_sizes]  # root + nodes
    cu = torch.tensor([0] + list(torch.tensor(rows).cumsum(0)), dtype=torch.int32)
    max_rows = max(rows)
    need = [math.ceil((p + r) / block_size) for p, r in zip(prefix_lens, rows)]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g)  # pages scattered over the cache
    table = torch.zeros(len(rows), max(need), dtype=torch.int32)
    at = 0
    for b, k in enumerate(need):
        table[b, :k] = perm[at:at + k].to(torch.int32)
        at += k
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    q = torch.randn(int(cu[-1]), hq, d, generator=g).to(dtype)
    mask = torch.zeros(int(cu[-1]), max_rows, dtype=torch.bool)
    for b, n in enumerate(tree_sizes):
        m = ancestor_mask(random_tree(n, g)) if n else torch.ones(1, 1, dtype=torch.bool)
        mask[int(cu[b]):int(cu[b + 1]), :n + 1] = m
    return q, k_cache, v_cache, table, torch.tensor(prefix_lens, dtype=torch.int32), cu, mask


@pytest.mark.parametrize("prefix_lens,tree_sizes,hq,hkv,d,block_size,dtype", [
    ([0], [1], 4, 4, 16, 16, torch.float32),  # no prefix, one node
    ([5, 17, 0], [3, 8, 0], 9, 3, 64, 16, torch.float32),  # SmolLM2 heads (GQA 3), a request with no drafts
    ([33, 300], [16, 33], 14, 2, 64, 32, torch.float16),  # Qwen2.5-0.5B heads (GQA 7)
    ([2048], [64], 8, 2, 64, 16, torch.bfloat16),  # long prefix, 64 nodes
])
def test_matches_float64_reference(triton_interpret, prefix_lens, tree_sizes, hq, hkv, d, block_size, dtype):
    case = make_case(prefix_lens, tree_sizes, hq, hkv, d, block_size, dtype)
    scale = d ** -0.5
    got = ta.tree_attention_triton(*case, scale)
    want = ta.tree_attention_reference(*case, scale)
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_the_mask_matters(triton_interpret):
    """Same inputs with every tree row visible to every other: the output must change (the kernel reads the mask)."""
    case = list(make_case([10], [6], 4, 2, 16, 16, torch.float32, seed=1))
    scale = 0.25
    tree = ta.tree_attention_triton(*case, scale)
    case[6] = torch.ones_like(case[6])
    full = ta.tree_attention_triton(*case, scale)
    assert not torch.allclose(tree, full, atol=1e-3)
    torch.testing.assert_close(full.double(), ta.tree_attention_reference(*case, scale), atol=1e-4, rtol=1e-4)


def test_bad_arguments_are_named():
    q, k, v, table, plen, cu, mask = make_case([4], [2], 6, 4, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="not a multiple"):
        ta.tree_attention_triton(q, k, v, table, plen, cu, mask, 1.0)
    q, k, v, table, plen, cu, mask = make_case([4], [2], 4, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="tree_mask has"):
        ta.tree_attention_triton(q, k, v, table, plen, cu, mask[:-1], 1.0)
