"""Fault containment without the engine (vllm_adaspec/faults.py): the driver turns any exception of its drafter into
a step without drafts, counts it and stops drafting at the limit; tree planning writes no position before every tree
of the step is planned; fault injection's spec is parsed strictly. The engine and server tests run the same through
vLLM (test_engine_multibranch.py, test_server.py)."""

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_adaspec.config import ProbeSettings
from vllm_adaspec.faults import INJECT_ENV, FaultGuard, InjectedFault, parse_injection
from vllm_adaspec.proposers.drafter import Drafter
from vllm_adaspec.proposers.driver import Driver
from vllm_adaspec.step import BatchView, DraftPlan, RequestTraits, Taps


class FlakyDrafter(Drafter):
    """Drafts [1, 2, 3] for every row; raises in `fail_in` on the calls listed in `fail_at` (1-based)."""
    fail_in, fail_at = "draft", ()

    def __init__(self, vllm_config, settings, driver):
        super().__init__(vllm_config, settings, driver)
        self.calls = {"observe": 0, "draft": 0, "on_step": 0}
        self.finished = []
        self.started = []  # start and finish calls, in order

    def _maybe_fail(self, where):
        self.calls[where] += 1
        if where == self.fail_in and self.calls[where] in self.fail_at:
            raise ZeroDivisionError(f"{where} broke")

    def observe(self, view, outcomes, taps):
        self._maybe_fail("observe")

    def draft(self, view, rows, budgets, policies, plans):
        self._maybe_fail("draft")
        for i in rows:
            plans[i] = DraftPlan((1, 2, 3))
        return 0.0

    def on_step(self, scheduled, pure):
        self._maybe_fail("on_step")

    def start(self, req_id, prompt):
        self.started.append((req_id, list(prompt)))
        if self.fail_in == "start":
            raise ZeroDivisionError("start broke")

    def finish(self, req_ids):
        self.finished += list(req_ids)
        self.started.append(("finished", list(req_ids)))


class FakePort:
    observers = []

    def __init__(self, batch):
        self.batch = batch
        self.dropped = []

    def view(self, sampled, num_tokens, token_ids):
        b = len(sampled)
        return BatchView(self.batch, sampled, num_tokens, token_ids, np.full(b, 2), np.zeros(b, np.float32))

    def feedback(self):
        return {}, 0, Taps(), None

    def drop_trees(self, req_ids):
        self.dropped += list(req_ids)

    def traits(self, req_id):
        return RequestTraits()

    def forget(self, req_ids):
        pass

    def live(self):
        return {}

    def tree_counts(self):
        return {}

    def tree_copies(self):
        return True

    def held_copy_tokens(self):
        return 0

    def observer_stats(self):
        return {}

    def observer_live(self):
        return {}


def make_driver(fail_in="draft", fail_at=(), limit=3, batch=("a", "b"), cost_model="off"):
    drafter = type("Flaky", (FlakyDrafter,), {"fail_in": fail_in, "fail_at": tuple(fail_at)})
    cls = type("FlakyDriver", (Driver,), {"drafter_cls": drafter, "proposer": "probe"})
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(seed=0),
                                  parallel_config=SimpleNamespace(tensor_parallel_size=1))
    settings = ProbeSettings(num_speculative_tokens=3, num_layers=2, cost_model=cost_model, fault_limit=limit)
    driver = cls(vllm_config, settings)
    driver.attach(FakePort(list(batch)))
    return driver


def step(driver, n=2):
    """One engine step for every request of the batch: schedule last step's drafts, then propose."""
    batch = driver.port.batch
    spec = {r: list(driver.plans[r].tokens) for r in batch if r in driver.plans}
    driver.on_schedule({r: 1 + len(spec.get(r, ())) for r in batch}, spec, set())
    sampled = [[7] for _ in batch]
    return driver.propose(sampled, np.full(len(batch), n), np.zeros((len(batch), 16), np.int64))


