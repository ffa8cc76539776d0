"""Draft-length policies: one object per request decides how many tokens to draft each step.

The interface every drafter relies on (kept narrow so adaptive policies plug in without drafter changes):
    begin_round() -> int                 most drafts this step (0 = do not draft)
    keep_drafting(depth, top_prob, entropy) -> bool
                                         after drafting token `depth` (1-based): draft another one?
    observe(drafted, accepted) -> None   verification feedback for the previous round
"""

from vllm_adaspec.policies.fixed import FixedPolicy

__all__ = ["FixedPolicy", "make_policy"]


def make_policy(name: str, max_drafts: int, seed: int = 0):
    """Build the policy named in the config for one request. `seed` is per request (identical on every rank)."""
    if name == "fixed":
        return FixedPolicy(max_drafts)
    raise ValueError(f"unknown draft-length policy {name!r}")
