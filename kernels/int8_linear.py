"""Weight-only int8 linear for draft passes: int8 weights with one scale per output row, bfloat16 activations.

A draft pass on a few rows reads every weight of the draft layer and its head once and does little arithmetic per
byte, so on a CPU its time is the weights' bytes over memory bandwidth, and each step's first pass finds them evicted
by the target's forward. int8 rows read a quarter of float32's bytes. Measured on the 2-core EPYC (AVX-512 BF16 and
VNNI; one thread; weights evicted before each call; microseconds):

    matrix [N, K]          float32   bfloat16   int8 rows
    gate_up [3072, 576]        610        453         238
    head [8192, 576]          1313       1016         363
    the six of one layer      1958       1583         827

Per call int8 costs about 35 us per row with warm weights, float32 or bfloat16 GEMMs much less per extra row, so
calls with more than `INT8_MAX_ROWS` rows (large batches, trees, a long prompt's KV feed) keep the dense weight.

Drafts only propose: their numerics never change an output, only how often drafts are accepted (measured with the
draft-layer replay's `--int8`).

Contents: `quantize_rows` (float weight -> int8 rows + scales), `Int8Rows` (one weight's, built once), `few_rows`
(whether a call is one for them), `int8_linear` (the launcher: aten's `_weight_int8pack_mm` CPU kernel; PyTorch has
it since 2.3), `int8_linear_reference` (plain torch, float64 in the tests), `int8_linear_emulated` (its numerics
with float32 GEMMs, for replays of many rows), `int8_available`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["INT8_MAX_ROWS", "Int8Rows", "few_rows", "int8_available", "int8_linear", "int8_linear_emulated",
           "int8_linear_reference", "quantize_rows"]

INT8_MAX_ROWS = 8  # rows per call up to which int8 beats the dense GEMM here (warm: 292 us vs bfloat16's 205 at 8)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] int8, scale [N] float32) with w ~ q * scale[:, None], symmetric per row."""
    w = w.detach().float()
    scale = w.abs().amax(1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def int8_linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What `int8_linear` computes on its int8 path: x [M, K] rounded to bfloat16 times the dequantized rows,
    in float64: [M, N]."""
    xb = x.to(torch.bfloat16).double()
    return xb @ (q.double() * scale.double()[:, None]).T


def int8_linear_emulated(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`int8_linear`'s numerics at GEMM speed for calls of many rows (offline replays, tests): x [..., K] rounded
    to bfloat16, times w [N, K] (the dequantized rows, q * scale, float32), the result rounded to bfloat16."""
    y = (x.to(torch.bfloat16).float() @ w.T).to(torch.bfloat16).to(x.dtype)
    return y if bias is None else y + bias.to(x.dtype)


@dataclass(frozen=True)
class Int8Rows:
    """One weight's int8 rows, built once: q [N, K] int8 and scale [N] bfloat16 (the activations' dtype)."""

    q: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor) -> "Int8Rows":
        q, scale = quantize_rows(weight)
        return cls(q.to(weight.device), scale.to(weight.device, torch.bfloat16))


def int8_available(device: torch.device | str) -> bool:
    """Whether this torch has the int8-rows kernel for `device` (the CPU one; elsewhere the dense weight runs)."""
    if torch.device(device).type != "cpu" or not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return False
    try:
        x = torch.ones(1, 32, dtype=torch.bfloat16)
        torch.ops.aten._weight_int8pack_mm(x, torch.ones(8, 32, dtype=torch.int8), torch.ones(8, dtype=torch.bfloat16))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def few_rows(x: torch.Tensor) -> bool:
    """Whether a call on x [..., K] is one for int8 rows (at most INT8_MAX_ROWS rows)."""
    return 0 < x.numel() // x.shape[-1] <= INT8_MAX_ROWS


def int8_linear(x: torch.Tensor, w: Int8Rows, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype, with the int8 rows (the caller keeps the dense weight for calls
    that are not `few_rows`)."""
    flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
    y = torch.ops.aten._weight_int8pack_mm(flat, w.q, w.scale).to(x.dtype)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])
