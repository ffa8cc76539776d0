"""Fault containment: our code only saves time, so an exception in it never reaches vLLM's worker.

The driver (proposers/driver.py) runs every drafter call, and the tree runtime / tree sampler (engine/) their
planning and verification, inside `FaultGuard.contain`-style try blocks: on an exception the step goes on as plain
decoding for the requests concerned (nothing proposed, or a planned tree verified as a chain or with no node
accepted: each is lossless), the error is logged once with its traceback and counted (`drafter_faults`,
/metrics `vllm:adaspec_drafter_faults_total`), and after `fault_limit` faults drafting is off for the rest of the
engine's life (one log line says so).

Fault injection, for tests (the engine runs in another process, so it is asked for by environment variable):

    VLLM_ADASPEC_INJECT_FAULTS="trie@3,suffix@10,tree_verify@20"

raises `InjectedFault` at the 3rd pass through the failpoint "trie", the 10th through "suffix", ... (`place@n`;
repeat a place for several faults; with VLLM_ADASPEC_INJECT_FAULTS_RANK=R, only on tensor-parallel rank R).
Failpoints: one per pool (its name, pools.POOLS: in the pool set's propose), "trie" (MultiBranchProposer's merge),
"draft" (early exit: after its first draft pass), "tree_plan" (planning a step's trees), "tree_verify" (verifying a
tree request), "tree_only" (verifying a request whose settings only the tree sampler applies: min_p, logit_bias, a
grammar over tree rows; its fallback is one token from its root row, every setting applied), "compaction" (after the
paged KV of accepted nodes moved), "tree_kernel", "draw_kernel", "verify_kernel", "compaction_kernel" (a GPU
runtime's launches of the tree-attention, row-draw, verification and KV compaction kernels). Unset, `point` is one attribute test.

The negative control of the sampling tests (they must reject a verifier that is not lossless):

    VLLM_ADASPEC_BIASED_VERIFIER_SEEDS=N

makes tree verification of requests seeded with N or more accept, with probability 0.5, one child of the last
accepted node that the exact rule rejected (`biased`). Unset, nothing changes.

Tensor parallelism: every rank drafts and verifies, and the ranks must do the same or their attention diverges. A
fault contained on one rank alone would make it draft or verify differently, so under TP each place where a fault
changes what a step does asks the other ranks (`agree`, one small all-reduce on the host): a fault on any rank turns
that step's drafts (or trees) off on every rank, and every rank counts it, so the fault limit is reached together.
"""

from __future__ import annotations

import logging
import os
import random
from collections import Counter

logger = logging.getLogger("vllm_adaspec")

INJECT_ENV = "VLLM_ADASPEC_INJECT_FAULTS"
INJECT_RANK_ENV = "VLLM_ADASPEC_INJECT_FAULTS_RANK"
BIAS_ENV = "VLLM_ADASPEC_BIASED_VERIFIER_SEEDS"
BIAS = 0.5  # how often a biased verifier accepts a rejected node
# besides one per pool (its name: pools.POOLS, the registry)
STEP_FAILPOINTS = ("trie", "draft", "tree_plan", "tree_verify", "tree_only", "compaction", "tree_kernel", "draw_kernel",
                   "verify_kernel", "compaction_kernel")


def failpoints() -> tuple[str, ...]:
    from vllm_adaspec.pools import POOLS

    return (*POOLS, *STEP_FAILPOINTS)


FAILPOINTS = failpoints()


class InjectedFault(RuntimeError):
    """Raised at a failpoint by fault injection (tests)."""


def parse_injection(spec: str) -> dict[str, set[int]]:
    """"place@n,place@m" -> {place: {n, m}}; a clear error for anything else (a test's typo must not pass silently)."""
    out: dict[str, set[int]] = {}
    places = failpoints()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        place, _, n = item.partition("@")
        if place not in places or not n.isdigit() or int(n) < 1:
            raise ValueError(f"{INJECT_ENV}: {item!r} is not PLACE@N with PLACE one of {', '.join(places)} "
                             "and N >= 1")
        out.setdefault(place, set()).add(int(n))
    return out


