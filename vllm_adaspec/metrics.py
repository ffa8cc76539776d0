"""Drafting statistics that leave the engine: per-request histograms and the snapshot files the server reads.

The drafter lives in the engine-core (or worker) process; the server's /metrics and its periodic log live in the
front-end process. The worker writes the drafter's cumulative counters to a small JSON snapshot (atomically, at
most every `interval` seconds) in a folder named by the environment variable below, which the front end sets
before it starts the engine (children inherit it). engine/metrics.py turns the snapshots into Prometheus metrics.
Pure Python: no vLLM import.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

ENV = "VLLM_ADASPEC_STATS_DIR"
# Per finished request: share of its verified drafts the target accepted, and drafts proposed per round.
ACCEPTANCE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
DRAFTS_PER_ROUND_BUCKETS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0)


def new_histogram(buckets: tuple[float, ...]) -> dict:
    """counts[i] = observations <= buckets[i] and > buckets[i-1]; the last count is above every bucket."""
    return {"buckets": list(buckets), "counts": [0] * (len(buckets) + 1), "sum": 0.0, "count": 0}


def observe(hist: dict, value: float) -> None:
    i = next((j for j, b in enumerate(hist["buckets"]) if value <= b), len(hist["buckets"]))
    hist["counts"][i] += 1
    hist["sum"] += value
    hist["count"] += 1


def ensure_stats_dir() -> str:
    """The snapshot folder for engines started from this process (created once; inherited by its children)."""
    path = os.environ.get(ENV)
    if not path:
        path = os.environ[ENV] = tempfile.mkdtemp(prefix="vllm-adaspec-stats-")
    return path


class SnapshotWriter:
    """Worker side: `maybe_write(stats)` after each step; cheap when nothing is due."""

    def __init__(self, tag: str, interval: float = 0.5):
        folder = os.environ.get(ENV)
        self.path = os.path.join(folder, f"engine-{os.getpid()}-{tag}.json") if folder else None
        self.interval = interval
        self._last = 0.0

    def maybe_write(self, stats, force: bool = False) -> bool:
        """stats: a dict, or a function returning one (called only when a snapshot is due)."""
        now = time.monotonic()
        if self.path is None or (not force and now - self._last < self.interval):
            return False
        self._last = now
        if callable(stats):
            stats = stats()
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump({"pid": os.getpid(), "time": time.time(), "stats": stats}, f)
            os.replace(tmp, self.path)
        except OSError:  # the folder was removed under us: statistics are best effort, decoding is not
            return False
        return True


def read_snapshots(folder: str | None = None) -> list[dict]:
    """Front-end side: the latest stats of every live engine that writes into `folder`."""
    folder = folder or os.environ.get(ENV)
    if not folder or not os.path.isdir(folder):
        return []
    out = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                snap = json.load(f)
            os.kill(int(snap["pid"]), 0)  # skip engines that are gone (an earlier engine of this process)
        except (OSError, ValueError, KeyError):
            continue
        out.append(snap["stats"])
    return out


def summary_line(now: dict, before: dict | None) -> str:
    """One log line over the interval between two snapshots of one engine's stats."""
    before = before or {}
    d = {k: now.get(k, 0) - before.get(k, 0) for k in ("propose_calls", "draft_tokens", "verified_drafts",
                                                        "accepted_drafts", "draft_seconds")}
    rounds = sum(now.get("round_lengths", [])) - sum(before.get("round_lengths", []))
    acc = d["accepted_drafts"] / d["verified_drafts"] if d["verified_drafts"] else 0.0
    per_round = d["draft_tokens"] / rounds if rounds else 0.0
    return (f"adaspec [{now.get('policy')}]: {rounds} draft rounds, {per_round:.2f} drafts/round, "
            f"acceptance {100 * acc:.1f}%, {d['accepted_drafts']} tokens from drafts, "
            f"drafting {d['draft_seconds']:.2f} s")
