"""numba for the drafter's and the GPU plan's hot loops (trees/step_plan.py, trees/step_choice.py, the context and
corpus pools): one place that says how they are compiled. numba comes with vLLM; without it `AVAILABLE` is False and
each caller keeps its Python (the same results, more host time)."""

from __future__ import annotations

try:
    from numba import njit
except ImportError:
    njit = None

AVAILABLE = njit is not None


def compiled(fn):
    """fn compiled by numba on its first call, its machine code cached on disk (beside the module, else in the
    user's cache folder); where neither is writable, compiled anew at every start. Bounds checked: an index out of
    range raises IndexError (a fault the caller contains) instead of reading or writing past an array."""
    try:
        return njit(cache=True, boundscheck=True)(fn)
    except Exception:  # numba: "cannot cache function ...: no locator available"
        return njit(boundscheck=True)(fn)