@pytest.mark.parametrize("fail_in", ["observe", "draft"])
def test_a_drafter_fault_becomes_a_step_without_drafts_and_is_counted(fail_in, caplog):
    driver = make_driver(fail_in, fail_at=[2])
    with caplog.at_level(logging.ERROR, logger="vllm_adaspec"):
        outs = [step(driver) for _ in range(4)]
    assert outs[0] == [[1, 2, 3]] * 2 and outs[1] == [[], []] and outs[2] == outs[3] == [[1, 2, 3]] * 2, outs
    assert driver.plans and driver.get_stats()["drafter_faults"] == 1 and not driver.get_stats()["drafting_off"]
    faults = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(faults) == 1 and faults[0].exc_info and "broke" in faults[0].getMessage(), caplog.text


def test_a_fault_while_scheduling_drops_the_steps_plans():
    driver = make_driver("on_step", fail_at=[2])
    step(driver)
    assert driver.plans
    batch = driver.port.batch
    spec = {r: list(driver.plans[r].tokens) for r in batch}
    driver.on_schedule({r: 4 for r in batch}, spec, set())  # the drafter's on_step raises
    assert driver.plans == {} and driver.faults.count == 1  # the runtime plans no tree: drafts verify as chains


def test_the_drafters_request_state_waits_for_the_launched_forward_in_order():
    """Driver.while_forward (the worker calls it once vLLM launched the forward: on a GPU the host is idle until the
    sampler waits for it) runs the finished and new requests' drafter work on_schedule brought, in order; propose
    runs what nothing ran; a fault in it is contained and the next steps draft."""
    driver = make_driver("nowhere")
    d = driver.drafter
    driver.on_schedule({"a": 5}, {}, {"x"}, {"a": [1, 2, 3]})
    driver.on_schedule({"a": 1, "b": 4}, {}, set(), {"b": [4, 5]})  # (a step without propose in between)
    assert d.started == [] and d.finished == []  # nothing yet: the forward is not launched
    driver.while_forward()
    assert d.started == [("finished", ["x"]), ("a", [1, 2, 3]), ("b", [4, 5])]
    driver.while_forward()  # done once
    assert len(d.started) == 3
    driver.on_schedule({"a": 1, "b": 1}, {}, {"b"}, {"c": [6]})
    step(driver)  # propose runs what is pending before it observes
    assert d.started[3:] == [("finished", ["b"]), ("c", [6])] and d.calls["observe"] == 1
    broken = make_driver("start")
    broken.on_schedule({"a": 5}, {}, set(), {"a": [1]})
    broken.while_forward()
    assert broken.faults.count == 1 and step(broken) == [[1, 2, 3]] * 2


def test_the_cost_model_learns_the_last_step_while_the_next_forward_runs():
    """The step measured at a propose call is learnt in the next while_forward (on a GPU behind the forward), where
    the price list is readied too; a fault there is contained and drafting goes on."""
    driver = make_driver("nowhere", cost_model="online")
    step(driver)
    step(driver)  # measures the step between the two propose calls
    assert driver.costs.observations == 0 and driver._to_learn is not None
    driver.while_forward()
    assert driver.costs.observations == 1 and driver.get_stats()["cost_observations"] == 1
    step(driver)
    driver.costs.observe = lambda *a, **k: 1 / 0
    driver.while_forward()
    assert driver.faults.count == 1 and step(driver) == [[1, 2, 3]] * 2


def test_the_price_list_readied_behind_the_forward_is_what_propose_reads_until_the_model_learns_again():
    """while_forward readies the scheduled batch's price list; propose's call for that batch size gets it as is,
    and once the models learn another step, a fresh one (equal to one computed from nothing)."""
    driver = make_driver("nowhere", cost_model="online")
    step(driver)
    step(driver)
    driver.while_forward()
    decoding, learned, readied = driver._prices
    assert learned == 1 and driver.step_seconds(decoding) is readied
    step(driver)
    driver.while_forward()  # learns the step between the last two propose calls
    assert driver.costs.observations == 2
    fresh = driver.step_seconds(decoding)
    assert fresh is not readied and driver.step_seconds(decoding) is fresh
    driver._prices = None
    again = driver.step_seconds(decoding)
    assert [fresh[0](r) for r in range(40)] == [again[0](r) for r in range(40)] and fresh[1:] == again[1:]
    assert [readied[0](r) for r in range(40)] != [fresh[0](r) for r in range(40)]  # (the model did move)


