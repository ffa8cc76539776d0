"""MultiBranchProposer: model-free candidate trees from several pools, verified as one token tree per request.

Each step, for every decoding request, each configured pool (vllm_adaspec/pools/) proposes a small candidate tree
rooted at the request's last token; the candidates go into one trie with calibrated probabilities
(trees/trie.py). Nodes are then chosen across the whole batch by path probability, as many as the verification
cost curve says pay for themselves (`best_prefix`: expected tokens per unit of step time), at most the request's
budget (its policy's, capped by `tree.budget` and the speed guard). The chosen nodes of a request are verified as
one tree (engine/tree_verification.py) or, where trees cannot be verified (a GPU engine, a request with
penalties / logprobs / grammars), as a chain along the best path. Verification outcomes calibrate the pools.

No drafting model: the only target outputs it reads are the logits of rows verification already computed (the
`recycled` pool) and, for the `medusa` pool, the final hidden state of the row that produced each request's last
token, on which the Medusa heads (heads/medusa.py) draft in one batched matmul. Every draft is verified by the
target, so output is exactly plain decoding's (greedy), and sampled output keeps the target distribution (sample-and-match over trees, vLLM's rejection sampler over chains).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_adaspec.policies.cost_model import attention_load
from vllm_adaspec.pools.branches import GramCache, append_branches, harvest, init_branches, propose_branches
from vllm_adaspec.pools.context import ContextIndex, propose_context
from vllm_adaspec.pools.recycled import RecycleTable, propose_recycled
from vllm_adaspec.proposers.base import AdaspecProposer, request_seed
from vllm_adaspec.trees.trie import Calibration, Trie, best_prefix, feedback, merge, ranked, streak_state, subtree

logger = logging.getLogger("vllm_adaspec")



def usable_pools(resolved, vllm_config) -> tuple[str, ...]:
    """The pools this engine runs. Pools the user listed must have their files (the corpus table for this tokenizer,
    Medusa heads for this model: AdaspecConfigError otherwise); of the default set, a model runs those it has files
    for, and the others are left out with a note in the log."""
    from vllm_adaspec.config import AdaspecConfigError
    from vllm_adaspec.heads.medusa import find_medusa
    from vllm_adaspec.pools.corpus import find_corpus

    def medusa():
        if vllm_config.parallel_config.tensor_parallel_size > 1:
            raise AdaspecConfigError("vllm_adaspec: the medusa pool needs tensor_parallel_size 1 (its heads read the "
                                     "unsharded LM head)")
        find_medusa(vllm_config.model_config.hf_text_config, resolved.medusa)

    checks = {"corpus": lambda: find_corpus(vllm_config.model_config.tokenizer, resolved.corpus), "medusa": medusa}
    out = []
    for pool in resolved.pools:
        if pool in checks:
            try:
                checks[pool]()
            except AdaspecConfigError as e:
                if resolved.pools_given:
                    raise
                logger.info("vllm_adaspec: default pool %r left out for this model: %s", pool, e)
                continue
        out.append(pool)
    return tuple(out)


def check_start_up(resolved, vllm_config) -> None:
    """Front-end checks (the user's process, before any engine starts): the listed pools' files fit this model;
    typical acceptance needs tree verification; where trees cannot be verified, say once that requests draft
    chains."""
    from vllm_adaspec.engine.plugin import tree_support

    usable_pools(resolved, vllm_config)
    reason = tree_support(vllm_config)
    if reason and resolved.branches:
        from vllm_adaspec.config import SECTION, AdaspecConfigError

        raise AdaspecConfigError(f"additional_config['{SECTION}']['branches']: draft branches ride in tree "
                                 f"verification forwards, which this engine lacks: {reason}; set branches to 0")
    if reason and resolved.acceptance.name == "typical":
        from vllm_adaspec.config import SECTION, AdaspecConfigError

        raise AdaspecConfigError(f"additional_config['{SECTION}']['acceptance']: 'typical' needs tree verification, "
                                 f"which this engine lacks: {reason}")
    if reason:
        logger.warning("vllm_adaspec: MultiBranchProposer proposes chains (the best path of each candidate tree): "
                       "%s", reason)


@dataclass
class RequestPools:
    """One request's pool state and its last proposal (for calibration once it is verified)."""
    req_id: str
    context: ContextIndex
    seen: int = 0  # committed tokens fed to the suffix pool (the prompt went in at start)
    last_token: int = -1  # the root of the last proposal
    trie: Trie | None = None
    chosen: list[int] = field(default_factory=list)  # trie nodes proposed, in proposal order
    accepted_last: int = 0  # drafts its last verified proposal got accepted (calibration state)
    nodes_sent: int = 0  # verified nodes of its last proposal (draft-branch rows follow them)
    branches: list[list[int]] = field(default_factory=list)  # Self-Draft branches (pools/branches.py)
    branches_sent: list[list[int]] = field(default_factory=list)  # the branches its last proposal carried
    grams: GramCache | None = None  # what its branches wrote (the `branches` pool)


class MultiBranchProposer(AdaspecProposer):
    proposer = "multi_branch"

    def __init__(self, vllm_config):
        super().__init__(vllm_config)
        from vllm_adaspec.engine.plugin import tree_support

        self.tree_mode = tree_support(vllm_config) is None
        self.pools = pools = usable_pools(self.cfg, vllm_config)
        self.wants_verified_logits = "recycled" in pools
        hf = vllm_config.model_config.hf_text_config
        self.recycled = RecycleTable(hf.vocab_size) if "recycled" in pools else None
        self.suffix = None
        if "suffix" in pools:
            from vllm_adaspec.pools.suffix import SuffixPool

            self.suffix = SuffixPool()
        self.corpus = None
        if "corpus" in pools:
            from vllm_adaspec.pools.corpus import CorpusTable, find_corpus

            self.corpus = CorpusTable.load(find_corpus(vllm_config.model_config.tokenizer, self.cfg.corpus))
        self.medusa = None  # engine/medusa_heads.MedusaHeads, once load_model has the target
        self.medusa_folder = None
        if "medusa" in pools:
            from vllm_adaspec.heads.medusa import find_medusa

            self.medusa_folder = find_medusa(hf, self.cfg.medusa)
            self.wants_target_hidden = True  # the worker hands over the sampled rows' final hidden states
        self.medusa_trees: dict[int, object] = {}  # budget -> pools.medusa.SparseTree, built once
        self._check_rows = os.environ.get("VLLM_ADASPEC_CHECK_TARGET_ROWS") == "1"
        self.calibration = Calibration()
        self.requests: dict[str, RequestPools] = {}
        # Self-Draft: N branches of L tokens per tree-verified request (0: off; tree mode only: a chain forward
        # cannot mask them apart)
        self.num_branches = self.cfg.branches if self.tree_mode else 0
        self._extra_rows = self.num_branches * self.cfg.branch_length
        self.vocab_size = hf.vocab_size
        self.stats.update({"pool_nodes": {p: 0 for p in pools}, "trie_nodes": 0, "chosen_nodes": 0,
                           "pool_accepted": {p: 0 for p in pools}, "branch_rows": 0, "branch_rows_read": 0,
                           "branch_grams": 0})

    # --- AdaspecProposer hooks ---
    def _policy_max(self) -> int:
        return self.cfg.tree.budget

    def load_model(self, target_model) -> None:
        """vLLM calls this on every custom proposer; only the medusa pool needs the target (its LM head rows)."""
        if self.medusa_folder is not None:
            from vllm_adaspec.engine.medusa_heads import load_medusa_heads

            self.medusa = load_medusa_heads(target_model, self.vllm_config, self.medusa_folder)
            self._target = target_model  # for the row check below (tests)
            logger.info("vllm_adaspec: Medusa heads %s (K=%d, draft vocabulary %d)", self.medusa_folder,
                        self.medusa.w.shape[0], len(self.medusa.vocab))

    def _on_finished(self, req_ids) -> None:
        for r in req_ids:
            if self.requests.pop(r, None) is not None and self.suffix is not None:
                self.suffix.stop(r)

    def live_state(self) -> dict:
        return {**super().live_state(), "pools": len(self.requests),
                "suffix_requests": len(self.suffix.cache.active_requests) if self.suffix is not None else 0,
                "branch_grams": sum(len(st.grams) for st in self.requests.values() if st.grams is not None)}

    def _verified_drafts_of(self, req_id: str, scheduled: int) -> int:
        st = self.requests.get(req_id)
        return scheduled if st is None or not st.branches_sent else min(scheduled, st.nodes_sent)

    def on_tree_paths(self, results: dict, kv_moves: int) -> None:
        """After verification: the argmax at each request's branch rows writes grams and moves its branches on."""
        super().on_tree_paths(results, kv_moves)
        if not self.num_branches:
            return
        req_ids = self.runner.input_batch.req_ids
        for row, (_, _, predicted) in results.items():
            st = self.requests.get(req_ids[row])
            if st is None or not predicted or not st.branches_sent:
                continue
            st.branches, added = harvest(st.branches_sent, predicted, st.grams, self.cfg.branch_length)
            self.stats["branch_rows_read"] += len(predicted)
            self.stats["branch_grams"] += added

    def _before_draft(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu) -> None:
        """Feed every decoding request's new tokens to its pools, and calibrate on its last proposal's outcome."""
        batch = self.runner.input_batch
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:
                continue
            req_id, n = batch.req_ids[i], int(num_tokens_no_spec[i])
            st = self.requests.get(req_id)
            if st is None:
                st = self.requests[req_id] = RequestPools(req_id, ContextIndex())
                if self.num_branches:
                    prompt = token_ids_cpu[i, :int(batch.num_prompt_tokens[i])].tolist()
                    st.grams = GramCache()
                    st.branches = init_branches(prompt, self.num_branches, self.cfg.branch_length,
                                                self.cfg.branch_init, request_seed(req_id, self.base_seed),
                                                self.vocab_size)
                if self.suffix is not None:
                    st.seen = int(batch.num_prompt_tokens[i])
                    self.suffix.start(req_id, token_ids_cpu[i, :st.seen])
            elif st.trie is not None:
                self._calibrate(st, i, len(sampled), self.states.get(req_id).drafted_last)
            if self.suffix is not None:
                self.suffix.extend(req_id, token_ids_cpu[i, st.seen:n])
                st.seen = n
            st.context.extend(token_ids_cpu[i, len(st.context.tokens):n].tolist())
            st.last_token = int(token_ids_cpu[i, n - 1])
            st.trie, st.chosen, st.nodes_sent, st.branches_sent = None, [], 0, []

    def _calibrate(self, st: RequestPools, row: int, num_sampled: int, scheduled: int) -> None:
        """The last proposal of this request was verified: which of its nodes were tested, which passed."""
        verified = st.chosen[:scheduled]  # the scheduler may have trimmed the proposal (breadth-first: still a tree)
        if not verified:
            return
        if row in self._tree_paths:
            path = [verified[j] for j in self._tree_paths[row]]
        else:  # verified as a chain: nodes 0..a-1 were accepted
            path = verified[:num_sampled - 1]
        feedback(st.trie, verified, path, self.calibration)
        st.accepted_last = len(path)
        for node in path:
            for pool in st.trie.keys[node][0][0]:  # the pools that proposed it
                self.stats["pool_accepted"][pool] += 1

    def _draft(self, rows, budgets, policies, num_tokens_no_spec, token_ids_cpu, sampled_token_ids, drafts) -> float:
        if not rows:
            return 0.0
        req_ids = self.runner.input_batch.req_ids
        treeish = self._tree_rows(rows, req_ids, num_tokens_no_spec) if self.tree_mode else [False] * len(rows)
        tries, cands = [], []  # per drafting row: its trie, and its candidate nodes (best first, within budget)
        medusa = self._medusa_candidates(rows, budgets, sampled_token_ids) if self.medusa is not None else None
        for e, (i, budget) in enumerate(zip(rows, budgets)):
            st = self.requests[req_ids[i]]
            pools = self._candidates(st, budget) + ([medusa[e]] if medusa is not None else [])
            trie = merge(pools, self.calibration, streak_state(st.accepted_last))
            order = ranked(trie)[:budget] if treeish[e] else best_path(trie, budget)
            tries.append(trie)
            cands.append(order)
            self.stats["trie_nodes"] += len(trie)
        # Across the batch: the nodes with the highest path probability first, as many as the step cost pays for
        # (expected tokens per second of the whole batch; cost_model "off": every candidate).
        flat = sorted(((tries[e].path[node], e, j) for e, order in enumerate(cands) for j, node in enumerate(order)),
                      key=lambda x: -x[0])
        decoding = sum(1 for s in sampled_token_ids if s)
        branching = [bool(self.num_branches and treeish[e] and self.requests[req_ids[i]].branches)
                     for e, i in enumerate(rows)]
        base_rows = decoding + self._extra_rows * sum(branching)  # branch rows run whatever the trees hold
        count = [0] * len(rows)
        if self.costs is None:
            keep = len(flat)
        else:
            step_cost, attention, tree_extra = self._step_seconds(decoding)
            # a node's row also costs attention over its request's context (seconds per row of each request)
            per_row = [attention * attention_load(1, int(num_tokens_no_spec[i])) for i in rows]
            extra = [attention * attention_load(1, sum(int(n) for n, s in zip(num_tokens_no_spec, sampled_token_ids)
                                                       if s))]
            for _, e, _ in flat:
                extra.append(extra[-1] + per_row[e])
            keep = best_prefix([p for p, _, _ in flat], float(decoding), step_cost, base_rows, extra)
        for _, e, j in flat[:keep]:
            count[e] = max(count[e], j + 1)  # a prefix of a request's ranked nodes is closed under parents
        chosen_of = [cands[e][:count[e]] for e in range(len(rows))]
        if self.costs is not None:  # trees cost more than chains of their rows: keep each only where it pays
            chains_where_cheaper(tries, chosen_of, [treeish[e] and not branching[e] for e in range(len(rows))],
                                 decoding + sum(p for p, _, _ in flat[:keep]), base_rows + keep, extra[keep],
                                 per_row, sum(branching), self._extra_rows * sum(branching), step_cost, tree_extra)
        for e, i in enumerate(rows):
            st = self.requests[req_ids[i]]
            chosen = chosen_of[e]
            if not chosen and not branching[e]:
                continue
            tokens, parents, order = subtree(tries[e], chosen)
            st.trie, st.chosen, st.nodes_sent = tries[e], order, len(tokens)
            drafts[i] = tokens
            if branching[e]:
                st.branches_sent = st.branches
                drafts[i], parents = append_branches(tokens, parents, st.branches)
                self.stats["branch_rows"] += len(drafts[i]) - len(tokens)
            if treeish[e]:
                self.pending_trees[req_ids[i]] = (drafts[i], parents, len(tokens))
                self.stats["tree_rounds"] += 1
                self.stats["tree_nodes"] += len(tokens)
            self.stats["chosen_nodes"] += len(tokens)
        return 0.0

    def _candidates(self, st: RequestPools, budget: int) -> list:
        """The model-free pools' candidates for one request (medusa's come batched, `_medusa_candidates`)."""
        out = {}
        toks = st.context.tokens
        if "context" in self.pools:
            out["context"] = propose_context(st.context, depth=budget)
        if self.suffix is not None:
            out["suffix"] = self.suffix.propose(st.req_id, np.asarray(toks[-self.suffix.max_depth:]), max_nodes=budget)
        if self.recycled is not None:
            out["recycled"] = propose_recycled(self.recycled, toks[-1], depth=budget)
        if self.corpus is not None:
            from vllm_adaspec.pools.corpus import propose_corpus

            out["corpus"] = propose_corpus(self.corpus, toks[-2:], depth=budget)
        if st.grams is not None:
            out["branches"] = propose_branches(st.grams, toks[-1], depth=budget)
        for pool, cand in out.items():
            self.stats["pool_nodes"][pool] += len(cand)
        return list(out.values())

    def _medusa_candidates(self, rows: list[int], budgets: list[int], sampled_token_ids) -> list:
        """Every drafting row's Medusa candidates: the heads on the final hidden state of the row that produced its
        last token, all rows and heads in one matmul; the tree's shape is the sparse tree of its budget."""
        from vllm_adaspec.pools.medusa import propose_medusa, sparse_tree

        if self._target_hidden is None:
            raise RuntimeError("medusa pool: the worker did not hand over the target's hidden states")
        m = self.medusa
        h = self._target_hidden[torch.tensor(self._bonus_rows(rows, sampled_token_ids),
                                             device=self._target_hidden.device)]  # [R, H]
        if self._check_rows:  # greedy tests: the row re-produces its token
            got = self._target.compute_logits(h).argmax(-1).tolist()
            self.stats["row_checks"] = self.stats.get("row_checks", 0) + len(rows)
            self.stats["row_mismatches"] = self.stats.get("row_mismatches", 0) + sum(
                g != sampled_token_ids[i][-1] for g, i in zip(got, rows))
        trees = []
        for budget in budgets:
            if budget not in self.medusa_trees:
                self.medusa_trees[budget] = sparse_tree(m.accuracy, budget)
            trees.append(self.medusa_trees[budget])
        width = max(t.max_rank for t in trees)
        e = None
        if m.embed is not None:  # token-conditioned heads: the embedding of each row's last committed token
            e = m.embed(torch.tensor([sampled_token_ids[i][-1] for i in rows], device=h.device))
        probs = m.logits(h, e).float().softmax(-1)  # [R, K, V']
        top_p, top_i = probs.topk(width, dim=-1)  # [R, K, width]
        top_ids, top_p = m.vocab[top_i].cpu().numpy(), top_p.cpu().numpy()
        out = [propose_medusa(t, top_ids[e], top_p[e]) for e, t in enumerate(trees)]
        if self._record:  # tests: head 1's top token after each committed length, against a plain-torch reference
            rec = self.stats.setdefault("medusa_top1", {})
            batch = self.runner.input_batch
            for e, i in enumerate(rows):  # [committed tokens, head 1's top token]
                rec.setdefault(batch.req_ids[i], []).append([int(batch.num_tokens_no_spec[i]), int(top_ids[e][0][0])])
        self.stats["pool_nodes"]["medusa"] += sum(map(len, out))
        return out

    # --- target rows (the worker calls this after every verification, `wants_verified_logits`) ---
    def on_verified_logits(self, logits: torch.Tensor, metadata) -> None:
        """logits [rows, V] of a step's sampled rows; metadata: vLLM's SpecDecodeMetadata, or None for a step
        without drafts (one row per request). Each request's rows are its root (its last committed token) and its
        drafts; their top-k next tokens refresh the recycled table, so the table fills from plain steps too."""
        if self.recycled is None or self.runner is None:
            return
        rows, tokens = recycled_rows(self.runner.input_batch.req_ids, self.requests, metadata, logits.shape[0])
        if not rows:
            return
        x = logits[torch.tensor(rows, device=logits.device)].float()  # [R, V]
        top, ids = x.topk(self.recycled.k, dim=-1)
        probs = torch.exp(top - torch.logsumexp(x, dim=-1, keepdim=True))
        self.recycled.update(np.asarray(tokens), ids.cpu().numpy(), probs.cpu().numpy())

    def _config_stats(self) -> dict:
        return {"pools": list(self.pools), "budget": self.cfg.tree.budget, "tree_mode": self.tree_mode,
                "acceptance": self.cfg.acceptance.name, "medusa": self.medusa_folder,
                "branches": self.num_branches, "branch_length": self.cfg.branch_length,
                "branch_init": self.cfg.branch_init}

    def get_stats(self) -> dict:
        from vllm_adaspec.engine.tree_verification import held_copy_tokens

        from vllm_adaspec.engine.tree_verification import BRANCH_SLOT_CHECKS

        return {**super().get_stats(), "pool_requests": len(self.requests),
                "branch_slot_checks": dict(BRANCH_SLOT_CHECKS),
                "gram_entries": sum(len(st.grams) for st in self.requests.values() if st.grams is not None),
                "suffix_active": len(self.suffix.cache.active_requests) if self.suffix is not None else 0,
                "kv_copies": held_copy_tokens()}


def is_tree(trie: Trie, nodes: list[int]) -> bool:
    """Whether some chosen node has a chosen sibling (else the nodes form a chain)."""
    parents = [trie.parents[i] for i in nodes]
    return len(set(parents)) < len(parents)


def chains_where_cheaper(tries: list[Trie], chosen: list[list[int]], may_switch: list[bool], tokens: float,
                         rows: int, attention: float, per_row: list[float], tree_requests: int, tree_rows: int, cost,
                         tree_extra) -> None:
    """Tree verification costs more than a chain of as many rows (its own attention: tree_extra(requests, rows)).
    For each request whose chosen nodes branch (and `may_switch`), keep the tree only if the batch's expected
    tokens per second beat those with the tree's best path alone; chosen[e] is replaced in place. tokens / rows /
    attention: the batch's expected tokens, rows and attention seconds with every choice as it stands (per_row[e]:
    what a row of request e adds to attention); tree_requests / tree_rows: tree rows that cannot switch (draft
    branches)."""
    branching = [e for e, nodes in enumerate(chosen) if may_switch[e] and is_tree(tries[e], nodes)]
    tree_requests += len(branching)
    tree_rows += sum(len(chosen[e]) for e in branching)
    for e in branching:
        nodes, trie = chosen[e], tries[e]
        chain = best_path(trie, len(nodes), among=set(nodes))
        t_chain = tokens - sum(trie.path[i] for i in nodes) + sum(trie.path[i] for i in chain)
        r_chain = rows - len(nodes) + len(chain)
        a_chain = attention - per_row[e] * (len(nodes) - len(chain))
        tree_rate = tokens / (cost(rows) + attention + tree_extra(tree_requests, tree_rows))
        chain_rate = t_chain / (cost(r_chain) + a_chain + tree_extra(tree_requests - 1, tree_rows - len(nodes)))
        if chain_rate >= tree_rate:
            chosen[e] = chain
            tokens, rows, attention = t_chain, r_chain, a_chain
            tree_requests, tree_rows = tree_requests - 1, tree_rows - len(nodes)


def best_path(trie: Trie, budget: int, among: set[int] | None = None) -> list[int]:
    """Chain fallback: from the root, always the child with the highest path probability, up to `budget` nodes
    (only `among` these nodes, when given)."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(trie.parents):
        if among is None or i in among:
            kids.setdefault(p, []).append(i)
    out, node = [], -1
    while len(out) < budget and kids.get(node):
        node = max(kids[node], key=lambda c: trie.path[c])
        out.append(node)
    return out


def recycled_rows(req_ids: list[str], requests: dict, metadata, num_rows: int) -> tuple[list[int], list[int]]:
    """Which sampled rows feed the recycled table, and the token each row's logits follow.

    metadata None (a step without drafts): row i is request i's last committed token. Otherwise, per request: the
    root's row (it verifies the first draft), each draft's row, in order (trees: the nodes breadth-first), the last
    being the bonus row; a request without drafts has only its bonus row, its root's. Requests that have not
    committed a token yet (prefill) are skipped."""
    rows, tokens = [], []
    if metadata is None:
        for i, req_id in enumerate(req_ids[:num_rows]):
            st = requests.get(req_id)
            if st is not None and st.last_token >= 0:
                rows.append(i)
                tokens.append(st.last_token)
        return rows, tokens
    cu = [0] + metadata.cu_num_draft_tokens.tolist()
    drafts = metadata.draft_token_ids.tolist()
    target, bonus = metadata.target_logits_indices.tolist(), metadata.bonus_logits_indices.tolist()
    for i, req_id in enumerate(req_ids[:len(cu) - 1]):
        st = requests.get(req_id)
        if st is None or st.last_token < 0:
            continue
        rows += target[cu[i]:cu[i + 1]] + [bonus[i]]
        tokens += [st.last_token] + drafts[cu[i]:cu[i + 1]]
    return rows, tokens
