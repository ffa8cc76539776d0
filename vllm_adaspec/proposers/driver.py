"""The driver: the per-request bookkeeping every drafter shares (request states and their draft-length policies,
budgets, the step cost model, tree admission, statistics), and the custom proposer vLLM calls. It drives one drafter
(proposers/drafter.py) through its interface and never sees vLLM's model runner: the engine glue attaches an engine
port (engine/port.py) that hands it the batch (`BatchView`) and each step's feedback, which becomes one `Outcome`
per decoding request (vllm_adaspec/step.py).

One step, as the glue drives it (worker process):
    attach(port)                                    once: the engine port (before the model loads)
    load_model(target_model)                        vLLM: the drafter builds what it needs on the target
    on_schedule(scheduled, spec_tokens, finished,   at the start of every step, before the forward; the drafter's
                prompts)                            per-request work it brings (finished requests' state freed,
                                                    new requests' prompt state built) waits for while_forward
    while_forward()                                 once vLLM launched the forward: on a GPU it runs while the GPU
                                                    computes (off the step's critical path); propose runs what
                                                    is still pending first
    propose(sampled_token_ids, ...)                 vLLM's custom-proposer call, after sampling: feedback ->
                                                    drafter.observe(view, outcomes, taps); policies and the cost
                                                    model -> budgets; drafter.draft(...) -> plans
    get_stats()                                     through the worker's `adaspec_stats` RPC
"""

from __future__ import annotations

import hashlib
import time
import zlib
from dataclasses import replace

import numpy as np
import torch

from vllm_adaspec.faults import FaultGuard
from vllm_adaspec.metrics import observe
from vllm_adaspec.policies import make_policy
from vllm_adaspec.policies.cost_model import (DraftCost, Prior, StepCostModel, attention_load, model_parameters,
                                              prior_for)
from vllm_adaspec.requests import RequestStates, bonus_rows
from vllm_adaspec.step import BatchView, DraftPlan, Needs, Outcome, RequestTraits, Taps
from vllm_adaspec.proposers.drafter import Drafter
from vllm_adaspec.trees import admit_within, copy_capacity


def request_seed(req_id: str, base_seed: int) -> int:
    """Same on every tensor-parallel rank (unlike hash()), so adaptive draws agree across ranks."""
    return (int.from_bytes(hashlib.sha256(req_id.encode()).digest()[:8], "little") ^ base_seed) & (2**63 - 1)


def engine_prior(vllm_config) -> Prior:
    """The step cost model's prior for this engine: its device's curve (on CUDA its card's), for its model's size."""
    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu") or "cpu")
    hf = getattr(getattr(vllm_config, "model_config", None), "hf_text_config", None)
    return prior_for(device, model_parameters(hf) if hf is not None else None, _card_name(device))


def _card_name(device: str) -> str | None:
    """The CUDA device's name ("NVIDIA H200", ...), None elsewhere or where torch cannot say."""
    if device != "cuda":
        return None
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:
        return None


