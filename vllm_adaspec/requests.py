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
    drafted_last: int = 0  # drafts verified in the last round (what the scheduler actually scheduled)
    rounds: int = 0  # verification rounds that carried drafts
    drafted: int = 0  # total drafts verified
    accepted: int = 0  # total drafts accepted


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
        drafted = st.drafted_last
        if drafted == 0:
            return 0, 0
        accepted = max(0, min(drafted, num_sampled - 1))
        st.rounds += 1
        st.drafted += drafted
        st.accepted += accepted
        st.drafted_last = 0
        st.policy.observe(drafted, accepted)
        return drafted, accepted

    def finish(self, req_ids: Iterable[str]) -> list[RequestState]:
        """Drop finished requests; returns their final states (for per-request statistics)."""
        return [st for st in (self.states.pop(r, None) for r in req_ids) if st is not None]

    def __len__(self) -> int:
        return len(self.states)
