"""kernels/ready_launch.py: a step's kernel launched without Triton's dispatch where a launch Triton compiles alike ran
before. This machine has no GPU (the interpreter returns no compiled kernel), so the dispatch and the compiled
kernel are stand-ins that record what they were handed; the key is checked against Triton's own specialization."""

import itertools
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.runtime.jit import JITFunction  # noqa: E402

from vllm_adaspec.kernels import ready_launch as rl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _kernel(x_ptr, y_ptr, n, stride, scale, flag, BLOCK: "tl.constexpr"):  # noqa: F821 (a signature, never run)
    pass


class _Compiled:
    """Triton's CompiledKernel as the ready path uses it: `[grid](*args)` (every argument in the kernel's order,
    tensors as pointers)."""

    def __init__(self, calls, fail):
        self.calls, self.fail = calls, fail

    def run(self, *a):
        raise AssertionError("launched through __getitem__")

    def __getitem__(self, grid):
        def runner(*args):
            if self.fail:
                raise TypeError("a Triton that launches otherwise")
            self.calls.append(("compiled", grid, args))
        return runner


class _Dispatch:
    """A JITFunction whose dispatch records its call and returns a compiled kernel (as JITFunction.run does)."""

    def __init__(self, fail=False):
        real = JITFunction(_kernel, do_not_specialize=["stride"])
        self.arg_names, self.params, self.calls, self.fail = real.arg_names, real.params, [], fail

    def __getitem__(self, grid):
        def dispatch(*args, **kwargs):
            self.calls.append(("dispatch", grid, args, kwargs))
            return _Compiled(self.calls, self.fail)
        return dispatch


def test_a_launch_like_one_before_calls_the_compiled_kernel_with_the_dispatchs_arguments():
    """The first launch of a specialization dispatches; the next ones with the same specialization call the
    compiled kernel with every argument in the kernel's order, tensors as their pointers; what Triton would
    specialize differently (dtype, alignment, an int's == 1 / % 16 / width, a float, a constexpr, an option)
    dispatches again; a ready launch that raises warns, turns the path off and dispatches."""
    rl.FAST = True
    try:
        k = _Dispatch()
        ready = rl.ready(k)
        buf = torch.zeros(64)
        x, y = buf[:16], buf[16:32]  # 64-byte offsets: aligned
        ready[(3,)](x, y, 32, 5, 0.5, True, BLOCK=16, num_warps=4)
        ready[(7, 2)](y, x, 48, 9, 0.5, True, BLOCK=16, num_warps=4)  # another grid, other pointers and ints
        assert [c[0] for c in k.calls] == ["dispatch", "compiled"]
        assert k.calls[1][1] == (7, 2, 1)  # padded as Triton's runner reads it
        assert k.calls[1][2] == (y.data_ptr(), x.data_ptr(), 48, 9, 0.5, True, 16)
        variants = [((buf[1:17], y, 32, 5, 0.5, True), dict(BLOCK=16, num_warps=4)),  # a misaligned pointer
                    ((x.double(), y, 32, 5, 0.5, True), dict(BLOCK=16, num_warps=4)),  # another dtype
                    ((x, y, 33, 5, 0.5, True), dict(BLOCK=16, num_warps=4)),  # not a multiple of 16
                    ((x, y, 1, 5, 0.5, True), dict(BLOCK=16, num_warps=4)),  # one
                    ((x, y, 2 ** 33, 5, 0.5, True), dict(BLOCK=16, num_warps=4)),  # 64-bit
                    ((x, y, 32, 5, 0.25, True), dict(BLOCK=16, num_warps=4)),  # a float
                    ((x, y, 32, 5, 0.5, False), dict(BLOCK=16, num_warps=4)),  # a bool
                    ((x, y, 32, 5, 0.5, True), dict(BLOCK=32, num_warps=4)),  # a constexpr
                    ((x, y, 32, 5, 0.5, True), dict(BLOCK=16, num_warps=8))]  # a launch option
        for args, kwargs in variants:
            n = len(k.calls)
            ready[(1,)](*args, **kwargs)
            assert k.calls[n][0] == "dispatch", (args, kwargs)
            ready[(1,)](*args, **kwargs)
            assert k.calls[n + 1][0] == "compiled", (args, kwargs)
        ready[(1,)](x, y, 32, 6, 0.5, True, BLOCK=16, num_warps=4)  # only a do-not-specialize int changed: ready
        assert k.calls[-1][0] == "compiled"
        failing = rl.ready(_Dispatch(fail=True))
        failing[(1,)](x, y, 32, 5, 0.5, True, BLOCK=16)
        with pytest.warns(RuntimeWarning, match="launching the compiled kernel directly failed"):
            failing[(1,)](x, y, 32, 5, 0.5, True, BLOCK=16)
        assert [c[0] for c in failing.kernel.calls] == ["dispatch", "dispatch"] and not rl.FAST
        n = len(k.calls)
        ready[(3,)](x, y, 32, 5, 0.5, True, BLOCK=16, num_warps=4)  # off for good, every kernel: dispatched
        assert [c[0] for c in k.calls[n:]] == ["dispatch"]
    finally:
        rl.FAST = True


