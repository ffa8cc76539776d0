"""Per-request drafting state, keyed by request id (never by batch row).

vLLM reorders and condenses batch rows as requests finish, and removes preempted requests from the batch
until they resume; keying by id and dropping state only when a request *finishes* keeps policy state and
statistics across all of that. Pure Python: no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable


@dataclass
class RequestState:
    policy: object
    steps: int = 0  # decode steps (target forwards that committed tokens for it)
    drafted_last: int = 0  # drafts verified in the last round (what the scheduler actually scheduled)
    rounds: int = 0  # verification rounds that carried drafts
    drafted: int = 0  # total drafts verified
    accepted: int = 0  # total drafts accepted
    rejected: int = 0  # rounds that ended in a rejected draft (accepted / (accepted + rejected): a draft's chance)


@dataclass
class RequestStates:
    new_policy: Callable[[str], object]  # req_id -> a fresh policy for that request
    states: dict[str, RequestState] = field(default_factory=dict)

    def get(self, req_id: str) -> RequestState:
        st = self.states.get(req_id)
        if st is None:
            st = self.states[req_id] = RequestState(policy=self.new_policy(req_id))
        return st

    def scheduled(self, req_id: str, num_drafts: int) -> None:
        """The scheduler put `num_drafts` of our drafts into this step for `req_id`."""
        self.get(req_id).drafted_last = num_drafts

    def verified(self, req_id: str, num_sampled: int) -> tuple[int, int]:
        """Verification emitted `num_sampled` tokens (accepted drafts + 1) for `req_id`.
        Returns (drafts verified, drafts accepted) of that round; (0, 0) when it carried none."""
        st = self.get(req_id)
        st.steps += 1
        drafted = st.drafted_last
        if drafted == 0:
            return 0, 0
        accepted = max(0, min(drafted, num_sampled - 1))
        st.rounds += 1
        st.drafted += drafted
        st.accepted += accepted
        st.rejected += accepted < drafted
        st.drafted_last = 0
        st.policy.observe(drafted, accepted)
        return drafted, accepted

    def finish(self, req_ids: Iterable[str]) -> dict[str, RequestState]:
        """Drop finished requests; returns their final states by id (for per-request statistics)."""
        return {r: st for r, st in ((r, self.states.pop(r, None)) for r in req_ids) if st is not None}

    def __len__(self) -> int:
        return len(self.states)


def bonus_rows(num_sampled: list[int], verified_drafts: list[int] | None,
               tree_paths: dict[int, list[int]] | None = None) -> list[int]:
    """For each batch row, the row of the target's sampled outputs (its logits / final hidden states, batch order)
    that produced the row's last sampled token, the bonus token.

    num_sampled [B]: tokens the step committed per batch row (accepted drafts + 1; 0 = none);
    verified_drafts [B]: drafts the step verified per row (None: a step without drafts); a row takes
    1 + verified_drafts outputs. A chain's bonus comes from the output after its last accepted draft; a tree's from
    the output of its last accepted node (tree_paths: batch row -> accepted node indices, root to deepest; the
    outputs are the root's, then node i's at 1 + i). Rows that committed nothing get -1."""
    out, start = [], 0
    for i, n in enumerate(num_sampled):
        taken = 1 + (verified_drafts[i] if verified_drafts is not None else 0)
        path = (tree_paths or {}).get(i)
        if n <= 0:
            out.append(-1)
        elif path is not None:
            out.append(start + (1 + path[-1] if path else 0))
        else:
            out.append(start + n - 1)
        start += taken
    return out
