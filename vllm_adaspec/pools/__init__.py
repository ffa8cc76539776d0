"""Candidate pools: cheap sources of draft continuations for MultiBranchProposer. No vLLM, no model.

Each pool proposes, for one request, a small tree of candidate tokens rooted at the request's last committed token
(`Candidates`): nodes in parent-before-child order, each with the pool's own estimate of the probability that the
target continues with it given that its parent was accepted, and the pool's evidence for it (a match length, a
head, a rank), which with the pool's name is part of the key under which verification outcomes are counted
(trees/trie.py merges pools and calibrates them).

    context   the earlier occurrences of the request's last tokens in its prompt and output (prompt lookup that
              keeps every recent match and weights continuations by how often they occur)
    suffix    arctic-inference's suffix trees, in tree mode: the request's prompt + the outputs of earlier requests
    recycled  Token Recycling: the target's own top-k successors of every token it verified, walked breadth-first
    corpus    an n-gram table built offline from general text for one tokenizer (shipped for SmolLM2)
    branches  Self-Draft: grams the target writes on draft-branch rows of its verification forwards
    medusa    Medusa heads on the final hidden state of the row that produced the request's last token

Every pool is a `Pool`: per-request state is created by `start` and dropped by `stop`, `extend` feeds newly
committed tokens, `propose` is batched over a step's drafting requests, and verification feeds back through
`observe_logits` / `observe_branches`. `POOLS` is the registry, the one place a pool is declared (what it needs,
its file, its default, in merge order), `make_pools` builds the named ones, `PoolSet` is what the drafter holds.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass
class Candidates:
    """One pool's candidate tree for one request: nodes in parent-before-child order."""
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1 = child of the root (the last committed token)
    probs: list[float] = field(default_factory=list)  # P(node | parent accepted), the pool's estimate
    evidence: list[int] = field(default_factory=list)  # the pool's case for each node (a match length, a head's
    # depth, a successor's rank): part of the node's calibration key (trees/trie.merge buckets it)
    pool: str = ""  # which pool proposed them (the calibration key's pool part)

    def add(self, parent: int, token: int, prob: float, evidence: int = 0) -> int:
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.probs.append(float(prob))
        self.evidence.append(evidence)
        return len(self.tokens) - 1

    def __len__(self) -> int:
        return len(self.tokens)


def continuation_trie(continuations, depth: int, max_nodes: int, pool: str, evidence: int) -> Candidates:
    """Candidates from weighted continuations [(tokens, weight), ...] of the root: shared prefixes are one node (at
    most `max_nodes`, each continuation cut at `depth`), and a node's probability given its parent is the share of
    the parent's weight that continues with it (the root's: of all weight). Every node carries `evidence`."""
    tokens, parents = [], []
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    count: list[float] = []
    total = 0
    for cont, weight in continuations:
        total += weight
        parent = -1
        for t in cont[:depth]:
            node = children.get((parent, t))
            if node is None:
                if len(tokens) >= max_nodes:
                    break
                node = children[(parent, t)] = len(tokens)
                tokens.append(t)
                parents.append(parent)
                count.append(0)
            count[node] += weight
            parent = node
    probs = [c / (count[p] if p >= 0 else total) for c, p in zip(count, parents)]
    return Candidates(tokens, parents, probs, [evidence] * len(tokens), pool)


def as_ints(tokens) -> list[int]:
    """Python ints of a token sequence (a list or an array): table keys must not be numpy scalars (int32 overflow
    in corpus keys, slow hashing)."""
    return tokens.tolist() if isinstance(tokens, np.ndarray) else [int(t) for t in tokens]


@dataclass(frozen=True)
class Taps:
    """What the target handed over this step, one entry per drafting request (the order of `requests`)."""
    hidden: torch.Tensor | None  # [R, H] final hidden state of the row that produced each request's last token
    last_tokens: list[int]  # [R] each request's last committed token


