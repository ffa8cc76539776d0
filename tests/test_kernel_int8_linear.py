"""kernels/int8_linear.py against its float64 reference: int8 rows with a scale each, bfloat16 activations."""

import pytest
import torch

from vllm_adaspec.kernels.int8_linear import (INT8_MAX_ROWS, Int8Rows, few_rows, int8_available, int8_linear,
                                              int8_linear_emulated, int8_linear_reference, quantize_rows)

pytestmark = pytest.mark.skipif(not int8_available("cpu"), reason="this torch has no CPU int8-rows kernel")


def test_quantized_rows_are_within_half_a_step_of_the_weight_and_use_the_whole_range():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different scales
    w[5] = 0.0  # an all-zero row gets a positive scale and zeros
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (64,) and bool((scale > 0).all())
    err = (q.double() * scale.double()[:, None] - w.double()).abs()
    assert bool((err <= scale.double()[:, None] / 2 + 1e-9).all())
    nonzero = torch.arange(64) != 5
    assert bool((q[nonzero].abs().amax(1) == 127).all()) and bool((q[5] == 0).all())


@pytest.mark.parametrize("shape", [(1, 576), (3, 96), (2, 4, 64), (INT8_MAX_ROWS, 1152)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_matches_the_float64_reference(shape, bias):
    g = torch.Generator().manual_seed(1)
    k, n = shape[-1], 80
    x, w = torch.randn(*shape, generator=g), torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    y = int8_linear(x, Int8Rows.of(w), b)
    assert y.shape == (*shape[:-1], n) and y.dtype == x.dtype
    ref = int8_linear_reference(x.reshape(-1, k), *quantize_rows(w)).reshape(*shape[:-1], n)
    if b is not None:
        ref = ref + b.double()
    # the kernel's result is bfloat16 (8 bits of mantissa): within a few of its steps of the largest value
    tol = 2 ** -7 * ref.abs().max().item()
    assert (y.double() - ref).abs().max().item() <= tol
    assert (int8_linear_emulated(x, (lambda q, s: q.float() * s[:, None])(*quantize_rows(w)), b).double()
            - ref).abs().max().item() <= tol
    # and the quantization is the only thing that moved it from the float weight: close, not equal
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    assert 0 < (y.double() - exact).abs().max().item() <= 0.05 * exact.abs().max().item()


def test_few_rows_counts_rows_of_any_leading_shape():
    assert few_rows(torch.zeros(1, 8)) and few_rows(torch.zeros(2, 4, 8)) == (8 <= INT8_MAX_ROWS)
    assert few_rows(torch.zeros(INT8_MAX_ROWS, 8)) and not few_rows(torch.zeros(INT8_MAX_ROWS + 1, 8))
    assert not few_rows(torch.zeros(0, 8))
