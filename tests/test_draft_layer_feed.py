"""A draft layer's KV upkeep (proposers/early_exit.py `_feed`, `on_step`), without vLLM: which committed rows it
runs, which feature each reads, which it skips because the step before's first draft pass wrote them, and the pause
once plain decoding wins. The engine test (test_engine_draft_layer.py) proves the KV it writes right; this one pins
the choice of rows, which that test sees only through acceptance."""

from types import SimpleNamespace

import numpy as np
import torch

from vllm_adaspec.proposers.early_exit import EarlyExitDrafter, EarlyExitStats
from vllm_adaspec.step import ForwardRows


class FakePrefix:
    reads_features = True

    def __init__(self):
        self.exit = SimpleNamespace(feeding=True, feature_width=4)
        self.fed = []

    def ensure_attached(self):
        pass

    def feed(self, rows, counts, first, feats, input_ids, positions, batch_rows, max_seq_len):
        self.fed.append((rows.tolist(), list(counts), first.clone(), batch_rows.tolist()))
        self.feats = feats.clone()


def drafter():
    d = EarlyExitDrafter.__new__(EarlyExitDrafter)
    d.prefix, d.stats, d.driver = FakePrefix(), EarlyExitStats(), SimpleNamespace(observers=[])
    d._carry, d._primed, d._steps, d._stale = {}, {}, 0, set()
    d._can_pause_feed, d._feed_next = True, True
    return d


def step(d, sampled, num_tokens, sched, drafted):
    """One propose call's observe: requests "a", "b" with `sched` rows each in the forward; hidden row r = r."""
    qs = np.concatenate([[0], np.cumsum(sched)])
    n = int(qs[-1])
    fwd = ForwardRows(parts=(torch.arange(n, dtype=torch.float32)[:, None].repeat(1, 4),),
                      input_ids=torch.arange(n), positions=torch.arange(n), query_start=qs)
    view = SimpleNamespace(req_ids=["a", "b"], sampled=sampled, num_tokens=np.array(num_tokens))
    outcomes = {i: SimpleNamespace(drafted=k, tree=False) for i, k in enumerate(drafted)}
    d.observe(view, outcomes, SimpleNamespace(forward=fwd))


def test_a_row_the_first_draft_pass_wrote_is_not_run_again_and_the_next_row_reads_its_feature():
    d = drafter()
    d._steps = 1
    d._carry = {"a": torch.full((4,), -1.0), "b": torch.full((4,), -2.0)}
    # the last propose call drafted "a" from its bonus token at position 9 ("b" drafted nothing there)
    d._primed = {"a": (1, 9)}
    # this step: "a" verified 3 drafts, 1 accepted (rows 0-3, committed 2: the bonus at 9 and the draft at 10);
    # "b" decoded one row (row 4)
    step(d, sampled=[[5, 6], [7]], num_tokens=[12, 30], sched=[4, 1], drafted=[3, 0])
    ((rows, counts, first, batch_rows),) = d.prefix.fed
    assert rows == [1, 4] and counts == [1, 1] and batch_rows == [0, 1]
    assert first[0].tolist() == [0.0] * 4  # "a": the skipped row 0's feature, not the carried one
    assert first[1].tolist() == [-2.0] * 4  # "b": its carried feature
    assert d._carry["a"].tolist() == [1.0] * 4 and d._carry["b"].tolist() == [4.0] * 4  # each's last committed row
    assert d.stats.feed_rows == 2 and d.stats.feed_rows_reused == 1


def test_a_primed_row_from_an_older_call_or_another_position_is_run():
    d = drafter()
    d._steps = 5
    d._primed = {"a": (3, 9), "b": (4, 28)}  # "a": two calls ago (a step ran without a propose call in between)
    step(d, sampled=[[5], [7]], num_tokens=[11, 30], sched=[1, 1], drafted=[1, 0])
    ((rows, counts, _, _),) = d.prefix.fed
    assert rows == [0, 1] and counts == [1, 1] and d.stats.feed_rows_reused == 0