def test_at_the_fault_limit_speculation_stops_for_good_and_state_is_released(caplog):
    driver = make_driver("draft", fail_at=[2, 3, 4], limit=3)
    with caplog.at_level(logging.ERROR, logger="vllm_adaspec"):
        outs = [step(driver) for _ in range(8)]
    assert outs[0] == [[1, 2, 3]] * 2 and all(o == [[], []] for o in outs[1:]), outs
    st = driver.get_stats()
    assert st["drafter_faults"] == 3 and st["drafting_off"] == 1, st
    assert driver.drafter.calls["draft"] == 4  # never asked again after the third fault
    assert len(driver.states) == 0 and sorted(driver.drafter.finished) == ["a", "b"] and driver.plans == {}
    assert sum("speculation is off" in r.getMessage() for r in caplog.records) == 1, caplog.text


def test_the_tree_paths_faults_count_on_the_same_guard_and_stop_drafting():
    driver = make_driver(limit=2)
    step(driver)
    for _ in range(2):  # e.g. the tree sampler (engine/tree_sampler.py) records on the driver's guard
        driver.faults.record("verifying a token tree", ValueError("bad tree"))
    assert step(driver) == [[], []] and driver.get_stats()["drafting_off"] == 1
    assert driver.snapshot()["drafter_faults"] == 2


def test_tree_planning_writes_no_position_unless_every_tree_is_planned():
    from vllm_adaspec.runtime.base import plan_step
    from vllm_adaspec.runtime.cpu import CPUTreeRuntime as TreeRuntime

    positions = torch.arange(10)
    query_start = np.array([0, 4, 8, 10])
    roots = np.array([0, 4, 8])  # each request's first row's position
    good = DraftPlan((5, 6, 7), (-1, 0, 0))
    bad = DraftPlan((5, 6, 7), (-1, 0, 9))  # a parent that does not exist
    spec = {"a": [5, 6, 7], "b": [5, 6, 7]}
    step = plan_step(["a", "b", "c"], query_start, roots, spec, {"a": good}, 10)
    assert step is not None and len(step.requests) == 1
    with pytest.raises(Exception):
        plan_step(["a", "b", "c"], query_start, roots, spec, {"a": good, "b": bad}, 10)
    runtime = TreeRuntime(faults=FaultGuard(5))
    seq_lens = torch.full((3,), 100)
    runtime.begin_step(["a", "b", "c"], query_start, roots, positions, spec, {"a": good, "b": bad}, 10, seq_lens,
                       set(), set())
    assert runtime.step is None and runtime.faults.count == 1  # contained: the step verifies chains
    assert positions.tolist() == list(range(10)) and seq_lens.tolist() == [100] * 3  # request a's tree too


def test_fault_injection_raises_at_the_chosen_pass_and_its_spec_is_strict():
    guard = FaultGuard(5, parse_injection("trie@2, trie@4,suffix@1"))
    guard.point("trie")
    with pytest.raises(InjectedFault, match="'trie', pass 2"):
        guard.point("trie")
    guard.point("trie")
    with pytest.raises(InjectedFault):
        guard.point("trie")
    with pytest.raises(InjectedFault):
        guard.point("suffix")
    guard.point("medusa")  # not asked for
    for bad in ("trie", "trie@0", "nowhere@3", "trie@x"):
        with pytest.raises(ValueError, match=INJECT_ENV):
            parse_injection(bad)