class Pool(ABC):
    """A source of candidate trees. Lifecycle per request: `start` (its first decode step) -> `extend` (every step
    with newly committed tokens) -> `stop` (finished or aborted: its state is dropped). `propose` is batched over
    the step's drafting requests; a pool keeps from start/extend whatever context it needs. Feedback from
    verification comes through the two `observe_*` hooks, no-ops unless a pool reads them."""
    name: str = ""
    logits_k: int = 0  # how many top tokens per verified row `observe_logits` wants (0: it ignores them)

    @classmethod
    def from_build(cls, build: "PoolBuild") -> "Pool":
        """The pool for an engine (make_pools): what it takes of `build`."""
        return cls()

    def start(self, req_id: str, prompt: Sequence[int] | np.ndarray) -> None:
        """The request's first decode step; prompt [P] its prompt tokens."""

    def extend(self, req_id: str, tokens: Sequence[int] | np.ndarray) -> None:
        """tokens [T] committed since the last call (or since the prompt), in order: an array, or a list of Python
        ints (PoolSet.extend converts once for every pool: a list is taken as that)."""

    def stop(self, req_id: str) -> None:
        """Drop the request's state (a request never started is fine)."""

    def live(self) -> int:
        """Per-request states held (leak checks, /metrics)."""
        return 0

    @abstractmethod
    def propose(self, requests: list[str], budgets: list[int], taps: Taps) -> list[Candidates]:
        """One candidate tree per request (at most about `budgets[i]` nodes / that depth; may be empty)."""

    def observe_logits(self, tokens: np.ndarray, top_ids: np.ndarray, top_probs: np.ndarray) -> None:
        """Verified rows: tokens [N] the token each row follows, top_ids / top_probs [N, >= logits_k] the target's
        most probable next tokens there."""

    def observe_branches(self, req_id: str, sent: list[list[int]], predicted: list[int]) -> int:
        """Draft-branch rows of one request's verification forward: the branches it carried and the target's
        argmax at each of their rows, in order (fewer when the scheduler cut the tail). -> grams added."""
        return 0


class TailPool(Pool):
    """A pool whose per-request state is the request's last `keep` tokens (prompt included)."""
    keep: int = 1

    def __init__(self):
        self.tails: dict[str, list[int]] = {}  # req -> its last `keep` tokens

    def start(self, req_id, prompt) -> None:
        self.tails[req_id] = as_ints(prompt[-self.keep:])

    def extend(self, req_id, tokens) -> None:
        tail = self.tails[req_id]
        tail += tokens[-self.keep:] if type(tokens) is list else as_ints(tokens[-self.keep:])
        del tail[:-self.keep]

    def stop(self, req_id) -> None:
        self.tails.pop(req_id, None)

    def live(self) -> int:
        return len(self.tails)


@dataclass(frozen=True)
class PoolBuild:
    """What construction hands every pool (`Pool.from_build` takes what it needs): the engine's vocabulary, the
    files the pools' specs named, loaded (`PoolSpec.file_key`), and the pools' settings."""
    vocab_size: int
    corpus_table: object = None  # a loaded CorpusTable or a path to one
    medusa_heads: object = None  # engine/medusa_heads.MedusaHeads, loaded with the target
    num_branches: int = 0  # Self-Draft
    branch_length: int = 4
    branch_init: str = "prompt"
    branch_seed: Callable[[str], int] = lambda req_id: 0  # req_id -> seed of its branch init
    suffix_cache_requests: int = 1000  # the suffix pool's global cache bound


@dataclass(frozen=True)
class PoolSpec:
    """A pool as the rest of the project knows it, read from here alone: config validation (known and default
    names), the drafter's needs from the step, the start-up lookup of its per-model file, construction and fault
    injection (its failpoint is its name: faults.py)."""
    cls: str  # its Pool class, in vllm_adaspec/pools/<pool name>.py (or "module:Class")
    summary: str
    default: bool = False  # in MultiBranchProposer's default set (left out for a model without its file)
    needs_hidden: bool = False  # Taps.hidden: the target's final hidden states (the worker must hand them over)
    logits_k: int = 0  # the top-k of every verified row `observe_logits` reads (0: none)
    needs_trees: bool = False  # tree verification forwards (it reads the draft-branch rows they carry)
    file_key: str | None = None  # the config key naming its per-model file ("auto": shipped or built for the model)
    build_command: str | None = None  # how a user builds that file for another model
    needs_package: str | None = None  # an optional dependency


