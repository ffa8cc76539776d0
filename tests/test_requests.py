"""Per-request bookkeeping: keyed by request id, survives reordering and preemption, dropped on finish."""

from vllm_adaspec.policies import FixedPolicy, make_policy
from vllm_adaspec.proposers.driver import request_seed
from vllm_adaspec.requests import RequestStates


class RecordingPolicy(FixedPolicy):
    def __init__(self, k):
        super().__init__(k)
        self.seen = []

    def observe(self, drafted, accepted):
        self.seen.append((drafted, accepted))


def states():
    return RequestStates(new_policy=lambda rid: RecordingPolicy(4))


def test_feedback_reaches_the_right_request_whatever_the_row_order():
    s = states()
    s.scheduled("a", 4)
    s.scheduled("b", 2)
    # rows come back in another order (vLLM condenses/reorders the batch)
    s.verified("b", 3)  # 2 accepted + bonus
    s.verified("a", 1)  # 0 accepted
    assert s.get("a").policy.seen == [(4, 0)]
    assert s.get("b").policy.seen == [(2, 2)]
    assert (s.get("a").drafted, s.get("a").accepted, s.get("b").accepted) == (4, 0, 2)


def test_no_feedback_for_a_step_without_drafts_and_no_double_count():
    s = states()
    s.scheduled("a", 0)
    s.verified("a", 1)
    s.scheduled("a", 3)
    s.verified("a", 4)
    s.verified("a", 1)  # a second report for the same round is ignored
    assert s.get("a").policy.seen == [(3, 3)]
    assert s.get("a").rounds == 1


def test_state_survives_preemption_and_is_dropped_on_finish():
    s = states()
    s.scheduled("a", 4)
    s.verified("a", 2)
    # preempted: the request leaves the batch, comes back later and is scheduled without drafts (recompute)
    s.scheduled("a", 0)
    s.verified("a", 1)
    s.scheduled("a", 4)
    s.verified("a", 5)
    assert s.get("a").policy.seen == [(4, 1), (4, 4)]
    s.finish(["a", "never-seen"])
    assert len(s) == 0
    assert s.get("a").policy.seen == []  # a fresh request with the same id starts clean


def test_accepted_is_clamped_to_what_was_drafted():
    s = states()
    s.scheduled("a", 2)
    s.verified("a", 9)
    assert s.get("a").accepted == 2


def test_fixed_policy_and_seeds():
    p = make_policy("fixed", 5, seed=1)
    assert p.begin_round() == 5 and p.accept(1) and p.keep_drafting(4) and not p.keep_drafting(5)
    assert request_seed("req-1", 0) == request_seed("req-1", 0) != request_seed("req-2", 0)
    assert request_seed("req-1", 0) != request_seed("req-1", 1)


def test_bonus_rows_follow_chains_and_the_last_accepted_tree_node():
    from vllm_adaspec.requests import bonus_rows

    # Row 0: chain of 3 drafts, 2 accepted (outputs 0..3, bonus from output 2). Row 1: prefill chunk (1 output,
    # nothing committed). Row 2: tree of 4 nodes (outputs 5..9), accepted path [1, 3]: the bonus comes from node 3's
    # output, 5 + 1 + 3 = 9, not from 5 + len(path) = 7 as for a chain. Row 3: tree, nothing accepted: the root's.
    sampled = [3, 0, 3, 1]
    verified = [3, 0, 4, 2]
    paths = {2: [1, 3], 3: []}
    assert bonus_rows(sampled, verified, paths) == [2, -1, 9, 10]
    assert bonus_rows(sampled, verified) == [2, -1, 7, 10]  # what chain bookkeeping would read
    assert bonus_rows([1, 1], None) == [0, 1]  # a step without drafts: one output per row
