"""MultiBranchProposer: model-free candidate trees from several pools, verified as one token tree per request.

Each step, for every decoding request, each configured pool (vllm_adaspec/pools/) proposes a small candidate tree
rooted at the request's last token; the candidates go into one trie with calibrated probabilities
(trees/trie.py). Nodes are then chosen across the whole batch by path probability, as many as the verification
cost curve says pay for themselves (`best_prefix`: expected tokens per unit of step time), at most the request's
budget (its policy's, capped by `tree.budget` and the speed guard). The chosen nodes of a request are verified as
one tree (runtime/, runtime/gpu.py) or, where trees cannot be verified (an attention
backend without a tree path, a request whose sampling needs vLLM's own per-request state), as a chain along the best
path. Verification outcomes calibrate the pools.

No drafting model: the only target outputs it reads are the logits of rows verification already computed (the
`recycled` pool) and, for the `medusa` pool, the final hidden state of the row that produced each request's last
token, on which the Medusa heads (heads/medusa.py) draft in one batched matmul. Every draft is verified by the
target, so output is exactly plain decoding's (greedy), and sampled output keeps the target distribution (sample-and-match over trees, vLLM's rejection sampler over chains).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from vllm_adaspec.compiled import warmed
from vllm_adaspec.policies.cost_model import attention_load
from vllm_adaspec.pools import POOLS, PoolSet, make_pools
from vllm_adaspec.pools import Taps as PoolTaps
from vllm_adaspec.pools.branches import append_branches
from vllm_adaspec.proposers.drafter import Drafter, Stats
from vllm_adaspec.proposers.driver import request_seed
from vllm_adaspec.step import BatchView, DraftPlan, Needs, Outcome, Taps
from vllm_adaspec.trees.step_choice import Prices, choose_compiled, choose_reference
from vllm_adaspec.trees.step_choice import compiled as choice_compiled
from vllm_adaspec.trees.trie import (Calibration, Trie, YieldCalibration, best_path, chains_where_cheaper,  # noqa: F401
                                     feedback, fold_sum, is_tree, merge, prune, streak_state)

logger = logging.getLogger("vllm_adaspec")



@dataclass
class RequestPools:
    """One request's pool state and its last proposal (for calibration once it is verified)."""
    req_id: str
    last_token: int = -1  # the root of the last proposal
    trie: Trie | None = None  # the nodes of its last proposal, in proposal order (step_choice.chosen_trie)
    accepted_last: int = 0  # drafts its last verified proposal got accepted (calibration state)
    nodes_sent: int = 0  # verified nodes of its last proposal (draft-branch rows follow them)
    branches_sent: list[list[int]] = field(default_factory=list)  # the Self-Draft branches its last proposal carried


@dataclass
class MultiBranchStats(Stats):
    pool_nodes: dict = field(default_factory=dict)  # candidate nodes each pool proposed
    pool_accepted: dict = field(default_factory=dict)  # accepted nodes each pool had proposed
    trie_nodes: int = 0
    chosen_nodes: int = 0
    branch_rows: int = 0  # Self-Draft branch rows sent, read back, and the grams they wrote
    branch_rows_read: int = 0
    branch_grams: int = 0
    grammar_checked: int = 0  # candidate nodes of structured-output requests checked against their grammar
    grammar_pruned: int = 0  # of which the grammar forbade (never verified)
    compiled_choices: int = 0  # steps whose nodes the compiled choice chose (trees/step_choice.py)
    choice_faults: int = 0  # faults of the compiled node choice (then the Python one chose)