def test_a_committed_row_reads_the_features_of_the_row_before_it_at_every_depth():
    d = drafter()
    d.prefix.exit.feature_width = 8  # two depths of width 4, joined
    d._steps = 2
    qs = np.array([0, 3, 4])
    low, top = torch.arange(4.0)[:, None].repeat(1, 4), 100 + torch.arange(4.0)[:, None].repeat(1, 4)
    fwd = ForwardRows(parts=(low, top), input_ids=torch.arange(4), positions=torch.arange(10, 14), query_start=qs)
    view = SimpleNamespace(req_ids=["a", "b"], sampled=[[5, 6, 7], [8]], num_tokens=np.array([14, 30]))
    d.observe(view, {0: SimpleNamespace(drafted=2, tree=False), 1: SimpleNamespace(drafted=0, tree=False)},
              SimpleNamespace(forward=fwd))
    ((rows, counts, first, _),) = d.prefix.fed
    assert rows == [0, 1, 2, 3] and counts == [3, 1]
    # rows 1, 2 of "a" read rows 0, 1: both depths, low first; a request's first row is replaced by the feed
    assert d.prefix.feats[1].tolist() == [0.0] * 4 + [100.0] * 4
    assert d.prefix.feats[2].tolist() == [1.0] * 4 + [101.0] * 4
    assert first.shape == (2, 8) and first.abs().sum() == 0  # nothing carried yet: zeros of the joined width
    assert d._carry["a"].tolist() == [2.0] * 4 + [102.0] * 4 and d._carry["b"].tolist() == [3.0] * 4 + [103.0] * 4


def test_a_verified_trees_accepted_path_is_fed_each_node_reading_its_parents_feature():
    # "a" verified a tree of 5 nodes (forward rows 0-5: the root, then node j at row 1 + j) and accepted the path of
    # nodes 1 then 4 (rows 2, 5; rows 1, 3, 4 are rejected siblings); "b" decoded one row (6)
    d = drafter()
    d._steps = 3
    d._primed = {"a": (3, 19)}  # the last call's first draft pass wrote "a"'s root (position 19)
    d._carry = {"a": torch.full((4,), -1.0), "b": torch.full((4,), -2.0)}
    qs = np.array([0, 6, 7])
    fwd = ForwardRows(parts=(torch.arange(7.0)[:, None].repeat(1, 4),), input_ids=torch.arange(7),
                      positions=torch.tensor([19, 20, 20, 21, 21, 21, 40]), query_start=qs)
    view = SimpleNamespace(req_ids=["a", "b"], sampled=[[5, 6, 7], [8]], num_tokens=np.array([23, 41]))
    d.observe(view, {0: SimpleNamespace(drafted=5, tree=True, accepted=(1, 4)),
                     1: SimpleNamespace(drafted=0, tree=False)}, SimpleNamespace(forward=fwd))
    ((rows, counts, first, batch_rows),) = d.prefix.fed
    assert rows == [2, 5, 6] and counts == [2, 1] and batch_rows == [0, 1]  # the root (primed) is not run again
    assert first[0].tolist() == [0.0] * 4  # node 1 reads the root's row 0, not the carried feature
    assert d.prefix.feats[1].tolist() == [2.0] * 4  # node 4 reads its parent node 1 (row 2), not row 4 before it
    assert first[1].tolist() == [-2.0] * 4
    assert d._carry["a"].tolist() == [5.0] * 4 and d._carry["b"].tolist() == [6.0] * 4  # the path's last row
    assert d.stats.feed_rows == 3 and d.stats.feed_rows_reused == 1


def test_the_feed_pauses_once_plain_decoding_wins_and_its_requests_never_draft_again():
    d = drafter()
    d._feed_next = False  # the cost model drafted nothing for PAUSE_AFTER decode steps
    d.on_step({"a": 1, "b": 1}, pure=True)
    assert d.prefix.exit.feeding is False and not d.eligible("a") and not d.eligible("b")
    assert d.stats.plain_switches == 2
    step(d, sampled=[[5], [7]], num_tokens=[11, 30], sched=[1, 1], drafted=[0, 0])
    assert d.prefix.fed == []
    # a prompt chunk in the step feeds again (a new request may draft); the paused ones stay paused
    d.on_step({"a": 1, "b": 1, "c": 40}, pure=False)
    assert d.prefix.exit.feeding is True and d.eligible("c") and not d.eligible("a")
    d.finish(["a", "b"])
    assert d.live()["paused_requests"] == 0


