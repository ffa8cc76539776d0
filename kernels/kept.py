"""Small device tensors a kernel launch needs every time, kept per device across launches instead of made each step
(a fill is a launch, an allocation host time): counters that every launch leaves at zero, the index 0 .. n - 1, and
one-element tensors passed where no program reads (a pointer of the dtype a launch always passes: one compiled
variant). A longer request replaces the kept tensor (launches on one stream: the old one is done with by then, as
the caching allocator assumes too)."""

from __future__ import annotations

import torch

__all__ = ["arange", "ones", "zeros"]

_KEPT: dict = {}


def _kept(key: tuple, n: int, make) -> torch.Tensor:
    have = _KEPT.get(key)
    if have is None or len(have) < n:
        have = _KEPT[key] = make(max(n, 1024))
    return have[:n]


def zeros(owner: str, n: int, device) -> torch.Tensor:
    """n int32 zeros: `owner`'s counters (its kernels leave each at 0 when a launch ends)."""
    return _kept(("zeros", owner, device), n, lambda m: torch.zeros(m, dtype=torch.int32, device=device))


def arange(n: int, device) -> torch.Tensor:
    """0 .. n - 1, int64."""
    return _kept(("arange", device), n, lambda m: torch.arange(m, dtype=torch.long, device=device))


def ones(device, dtype=torch.float32) -> torch.Tensor:
    """[1] of ones."""
    return _kept(("ones", device, dtype), 1, lambda m: torch.ones(1, dtype=dtype, device=device))