class MultiBranchDrafter(Drafter):
    stats_cls = MultiBranchStats

    def __init__(self, vllm_config, settings, driver):
        super().__init__(vllm_config, settings, driver)
        self.tree_mode = self.cfg.tree_unsupported is None
        self.pools = pools = self.cfg.pools  # the pools this engine runs, their files checked at start-up
        hf = vllm_config.model_config.hf_text_config
        self.corpus = None
        if "corpus" in pools:
            from vllm_adaspec.pools.corpus import CorpusTable

            self.corpus = CorpusTable.load(self.cfg.corpus)
        self.medusa = None  # engine/medusa_heads.MedusaHeads, once load_model has the target
        self.medusa_folder = self.cfg.medusa if "medusa" in pools else None
        self.calibration = Calibration()
        # chains' and trees' accepted drafts against their nodes' promise: off unless VLLM_ADASPEC_YIELD_CALIBRATION=1
        # (measured neutral in compiled mode: 1.61x vs 1.60x plain at batch 1, 1.07x both at batch 8;
        # benchmarks/log/2026-11-26.md), kept for the next attempt at the audit's finding
        self.yields = YieldCalibration(enabled=os.environ.get("VLLM_ADASPEC_YIELD_CALIBRATION", "0") == "1")
        # Structured-output requests' candidates are checked against their grammar before any is chosen. Off only
        # to measure what that saves (benchmarks/bench_e2e.py --unpruned): forbidden nodes are then verified, and
        # never accepted (the grammar masks their parents' rows).
        self.prune_grammar = os.environ.get("VLLM_ADASPEC_GRAMMAR_PRUNING", "1") != "0"
        self.requests: dict[str, RequestPools] = {}
        self.compiled_choice = choice_compiled() and choice_ready()  # trees/step_choice.py (off without numba or
        # after a fault in it: the Python choice, the same nodes)
        # Self-Draft: N branches of L tokens per tree-verified request (0: off; tree mode only: a chain forward
        # cannot mask them apart)
        self.num_branches = self.cfg.branches if self.tree_mode else 0
        self._extra_rows = self.num_branches * self.cfg.branch_length
        self.vocab_size = hf.vocab_size
        self.poolset = self._make_pools() if self.medusa_folder is None else None  # medusa: once the heads load
        # what the step must hand over, as the pools' specs declare it (medusa: the target's final hidden states;
        # recycled: the top-k at every verified row)
        specs = [POOLS[p] for p in pools]
        self.needs = Needs(target_hidden=any(s.needs_hidden for s in specs),
                           verified_logits=max((s.logits_k for s in specs), default=0), trees=self.tree_mode)
        self.stats.pool_nodes = self.poolset.nodes if self.poolset else {}
        self.stats.pool_accepted = {p: 0 for p in pools}

    def _make_pools(self, heads=None) -> PoolSet:
        return PoolSet(make_pools(self.pools, vocab_size=self.vocab_size, corpus_table=self.corpus, medusa_heads=heads,
                                  num_branches=self.num_branches, branch_length=self.cfg.branch_length,
                                  branch_init=self.cfg.branch_init,
                                  branch_seed=lambda r: request_seed(r, self.driver.base_seed),
                                  suffix_cache_requests=self.cfg.suffix_cache_requests),
                       failpoint=self.driver.faults.point)

    # --- the drafter interface ---
    def max_drafts(self) -> int:
        return self.cfg.tree.budget

    def load_model(self, target_model) -> None:
        """vLLM calls this on every custom proposer; only the medusa pool needs the target (its LM head rows)."""
        if self.medusa_folder is not None:
            self.medusa = self.driver.port.medusa_heads(target_model, self.medusa_folder)
            self.poolset = self._make_pools(self.medusa)
            self.stats.pool_nodes = self.poolset.nodes
            logger.info("vllm_adaspec: Medusa heads %s (K=%d, draft vocabulary %d)", self.medusa_folder,
                        self.medusa.w.shape[0], len(self.medusa.vocab))

    def start(self, req_id: str, prompt) -> None:
        if req_id not in self.requests:  # (a request seen before: its pools run on, as when observe met it)
            self.requests[req_id] = RequestPools(req_id)
            self.poolset.start(req_id, prompt)

    def finish(self, req_ids) -> None:
        for r in req_ids:
            self.requests.pop(r, None)
            self.poolset.stop(r)

    def _grams_held(self) -> int:
        branches = self.poolset.get("branches") if self.poolset is not None else None
        return branches.grams_held() if branches is not None else 0

    def live(self) -> dict:
        live = self.poolset.live() if self.poolset is not None else {}
        return {"pools": len(self.requests), "suffix_requests": live.get("suffix", 0),
                "branch_grams": self._grams_held()}

    def observe(self, view: BatchView, outcomes: dict[int, Outcome], taps: Taps) -> None:
        """Every decoding request: its last proposal's outcome calibrates the pools (and its branch rows' argmax
        writes grams), its new tokens feed its pools; the recycled table takes the verified rows' top-k."""
        for req_ids, tokens, ids, probs in taps.logits_topk:
            known = [j for j, r in enumerate(req_ids) if r in self.requests]
            if known:
                self.poolset.observe_logits(tokens[known], ids[known], probs[known])
        for i, outcome in outcomes.items():
            req_id, n = view.req_ids[i], int(view.num_tokens[i])
            st = self.requests.get(req_id)
            if st is None:  # (not started at scheduling: a prompt without token ids)
                self.start(req_id, view.token_ids[i, :int(view.num_prompt[i])])
                st = self.requests[req_id]
            elif st.trie is not None:
                self._calibrate(st, outcome)
            if outcome.branch_argmax and st.branches_sent:
                self.stats.branch_grams += self.poolset.observe_branches(req_id, st.branches_sent,
                                                                            list(outcome.branch_argmax))
                self.stats.branch_rows_read += len(outcome.branch_argmax)
            self.poolset.extend(req_id, view.token_ids[i, self.poolset.fed[req_id]:n])
            st.last_token = int(view.token_ids[i, n - 1])
            st.trie, st.nodes_sent, st.branches_sent = None, 0, []

    def _calibrate(self, st: RequestPools, outcome: Outcome) -> None:
        """The last proposal of this request was verified: which of its nodes were tested, which passed (st.trie:
        the proposal's nodes, in proposal order)."""
        verified = range(min(outcome.drafted, len(st.trie)))  # the scheduler may have trimmed it (still a tree)
        if not verified:
            return
        path = list(outcome.accepted)
        trie, pools_of = st.trie, self.calibration.pool_names
        if self.yields.enabled:
            self.yields.observe(outcome.tree, fold_sum(trie.path[:len(verified)]), len(path))
        accepted = set(path) if self.driver.observers else ()
        for obs in self.driver.observers:  # the audit: what calibration expected of these nodes, what came of them
            obs.proposal_outcome(st.req_id, 1.0 + fold_sum(trie.path[n] for n in verified), 1 + len(path),
                                 [(trie.path[n], pools_of(trie.codes[n]), n in accepted) for n in verified],
                                 outcome.tree)
        feedback(trie, verified, path, self.calibration)
        st.accepted_last = len(path)
        counts, codes = self.stats.pool_accepted, trie.codes
        for node in path:
            for pool in pools_of(codes[node]):  # the pools that proposed it
                counts[pool] += 1

    def score(self, req_id: str, candidates: list, state: tuple) -> Trie:
        """A request's candidates (one Candidates per pool) as its trie, each node scored with its calibrated chance
        (trees.trie.merge). The one place scores are made: an offline replay may stand in for it
        (benchmarks/decision_replay.py's oracle selection)."""
        return merge(candidates, self.calibration, state)

    def draft(self, view: BatchView, rows: list[int], budgets: list[int], policies: list,
               plans: dict[int, DraftPlan]) -> float:
        if not rows:
            return 0.0
        req_ids, num_tokens_no_spec = view.req_ids, view.num_tokens
        treeish = self.driver.tree_rows(view, rows, self._extra_rows) if self.tree_mode else [False] * len(rows)
        candidates = self.poolset.propose([req_ids[i] for i in rows], budgets, self._pool_taps(view, rows))
        medusa = self.poolset.get("medusa")
        for obs in self.driver.observers if medusa is not None else ():
            obs.medusa_top([req_ids[i] for i in rows], [int(view.num_tokens[i]) for i in rows], medusa.last_top_ids)
        states = [streak_state(self.requests[req_ids[i]].accepted_last) for i in rows]
        grammar = [treeish[e] and self.prune_grammar and self.driver.traits_of(req_ids[i]).grammar
                   for e, i in enumerate(rows)]
        # compiled (trees/step_choice.py) unless this step needs what only the Python choice does
        compiled = self.compiled_choice and not any(grammar) and "score" not in self.__dict__
        tries = []
        for e, i in enumerate(rows):
            self.driver.faults.point("trie")
            if compiled:
                continue
            trie = self.score(req_ids[i], candidates[e], states[e])
            if grammar[e]:
                trie, treeish[e] = self._grammar_pruned(view, i, trie)
            tries.append(trie)
        scale = [self.yields.ratio(treeish[e]) for e in range(len(rows))]
        decoding = view.decoding()
        branch_pool = self.poolset.get("branches")
        branches = [branch_pool.branches_of(req_ids[i]) if branch_pool is not None else [] for i in rows]
        branching = [bool(self.num_branches and treeish[e] and branches[e]) for e in range(len(rows))]
        # Across the batch: the nodes with the highest path probability first, as many as the step cost pays for
        # (expected tokens per second of the whole batch; cost_model "off": every candidate), trees that do not
        # pay for their extra cost as chains
        prices = None
        if self.driver.costs is not None:
            step_cost, attention, tree_extra = self.driver.step_seconds(decoding)
            # a node's row also costs attention over its request's context (seconds per row of each request)
            per_row = [attention * attention_load(1, int(num_tokens_no_spec[i])) for i in rows]
            may_switch = [treeish[e] and not branching[e]
                          and self.driver.traits_of(req_ids[i]).controls.speculation != "tree"
                          for e, i in enumerate(rows)]
            prices = Prices(float(decoding), decoding + self._extra_rows * sum(branching), step_cost, tree_extra,
                            per_row, attention * attention_load(1, sum(int(n) for n, s in
                                                                       zip(num_tokens_no_spec, view.sampled) if s)),
                            may_switch, sum(branching), self._extra_rows * sum(branching),
                            (self.yields.ratio(True), self.yields.ratio(False)))
        chosen = None
        if compiled:
            try:
                chosen, sizes = choose_compiled(candidates, self.calibration, [s[0] for s in states], treeish,
                                                budgets, scale, prices)
                self.stats.compiled_choices += 1
            except Exception as exc:
                # candidates Python refuses as well are the pools' fault (raised here, contained by the driver); else
                # the compiled choice's: the Python one from now on
                tries = [self.score(req_ids[i], candidates[e], states[e]) for e, i in enumerate(rows)]
                logger.error("vllm_adaspec: the compiled node choice failed; the Python one chooses from now on",
                             exc_info=exc)
                self.stats.choice_faults += 1
                self.compiled_choice = False
        if chosen is None:
            chosen, sizes = choose_reference(tries, treeish, budgets, scale, prices), [len(t) for t in tries]
        self.stats.trie_nodes += sum(sizes)
        for e, i in enumerate(rows):
            ch = chosen[e]
            if not len(ch) and not branching[e]:
                continue
            st = self.requests[req_ids[i]]
            st.trie, st.nodes_sent = ch, len(ch)
            rows_out, parents = ch.tokens, ch.parents
            if branching[e]:
                st.branches_sent = branches[e]
                rows_out, parents = append_branches(ch.tokens, ch.parents, branches[e])
                self.stats.branch_rows += len(rows_out) - len(ch)
            plans[i] = DraftPlan(tuple(rows_out), tuple(parents) if treeish[e] else None,
                                 len(ch) if len(rows_out) > len(ch) else None)
            self.stats.chosen_nodes += len(ch)
        return 0.0

    def _grammar_pruned(self, view: BatchView, i: int, trie: Trie) -> tuple[Trie, bool]:
        """A structured-output request's candidates, checked against its grammar before any is chosen: nodes the
        grammar forbids (and their subtrees) are dropped. (trie, still a tree?): a request without a usable grammar
        copy drafts its best path as a chain, which vLLM's scheduler checks."""
        output = view.token_ids[i, int(view.num_prompt[i]):int(view.num_tokens[i])].tolist()
        keep = self.driver.port.grammar_valid(view.req_ids[i], output, trie.tokens, trie.parents)
        if keep is None:
            return trie, False
        self.stats.grammar_checked += len(keep)
        self.stats.grammar_pruned += len(keep) - sum(keep)
        return prune(trie, keep), True

    def _pool_taps(self, view: BatchView, rows: list[int]) -> PoolTaps:
        """What the pools read of the target for the drafting rows: the final hidden state of the row that
        produced each one's last token [R, H] (medusa), and that token."""
        last = [view.sampled[i][-1] for i in rows]
        if not self.poolset.needs_hidden:
            return PoolTaps(None, last)
        hidden = self.driver.taps.hidden
        if hidden is None:
            raise RuntimeError("medusa pool: the worker did not hand over the target's hidden states")
        at = [self.driver.outcomes[i].row for i in rows]
        if at == list(range(at[0], at[0] + len(at))):  # consecutive rows (every chain step, batch 1): a view
            h = hidden[at[0]:at[0] + len(at)]  # [R, H]
        else:
            h = hidden.index_select(0, torch.tensor(at, device=hidden.device))  # [R, H] (not advanced indexing: slower)
        for obs in self.driver.observers:
            obs.target_rows(last, h)
        return PoolTaps(h, last)

    def config(self) -> dict:
        return {"pools": list(self.pools), "budget": self.cfg.tree.budget, "tree_mode": self.tree_mode,
                "acceptance": self.cfg.acceptance.name, "medusa": self.medusa_folder,
                "branches": self.num_branches, "branch_length": self.cfg.branch_length,
                "branch_init": self.cfg.branch_init}

    def extra_stats(self) -> dict:
        return {"pool_requests": len(self.requests),
                "gram_entries": self._grams_held(),
                "suffix_active": (self.poolset.live().get("suffix", 0) if self.poolset is not None else 0),
                "kv_copies": self.driver.port.held_copy_tokens() if self.driver.port is not None else 0}


def choice_ready() -> bool:
    """The compiled node choice compiled now, at start-up (not in the first step); False where it cannot."""
    from vllm_adaspec.trees import step_choice

    return warmed(step_choice.warm_up, "the compiled node choice did not compile; the Python one chooses (the same "
                                       "nodes, more host time a step)")