# Every pool, in merge order: the trie numbers nodes in the order pools are inserted, and ties in rank break by
# node number, so the order is part of the behaviour. Calibration keys hold at most trees/trie.MAX_POOLS pools (a
# test checks the registry fits).
POOLS: dict[str, PoolSpec] = {
    "context": PoolSpec("ContextPool", "every earlier occurrence of the request's last tokens (prompt, output)",
                        default=True),
    "suffix": PoolSpec("SuffixPool", "arctic-inference's suffix trees: the prompt and earlier requests' outputs",
                       default=True, needs_package="arctic-inference"),
    "recycled": PoolSpec("RecycledPool", "Token Recycling: the target's top-k successors of every token it verified",
                         logits_k=8),
    "corpus": PoolSpec("CorpusPool", "an n-gram table built offline for the tokenizer", default=True,
                       file_key="corpus", build_command="adaspec build corpus --model MODEL"),
    "branches": PoolSpec("BranchesPool", "Self-Draft: grams the target writes on draft-branch rows", needs_trees=True),
    "medusa": PoolSpec("MedusaPool", "Medusa heads on the target's last hidden state", default=True,
                       needs_hidden=True, file_key="medusa", build_command="adaspec train medusa --model MODEL"),
}


def default_pools() -> tuple[str, ...]:
    return tuple(n for n, spec in POOLS.items() if spec.default)


def pool_class(name: str) -> type[Pool]:
    """Imported on demand: suffix needs arctic-inference, medusa torch."""
    module, _, cls = POOLS[name].cls.rpartition(":")
    return getattr(importlib.import_module(module or f"vllm_adaspec.pools.{name}"), cls)


def make_pools(names: Sequence[str], **build) -> list[Pool]:
    """The named pools, in merge order (POOLS, not the order of `names`), each built from `PoolBuild(**build)`."""
    unknown = [n for n in names if n not in POOLS]
    if unknown:
        raise ValueError(f"unknown pool(s) {', '.join(map(repr, unknown))}; known: {', '.join(POOLS)}")
    b = PoolBuild(**build)
    return [pool_class(name).from_build(b) for name in POOLS if name in names]


class PoolSet:
    """The drafter's pools as one: lifecycle calls fan out to every pool, `propose` gathers every pool's candidates
    per request (pools in their order), and what it proposed is counted per pool (stats)."""

    def __init__(self, pools: Sequence[Pool], failpoint: Callable[[str], None] | None = None):
        self.pools = list(pools)
        self.failpoint = failpoint  # faults.FaultGuard.point: fault injection in each pool's propose (tests)
        self.fed: dict[str, int] = {}  # req -> tokens fed so far (prompt + extends): where the next extend starts
        self.nodes = {p.name: 0 for p in self.pools}  # candidate nodes proposed, per pool

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.pools)

    @property
    def needs_hidden(self) -> bool:
        return any(POOLS[p.name].needs_hidden for p in self.pools)

    @property
    def logits_k(self) -> int:
        """Top tokens per verified row that `observe_logits` wants (0: no pool reads verified logits)."""
        return max((p.logits_k for p in self.pools), default=0)

    def get(self, name: str) -> Pool | None:
        return next((p for p in self.pools if p.name == name), None)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.fed

    def __len__(self) -> int:
        return len(self.fed)

    def start(self, req_id: str, prompt) -> None:
        for p in self.pools:
            p.start(req_id, prompt)
        self.fed[req_id] = len(prompt)

    def extend(self, req_id: str, tokens) -> None:
        if not len(tokens):
            return
        tokens = as_ints(tokens)  # once, not once per pool
        for p in self.pools:
            p.extend(req_id, tokens)
        self.fed[req_id] += len(tokens)

    def stop(self, req_id: str) -> None:
        for p in self.pools:
            p.stop(req_id)
        self.fed.pop(req_id, None)

    def propose(self, requests: list[str], budgets: list[int], taps: Taps) -> list[list[Candidates]]:
        """[R][pools] every pool's candidates for each drafting request."""
        out: list[list[Candidates]] = [[] for _ in requests]
        if not requests:
            return out
        for p in self.pools:
            if self.failpoint is not None:
                self.failpoint(p.name)
            cands = p.propose(requests, budgets, taps)
            for row, c in zip(out, cands):
                row.append(c)
            self.nodes[p.name] += sum(map(len, cands))
        return out

    def observe_logits(self, tokens: np.ndarray, top_ids: np.ndarray, top_probs: np.ndarray) -> None:
        for p in self.pools:
            p.observe_logits(tokens, top_ids, top_probs)

    def observe_branches(self, req_id: str, sent: list[list[int]], predicted: list[int]) -> int:
        return sum(p.observe_branches(req_id, sent, predicted) for p in self.pools)

    def live(self) -> dict[str, int]:
        """Per-request states held by each pool (every one should equal len(self) between steps)."""
        return {p.name: p.live() for p in self.pools}
