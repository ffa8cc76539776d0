"""A kernel launched once a step, without Triton's dispatch where a launch Triton would compile alike ran before.

Triton's dispatch (`kernel[grid](...)`) binds every argument, specializes each (a tensor's dtype and 16-byte
alignment, an int's width, whether it is 1 or a multiple of 16), builds a cache key string and looks the compiled
kernel up: ~25 us of Python an H200's host spends per launch of the verification kernels (session 36's profile,
three launches a step: the row draws, the verification, the compaction), more than their GPU time. `ready(kernel)`
launches like the kernel: the first launch of each specialization goes through the dispatch, which returns the
compiled kernel; later launches of the same specialization call that compiled kernel's launcher straight away,
with every argument in the kernel's order and tensors as their pointers (as Triton's own launcher receives them).

Our key is finer than Triton's (`spec`: tensors by dtype and pointer % 16, ints by == 1, % 16, and width, floats
and constexprs by value; tests/test_kernel_ready_launch.py checks it against Triton's own specialization), so a
launch never reuses a kernel Triton would have compiled otherwise; at worst it dispatches where it need not. Under
the interpreter the dispatch returns no compiled kernel: every launch dispatches. A ready launch that raises turns
the ready path off for the process (a warning) and that launch dispatches.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["ready", "ReadyKernel", "spec"]

FAST = True  # off: every launch through Triton's dispatch (turned off for good if a ready launch ever fails)
MAX_HELD = 64  # specializations held per kernel (a step's launches have a handful; more: start over)


def spec(value, constexpr: bool):
    """What of one argument Triton's compiled kernel may depend on (at least): tensors -> (dtype, 16-byte aligned),
    ints -> (== 1, % 16 == 0, width), everything else (floats, bools, None, constexprs) by value."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, int) and not isinstance(value, bool) and not constexpr:
        return value == 1, value % 16 == 0, -2 ** 31 <= value < 2 ** 31, value < 2 ** 63
    return type(value), value


def _is_compiled(got) -> bool:
    return hasattr(got, "run") and hasattr(got, "__getitem__")  # a CompiledKernel (None from the interpreter)


class ReadyKernel:
    """`ready(kernel)[grid](*args, **kwargs)` launches as `kernel[grid](*args, **kwargs)` does (module docstring)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.names = list(kernel.arg_names)
        params = getattr(kernel, "params", None)  # (unknown: every argument keyed by value, finer still)
        self.constexpr = [bool(p.is_constexpr) for p in params] if params else [True] * len(self.names)
        self.compiled: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        global FAST
        if not FAST:
            return self.kernel[grid](*args, **kwargs)
        names = self.names
        if len(args) + sum(n in kwargs for n in names[len(args):]) != len(names):  # (defaults: not handled here)
            return self.kernel[grid](*args, **kwargs)
        values = [*args, *(kwargs[n] for n in names[len(args):])]
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in names))
        key = (options, *(spec(v, c) for v, c in zip(values, self.constexpr)))
        got = self.compiled.get(key)
        if got is not None:
            try:
                got[tuple(grid) + (1,) * (3 - len(grid))](
                    *[v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values])
                return got
            except Exception as e:  # a Triton whose compiled kernels launch otherwise: its dispatch from now on
                FAST = False
                self.compiled.clear()
                warnings.warn(f"{getattr(self.kernel, '__name__', 'a kernel')}: launching the compiled kernel "
                              f"directly failed ({type(e).__name__}: {e}); Triton's dispatch launches every kernel "
                              "from now on", RuntimeWarning)
                return self.kernel[grid](*args, **kwargs)
        got = self.kernel[grid](*args, **kwargs)
        if _is_compiled(got):
            if len(self.compiled) >= MAX_HELD:
                self.compiled.clear()
            self.compiled[key] = got
        return got


def ready(kernel) -> ReadyKernel:
    return ReadyKernel(kernel)
