"""What a decoding step costs, learned online from the engine's own step times: the drafters' price list.

A step of b decoding requests verifies R = b + (their drafted rows) rows in one target forward. Its time is a curve
in R (matrix products: flat while the weights dominate, then rising; this CPU's library jumps at a few row
counts), plus what tree verification adds (its own attention per tree request and row). The curve is fitted per
batch-size bucket, so whatever requests happen to run only move the point on the curve, never the curve:
acceptance is not in it (the speed guard it replaces compared tokens/s of whole intervals, which mixed both).

Model, per bucket: seconds = sum_a w_a hat_a(R) + k_b * (b - 1) + k_att * A + k_req * tree_requests + k_row *
tree_rows, hat_a the piecewise-linear basis on anchor row counts (b - 1: what each request adds besides its rows, its
bookkeeping; A: rows weighted by their request's context length, what attention reads: a row of a request deep into
a long document costs more than one of a short chat). Ridge regression towards a prior (the shipped relative curve, scaled by the
machine's measured plain step), with a first-difference penalty so that evidence at one row count moves its
neighbours too, exponential forgetting (the machine's speed drifts) and residuals clipped at a few robust standard
deviations (a garbage collection or the OS must not bend the curve). A bucket with no data of its own starts from
the prior at the global scale, so a new machine (GPU, bigger model) needs no hand measurement.

Decisions read `curve(b)`: the fit lowered where the data are thin, by up to OPTIMISM of it at a row count never
seen and shrinking as steps there are measured (optimism in the face of uncertainty), so that row counts the prior
overprices get tried; `predict` is the fit itself.

Pure Python + numpy: no vLLM, no torch. The drafter owns one model and feeds it one observation per pure decode
step.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

__all__ = ["GPU_VERIFY_COST", "GPU_VERIFY_COST_BY_CARD", "VERIFY_COST", "DraftCost", "Prior", "StepCostModel",
           "TreeExtra", "attention_load", "prior_curve", "prior_for"]

# Relative time of a verification step by the rows it verifies in all (the batch's requests + their drafts; 1 = a plain
# decoding step of one request), SmolLM2-135M float32 on the 2-core CPU of benchmarks/RESULTS.md
# (benchmarks/verify_cost.py, benchmarks/log/2026-11-25.md: batch 1, 1-17 rows; batch 8, 8-136 rows less
# PER_REQUEST_PRIOR * 7), smoothed to a rising curve (this CPU's matrix library is even cheaper at 3-6 rows than at 1:
# the fit finds that).
# The prior every engine starts from, scaled to its own plain step, then refitted online.
VERIFY_COST = {1: 1.0, 2: 1.05, 4: 1.05, 8: 1.08, 12: 1.15, 16: 1.3, 24: 1.65, 32: 1.95, 48: 2.9, 64: 3.7,
               96: 5.1, 136: 6.4}
PER_REQUEST_PRIOR = 0.02  # what each decoding request adds besides its rows, relative

# Anchor row counts of the fitted curve (total rows of a forward): dense where CPU matrix libraries switch paths.
ANCHORS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512, 1024,
           2048)
STEP_COST_ROWS = (1, 2, 4, 8, 16, 32)  # the table's points: 1 + drafted rows above the batch's own
UNIT_STEPS = 31  # steps whose median sets the prior's scale in seconds
# Tree verification over chain verification, prior: per tree request a fifth of a plain step, per tree row 1%
# (benchmarks/log/2026-11-25.md: the CPU tree path's attention over each tree request's prefix, 30 layers).
TREE_REQUEST_PRIOR, TREE_ROW_PRIOR = 0.2, 0.01
ATTENTION_PRIOR = 0.03  # attention per row and 1000 tokens of its context, relative (30 layers at ~50 us)
EXTRA = 4  # features past the anchors: requests - 1, attention load, tree requests, tree rows
OPTIMISM = 0.15  # decisions see an untried row count this much cheaper than the fit (the prior's own uncertainty)
# Decisions re-solve a bucket's fit after this many new steps, not after every one: a solve (a [F, F] inverse) and the
# curve's table cost ~0.1-0.2 ms in the engine (cache-cold after each forward), and one step moves a fit forgetting at
# 0.998 by well under 1%. predict / table (statistics, the audit) always solve.
REFIT_STEPS = 8
PASS_WINDOW = 31  # steps whose median per-pass time prices a draft pass (DraftCost)


# GPU: one decoder forward over R rows in all, relative to a forward over 1 row (bf16, random weights, captured in a
# CUDA graph, a 1024-token context whose new keys are written into the cache in place; one H100, torch 2.11:
# `bench_tree_attention.py --cost-curve`, benchmarks/device_runs/2026-11-27-h100-b/, made monotone where 8 rows timed
# under 4). Rows up to 64 from batch 1, 128-512 from batch 8, 1024-2048 from batch 32 (the batch sizes a step of that
# many rows has). Measured for two model sizes; a model's prior lies between them by the log of its parameter count
# (`prior_for`). Nearly flat until the matrix products turn compute-bound: on a GPU extra rows are almost free. (The
# H100 reference table the GPU targets are stated against, the prior before that run, agrees within 0.1 up to 512 rows:
# 8B 1.11-1.18 up to 64 rows, 2.44 at 512.)
GPU_VERIFY_COST = {
    1.5e9: {1: 1.0, 2: 1.21, 4: 1.21, 8: 1.22, 16: 1.24, 32: 1.24, 64: 1.28, 128: 1.39, 256: 1.63, 512: 2.26,
            1024: 4.10, 2048: 6.88},  # Qwen2.5-1.5B (28 x 1536, GQA 12 / 2): 2.15 ms at 1 row
    8.0e9: {1: 1.0, 2: 1.09, 4: 1.09, 8: 1.09, 16: 1.12, 32: 1.13, 64: 1.13, 128: 1.31, 256: 1.55, 512: 2.39,
            1024: 4.84, 2048: 8.99},  # Llama-3-8B (32 x 4096, GQA 32 / 8): 6.35 ms at 1 row
}
# The same forwards on other cards, by a name their CUDA device name contains (any other card: the H100's). An H200
# (benchmarks/device_runs/2026-11-28-h200/bench_tree_attention.txt, run 1, the same batches): its one-row step is
# faster (8B: 4.92 ms) and its extra rows cost relatively more (8 x 16 rows 1.59x, not 1.31x).
GPU_VERIFY_COST_BY_CARD = {
    "H200": {
        1.5e9: {1: 1.0, 2: 1.24, 4: 1.26, 8: 1.27, 16: 1.28, 32: 1.31, 64: 1.33, 128: 1.43, 256: 1.73, 512: 2.42,
                1024: 4.52, 2048: 7.67},  # 1.89 ms at 1 row
        8.0e9: {1: 1.0, 2: 1.11, 4: 1.11, 8: 1.13, 16: 1.14, 32: 1.17, 64: 1.19, 128: 1.59, 256: 1.88, 512: 3.17,
                1024: 6.28, 2048: 11.71},  # 4.92 ms at 1 row
    },
}


@dataclass(frozen=True)
class Prior:
    """What a step cost model starts from, relative to a plain step of one request: the curve by total rows, what
    each request adds besides its rows, attention per row and 1000 tokens of context, tree verification's extra
    per tree request and per tree row."""
    curve: dict
    per_request: float = 0.02
    attention: float = 0.03
    tree_request: float = 0.2
    tree_row: float = 0.01


def prior_for(device: str, params: float | None = None, card: str | None = None) -> Prior:
    """The prior of an engine on `device` ("cpu", "cuda") for a model of `params` parameters. CPU: the curve
    measured on this project's CPU. CUDA: the card's curves (GPU_VERIFY_COST_BY_CARD by `card`, its device name;
    else GPU_VERIFY_COST, an H100's) between their two measured sizes by log(params) (clamped: no extrapolation),
    with GPU-sized extras (a request's bookkeeping and a tree's kernel are small against a graphed forward;
    attention per 1000 tokens of context as reading that KV costs an 8B model)."""
    if device != "cuda":
        return Prior(VERIFY_COST, PER_REQUEST_PRIOR, ATTENTION_PRIOR, TREE_REQUEST_PRIOR, TREE_ROW_PRIOR)
    curves = next((c for name, c in GPU_VERIFY_COST_BY_CARD.items() if card and name in card), GPU_VERIFY_COST)
    (small, lo), (big, hi) = sorted(curves.items())
    w = 0.5 if not params else min(1.0, max(0.0, math.log(params / small) / math.log(big / small)))
    curve = {r: (1 - w) * lo[r] + w * hi[r] for r in lo}
    return Prior(curve, per_request=0.003, attention=0.005, tree_request=0.02, tree_row=0.002)


def model_parameters(hf_config) -> float | None:
    """About how many parameters a decoder has, from its config (layers x (attention + MLP) + the embeddings and
    an untied LM head)."""
    try:
        h, layers = hf_config.hidden_size, hf_config.num_hidden_layers
        heads = hf_config.num_attention_heads
        kv = getattr(hf_config, "num_key_value_heads", None) or heads
        d = getattr(hf_config, "head_dim", None) or h // heads
        inter = getattr(hf_config, "intermediate_size", 4 * h)
        embeddings = (1 if getattr(hf_config, "tie_word_embeddings", False) else 2) * hf_config.vocab_size * h
        return float(layers * (h * d * (2 * heads + 2 * kv) + 3 * h * inter) + embeddings)
    except (AttributeError, TypeError):
        return None


def attention_load(rows: int, context: int) -> float:
    """The attention feature of `rows` verified rows of a request `context` tokens deep: thousands of tokens read."""
    return rows * context / 1000


def prior_curve(anchors: dict[int, float]) -> Callable[[float], float]:
    """Relative step time by rows, linear between measured anchors {rows: time} and along the last slope past
    them (VERIFY_COST: 1 = a plain step of one request)."""
    xs = sorted(anchors)
    ys = [anchors[x] for x in xs]
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0

    def f(rows: float) -> float:
        if rows >= xs[-1]:
            return ys[-1] + slope * (rows - xs[-1])
        return float(np.interp(rows, xs, ys))

    return f


def _dot(w: list, i: int, t: float, extras: tuple) -> float:
    """features(...) @ w, in Python floats, for the basis (i, t) and the four extra features."""
    return w[i] * (1.0 - t) + w[i + 1] * t + sum(wk * xk for wk, xk in zip(w[-EXTRA:], extras))


def hat(rows: float, anchors) -> tuple[int, float]:
    """Piecewise-linear basis at `rows` over sorted `anchors` (a list or an array): (left anchor index i, weight of
    anchor i + 1); anchor i gets 1 - weight. Past the last anchor the last segment extends (weights outside [0, 1])."""
    i = min(max(bisect.bisect_right(anchors, rows) - 1, 0), len(anchors) - 2)
    return i, (rows - anchors[i]) / (anchors[i + 1] - anchors[i])


@dataclass(frozen=True)
class TreeExtra:
    """Seconds tree verification adds over chains of the same rows: per tree request and per tree row."""
    per_request: float
    per_row: float

    def __call__(self, tree_requests: int, tree_rows: int) -> float:
        return self.per_request * tree_requests + self.per_row * tree_rows


@dataclass
class _Bucket:
    xtx: np.ndarray  # [F, F] forgotten sum of x x^T
    xty: np.ndarray  # [F] forgotten sum of x y
    n: float = 0.0  # forgotten count of observations
    solved: tuple | None = None  # cached (weights, optimistic weights)
    since: int = 0  # observations since the decision fit was solved
    curve: dict | None = None  # batch -> [curve table without `plus` (a list, made when first read), its base, the
    # table as an array], of `solved`
    interp: np.ndarray | None = None  # the anchors' interpolation at integer rows 0, 1, ... under `solved` (no base)
    weights: list | None = None  # solved[0] as Python floats (observe reads it every step)
    pending: list = field(default_factory=list)  # observations not yet in xtx / xty: (i, t, extras, y), folded at a solve
    latest: tuple | None = None  # (observations, fit) of the last fresh solve (statistics), apart from decisions
    scale: float = 0.0  # robust residual scale (seconds)


@dataclass
class StepCostModel:
    """seconds(batch, rows, tree_requests, tree_rows) of one verification step, learned online.

    prior: {rows: relative time}, 1 = a plain step of one request; strength: the prior's weight, in observations per
    anchor; smooth: weight of the first-difference penalty; forget: per-observation forgetting factor of a bucket."""
    prior: dict[int, float] | Prior
    strength: float = 0.5
    smooth: float = 0.5
    forget: float = 0.998
    clip: float = 3.0
    anchors: np.ndarray = field(default_factory=lambda: np.asarray(ANCHORS, dtype=np.float64))
    unit: float | None = None  # seconds of a plain one-request step (the prior's scale): median of the first ratios
    _ratios: list = field(default_factory=list)
    buckets: dict[int, _Bucket] = field(default_factory=dict)
    observations: int = 0

    def __post_init__(self):
        p = self.prior if isinstance(self.prior, Prior) else Prior(self.prior, PER_REQUEST_PRIOR, ATTENTION_PRIOR,
                                                                   TREE_REQUEST_PRIOR, TREE_ROW_PRIOR)
        rel = prior_curve(p.curve)
        self._prior_rel = np.asarray([rel(a) for a in self.anchors]
                                     + [p.per_request, p.attention, p.tree_request, p.tree_row])
        a = len(self.anchors)
        d = np.zeros((a - 1, a + EXTRA))
        d[np.arange(a - 1), np.arange(a - 1)] = -1.0
        d[np.arange(a - 1), np.arange(1, a)] = 1.0
        self._precision = self.strength * np.eye(a + EXTRA) + self.smooth * d.T @ d  # [F, F] prior precision
        self._precision[a:, a:] += self.strength * np.eye(EXTRA) * 4  # few data on these: keep them near the prior
        self._anchor_list, self._prior_list = self.anchors.tolist(), self._prior_rel.tolist()
        self._grid = None  # (i, t, i + 1, 1 - t) of `hat` at integer rows 0 .. n - 1, grown when a longer one is asked

    @staticmethod
    def bucket(batch: int) -> int:
        """1 -> 1, 2-3 -> 2, 4-7 -> 3, 8-15 -> 4, ...: steps with similar batch sizes share a curve."""
        return max(1, batch).bit_length()

    def features(self, rows: float, batch: int = 1, tree_requests: int = 0, tree_rows: int = 0,
                 attention: float = 0.0) -> np.ndarray:
        """attention: the step's rows weighted by their request's context, in thousands of tokens (sum over requests
        of rows x context / 1000): what attention reads grows with it, the matrix products do not."""
        x = np.zeros(len(self.anchors) + EXTRA)
        i, w = hat(rows, self.anchors)
        x[i], x[i + 1] = 1.0 - w, w
        x[-4], x[-3], x[-2], x[-1] = batch - 1, attention, tree_requests, tree_rows
        return x

    def _fit(self, b: int, fresh: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Bucket b's fitted weights [F] in seconds (relative units before the first observation), and their
        optimistic version for decisions (anchor weights lowered by one posterior standard deviation).

        fresh=False (decisions): the bucket's decision fit, re-solved only on a schedule every rank of a
        tensor-parallel engine keeps alike (its first use, then every REFIT_STEPS observations: observe() asks each
        step). fresh=True (predict, table: statistics, the audit): the fit of every observation so far, solved
        apart, so that reading statistics on one rank never moves that rank's decisions."""
        bk = self.buckets.get(b)
        if bk is None:
            prior = self._prior_rel * (self.unit or 1.0)
            return prior, prior
        if bk.solved is None or bk.since >= REFIT_STEPS:
            self._fold(bk)
            bk.solved, bk.since, bk.curve, bk.interp = self._solve(bk.xtx, bk.xty), 0, None, None
            bk.weights = bk.solved[0].tolist()
        if not fresh or not bk.since:
            return bk.solved
        if bk.latest is None or bk.latest[0] != self.observations:
            bk.latest = (self.observations, self._solve(*self._fold(bk, apply=False)))
        return bk.latest[1]

    def _weights(self, b: int) -> list[float]:
        """The decision fit's weights as Python floats (the prior's where the bucket has no steps)."""
        bk = self.buckets.get(b)
        if bk is None:
            return (self._prior_rel * (self.unit or 1.0)).tolist()
        self._fit(b, fresh=False)
        return bk.weights

    def _solve(self, xtx: np.ndarray, xty: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        prior = self._prior_rel * (self.unit or 1.0)
        cov = np.linalg.inv(self._precision + xtx)  # [F, F] posterior covariance / residual variance
        w = cov @ (self._precision @ prior + xty)
        low = w.copy()
        a = len(self.anchors)
        # unseen: diag(cov) * strength ~ 1 (the prior alone); seen n times: ~ strength / n
        untried = np.sqrt(np.clip(np.diag(cov)[:a] * self.strength, 0.0, 1.0))
        low[:a] = w[:a] * (1.0 - OPTIMISM * untried)
        return w, low

    def _fold(self, bk: _Bucket, apply: bool = True):
        """The pending observations into the bucket's forgotten sums, as if each had been added in its turn (apply:
        in place, pending emptied; else the sums that would be, returned, the bucket untouched)."""
        k, a = len(bk.pending), len(self.anchors)
        if not k:
            return None if apply else (bk.xtx, bk.xty)
        x = np.zeros((k, a + EXTRA))  # [k, F]
        y = np.empty(k)
        for j, (i, t, extras, yj) in enumerate(bk.pending):
            x[j, i], x[j, i + 1] = 1.0 - t, t
            x[j, a:] = extras
            y[j] = yj
        xw = x.T * self.forget ** np.arange(k - 1, -1, -1.0)  # [F, k]: the j-th of k forgotten k - 1 - j times
        xtx, xty = bk.xtx * self.forget ** k + xw @ x, bk.xty * self.forget ** k + xw @ y
        if not apply:
            return xtx, xty
        bk.xtx, bk.xty = xtx, xty
        bk.pending.clear()
        return None

    def predict(self, batch: int, rows: float, tree_requests: int = 0, tree_rows: int = 0,
                attention: float = 0.0) -> float:
        return float(self.features(rows, batch, tree_requests, tree_rows, attention) @ self._fit(self.bucket(batch))[0])

    def curve(self, batch: int, plus: float = 0.0) -> Callable[[float], float]:
        """seconds by total rows of a chain step for `batch` decoding requests, optimistic where untried (what
        decisions read), plus `plus` seconds. The integer row counts a step of this batch can verify (16 drafts a
        request) are tabulated in one vectorised pass, once per solve: decisions ask for one per candidate node (~130
        at batch 8)."""
        b = self.bucket(batch)
        w = self._fit(b, fresh=False)[1]
        anchors = self.anchors
        vals = w[:len(anchors)]
        bk = self.buckets.get(b)
        cached = bk.curve.get(batch) if bk is not None and bk.curve is not None else None
        if cached is None:
            base = float(w[-4] * (batch - 1))
            n = 17 * batch + 33
            interp = bk.interp if bk is not None else None
            if interp is None or len(interp) < n:  # once per solve for the bucket's batch sizes (it changes often)
                i, t, i1, one_t = self._hat_grid(n)
                interp = vals[i] * one_t + vals[i1] * t
                if bk is not None:
                    bk.interp = interp
            cached = [None, base, interp[:n] + base]  # the formula below, in its order
            if bk is not None:  # (a queue's batch size moves between a few values: each kept until the next solve)
                if bk.curve is None:
                    bk.curve = {}
                bk.curve[batch] = cached
        _, base, array = cached
        top = len(array) - 1

        def cost(rows: float) -> float:
            if type(rows) is int and 0 <= rows <= top:
                table = cached[0]
                if table is None:  # (the compiled choice reads the array: the list only where Python asks)
                    table = cached[0] = array.tolist()
                return table[rows] + plus
            i, t = hat(rows, anchors)
            return float(vals[i] * (1.0 - t) + vals[i + 1] * t) + base + plus

        # what the compiled node choice reads (trees/step_choice.cost_table): the table with `plus` added once here,
        # where the driver readies the step's prices behind the forward, not in the step's choice
        cost.array, cost.plus, cost.table = array, plus, array + plus
        return cost

    def _hat_grid(self, n: int) -> tuple:
        """`hat` at the integer rows 0 .. n - 1 (at least), vectorised: (i, t, i + 1, 1 - t), each [>= n]."""
        grid = self._grid
        if grid is None or len(grid[0]) < n:
            anchors = self.anchors
            r = np.arange(max(n, 2 * len(grid[0]) if grid is not None else 256), dtype=np.float64)
            i = np.clip(np.searchsorted(anchors, r, side="right") - 1, 0, len(anchors) - 2)
            t = (r - anchors[i]) / (anchors[i + 1] - anchors[i])
            grid = self._grid = (i, t, i + 1, 1.0 - t)
        return grid

    def attention_seconds(self, batch: int) -> float:
        """Seconds a row adds per 1000 tokens of its request's context (attention), for decisions."""
        return max(0.0, self._weights(self.bucket(batch))[-3])

    def tree_extra(self, batch: int, tree_requests: int, tree_rows: int) -> float:
        """Seconds tree verification adds over chains of the same rows."""
        return self.tree_prices(batch)(tree_requests, tree_rows)

    def tree_prices(self, batch: int) -> TreeExtra:
        """tree_extra of this batch size as a function of (tree requests, tree rows)."""
        w = self._weights(self.bucket(batch))
        return TreeExtra(w[-2], w[-1])

    def observe(self, batch: int, rows: int, seconds: float, tree_requests: int = 0, tree_rows: int = 0,
                attention: float = 0.0) -> None:
        """One pure decode step: `batch` requests, `rows` rows verified in all, `seconds` of step time (drafting
        excluded)."""
        if not (seconds > 0 and math.isfinite(seconds)) or batch < 1 or rows < batch:
            return
        # (Python floats, not numpy: this runs every step, cache-cold after the forward; the sums take it at a solve)
        anchors = self._anchor_list
        i, t = hat(rows, anchors)
        extras = (batch - 1, attention, tree_requests, tree_rows)
        if len(self._ratios) < UNIT_STEPS:  # the machine's scale: early steps read through the prior's shape
            self._ratios.append(seconds / _dot(self._prior_list, i, t, extras))
            self.unit = float(np.median(self._ratios))
            for bk in self.buckets.values():  # the scale moved: every fit is re-solved at its next use
                bk.solved = None
        b = self.bucket(batch)
        bk = self.buckets.get(b)
        if bk is None:
            f = len(anchors) + EXTRA
            bk = self.buckets[b] = _Bucket(np.zeros((f, f)), np.zeros(f))
        self._fit(b, fresh=False)
        expected = _dot(bk.weights, i, t, extras)
        resid = seconds - expected
        if bk.n >= 8:  # robust: a residual past `clip` scales counts only that far (floor: 3% of the step)
            limit = self.clip * max(bk.scale, 0.03 * expected)
            resid = max(-limit, min(limit, resid))
        # robust scale: mean absolute residual (x 1.25 ~ a standard deviation), forgotten like the data
        bk.scale = abs(resid) * 1.25 if bk.n == 0 else 0.97 * bk.scale + 0.03 * abs(resid) * 1.25
        bk.pending.append((i, t, extras, expected + resid))
        bk.n = bk.n * self.forget + 1.0
        bk.since += 1
        self.observations += 1

    def table(self) -> dict[str, list]:
        """{"batch size": [observations, milliseconds of a step with each of STEP_COST_ROWS - 1 drafted rows]} for
        every bucket with steps: what the model believes (statistics, /metrics)."""
        out = {}
        for b in sorted(self.buckets):
            batch = 1 << (b - 1)
            out[str(batch)] = [round(self.buckets[b].n, 1)] + [round(self.predict(batch, batch + r - 1) * 1e3, 3)
                                                                for r in STEP_COST_ROWS]
        return out


@dataclass
class DraftCost:
    """Seconds of the drafter's own work per step, per batch-size bucket: fixed + per_pass * passes (passes: the
    drafting model's forward passes that step; 0 for model-free drafting). The per-pass price is timed directly
    (each pass ends in a device->host read of its tokens, so its wall time is its cost), not regressed on the pass
    count: a drafter that drafts the same depth every step leaves that regression no spread to read a slope from,
    and a slope of 0 prices every depth as free. It is the median of the last PASS_WINDOW steps' per-pass times: a
    first pass that warms caches or compiles (seconds) must not price drafting out for the next hundred steps. The
    fixed part is an average with forgetting. (Python floats: read and fed every step.)"""
    forget: float = 0.98
    stats: dict[int, list] = field(default_factory=dict)  # bucket -> [weight, sum of the fixed part]
    passes: dict[int, deque] = field(default_factory=dict)  # bucket -> the last PASS_WINDOW per-pass seconds
    _median: dict[int, float] = field(default_factory=dict)

    def observe(self, batch: int, passes: int, seconds: float, pass_seconds: float = 0.0) -> None:
        """One step: its `passes` draft passes took `pass_seconds` of the drafter's `seconds` in all."""
        if not (seconds >= 0 and math.isfinite(seconds) and math.isfinite(pass_seconds)) or batch < 1:
            return
        b = StepCostModel.bucket(batch)
        s = self.stats.setdefault(b, [0.0, 0.0])
        s[0], s[1] = s[0] * self.forget + 1.0, s[1] * self.forget + max(seconds - pass_seconds, 0.0)
        if passes > 0:
            self.passes.setdefault(b, deque(maxlen=PASS_WINDOW)).append(max(pass_seconds, 0.0) / passes)
            self._median.pop(b, None)

    def per_pass(self, batch: int) -> float:
        b = StepCostModel.bucket(batch)
        if b not in self._median:
            window = self.passes.get(b)
            self._median[b] = float(np.median(window)) if window else 0.0
        return self._median[b]

    def predict(self, batch: int, passes: int) -> float:
        s = self.stats.get(StepCostModel.bucket(batch))
        if s is None or s[0] <= 0:
            return 0.0
        return s[1] / s[0] + self.per_pass(batch) * passes