def key_against_triton() -> int:
    """Pairs of arguments sharing a key, each pair checked to get one specialization from Triton's own function
    (its CUDA backend, with and without specialization and alignment)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    buf = torch.zeros(256, dtype=torch.float64)
    values = [buf, buf[1:], buf[2:], buf[3:], buf.float(), buf.float()[1:], buf.float()[4:], buf.half(),
              buf.bfloat16()[8:], buf.to(torch.int32), buf.long()[3:], buf.bool()]
    values += [0, 1, 2, 15, 16, 17, 32, -16, -1, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 16, -2 ** 31, -2 ** 31 - 1,
               2 ** 63 - 16, 2 ** 63, 2 ** 64 - 1, True, False, None, 0.5, 1.0, 3e38, 1e300, -0.0]
    checked = 0
    for a, b in itertools.combinations(values, 2):
        if rl.spec(a, False) == rl.spec(b, False):
            for specialize, align in itertools.product((True, False), (True, False)):
                ta = native_specialize_impl(CUDABackend, a, False, specialize, align)
                tb = native_specialize_impl(CUDABackend, b, False, specialize, align)
                assert ta == tb, (a, b, ta, tb)
            checked += 1
    return checked


def test_the_key_is_at_least_as_fine_as_tritons_specialization():
    """Any two arguments with the same key get the same specialization from Triton: the ready path never reuses a
    kernel Triton would have compiled otherwise. In a process of its own without the interpreter (as a GPU engine
    runs: Triton's CUDA backend cannot load once the interpreter decorated triton.language)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys; sys.path.insert(0, 'tests'); import test_kernel_ready_launch as t; "
            "print('checked', t.key_against_triton())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split("checked")[-1]) >= 10  # some pairs did share a key
    assert rl.spec(16, True) != rl.spec(32, True)  # constexprs by value


def test_the_real_kernels_launch_through_it_in_the_interpreter(triton_interpret):
    """Under the interpreter (this machine's tests) every launch dispatches and nothing is held: the kernels'
    results stay what their own tests check."""
    from conftest import load_interpreted

    tv = load_interpreted("tree_verify")
    assert isinstance(tv._READY, rl.ReadyKernel)
    from conftest import random_trees
    from vllm_adaspec.trees import pack_trees

    g = torch.Generator().manual_seed(1)
    trees = random_trees(3, g, 12, vocab=3)
    batch = pack_trees(trees, [len(t) for t in trees], width=max(len(t) for t in trees))
    draws = torch.randint(0, 3, (3, batch.tokens.shape[1] + 1), generator=g)
    for _ in range(2):
        got, want = (torch.full((4, 17), 7, dtype=torch.int32) for _ in range(2))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            a = tv.verify_trees(batch, draws, got, torch.tensor([3, 0, 2]))
        b = tv.verify_trees_reference(batch, draws, want, torch.tensor([3, 0, 2]))
        assert all(torch.equal(x, y) for x, y in zip(a, b)) and torch.equal(got, want)
    assert not tv._READY.compiled