class Driver:
    """The per-request bookkeeping every drafter shares, and the custom proposer vLLM calls: it owns the request
    states and their draft-length policies, budgets, the step cost model, tree admission and the statistics, and
    drives one `Drafter` (proposers/drafter.py) through its interface. The class vLLM instantiates
    (engine/proposers.py) is a Driver with its drafter class and the settings checked at start-up."""
    proposer = "early_exit"  # which part of the adaspec config applies (config.PROPOSER_KEYS)
    drafter_cls: type = Drafter

    def __init__(self, vllm_config, settings):
        """settings: this proposer's part of the config, checked once at start-up (engine/startup.py)."""
        self.cfg = settings
        k = self.cfg.num_speculative_tokens
        self.base_seed = vllm_config.model_config.seed or 0
        self.states = RequestStates(
            new_policy=lambda rid: make_policy(self.cfg.policy, self.drafter.max_drafts(),
                                               request_seed(rid, self.base_seed), self.cfg.policy_params))
        self.port = None  # engine/port.EnginePort, attached by the worker
        self.outcomes: dict[int, Outcome] = {}  # this propose call's feedback, by batch row (drafters read rows)
        self.taps = Taps()  # and the target outputs of the step
        self.tree = self.cfg.tree
        self.plans: dict[str, DraftPlan] = {}  # the last propose call's plans, by request (trees and chains)
        self.tree_holders: set[str] = set()  # requests admitted to tree mode last step (they keep KV copies)
        self.grammar_trees: set[str] = set()  # structured-output requests whose last plan is a tree (the scheduler)
        self._tp = vllm_config.parallel_config.tensor_parallel_size > 1
        # What a step costs by its rows (policies/cost_model.py): fitted online from the engine's own step times
        # ("online"), the shipped curve only ("prior"), or none ("off": drafts are not sized by cost).
        self.costs = StepCostModel(engine_prior(vllm_config)) if self.cfg.cost_model != "off" else None
        self._last_end = None  # perf_counter when the previous propose call returned
        self._step_shape = None  # (decoding requests, rows, tree requests, tree rows) of the pure decode step since
        self._steps = 0  # engine steps since the previous propose call (an observation needs exactly one)
        # (decoding requests, draft passes, seconds, of which in draft passes) of the previous propose call
        self._last_propose = (0, 0, 0.0, 0.0)
        self.draft_costs = DraftCost()  # our own work per step: pools, bookkeeping, draft passes
        self.chain_counts = [0, 0]  # accepted drafts, rejections (engine-wide: the prior of each request's rate)
        self._context: dict[str, int] = {}  # req_id -> committed tokens at its last propose (attention's load)
        self._pending: list = []  # the drafter's per-request work for while_forward, in order: ("finish", ids),
        # ("start", {req_id: prompt})
        self._to_learn = None  # the last measured step, which the cost model learns in while_forward
        self._next_decoding = 0  # requests of the scheduled step (the price list's batch size, likely)
        self._learned = 0  # steps the cost models learned (the price list below is theirs while it stands)
        self._prices = None  # (decoding, steps learned, step_seconds' answer): what while_forward readied
        self.observers: list = []  # vllm_adaspec/observers.py: what tests attach (through the port)
        # Cost accounting, read through the worker's `adaspec_stats` RPC (and /metrics)
        self.stats = self.drafter_cls.stats_cls(tree_accepted_depth=[0] * (k + 1), round_lengths=[0] * (k + 1),
                                                policy=self.cfg.policy)
        # Contained faults (faults.py): shared with the tree runtime; the failpoints of fault injection (tests).
        self.faults = FaultGuard.from_env(self.cfg.fault_limit)
        self.drafter = self.drafter_cls(vllm_config, settings, self)

    @property
    def needs(self) -> Needs:
        return self.drafter.needs

    @property
    def tree_mode(self) -> bool:
        return self.drafter.needs.trees

    def load_model(self, target_model) -> None:
        """vLLM calls this with the target model once it is loaded."""
        self.drafter.load_model(target_model)

    def warm_up(self) -> None:
        """At start-up (engine/worker.py): the drafter's first passes, so the first request does not pay for them.
        A fault here is contained like one in drafting: the engine starts, and drafting sets itself up lazily."""
        try:
            with torch.inference_mode():
                self.drafter.warm_up()
        except Exception as e:  # our code only saves time: never the engine's fault
            self.faults.record("warming up the drafter", e)

    # --- wiring (called by vLLM and by engine/worker.py) ---
    def attach(self, port) -> None:
        """The engine port (engine/port.py): the batch view, feedback, tree runtime and rank broadcast."""
        self.port = port
        self.observers = port.observers
        self.drafter.attach(port)

    def on_schedule(self, scheduled: dict, spec_tokens: dict, finished, prompts: dict | None = None) -> None:
        """At the start of every step: finished requests' state goes, and the step's shape is noted (cost model).
        prompts: {req_id: prompt token ids} of requests scheduled for the first time. The drafter's state of finished
        and new requests is left to while_forward. A fault here is contained: this step's plans are dropped (its
        scheduled drafts verify as chains)."""
        if self.faults.off:
            return
        try:
            self._on_schedule(scheduled, spec_tokens, finished)
            if finished:
                self._pending.append(("finish", list(finished)))
            if prompts:
                self._pending.append(("start", prompts))
            self._next_decoding = len(scheduled)
        except Exception as e:  # our code only saves time: never the engine's fault
            self.contain("the drafter's step bookkeeping", e)

    def while_forward(self) -> None:
        """What needs nothing of the step's outcome, run once vLLM has launched the step's forward: on a GPU the host
        is idle until the sampler waits for the forward, so this costs the step nothing there (on a CPU the forward
        is synchronous: the same work, at another time). The drafter's per-request work on_schedule brought (finished
        requests' pools freed, new requests' prompt state built), and the cost model learning the last measured
        step and readying this step's price list (decisions read the model one step late). A fault here is
        contained like one in on_schedule. (Not the suffix pool's global tree: requests sampled from one prompt
        draft each other's tokens of the same step from it.)"""
        if not self._pending and self._to_learn is None:  # (propose's call after the worker's: nothing left)
            return
        pending, self._pending = self._pending, []
        seen, self._to_learn = self._to_learn, None
        if self.faults.off:
            return
        try:
            for kind, what in pending:
                if kind == "finish":
                    self.drafter.finish(what)
                else:
                    for req_id, prompt in what.items():
                        self.drafter.start(req_id, prompt)
        except Exception as e:  # our code only saves time: never the engine's fault
            self.contain("the drafter's request state", e)
        if seen is None:
            return
        try:
            self._learn(*seen)
            if self._next_decoding:  # solved and tabulated now, not inside the next propose
                self.step_seconds(self._next_decoding)
        except Exception as e:
            self.contain("learning the last step", e)

    def _on_schedule(self, scheduled: dict, spec_tokens: dict, finished) -> None:
        if finished and self.tree_mode:  # their tree KV copies go now, not at the next step
            self.port.drop_trees(finished)
            self.tree_holders.difference_update(finished)
        for obs in self.observers if finished else ():
            obs.forget(finished)
        for req_id in finished:
            self._context.pop(req_id, None)
        for req_id, st in self.states.finish(finished).items():
            self.stats.requests_finished += 1
            if st.rounds:
                observe(self.stats.request_acceptance, st.accepted / st.drafted)
                observe(self.stats.request_drafts_per_round, st.drafted / st.rounds)
        if finished:
            self.port.forget(finished)
        pure = bool(scheduled)
        rows = tree_requests = tree_rows = 0
        attention = 0.0
        for req_id, n in scheduled.items():
            spec = spec_tokens.get(req_id, ())
            drafts = len(spec)
            plan = self.plans.get(req_id) if drafts else None
            plan = plan.scheduled(drafts) if plan is not None else None
            self.states.scheduled(req_id, drafts if plan is None else min(drafts, plan.num_verified))
            pure = pure and n == 1 + drafts
            rows += n
            attention += attention_load(n, self._context.get(req_id, 0))
            if plan is not None and self.tree_mode and plan.is_tree:
                tree_requests += 1
                tree_rows += drafts
        self._steps += 1
        self._step_shape = (len(scheduled), rows, tree_requests, tree_rows, attention) if pure else None
        self.drafter.on_step(scheduled, pure)

    # --- the proposer interface ---
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_):
        """vLLM's custom-proposer call: drafts per batch row ([] = none). A fault in drafting is contained: no row
        drafts this step (plain decoding for the step, lossless). In torch's inference mode (vLLM's GPU worker calls
        it there already: entering it again would cost the step ~2 us warm, ~10 cold)."""
        if torch.is_inference_mode_enabled():
            return self._propose_call(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        with torch.inference_mode():
            return self._propose_call(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)

    def _propose_call(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu):
        if self.port is None:
            raise RuntimeError(
                f"{type(self).__name__} was not attached to the engine: the vllm_adaspec plugin did not install "
                "its worker (is the package installed in the environment vLLM runs in?)")
        drafts, account, faulted = None, None, False
        now = time.perf_counter()
        self.while_forward()  # what the glue did not run while the forward ran (a replay, a path without the hook)
        try:
            self._observe_step(now)  # (on every call: under TP a collective every rank takes part in)
        except Exception as e:
            self.contain("measuring the last step", e)
        if not self.faults.off:
            try:
                drafts, account = self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, now)
            except Exception as e:  # our code only saves time: never the engine's fault
                self.contain("drafting", e)
                faulted = True
        # tensor parallelism: a fault on any rank (or drafting off there), none of them drafts this step (faults.py)
        if self.faults.agree(faulted, "drafting", off=self.faults.off) and drafts is not None:
            self.plans, self._last_end, self._step_shape, self.grammar_trees = {}, None, None, set()
            drafts = None
        if drafts is not None:
            try:
                account()
            except Exception as e:  # the drafts stand; only their statistics are lost
                self.faults.record("counting the step's drafts", e)
        if drafts is None:
            if self.faults.off and not self.stats.drafting_off:  # the limit was reached (here or in the tree path)
                self.stats.drafting_off = 1
                self._release_all()
            drafts = [[] for _ in sampled_token_ids]
        if self._tp:  # digests of every token committed and every draft proposed: the ranks must agree (tests)
            self.stats.committed_digest = zlib.crc32(
                np.asarray([t for c in sampled_token_ids for t in list(c) + [-1]], np.int64).tobytes(),
                self.stats.committed_digest)
            self.stats.draft_digest = zlib.crc32(np.asarray([t for d in drafts for t in d + [-1]], np.int64).tobytes(),
                                                 self.stats.draft_digest)
        return drafts

    def _route(self, req_ids: list, plans: dict[int, DraftPlan]) -> None:
        """Requests whose settings only the tree sampler applies (min_p, logit_bias) verify every plan in the tree
        path, a chain included, or draft nothing; the scheduler is told which structured-output requests' drafts
        are trees (it must not check or mask them as a chain: engine/scheduler.py)."""
        self.grammar_trees = set()
        for i in list(plans):
            plan, traits = plans[i], self.traits_of(req_ids[i])
            if traits.own_sampler and not plan.tree_path:
                if plan.parents is None:
                    del plans[i]
                    continue
                plans[i] = plan = replace(plan, tree_path=True)
            if traits.grammar and plan.is_tree:
                self.grammar_trees.add(req_ids[i])

    def traits_of(self, req_id: str) -> RequestTraits:
        """What the request allows and needs (step.RequestTraits), read once through the port."""
        return self.port.traits(req_id)

    def not_asked(self) -> None:
        """vLLM ran a step without calling propose (a request too close to max_model_len for a full draft): that
        step drafts nothing (engine/runner_hooks.py), and what its verification left (tree results, taps, rows) is
        dropped, since the next propose call's batch rows are not that step's; the plans it verified are spent."""
        try:
            self.port.feedback()
        except Exception as e:  # our code only saves time: never the engine's fault
            self.contain("dropping a skipped step's feedback", e)
        self.plans, self._last_end, self._step_shape = {}, None, None

    def contain(self, where: str, exc: Exception) -> None:
        """After a contained fault: nothing this step's drafter planned is used; the step cost model skips it."""
        self.faults.record(where, exc)
        # (grammar_trees stays: the scheduler masked this step's rows by it, and the tree sampler reads it)
        self.plans, self._last_end, self._step_shape = {}, None, None

    def _release_all(self) -> None:
        """Speculation is off for good: drop what every request holds (each part guarded: something is broken)."""
        held = list(self.states.states)
        for release in (lambda: self.port.drop_trees(held), lambda: self.drafter.finish(held),
                        lambda: self.port.forget(held),
                        lambda: self.states.finish(held)):
            try:
                release()
            except Exception:  # noqa: BLE001 (best effort: the engine runs on without us either way)
                pass
        self.plans, self.tree_holders, self._context, self.grammar_trees = {}, set(), {}, set()
        for obs in self.observers:
            obs.forget(held)

    def _propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, now: float):
        self.grammar_trees = set()
        passes_before = (self.stats.draft_passes, self.stats.draft_pass_seconds)
        view = self.port.view(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        req_ids = view.req_ids
        outcomes, taps = self._outcomes(view)
        self.outcomes, self.taps = outcomes, taps
        self.drafter.observe(view, outcomes, taps)
        plans: dict[int, DraftPlan] = {}
        decoding = view.decoding()
        self.stats.decode_rows += decoding  # target forwards, summed over requests (tau = tokens / this)
        rows, budgets, policies = [], [], []
        tp = time.perf_counter()  # policy time: its decisions, feedback and the statistics it asks for
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:  # prefill chunk in flight or discarded step: no new token to draft from
                self.stats.prefill_chunk_rows += 1
                continue
            req_id = req_ids[i]
            self._context[req_id] = int(num_tokens_no_spec[i])
            drafted, accepted = self.states.verified(req_id, len(sampled))
            self.stats.verified_drafts += drafted
            self.stats.accepted_drafts += accepted
            if drafted:  # the engine's chain acceptance: accepted drafts, rounds ended by a rejection
                self.chain_counts[0] += accepted
                self.chain_counts[1] += accepted < drafted
            if not self.drafter.eligible(req_id):
                continue
            traits = self.traits_of(req_id)
            if traits.controls.off or (traits.own_sampler and not self.tree_mode):
                continue  # the request asked for none, or only the tree sampler applies its settings
            policy = self.states.get(req_id).policy
            budget = min(policy.begin_round(), self.drafter.max_drafts())
            if traits.controls.max_drafts is not None:
                budget = min(budget, traits.controls.max_drafts)
            if budget > 0:
                rows.append(i)
                budgets.append(budget)
                policies.append(policy)
        policy_s = time.perf_counter() - tp
        t0 = time.perf_counter()
        if rows and self.costs is not None:
            budgets = self.drafter.size(view, rows, budgets, decoding)
            kept = [e for e, b in enumerate(budgets) if b > 0]
            rows, budgets, policies = [rows[e] for e in kept], [budgets[e] for e in kept], [policies[e] for e in kept]
        policy_s += self.drafter.draft(view, rows, budgets, policies, plans)
        self._route(req_ids, plans)
        self.plans = {req_ids[i]: plan for i, plan in plans.items()}
        drafts = [list(plans[i].tokens) if i in plans else [] for i in range(len(sampled_token_ids))]
        return drafts, lambda: self._account(view, plans, drafts, rows, decoding, t0, policy_s, now, passes_before)

    def _account(self, view, plans, drafts, rows, decoding, t0, policy_s, now, passes_before) -> None:
        """The statistics of a propose call whose drafts stand (on every tensor-parallel rank)."""
        st = self.stats
        for obs in self.observers:
            obs.after_propose(view, plans, self.states)
        if rows:
            st.propose_calls += 1
            st.draft_tokens += sum(map(len, drafts))
            st.draft_seconds += time.perf_counter() - t0
            for i in rows:
                st.round_lengths[min(len(drafts[i]), len(st.round_lengths) - 1)] += 1
            if self.tree_mode:
                for i in rows:
                    if i in plans and plans[i].is_tree:
                        st.tree_rounds += 1
                        st.tree_nodes += plans[i].num_verified
        if decoding:
            st.draft_steps[any(drafts)] += 1
        st.policy_seconds += policy_s
        self._last_end = time.perf_counter()
        self._last_propose = (decoding, st.draft_passes - passes_before[0], self._last_end - now,
                              st.draft_pass_seconds - passes_before[1])

    def _outcomes(self, view: BatchView) -> tuple[dict[int, Outcome], Taps]:
        """What the last verification made of every decoding row's plan (by batch row), from the engine's feedback:
        tree results, or for chains the number of tokens committed; and the step's taps."""
        results, kv_moves, taps, verified_rows = self.port.feedback()
        if results:
            st = self.stats
            st.tree_verified += len(results)
            st.tree_kv_moves += kv_moves
            st.tree_kv_copy_peak = max(st.tree_kv_copy_peak, self.port.held_copy_tokens())
            for path, *_ in results.values():
                st.tree_accepted_depth[len(path)] += 1
        paths = {row: path for row, (path, *_) in results.items()}
        rows_of = bonus_rows([len(s) for s in view.sampled], verified_rows, paths)
        outcomes = {}
        for i, sampled in enumerate(view.sampled):
            if not sampled:
                continue
            drafted = self.states.get(view.req_ids[i]).drafted_last
            if i in results:
                path, _, predicted = results[i]
                outcomes[i] = Outcome(drafted, tuple(path), sampled[-1], rows_of[i], True, tuple(predicted))
            else:
                outcomes[i] = Outcome(drafted, tuple(range(min(drafted, len(sampled) - 1))), sampled[-1], rows_of[i])
        return outcomes, taps

    def _observe_step(self, now: float) -> None:
        """Feed the cost model the engine step that ran since the previous propose call returned: its seconds, by
        its decoding requests and verified rows (chains and trees apart). Only pure decode steps (prefill chunks
        cost what they cost), and only when exactly one step ran in between."""
        step, steps, last = self._step_shape, self._steps, self._last_end
        self._steps, self._step_shape = 0, None
        if self.costs is None or self.cfg.cost_model != "online":
            return
        seen = (step, now - last, self._last_propose) if step is not None and steps == 1 and last is not None else None
        seen = self._same_on_every_rank(seen)  # on every call: a rank that saw nothing still takes part
        if seen is not None:
            self._to_learn = seen  # learnt while the next forward runs (while_forward)

    def _learn(self, step: tuple, seconds: float, last_propose: tuple) -> None:
        (batch, rows, tree_requests, tree_rows, attention), (decoding, passes, own, pass_s) = step, last_propose
        self._learned += 1  # (first: a fault below leaves no price list of the old model standing)
        for obs in self.observers:  # (the audit: what the model predicted for this step before learning from it)
            obs.step_cost((batch, rows, tree_requests, tree_rows, attention),
                          self.costs.predict(batch, rows, tree_requests, tree_rows, attention), seconds)
        self.costs.observe(batch, rows, seconds, tree_requests, tree_rows, attention)
        self.draft_costs.observe(decoding, passes, own, pass_s)
        self.stats.cost_observations += 1

    def step_seconds(self, decoding: int):
        """For a step of `decoding` requests (seconds, or relative units until the first step is measured):
        rows -> its verification + our own work without draft passes; the seconds a row adds per 1000 tokens of its
        request's context (attention); and what tree verification adds, (tree requests, tree rows) -> seconds."""
        kept = self._prices
        if kept is not None and kept[0] == decoding and kept[1] == self._learned:  # readied behind the forward
            return kept[2]
        own = self.draft_costs.predict(decoding, 0) if self.costs.unit else 0.0
        prices = (self.costs.curve(decoding, own), self.costs.attention_seconds(decoding),
                  self.costs.tree_prices(decoding))
        self._prices = (decoding, self._learned, prices)
        return prices

    # --- for drafters ---
    def tree_rows(self, view: BatchView, rows: list[int], extra_rows: int = 0) -> list[bool]:
        """Which drafting rows may draft a tree: requests the tree sampler can verify exactly and that did not ask
        for chains (step.RequestTraits), and whose KV copies fit the tree path's cap (trees.admit_within); the others
        draft chains. extra_rows: rows a tree carries besides its nodes (draft branches)."""
        if self.tree is None:
            return [False] * len(rows)
        req_ids = view.req_ids
        ok = []
        for i in rows:
            traits = self.traits_of(req_ids[i])
            ok.append(traits.tree and traits.controls.speculation != "chain")
        cand = [e for e, good in enumerate(ok) if good]
        if not self.port.tree_copies():  # the GPU runtime reads the paged cache in place: nothing to cap
            self.tree_holders = {req_ids[rows[e]] for e in cand}
            return ok
        lengths = [copy_capacity(int(view.num_tokens[rows[e]]) + self.tree.budget + extra_rows) for e in cand]
        holding = [req_ids[rows[e]] in self.tree_holders for e in cand]
        admitted = admit_within(lengths, self._copy_cap(), holding)
        for e, a in zip(cand, admitted):
            ok[e] = a
        self.stats.tree_capped += len(cand) - sum(admitted)
        self.tree_holders = {req_ids[rows[e]] for e, a in zip(cand, admitted) if a}
        return ok

    def _copy_cap(self) -> int:
        """KV positions the tree path's copies may hold (config tree.kv_copy_tokens; default 1/8 of the cache)."""
        if self.tree.kv_copy_tokens is not None:
            return self.tree.kv_copy_tokens
        return self.port.kv_positions() // 8

    def _same_on_every_rank(self, value):
        """Tensor parallelism: every rank drafts, and must draft the same. The cost model's only rank-local inputs
        are what each rank measured (and whether it could: a fault contained on one rank resets its step); rank 0's
        observation is used everywhere (one small broadcast per propose call)."""
        return self.port.from_rank0(value) if self._tp else value

    def live_state(self) -> dict:
        """Per-request state held right now, by kind (0 everywhere once every request has finished and the engine
        stepped after it: /metrics `vllm:adaspec_live_state`, the soak test's check that nothing leaks)."""
        held = self.port.held_copy_tokens() if self.port is not None else 0
        return {"policies": len(self.states), "contexts": len(self._context), "tree_kv_copy_tokens": held,
                "tree_holders": len(self.tree_holders), **(self.port.live() if self.port is not None else {}),
                **self.drafter.live(),
                **(self.port.observer_live() if self.port is not None else {})}

    def snapshot(self) -> dict:
        """What /metrics shows (engine/metrics.py): the counters, the live state and the step cost model's fit."""
        self.stats.drafter_faults = self.faults.count  # (the tree path counts its faults on the same guard)
        return {**self.stats.as_dict(), "live": self.live_state(),
                "step_costs": self.costs.table() if self.costs is not None else {}}

    def get_stats(self) -> dict:
        # Copies: in a single-process engine the RPC hands back this very object, and callers diff snapshots.
        self.stats.drafter_faults = self.faults.count
        return {**self.stats.as_dict(), "tracked_requests": len(self.states),
                **(self.port.tree_counts() if self.port is not None else {}),
                "step_costs": self.costs.table() if self.costs is not None else {},
                "config": {"cost_model": self.cfg.cost_model, **self.drafter.config()}, "live": self.live_state(),
                "faults_by_place": dict(self.faults.by_place), **self.drafter.extra_stats(),
                **(self.port.observer_stats() if self.port is not None else {})}
