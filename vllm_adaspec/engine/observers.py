"""Test instrumentation, kept out of the hot paths: observers the tests switch on (an environment variable, since
the engine runs in its own process), attached once when the worker installs its hooks. With none attached the
runtime's observer loop is empty.

    VLLM_ADASPEC_CHECK_BRANCH_SLOTS=1   BranchSlotCheck: no committed position is ever read from a branch row's KV
"""

from __future__ import annotations

import os

import numpy as np
import torch


class BranchSlotCheck:
    """Before every forward (each scheduled request, tree or not): a position a draft-branch row wrote must not
    be part of the request's committed prefix (positions below its first row, which this forward reads as final).
    Then: this forward's rows overwrite their positions, and its branch rows leave theirs dirty. Compaction only ever
    moves verified nodes to root + 1 .. root + accepted, below every branch position (branch rows come last)."""

    def __init__(self):
        self.dirty: dict[str, set[int]] = {}  # req_id -> positions last written by a branch row
        self.checked = 0
        self.violations = 0

    def before_forward(self, req_ids: list[str], query_start: np.ndarray, positions: torch.Tensor, step) -> None:
        branch_rows = {r.req_id: r for r in step.requests if r.branch_rows} if step is not None else {}
        for row, req_id in enumerate(req_ids):
            start, end = int(query_start[row]), int(query_start[row + 1])
            if end <= start:
                continue
            root = int(positions[start])  # never rewritten by planning: the first row keeps its sequence position
            dirty = self.dirty.get(req_id, set())
            self.checked += 1
            self.violations += sum(p < root for p in dirty)
            dirty = {p for p in dirty if p >= end - start + root}
            r = branch_rows.get(req_id)
            if r is not None:
                dirty |= set(range(root + 1 + r.num_verified, root + 1 + len(r.tree)))
            if dirty:
                self.dirty[req_id] = dirty
            else:
                self.dirty.pop(req_id, None)

    def forget(self, req_ids) -> None:
        for r in req_ids:
            self.dirty.pop(r, None)

    def stats(self) -> dict:
        return {"branch_slot_checks": {"checked": self.checked, "violations": self.violations},
                "branch_slot_records": len(self.dirty)}


def runtime_observers() -> list:
    """The tree runtime's observers the environment asks for."""
    return [BranchSlotCheck()] if os.environ.get("VLLM_ADASPEC_CHECK_BRANCH_SLOTS") == "1" else []
