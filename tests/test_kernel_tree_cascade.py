"""kernels/tree_cascade.py under TRITON_INTERPRET=1: tree attention as a cascade (the prefix by a dense kernel with
its log-sum-exp, the tree's own keys by the tree kernel writing partials, one merge launch) equals the tree
kernel's reference over the whole paged case."""

import math

import pytest
import torch

from conftest import load_interpreted


def _case(g, batch, prefix, nodes, hq, hkv, d, bs=16):
    ta = load_interpreted("tree_attention")
    from vllm_adaspec.trees import DraftTree, ancestor_mask

    rows = nodes + 1
    per = math.ceil((prefix + rows) / bs)
    table = torch.randperm(batch * per, generator=g).view(batch, per).to(torch.int32)
    k = torch.randn(batch * per, bs, hkv, d, generator=g)
    v = torch.randn(batch * per, bs, hkv, d, generator=g)
    q = torch.randn(batch * rows, hq, d, generator=g)
    masks = []
    for _ in range(batch):
        parents = [-1] + [int(torch.randint(i + 1, (), generator=g)) - 1 for i in range(nodes - 1)]
        masks.append(ancestor_mask(DraftTree(torch.zeros(nodes, dtype=torch.long), torch.tensor(parents))))
    bits = ta.ancestor_bits(torch.cat(masks))
    cu = torch.arange(0, batch * rows + 1, rows, dtype=torch.int32)
    plen = torch.full((batch,), prefix, dtype=torch.int32)
    return ta, q, k, v, table, plen, cu, bits


@pytest.mark.parametrize("batch,prefix,nodes,heads", [(3, 40, 5, (6, 2, 16)), (2, 77, 12, (4, 4, 32)),
                                                      (1, 16, 1, (8, 2, 16))])
def test_the_cascade_equals_the_tree_attention_over_the_whole_case(triton_interpret, batch, prefix, nodes, heads):
    """Prefix part by torch's FlashAttention op (its CPU kernel) and by float64 torch, tree part by the tree kernel
    writing partials (no reduce launch: the merge is the only reader), merged in one launch: the rows' attention
    over prefix + ancestors equals the float64 reference within float32 error; the merge kernel equals its torch
    reference; rows outside the trees are not written."""
    tc = load_interpreted("tree_cascade")
    g = torch.Generator().manual_seed(prefix)
    hq, hkv, d = heads
    ta, q, k, v, table, plen, cu, bits = _case(g, batch, prefix, nodes, hq, hkv, d)
    rows, scale = nodes + 1, d ** -0.5
    want = ta.tree_attention_reference(q, k, v, table, plen, cu, bits, scale)
    fq = tc.fold_rows(q, batch, rows, hkv)
    fk, fv = (tc.contiguous_keys(c, table, 0, prefix) for c in (k, v))
    q_rows = torch.arange(batch * rows, dtype=torch.int32)
    plan = ta.plan_launch(plen, cu, bits, q_rows, torch.arange(batch, dtype=torch.int32), hq, hkv, d,
                          max_rows=rows, longest=prefix + rows, partials=True)
    assert plan.splits == 1 and plan.partials and plan.done is None
    spare = torch.full_like(q, 7.0)
    ta.launch(plan, q, k, v, table, scale, spare)  # the trees' own keys, in place in the paged cache
    assert torch.equal(spare, torch.full_like(q, 7.0))  # partials only: the output untouched
    for reference in (False, True):
        o_p, lse = tc.prefix_attention(fq, fk, fv, scale, reference=reference)
        offsets = tc.folded_offsets(batch, rows, hq, hkv, o_p, lse)
        out = torch.full((batch * rows + 2, hq, d), 5.0)  # two rows past the trees' rows
        tc.merge(o_p.float(), lse.float(), offsets, plan.acc, plan.m, plan.l, q_rows, out)
        torch.testing.assert_close(out[:-2].double(), want, atol=2e-5, rtol=2e-5)
        assert torch.equal(out[-2:], torch.full((2, hq, d), 5.0))
        ref = tc.merge_reference(o_p, lse, offsets, plan.acc, plan.m, plan.l, q_rows, torch.full_like(out, 5.0))
        torch.testing.assert_close(out, ref.float(), atol=1e-5, rtol=1e-5)
