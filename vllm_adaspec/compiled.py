"""numba for the drafter's and the GPU plan's hot loops (trees/step_plan.py, trees/step_choice.py, the context and
corpus pools): one place that says how they are compiled. numba comes with vLLM; without it `AVAILABLE` is False and
each caller keeps its Python (the same results, more host time)."""

from __future__ import annotations

import logging
from typing import Callable

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


def warmed(warm_up: Callable[[], object], failure: str) -> bool:
    """warm_up() run now, at start-up (numba compiles, or loads its disk cache), so that nothing compiles in a step.
    False where numba is missing, or with one warning ("vllm_adaspec: " + failure) where warm_up fails: the caller
    keeps its Python (the same results, more host time)."""
    if not AVAILABLE:
        return False
    try:
        warm_up()
        return True
    except Exception:
        logging.getLogger("vllm_adaspec").warning("vllm_adaspec: %s", failure, exc_info=True)
        return False
