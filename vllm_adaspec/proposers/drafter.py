"""What a drafter implements: the algorithm only. The per-request bookkeeping (policies, budgets, the step cost
model, tree admission, statistics) lives once in the driver (proposers/driver.py), which calls these methods and
which a drafter reads through `self.driver` (its cost model, admission, this call's outcomes and taps, the engine
port). One drafter per file: multi_branch.py, early_exit.py, probe.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from vllm_adaspec.metrics import ACCEPTANCE_BUCKETS, DRAFTS_PER_ROUND_BUCKETS, new_histogram
from vllm_adaspec.step import BatchView, DraftPlan, Needs, Outcome, Taps


@dataclass
class Stats:
    """A drafter's counters (the `adaspec_stats` RPC, /metrics). Drafters extend it with their own."""
    propose_calls: int = 0  # propose calls that drafted
    decode_rows: int = 0  # target forwards, summed over requests (tau = tokens / this)
    prefill_chunk_rows: int = 0  # rows that sampled nothing: a prompt chunk in flight (chunked prefill happened)
    draft_passes: int = 0  # draft-model passes (early exit: per depth)
    draft_tokens: int = 0
    draft_seconds: float = 0.0  # wall time drafting (CPU: synchronous, so this is the drafting cost)
    draft_pass_seconds: float = 0.0  # the part of it in draft passes, each timed to its tokens' read-back
    policy_seconds: float = 0.0
    draft_digest: int = 0  # tensor parallelism: a CRC of every draft proposed (ranks must propose the same)
    committed_digest: int = 0  # tensor parallelism: a CRC of every token committed (ranks must commit the same)
    # tree mode: trees proposed, their verified nodes, trees verified as trees, KV slots compacted, requests the copy
    # cap kept to chains, the copies' peak, accepted depth histogram
    tree_rounds: int = 0
    tree_nodes: int = 0
    tree_verified: int = 0
    tree_kv_moves: int = 0
    tree_capped: int = 0
    tree_kv_copy_peak: int = 0
    tree_accepted_depth: list = field(default_factory=list)
    plain_switches: int = 0  # early exit: requests that went on without the exit layers' KV upkeep
    draft_steps: list = field(default_factory=lambda: [0, 0])  # decode steps without / with our drafts
    cost_observations: int = 0
    round_lengths: list = field(default_factory=list)  # rounds by the number of drafts proposed
    policy: str = ""
    # what verification made of our drafts, and per finished request (metrics.py histograms)
    verified_drafts: int = 0
    accepted_drafts: int = 0
    requests_finished: int = 0
    request_acceptance: dict = field(default_factory=lambda: new_histogram(ACCEPTANCE_BUCKETS))
    request_drafts_per_round: dict = field(default_factory=lambda: new_histogram(DRAFTS_PER_ROUND_BUCKETS))
    # contained faults (vllm_adaspec/faults.py), and 1 once they reached fault_limit (speculation off for good)
    drafter_faults: int = 0
    drafting_off: int = 0

    def as_dict(self) -> dict:
        return asdict(self)  # (a deep copy: callers diff snapshots)


class Drafter:
    """The interface, with what a drafter that needs nothing more does."""
    stats_cls = Stats  # the driver's counters, extended with the drafter's own
    needs = Needs()  # what the engine must hand over (set in __init__)

    def __init__(self, vllm_config, settings, driver):
        self.vllm_config = vllm_config
        self.cfg = settings
        self.driver = driver
        self.stats = driver.stats  # the driver's counters (a `stats_cls`)
        self.tree = settings.tree

    def attach(self, port) -> None:
        """The engine port, before the model loads (drafters that build on the target load through it)."""

    def load_model(self, target_model) -> None:
        """vLLM's target model, once loaded."""

    def warm_up(self) -> None:
        """Once at start-up, after vLLM's own warm-up, the KV cache allocated and no request in it: run what the
        first request would otherwise pay for once (lazy set-up, first kernel calls)."""

    def max_drafts(self) -> int:
        """The most drafts a request may get in one step (policies are built with it)."""
        return self.cfg.num_speculative_tokens

    def eligible(self, req_id: str) -> bool:
        return True

    def observe(self, view: BatchView, outcomes: dict[int, Outcome], taps: Taps) -> None:
        """Every propose call, before the drafting rows are chosen: what verification made of each decoding row's
        last plan (outcomes by batch row), and the target outputs asked for in `needs`."""

    def size(self, view: BatchView, rows: list[int], budgets: list[int], decoding: int) -> list[int]:
        """The cost model's cap on each drafting row's budget before drafting (early exit: chain lengths from the
        requests' acceptance and the draft pass cost). MultiBranchProposer sizes its trees while drafting."""
        return budgets

    def draft(self, view: BatchView, rows: list[int], budgets: list[int], policies: list,
              plans: dict[int, DraftPlan]) -> float:
        """Fill plans[row] for the drafting rows (batch rows of `view`); returns the seconds spent in policy work."""
        raise NotImplementedError

    def on_step(self, scheduled: dict, pure: bool) -> None:
        """At the start of every engine step (early exit pauses its exit layers' KV upkeep here)."""

    def start(self, req_id: str, prompt) -> None:
        """A request scheduled for the first time, its prompt token ids [P] (a list): per-request state that needs only
        the prompt may be built here, while the GPU runs the forward (Driver.while_forward), instead of in the
        request's first observe. Not called for requests without token ids (prompt embeddings): observe must
        still start what it first sees."""

    def finish(self, req_ids) -> None:
        """Requests that finished or were aborted: drop their per-request state (while the GPU runs the forward of the
        step that reported them, Driver.while_forward)."""

    def live(self) -> dict:
        """Per-request state the drafter holds now, by kind."""
        return {}

    def config(self) -> dict:
        return {}

    def extra_stats(self) -> dict:
        return {}
