"""Small device tensors a kernel launch needs every time, kept per device across launches instead of made each step
(a fill is a launch, an allocation host time): counters that every launch leaves at zero, the index 0 .. n - 1, and
one-element tensors passed where no program reads (a pointer of the dtype a launch always passes: one compiled
variant). A longer request replaces the kept tensor (launches on one stream: the old one is done with by then, as
the caching allocator assumes too)."""

from __future__ import annotations

import torch

__all__ = ["arange", "ones", "scratch", "zeros"]

_KEPT: dict = {}


def _buffer(key: tuple, n: int, make) -> torch.Tensor:
    """The kept tensor of `key`, replaced by make(n) where it is shorter than n."""
    have = _KEPT.get(key)
    if have is None or len(have) < n:
        have = _KEPT[key] = make(n)
    return have


def _kept(key: tuple, n: int, make) -> torch.Tensor:
    return _buffer(key, n, lambda m: make(max(m, 1024)))[:n]


def zeros(owner: str, n: int, device) -> torch.Tensor:
    """n int32 zeros: `owner`'s counters (its kernels leave each at 0 when a launch ends)."""
    return _kept(("zeros", owner, device), n, lambda m: torch.zeros(m, dtype=torch.int32, device=device))


def scratch(owner: str, n: int, device) -> torch.Tensor:
    """n float32 elements of `owner`'s scratch, contents undefined: one buffer grown to the most asked for (a power of
    two), in place of an allocation a launch plan. Views of it are valid until the owner's next call: one plan at a
    time (its launches read what they wrote before the next plan's are enqueued on the stream)."""
    return _buffer(("scratch", owner, device), n,
                   lambda m: torch.empty(1 << max(10, (m - 1).bit_length()), dtype=torch.float32, device=device))


def arange(n: int, device) -> torch.Tensor:
    """0 .. n - 1, int64."""
    return _kept(("arange", device), n, lambda m: torch.arange(m, dtype=torch.long, device=device))


def ones(device, dtype=torch.float32) -> torch.Tensor:
    """[1] of ones."""
    return _kept(("ones", device, dtype), 1, lambda m: torch.ones(1, dtype=dtype, device=device))