class FaultGuard:
    """One per engine worker, shared by the driver and the tree path: counts faults, says when drafting is off,
    and runs the failpoints of fault injection."""

    def __init__(self, limit: int, inject: dict[str, set[int]] | None = None, biased_from_seed: int | None = None):
        self.limit = limit  # faults after which drafting is off for the engine's life
        self.count = 0
        self.by_place: Counter = Counter()
        self.off = False
        self.inject = inject or None  # place -> passes that raise
        self.passes: Counter = Counter()
        self.biased_from_seed = biased_from_seed  # the sampling tests' negative control (module docstring)
        self._coin = random.Random(0)
        self.inject_rank: int | None = None  # injection only on this tensor-parallel rank
        self.rank = 0  # this worker's tensor-parallel rank (set by the worker)
        # Tensor parallelism (set by the worker when TP > 1): values -> their largest over the ranks, elementwise
        self.sync = None

    @classmethod
    def from_env(cls, limit: int) -> FaultGuard:
        spec, bias = os.environ.get(INJECT_ENV, ""), os.environ.get(BIAS_ENV, "")
        guard = cls(limit, parse_injection(spec) if spec else None, int(bias) if bias else None)
        rank = os.environ.get(INJECT_RANK_ENV, "")
        guard.inject_rank = int(rank) if rank else None
        return guard

    def agree_rows(self, faulted: bool, where: str, flags: list[int]) -> tuple[bool, list[int]]:
        """`agree`, with per-row flags (0 / 1) taken as their largest over the ranks in the same collective: a row
        flagged on any rank is flagged on every rank. Without TP: (faulted, flags)."""
        if self.sync is None:
            return faulted, list(flags)
        return self._agree(faulted, where, 0, False, list(flags))

    def agree(self, faulted: bool, where: str, digest: int = 0, off: bool = False) -> bool:
        """Whether a fault happened at `where` in this step on any tensor-parallel rank (this one: `faulted`), or
        drafting is `off` on one, or the ranks' `digest`s of what they are about to do differ; the ranks' fault
        counts become the largest of them (so they reach the limit together). Every rank must call it at the same
        places in the same order (a collective). Without TP: `faulted`."""
        if self.sync is None:
            return faulted
        return self._agree(faulted, where, digest, off, [])[0]

    def _agree(self, faulted: bool, where: str, digest: int, off: bool, flags: list[int]) -> tuple[bool, list[int]]:
        anywhere, count, hi, neg_lo, off_somewhere, *flags = self.sync([int(faulted), self.count, digest, -digest,
                                                                       int(off), *flags])
        if off_somewhere:
            anywhere = 1
        elif hi != -neg_lo:
            logger.error("vllm_adaspec: the tensor-parallel ranks planned different things at %s; this step decodes "
                         "without speculation for the requests concerned on every rank", where)
            anywhere = 1
        elif anywhere and not faulted:
            logger.error("vllm_adaspec: %s failed on another tensor-parallel rank; this step decodes without "
                         "speculation for the requests concerned on every rank", where)
        if count > self.count:
            self.by_place["on another tensor-parallel rank"] += count - self.count
            self.count = count
            self._check_limit()
        return bool(anywhere), flags

    def biased(self, generator) -> bool:
        """Negative control: should this request's verifier (its torch.Generator, or None) accept a rejected node
        now? Never unless VLLM_ADASPEC_BIASED_VERIFIER_SEEDS is set."""
        if self.biased_from_seed is None or generator is None or generator.initial_seed() < self.biased_from_seed:
            return False
        return self._coin.random() < BIAS

    def point(self, place: str) -> None:
        """A failpoint: raises InjectedFault when injection asked for this pass through `place`."""
        if self.inject is None or place not in self.inject or self.inject_rank not in (None, self.rank):
            return
        self.passes[place] += 1
        if self.passes[place] in self.inject[place]:
            raise InjectedFault(f"fault injected at {place!r}, pass {self.passes[place]} ({INJECT_ENV})")

    def record(self, where: str, exc: BaseException) -> None:
        """An exception was contained at `where`: log it with its traceback, count it, turn drafting off at the
        limit."""
        self.count += 1
        self.by_place[where] += 1
        logger.error("vllm_adaspec: %s failed (%s: %s); this step decodes without speculation for the requests "
                     "concerned (fault %d; drafting stops after %d)", where, type(exc).__name__, exc, self.count,
                     self.limit, exc_info=exc)
        self._check_limit()

    def _check_limit(self) -> None:
        if self.count >= self.limit and not self.off:
            self.off = True
            logger.error("vllm_adaspec: %d faults in the drafter (fault_limit = %d): speculation is off for the rest "
                         "of this engine's life; requests decode plainly, with the same output", self.count,
                         self.limit)
