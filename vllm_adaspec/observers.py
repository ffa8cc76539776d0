"""Instrumentation kept out of the hot paths: observers that tests (and `adaspec train c2t`) attach. The engine runs
in its own process, so they are asked for by environment variable; the worker builds them once (`from_env`) and
hands them to the drafter and the tree runtime. With none attached, each hook point is an empty loop.

    VLLM_ADASPEC_RECORD_DRAFTS=1       DraftRecorder: per request its counts and the first draft after each
                                       committed length; Medusa head 1's top token (references in plain torch)
    VLLM_ADASPEC_CHECK_TARGET_ROWS=1   TargetRowCheck: the target row a drafter reads re-produces its token (greedy)
    VLLM_ADASPEC_RECORD_TREES=1        TreeRecorder: features and accepted labels of every verified tree (C2T data)
    VLLM_ADASPEC_CHECK_BRANCH_SLOTS=1  BranchSlotCheck: no committed position is ever read from a branch row's KV
    VLLM_ADASPEC_AUDIT=1               CostAudit: the step cost model's prediction of every pure decode step against
                                       its measured time, each proposal's expected tokens against what it committed,
                                       and the calibrated node probabilities against acceptance, per pool
                                       (benchmarks/audit_cost_model.py)

Each observer's counters come back in the drafter's statistics (`LLM.collective_rpc("adaspec_stats")`).
"""

from __future__ import annotations

import os

import numpy as np


class Observer:
    """Hook points (all optional). Drafter: after_propose, target_rows, medusa_top, tree_features, tree_outcome.
    Tree runtime: before_forward, forget."""
    wants_tree_features = False

    def after_propose(self, view, plans: dict, states) -> None: ...
    def target_rows(self, tokens: list[int], hidden) -> None: ...
    def medusa_top(self, req_ids: list[str], lengths: list[int], top_ids) -> None: ...
    def tree_features(self, req_id: str, features: np.ndarray, parents: np.ndarray) -> None: ...
    def tree_outcome(self, req_id: str, accepted: tuple[int, ...]) -> None: ...
    def before_forward(self, req_ids: list[str], query_start: np.ndarray, roots: np.ndarray, step) -> None: ...
    def forget(self, req_ids) -> None: ...
    def step_cost(self, shape: tuple, predicted: float, measured: float) -> None: ...
    def proposal_outcome(self, req_id: str, expected: float, committed: int, nodes: list, tree: bool) -> None: ...

    def stats(self) -> dict:
        return {}

    def live(self) -> dict:
        return {}


class DraftRecorder(Observer):
    def __init__(self):
        self.per_request: dict[str, list[int]] = {}  # [decode steps, rounds with drafts, drafts, accepted]
        self.first_drafts: dict[str, dict] = {}  # req -> {"tokens": committed, "drafts": [[length, draft 0], ...]}
        self.medusa_top1: dict[str, list] = {}  # req -> [[committed tokens, head 1's top token], ...]
        self.tree_rounds: dict[str, int] = {}  # req -> plans verified in the tree path

    def after_propose(self, view, plans, states) -> None:
        for i, sampled in enumerate(view.sampled):
            if not sampled:
                continue
            rs = states.get(view.req_ids[i])
            self.per_request[view.req_ids[i]] = [rs.steps, rs.rounds, rs.drafted, rs.accepted]
        for i, plan in plans.items():
            if plan.is_tree:
                self.tree_rounds[view.req_ids[i]] = self.tree_rounds.get(view.req_ids[i], 0) + 1
            if plan.tokens:
                r = self.first_drafts.setdefault(view.req_ids[i], {"tokens": [], "drafts": []})
                r["tokens"] = view.tokens(i).tolist()
                r["drafts"].append([int(view.num_tokens[i]), plan.tokens[0]])

    def medusa_top(self, req_ids, lengths, top_ids) -> None:
        for e, (req_id, n) in enumerate(zip(req_ids, lengths)):
            self.medusa_top1.setdefault(req_id, []).append([n, int(top_ids[e][0][0])])

    def stats(self) -> dict:
        return {"per_request": self.per_request, "first_drafts": self.first_drafts, "tree_rounds_by_request": self.tree_rounds,
                **({"medusa_top1": self.medusa_top1} if self.medusa_top1 else {})}


class TargetRowCheck(Observer):
    """The final hidden state a drafter reads for a request (its bonus row) must, through the LM head, give the
    token the request just committed (greedy runs)."""

    def __init__(self, compute_logits):
        self.compute_logits = compute_logits  # hidden [R, H] -> logits [R, V]
        self.checks = self.mismatches = 0

    def target_rows(self, tokens, hidden) -> None:
        got = self.compute_logits(hidden).argmax(-1).tolist()
        self.checks += len(tokens)
        self.mismatches += sum(g != t for g, t in zip(got, tokens))

    def stats(self) -> dict:
        return {"row_checks": self.checks, "row_mismatches": self.mismatches}