def test_tensor_parallel_ranks_agree_on_faults_and_count_them_alike():
    """Two ranks' guards joined by a stand-in for the host all-reduce: a fault on rank 1 alone is a fault on both
    (the step's drafts or trees off everywhere), both count it, and both reach the fault limit on the same step;
    ranks that planned different trees (digests) also fall back together."""
    from vllm_adaspec.faults import FaultGuard

    ranks = [FaultGuard(limit=2), FaultGuard(limit=2)]
    inbox: list = []

    def sync(values):  # called by each rank in turn; the second call sees both
        inbox.append(values)
        return [max(col) for col in zip(*inbox)]

    for g in ranks:
        g.sync = sync
    ranks[1].record("drafting", RuntimeError("rank 1 only"))
    got = [g.agree(f, "drafting") for g, f in ((ranks[1], True), (ranks[0], False))]
    assert got[1] is True and ranks[0].count == ranks[1].count == 1
    assert ranks[0].by_place == {"on another tensor-parallel rank": 1}
    inbox.clear()
    ranks[1].record("verifying", RuntimeError("again"))
    [g.agree(f, "verifying") for g, f in ((ranks[1], True), (ranks[0], False))]
    assert ranks[0].off and ranks[1].off and ranks[0].count == 2
    inbox.clear()
    answers = [g.agree(False, "planning", digest=d) for g, d in ((ranks[1], 7), (ranks[0], 9))]
    assert answers[1] is True  # the ranks planned different trees: neither verifies them
    assert FaultGuard(limit=3).agree(True, "x") is True and FaultGuard(limit=3).agree(False, "x") is False


def test_the_smoke_report_fails_on_a_difference_a_fault_or_a_cold_kernel(capsys):
    """`adaspec smoke` (vllm_adaspec/smoke.py) exits 1 unless every output is identical, nothing faulted and every
    kernel launch was compiled at start-up (its engines run for real on a GPU; here its verdict logic)."""
    from vllm_adaspec.smoke import compare, print_report

    assert compare([[1, 2], [3]], [[1, 2], [3]]) == [] and compare([[1, 2], [3]], [[1, 5], [3], [4]]) == [0, 2]
    run = {"token_ids": [[1, 2]], "seconds": 1.0, "tokens": 2, "tau": 1.5, "start_seconds": 3.0,
           "drafter_faults": 0, "tree_kernel_cold": 0}
    report = {"machine": {"device": "cpu"}, "engines": {"plain": dict(run), "multibranch": dict(run)}, "differ": []}
    assert print_report(report) is True
    for bad in ({"differ": [0]}, {"engines": {"plain": run, "multibranch": {**run, "tree_kernel_cold": 2}}},
                {"engines": {"plain": run, "multibranch": {**run, "drafter_faults": 1}}},
                {"engines": {"plain": run, "multibranch": {"error": "boom"}}},
                {"kernel": [{"dtype": "torch.bfloat16", "error": 0.5, "ok": False, "seconds": 1.0}]}):
        assert print_report({**report, **bad}) is False
    assert "result: FAIL" in capsys.readouterr().out


def test_propose_runs_in_inference_mode_entering_it_only_where_the_caller_has_not(monkeypatch):
    """Drafting runs in torch's inference mode: vLLM's GPU worker calls propose there already (it is not entered
    again: ~2-10 us a step), a caller outside it (a replay, a test) gets it entered for the call."""
    import torch

    driver = make_driver("nowhere")
    seen, entered = [], []
    real_draft = driver.drafter.draft
    monkeypatch.setattr(driver.drafter, "draft", lambda *a: seen.append(torch.is_inference_mode_enabled())
                        or real_draft(*a))
    real_mode = torch.inference_mode
    monkeypatch.setattr(torch, "inference_mode", lambda *a: entered.append(1) or real_mode(*a))
    assert step(driver) == [[1, 2, 3]] * 2 and seen == [True] and len(entered) == 1
    with real_mode():
        assert step(driver) == [[1, 2, 3]] * 2
    assert seen == [True, True] and len(entered) == 1  # (not entered again inside vLLM's)