def test_the_start_up_warm_up_writes_only_into_vllms_null_block():
    """The first draft pass and feed of a process are slow (lazy set-up): start-up runs them on dummy rows, which
    must land in block 0 (the block pool never gives it to a request) and nowhere else."""
    calls = []

    class WarmPrefix(FakePrefix):
        device, block_size = torch.device("cpu"), 16

        def forward(self, blocks, tokens, positions, max_seq_len, features=None):
            calls.append(("forward", blocks.tolist(), positions.tolist(), tuple(features.shape)))
            return torch.zeros(1, 4), torch.zeros(1, 4)

        def head(self, hidden, residual):
            calls.append(("head",))

        def feed(self, rows, counts, first, feats, input_ids, positions, batch_rows, max_seq_len, blocks=None):
            calls.append(("feed", blocks.tolist(), positions[rows].tolist(), list(counts)))

    d = drafter()
    d.prefix = WarmPrefix()
    d.prefix.exit.feat_norm = SimpleNamespace(weight=torch.ones(4))
    d.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1))
    d.warm_up()
    assert calls[0] == ("forward", [[0]], [0], (1, 4)) and calls[1] == ("head",)
    assert calls[2] == ("feed", [[0]], list(range(8)), [8])  # a dummy prompt of 8 rows, all in block 0
    assert d._carry == {} and d._primed == {} and d.stats.feed_rows == 0  # no request's state touched
    calls.clear()
    d.vllm_config.parallel_config.tensor_parallel_size = 2  # every rank would have to agree: not warmed
    d.warm_up()
    assert calls == []


def sizing_drafter(engine_accepted, engine_rejected):
    import random

    from vllm_adaspec.requests import RequestState

    d = drafter()
    d.tree, d.pass_prior, d._plain_streak, d._rng = None, 0.2, 0, random.Random(0)
    states = {}
    d.driver = SimpleNamespace(
        observers=[], chain_counts=(engine_accepted, engine_rejected),
        states=SimpleNamespace(get=lambda r: states.setdefault(r, RequestState(policy=None))),
        step_seconds=lambda decoding: (lambda rows: 0.025 * (1 + 0.05 * (rows - 1)), 0.0, None), costs=SimpleNamespace(unit=0.025),
        draft_costs=SimpleNamespace(per_pass=lambda decoding: 0.004))
    return d, states


def test_a_new_request_measures_its_own_acceptance_before_the_engines_rate_silences_it():
    # the engine's earlier requests accepted 1 draft in 40: by that rate alone nothing pays
    d, states = sizing_drafter(1, 39)
    view = SimpleNamespace(req_ids=["math"], num_tokens=np.array([50]))
    d._plain_streak = 40  # the requests before it paused the feed
    assert d.size(view, [0], [3], 1) == [1]  # one draft: its own evidence, not the engine's rate
    assert d._plain_streak == 0 and d._feed_next  # ... and the feed goes on while it measures
    states["math"].drafted, states["math"].rejected = 8, 8  # its own 8 drafts all rejected: now the rate is its own
    d._rng.random = lambda: 1.0  # (no random exploration)
    assert d.size(view, [0], [3], 1) == [0] and d._plain_streak == 1
    states["math"].accepted, states["math"].rejected = 7, 1  # ... or mostly accepted: it drafts on its own merit
    assert d.size(view, [0], [3], 1)[0] >= 1 and d._plain_streak == 0


def test_tree_mode_drafts_a_tree_as_deep_as_the_cost_model_pays_for():
    # token trees are sized like chains: the depth is the chain the cost model would draft (the builder fills
    # it), none where nothing pays once the request measured its own rate
    d, states = sizing_drafter(1, 39)
    d.tree = SimpleNamespace(budget=6, top_k=2)
    d._rng.random = lambda: 1.0  # (no random exploration)
    view = SimpleNamespace(req_ids=["math"], num_tokens=np.array([50]))
    st = d.driver.states.get("math")
    st.drafted, st.rejected = 8, 8
    assert d.size(view, [0], [6], 1) == [0]
    st.accepted, st.rejected = 30, 2
    depth = d.size(view, [0], [6], 1)[0]
    assert 2 <= depth <= 6