class TreeRecorder(Observer):
    """Per verified tree: its nodes' features and which were accepted (`adaspec train c2t` reads these)."""
    wants_tree_features = True

    def __init__(self):
        self.pending: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # req -> (features [nodes, 3], parents)
        self.records: list = []

    def tree_features(self, req_id, features, parents) -> None:
        self.pending[req_id] = (features, parents)

    def tree_outcome(self, req_id, accepted) -> None:
        tree = self.pending.pop(req_id, None)
        if tree is not None:
            labels = np.zeros(len(tree[0]), dtype=bool)
            labels[list(accepted)] = True
            self.records.append((tree[0].tolist(), labels.tolist(), tree[1].tolist()))  # (stats travel as JSON)

    def forget(self, req_ids) -> None:
        for r in req_ids:
            self.pending.pop(r, None)

    def stats(self) -> dict:
        return {"tree_records": self.records}

    def live(self) -> dict:
        return {"tree_features": len(self.pending)}


class BranchSlotCheck(Observer):
    """Before every forward (each scheduled request, tree or not): a position a draft-branch row wrote must not
    be part of the request's committed prefix (positions below its first row, which this forward reads as final).
    Then: this forward's rows overwrite their positions, and its branch rows leave theirs dirty. Compaction only ever
    moves verified nodes to root + 1 .. root + accepted, below every branch position (branch rows come last)."""

    def __init__(self):
        self.dirty: dict[str, set[int]] = {}  # req_id -> positions last written by a branch row
        self.checked = 0
        self.violations = 0

    def before_forward(self, req_ids, query_start, roots, step) -> None:
        branch_rows = {r.req_id: r for r in step.requests if r.branch_rows} if step is not None else {}
        for row, req_id in enumerate(req_ids):
            start, end = int(query_start[row]), int(query_start[row + 1])
            if end <= start:
                continue
            root = int(roots[row])  # the position of the request's first scheduled row
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
        return {"branch_slot_checks": {"checked": self.checked, "violations": self.violations}}

    def live(self) -> dict:
        return {"branch_slot_records": len(self.dirty)}


RELIABILITY_BINS = 10  # calibrated probability in tenths


class CostAudit(Observer):
    """What the cost model and the calibration predicted against what happened (benchmarks/audit_cost_model.py):

    audit_steps: [batch, rows, tree requests, tree rows, attention load, predicted s, measured s] per pure decode
    step the cost model observed (at most MAX entries); audit_rounds: per request, [expected committed tokens (1 +
    the chosen nodes' path probabilities), committed, nodes, tree] per verified proposal; audit_reliability: per
    pool (and "all"), per tenth of calibrated path probability, [nodes verified, accepted]."""
    MAX = 50000

    def __init__(self):
        self.steps: list = []
        self.rounds: dict[str, list] = {}
        self.reliability: dict[str, list] = {}

    def step_cost(self, shape, predicted, measured) -> None:
        if len(self.steps) < self.MAX:
            self.steps.append([*shape, predicted, measured])

    def proposal_outcome(self, req_id, expected, committed, nodes, tree) -> None:
        self.rounds.setdefault(req_id, []).append([expected, committed, len(nodes), tree])
        for prob, pools, accepted in nodes:
            b = min(RELIABILITY_BINS - 1, int(prob * RELIABILITY_BINS))
            for pool in ("all", *pools):
                cell = self.reliability.setdefault(pool, [[0, 0] for _ in range(RELIABILITY_BINS)])[b]
                cell[0] += 1
                cell[1] += int(accepted)

    def stats(self) -> dict:
        return {"audit_steps": self.steps, "audit_rounds": self.rounds, "audit_reliability": self.reliability}


def from_env(compute_logits=None) -> list[Observer]:
    """The observers the environment asks for. compute_logits: the target's LM head (TargetRowCheck)."""
    on = lambda name: os.environ.get(f"VLLM_ADASPEC_{name}") == "1"  # noqa: E731
    out: list[Observer] = []
    if on("RECORD_DRAFTS"):
        out.append(DraftRecorder())
    if on("CHECK_TARGET_ROWS") and compute_logits is not None:
        out.append(TargetRowCheck(compute_logits))
    if on("RECORD_TREES"):
        out.append(TreeRecorder())
    if on("CHECK_BRANCH_SLOTS"):
        out.append(BranchSlotCheck())
    if on("AUDIT"):
        out.append(CostAudit())
    return out
