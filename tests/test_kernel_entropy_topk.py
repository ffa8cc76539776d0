"""The fused entropy / max-probability / top-k kernel against a float64 torch reference (Triton interpreter)."""

import math

import pytest
import torch

from conftest import load_interpreted

K = load_interpreted("entropy_topk")
pytestmark = pytest.mark.usefixtures("triton_interpret")


@pytest.mark.parametrize("rows,vocab,k,block", [
    (3, 49152, 8, 4096),  # SmolLM2's vocabulary
    (2, 151936, 4, 8192),  # Qwen2.5's
    (4, 8192, 1, 1024),  # a draft vocabulary
    (3, 1000, 5, 256),  # not a multiple of the block
    (2, 37, 3, 4096),  # smaller than one block
])
def test_matches_float64_reference(rows, vocab, k, block):
    g = torch.Generator().manual_seed(vocab + k)
    logits = torch.randn(rows, vocab, generator=g) * 4
    logits[0, 123 % vocab] += 25  # one confident row
    temps = torch.tensor([0.7, 1.0, 1.3, 0.0][:rows])  # 0 = greedy request: statistics at T = 1
    ent, maxp, ids, probs, _ = K.entropy_topk_triton(logits, temps, k=k, block=block)
    r_ent, r_maxp, r_ids, r_probs, _ = K.entropy_topk_reference(logits, temps, k=k)
    torch.testing.assert_close(ent.double(), r_ent, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(maxp.double(), r_maxp, rtol=1e-4, atol=1e-6)
    assert torch.equal(ids, r_ids)
    torch.testing.assert_close(probs.double(), r_probs, rtol=1e-4, atol=1e-6)
    assert maxp[0] > 0.99 and ent[0] < 0.1  # the confident row


@pytest.mark.parametrize("rows,vocab,n,block", [
    (3, 49152, 1000, 4096),  # C2T's top-1000 entropy over SmolLM2's vocabulary
    (3, 8192, 1000, 1024),  # over a draft vocabulary
    (2, 600, 1000, 256),  # fewer tokens than n: the full entropy
    (2, 3000, 7, 512),  # a small n: the threshold search must land exactly
])
def test_top_n_entropy_matches_float64(rows, vocab, n, block):
    g = torch.Generator().manual_seed(vocab + n)
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[0, 5] += 20  # a confident row: H_n close to H
    temps = torch.tensor([1.0, 0.8, 1.5][:rows])
    got = K.entropy_topk_triton(logits, temps, k=4, block=block, top_n=n)
    want = K.entropy_topk_reference(logits, temps, k=4, top_n=n)
    torch.testing.assert_close(got.top_n_entropy.double(), want.top_n_entropy, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.entropy.double(), want.entropy, rtol=1e-4, atol=1e-4)  # unchanged beside it
    assert torch.equal(got.top_ids, want.top_ids)
    if n < vocab:  # the tail's share is left out: strictly less than the full entropy on non-confident rows
        assert (want.top_n_entropy[1:] < want.entropy[1:] - 1e-3).all()
    else:
        torch.testing.assert_close(want.top_n_entropy, want.entropy)
    assert K.entropy_topk_triton(logits, temps, k=4, block=block).top_n_entropy is None


def test_top_n_entropy_by_hand_and_with_masked_logits():
    # p = (0.5, 0.25, 0.125, 0.125): top-2 entropy = 0.5 log 2 + 0.25 log 4 = log 2
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]], dtype=torch.float64))
    ref = K.entropy_topk_reference(logits, 1.0, k=1, top_n=2)
    assert abs(float(ref.top_n_entropy[0]) - math.log(2)) < 1e-12
    x = torch.randn(2, 5000, generator=torch.Generator().manual_seed(3))
    x[:, 10:4990] = float("-inf")  # 20 finite logits, n = 15
    got = K.entropy_topk_triton(x, 1.0, k=2, block=1024, top_n=15)
    torch.testing.assert_close(got.top_n_entropy.double(), K.entropy_topk_reference(x, 1.0, k=2, top_n=15).top_n_entropy,
                               rtol=1e-4, atol=1e-5)


def test_masked_logits_and_low_precision_inputs():
    logits = torch.randn(2, 5000, generator=torch.Generator().manual_seed(0))
    logits[:, 100:4000] = float("-inf")  # e.g. tokens a grammar forbids
    for dtype in (torch.float16, torch.bfloat16):
        x = logits.to(dtype)
        ent, maxp, ids, probs, _ = K.entropy_topk_triton(x, 1.0, k=6, block=1024)
        r_ent, r_maxp, r_ids, r_probs, _ = K.entropy_topk_reference(x, 1.0, k=6)
        assert torch.isfinite(ent).all()
        torch.testing.assert_close(ent.double(), r_ent, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(probs.double(), r_probs, rtol=1e-4, atol=1e-6)
        assert ((ids < 100) | (ids >= 4000)).all()


def test_cpu_dispatch_is_the_torch_path_in_float32():
    logits = torch.randn(3, 777, generator=torch.Generator().manual_seed(1))
    ent, maxp, ids, probs, _ = K.entropy_topk(logits, 0.9, k=2)
    assert ent.dtype == torch.float32
    torch.testing.assert_close(ent.double(), K.entropy_topk_reference(logits, 0.9, k=2)[0], rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="k must be in"):
        K.entropy_topk_triton(torch.zeros(1, 10), 1.0, k=11)
    with pytest.raises(ValueError, match="temperature has 3 values for 2 rows"):
        K.entropy_topk_triton(torch.zeros(2, 10), torch.ones(3), k=1)
    with pytest.raises(ValueError, match="top_n must be >= 1"):
        K.entropy_topk_triton(torch.zeros(1, 10), 1.0, k=1, top_n=0)
    with pytest.raises(ValueError, match="unit stride"):
        K.entropy_topk_triton(torch.zeros(10, 2).t(), 1.0, k=1)
