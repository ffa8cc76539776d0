"""EESD early-exit self-drafting: draft with the target's own first N layers and an exit head.

vLLM constructs it in the worker, inside the driver (speculative_config.model = "vllm_adaspec.EarlyExitProposer").
Each step it drafts, batched across requests, up to K tokens per request: token by token through the first
N layers (engine/drafting.py) and the exit head, greedily. The number of drafts per request is decided by
that request's draft-length policy. Verification is vLLM's own: drafts are deterministic given the context,
so its rejection sampler stays lossless (the draft distribution is a point mass).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from vllm_adaspec.kernels.entropy_topk import entropy_topk
from vllm_adaspec.policies import POLICIES
from vllm_adaspec.policies.cost_model import attention_load
from vllm_adaspec.proposers.drafter import Drafter, Stats
from vllm_adaspec.step import BatchView, DraftMask, DraftPlan, DraftPrefix, Needs, Outcome, Taps
from vllm_adaspec.trees import GrowingTree, add_children, best_subtree, to_expand
from vllm_adaspec.trees.trie import best_prefix
from vllm_adaspec.trees.c2t import ENTROPY_TOP_N, confidence, node_features, select_layer


ACCEPT_PRIOR = 4.0  # a request's acceptance starts from the engine's rate, worth this many drafts
PASS_OVERHEAD = 0.05  # a draft pass / a plain target step, besides its share of the layers (until measured)
EXPLORE = 0.03  # share of steps that draft one token where the cost model drafts nothing
# A request drafts one token where nothing pays until this many of its own drafts were verified: the engine's rate
# it starts from comes from other requests (a translation's 14% says little of a math answer's 56%), and once the
# feed pauses a request never drafts again, so it must measure its own rate early.
OWN_EVIDENCE = 8
PAUSE_AFTER = 32  # decode steps without drafts after which the exit layers' KV upkeep stops


@dataclass
class EarlyExitStats(Stats):
    c2t_seconds: float = 0.0  # C2T's classifier calls (tree builder "c2t")
    # a draft layer's KV upkeep: committed rows it ran, and rows whose KV the first draft pass had already written
    feed_rows: int = 0
    feed_rows_reused: int = 0


class EarlyExitDrafter(Drafter):
    stats_cls = EarlyExitStats

    def __init__(self, vllm_config, settings, driver):
        super().__init__(vllm_config, settings, driver)
        self.prefix = None
        # thompson-cali's acceptance predictor (policies/calibration.py) and the target output it reads: the
        # worker hands over the last forward's sampled rows of the final hidden state (normed) and, per batch row,
        # how many drafts it verified (the rows a request took there).
        self.calibration = None
        self.needs = Needs(target_hidden=getattr(POLICIES[self.cfg.policy], "needs_score", False),
                           trees=self.tree is not None)
        self.exit_head = None  # checkpoint folder in use, None = untrained exit
        # Where plain decoding wins (the cost model drafts nothing for PAUSE_AFTER decode steps in a row), the exit
        # layers' KV upkeep stops too (a layer's worth of work on every target step). Requests decoded without it
        # have holes in that KV and never draft again. Eager mode only for exit layers on the first N: under
        # torch.compile the hook is traced into the target's graph with its flag as a constant. A draft layer's feed
        # is our own eager code and pauses in either mode.
        self._can_pause_feed = bool(vllm_config.model_config.enforce_eager)
        self._feed_next = True
        self._plain_streak = 0  # decode steps in a row the cost model drafted nothing
        self._stale: set[str] = set()
        self._rng = random.Random(self.driver.base_seed)  # exploration draws: the same on every tensor-parallel rank
        self.c2t = None  # C2T's classifier parameters (tree builder "c2t")
        self.pass_prior = 0.25 + PASS_OVERHEAD  # set from the layers a pass runs once the model loads
        # A draft layer's feature of each request's last committed token (the input of its next row), by request
        self._carry: dict[str, torch.Tensor] = {}
        # ... and (propose call, position) of the row whose KV the last first draft pass wrote, by request
        self._primed: dict[str, tuple[int, int]] = {}
        self._steps = 0  # propose calls seen

    # --- wiring (called by vLLM and by engine/worker.py) ---
    def load_model(self, target_model) -> None:
        self.prefix = self.driver.port.target_prefix(target_model, self.cfg.exit_layer, self.cfg.exit_head,
                                                     self.cfg.exit_head_setting, self.cfg.draft_weights)
        self.exit_head = self.cfg.exit_head if self.prefix.exit is not None else None
        # until a pass is timed: its share of the target's layers (N of them + the exit's own) and some overhead
        layers = len(self.prefix.layers) + (len(self.prefix.exit.layers) if self.prefix.exit is not None else 0)
        self.pass_prior = min(1.0, layers / self.vllm_config.model_config.hf_text_config.num_hidden_layers
                              + PASS_OVERHEAD)
        if self.prefix.reads_features:  # a draft layer: its KV is fed from every forward's rows (feed)
            self.needs = replace(self.needs, forward_rows=True, aux_layers=self.prefix.exit.aux_layers)
            self._can_pause_feed = True  # its feed is eager code of ours in either mode
        if self.tree is not None and self.tree.builder == "c2t":
            from vllm_adaspec.heads.c2t import load_c2t

            device = next(target_model.parameters()).device
            self.c2t = {k: v.to(device) for k, v in load_c2t(self.exit_head)[1].items()}
        if self.needs.target_hidden:
            self.calibration = self.driver.port.acceptance_calibration(self.exit_head, self.cfg.policy,
                                                                next(target_model.parameters()).device)

    def warm_up(self) -> None:
        """One draft pass of a dummy row at position 0 (and, for a draft layer, the KV feed of a dummy prompt) in
        vLLM's null block (block 0: the block pool keeps it out of every request's table). Their first calls in a process cost ~0.3 s
        on a 2-core CPU (lazy set-up of the attention metadata and kernels), a quarter of a short first request.
        One rank only: under tensor parallelism a fault on one rank would leave the others in a collective."""
        if self.vllm_config.parallel_config.tensor_parallel_size > 1:
            return
        p = self.prefix
        p.ensure_attached()
        device = p.device
        blocks = torch.zeros(1, 1, dtype=torch.int32, device=device)  # [1, 1] the null block
        tokens = torch.zeros(1, dtype=torch.long, device=device)
        positions = torch.zeros(1, dtype=torch.long, device=device)
        feats = None
        if p.reads_features:
            feats = torch.zeros(1, p.exit.feature_width, dtype=p.exit.feat_norm.weight.dtype, device=device)
        hidden, residual = p.forward(blocks, tokens, positions, 1, features=feats)
        p.head(hidden, residual)
        if p.reads_features:  # a prompt's rows (a query of several rows: the attention's prefill path)
            m = min(8, p.block_size)
            rows = torch.arange(m, device=device)
            p.feed(rows, [m], feats, feats.new_zeros(m, feats.shape[-1]), rows, rows,
                   torch.zeros(1, dtype=torch.long, device=device), m, blocks=blocks)

    def eligible(self, req_id: str) -> bool:
        return req_id not in self._stale

    def finish(self, req_ids) -> None:
        self._stale.difference_update(req_ids)
        for r in req_ids:
            self._carry.pop(r, None)
            self._primed.pop(r, None)

    def live(self) -> dict:
        return {"paused_requests": len(self._stale), "carried_features": len(self._carry)}

    def observe(self, view: BatchView, outcomes: dict[int, Outcome], taps: Taps) -> None:
        self._steps += 1
        if self.prefix is not None and self.prefix.reads_features and self.prefix.exit.feeding:
            self._feed(view, outcomes, taps.forward)
        for obs in self.driver.observers:  # labels for `adaspec train c2t`: a node is accepted iff it is on the path
            for row, outcome in outcomes.items():
                if outcome.tree:
                    obs.tree_outcome(view.req_ids[row], outcome.accepted)

    def _feed(self, view: BatchView, outcomes: dict[int, Outcome], fwd) -> None:
        """The draft layer's KV for every token the step committed (prompt chunks, the last bonus token, accepted
        drafts), each reading the target's feature of the token before it; then each request's carried feature
        becomes its last committed row's (what its next row, drafted or verified, reads)."""
        if fwd is None:
            return
        qs = fwd.query_start
        if len(qs) != len(view.req_ids) + 1:
            raise RuntimeError(f"the forward had {len(qs) - 1} requests, the batch {len(view.req_ids)}")
        # per request fed: its committed tokens' forward rows in order, and the row each reads the feature of (its
        # parent: the row before in a chain, the path's node before in a tree; -1: the feature carried from before)
        counts, live, ends, skipped, reused, row_list, parent_list = [], [], [], [], 0, [], []
        for i, sampled in enumerate(view.sampled):
            out = outcomes.get(i)
            start = int(qs[i])
            if out is not None and out.tree:  # the root, then the accepted path (node j is the forward's row 1 + j)
                path = [start] + [start + 1 + a for a in out.accepted]
            else:
                sched = int(qs[i + 1] - qs[i])
                path = list(range(start, start + (min(sched, len(sampled)) if out is not None and out.drafted
                                                  else sched)))
            if not path:
                continue
            ends.append((i, path[-1]))
            # The previous step's first draft pass already wrote this request's first row (its last committed token,
            # from the same carried feature): that KV stands, the row is not run again.
            primed = (self._steps - 1, int(view.num_tokens[i]) - len(sampled) - 1)
            skip = int(bool(sampled) and self._primed.get(view.req_ids[i]) == primed)
            reused += skip
            if len(path) > skip:
                row_list += path[skip:]
                parent_list += ([-1] + path[:-1])[skip:]
                counts.append(len(path) - skip)
                live.append(i)
                skipped.append(skip)
        if not ends:
            return
        self.stats.feed_rows += sum(counts)
        self.stats.feed_rows_reused += reused
        device = fwd.parts[0].device
        width = self.prefix.exit.feature_width
        if live:
            self.prefix.ensure_attached()
            rows = torch.tensor(row_list, device=device)  # [M]
            parents = torch.tensor(parent_list, device=device)  # [M]
            feats = fwd.features(parents.clamp(min=0))  # [M, W] each row's parent's feature ...
            first = self._carried(view, live, feats, width)  # [R, W] ... or, where none ran here, the carried one
            if any(skipped):  # past a skipped root, the first row's parent ran in this forward
                heads = np.cumsum([0] + counts[:-1])
                past = [j for j, k in enumerate(skipped) if k]
                first[torch.tensor(past, device=device)] = feats[torch.from_numpy(heads[past]).to(device)]
            self.prefix.feed(rows, counts, first, feats, fwd.input_ids, fwd.positions,
                             torch.tensor(live, device=device), int(view.num_tokens.max()) + 1)
        last = fwd.features(torch.tensor([e for _, e in ends], device=device))  # [R, W]
        for j, (i, _) in enumerate(ends):
            self._carry[view.req_ids[i]] = last[j]

    def _carried(self, view: BatchView, rows: list[int], like: torch.Tensor, width: int) -> torch.Tensor:
        """[R, width] each row's carried feature (zeros before its first forward), in `like`'s dtype and device."""
        zero = like.new_zeros(width)
        return torch.stack([self._carry.get(view.req_ids[i], zero) for i in rows])

    def on_step(self, scheduled: dict, pure: bool) -> None:
        exit_ = self.prefix.exit if self.prefix is not None else None
        if exit_ is not None and scheduled and self._can_pause_feed:
            # Prompt chunks always feed the exit layers: a new request may draft.
            exit_.feeding = not pure or self._feed_next
            if not exit_.feeding:
                new = scheduled.keys() - self._stale
                self.stats.plain_switches += len(new)
                self._stale.update(new)

    def size(self, view: BatchView, rows: list[int], budgets: list[int], decoding: int) -> list[int]:
        """Chain lengths from the cost model: a request's j-th draft is accepted with chance a^j (a: its share of
        drafts accepted, from a prior at the engine's rate); drafts are taken best first across the batch while the
        batch's expected tokens per second rise, a step costing its verified rows (the fitted curve) plus one draft
        pass per depth drafted. In tree mode the length is the tree's depth (the tree builder fills it; a tree's
        rounds measure a as the chance of going one depth further). When nothing pays, now and then (EXPLORE) every
        request drafts one token so that acceptance keeps being measured, and a request with fewer than
        OWN_EVIDENCE verified drafts of its own drafts one."""
        req_ids = view.req_ids
        total_acc, total_rej = self.driver.chain_counts
        engine_rate = (total_acc + 1) / (total_acc + total_rej + 2)
        units, own = [], []
        for e, (i, budget) in enumerate(zip(rows, budgets)):
            st = self.driver.states.get(req_ids[i])
            own.append(st.drafted)
            a = (st.accepted + ACCEPT_PRIOR * engine_rate) / (st.accepted + st.rejected + ACCEPT_PRIOR)
            units += [(a ** j, e, j) for j in range(1, budget + 1)]
        units.sort(key=lambda u: (-u[0], u[2]))
        step_cost, attention, _ = self.driver.step_seconds(decoding)
        unit = self.driver.costs.unit  # a plain step's seconds, None until measured (then prices are relative)
        per_pass = (self.driver.draft_costs.per_pass(decoding) or self.pass_prior * unit) if unit else self.pass_prior
        n = view.num_tokens
        ctx = [attention * attention_load(1, int(n[i])) for i in rows]  # a verified row's attention, per request
        depth, att = 0, sum(ctx)  # the requests' own rows read their contexts whatever is drafted
        extra = [att]
        for _, e, j in units:
            depth = max(depth, j)
            att += ctx[e]
            extra.append(depth * per_pass + att)
        keep = best_prefix([u[0] for u in units], float(decoding), step_cost, decoding, extra)
        sized = [0] * len(rows)
        for _, e, j in units[:keep]:
            sized[e] = max(sized[e], j)
        for e, drafted in enumerate(own):
            if not sized[e] and budgets[e] and drafted < OWN_EVIDENCE:
                sized[e] = 1
        # The streak counts steps where nothing drafts but a random exploring one (which does not reset it); a
        # request still measuring its own rate keeps the feed on.
        self._plain_streak = 0 if any(sized) else self._plain_streak + 1
        self._feed_next = self._plain_streak < PAUSE_AFTER
        if not any(sized) and self._rng.random() < EXPLORE:
            sized = [min(1, b) for b in budgets]
        return sized

    def draft(self, view: BatchView, rows: list[int], budgets: list[int], policies: list,
               plans: dict[int, DraftPlan]) -> float:
        if not rows:
            return 0.0
        self.prefix.ensure_attached()
        treeish = self.driver.tree_rows(view, rows)
        policy_s = 0.0
        for part, draft in (([e for e, t in enumerate(treeish) if not t], self._draft_chains),
                            ([e for e, t in enumerate(treeish) if t], self._draft_trees)):
            if part:
                policy_s += draft(view, [rows[e] for e in part], [budgets[e] for e in part],
                                  [policies[e] for e in part], plans)
        return policy_s

    def _round_inputs(self, view: BatchView, rows, policies):
        """What chain and tree drafting both start from: n [R] committed tokens per row, block rows [R, max_blocks],
        temperatures [R] (only when a policy reads confidence), thompson-cali's target projection [R, 10] (or None),
        and the seconds the policy-only parts took."""
        rows_np = np.asarray(rows)
        device = self.prefix.device
        blocks = self.prefix.block_rows(torch.tensor(rows, device=device))
        tp = time.perf_counter()
        confident = any(getattr(pol, "needs_confidence", False) for pol in policies)
        temps = torch.from_numpy(view.temperature[rows_np]).to(device) if confident else None
        ht_proj = self._target_projection(view, rows)
        return view.num_tokens[rows_np], blocks, temps, ht_proj, time.perf_counter() - tp

    def _draft_chains(self, view: BatchView, rows, budgets, policies, plans) -> float:
        """Draft chains for `rows` (batch rows) into `drafts`, one batched step per depth: the exit head's argmax,
        while each row's policy accepts. Returns the seconds spent in policy work."""
        n, blocks, temps, ht_proj, policy_s = self._round_inputs(view, rows, policies)
        device = self.prefix.device
        drafts = {i: [] for i in rows}
        tokens = torch.from_numpy(view.token_ids[np.asarray(rows), n - 1].astype(np.int64)).to(device)  # [B]
        positions = torch.from_numpy((n - 1).astype(np.int64)).to(device)  # [B]
        max_seq_len = int(n.max())  # host-side upper bound, grows by one per depth
        entries = list(range(len(rows)))  # index into rows/budgets/policies for each active request
        feats = None
        if self.prefix.reads_features:  # a draft layer: the first step reads each request's carried feature
            feats = self._carried(view, rows, self.prefix.exit.feat_norm.weight, self.prefix.exit.feature_width)
        for depth in range(1, max(budgets) + 1):
            t_pass = time.perf_counter()
            hidden, residual = self.prefix.forward(blocks, tokens, positions, max_seq_len, features=feats)
            self.driver.faults.point("draft")  # fault injection: after a pass wrote draft KV (tests)
            logits, vocab, normed = self.prefix.head(hidden, residual)  # [B, V'], V' ids (None: all), [B, H]
            tokens = logits.argmax(dim=-1)  # [B]
            if vocab is not None:
                tokens = vocab[tokens]
            self.stats.draft_passes += 1
            token_list = tokens.tolist()  # (the device sync: drafting time, not policy time)
            tp = time.perf_counter()
            self.stats.draft_pass_seconds += tp - t_pass
            if depth == 1 and feats is not None:  # this pass wrote the layer's KV of each row's last committed token
                self._primed.update({view.req_ids[i]: (self._steps, int(n[e] - 1)) for e, i in enumerate(rows)})
            conf = self._confidence(logits, temps, len(entries))
            scores = [None] * len(entries)
            if ht_proj is not None:  # thompson-cali: predicted acceptance of this draft (EESD Eq. 5)
                scores = self.calibration.score(ht_proj, normed, depth).tolist()
            keep = []
            for j, (e, tok) in enumerate(zip(entries, token_list)):
                if not policies[e].accept(depth, *conf[j], scores[j]):
                    continue  # not proposed; the request's round ends here
                drafts[rows[e]].append(tok)
                if depth < budgets[e] and policies[e].keep_drafting(depth):
                    keep.append(j)
            policy_s += time.perf_counter() - tp
            if not keep:
                break
            if feats is not None:  # the next step reads this one's output (the layer's guess of the next feature)
                feats = hidden + residual
            if len(keep) < len(entries):
                idx = torch.tensor(keep, device=device)
                blocks, tokens, positions = blocks[idx], tokens[idx], positions[idx]
                if feats is not None:
                    feats = feats[idx]
                if temps is not None:
                    temps = temps[idx]
                if ht_proj is not None:
                    ht_proj = ht_proj[idx]
                entries = [entries[j] for j in keep]
            positions = positions + 1
            max_seq_len += 1
        plans.update({i: DraftPlan(tuple(d)) for i, d in drafts.items() if d})
        return policy_s

    def _draft_trees(self, view: BatchView, rows, budgets, policies, plans) -> float:
        """Draft a token tree per row, depth by depth. Depth 1 runs each root (the last committed token); at
        depth d the chosen depth d - 1 nodes of every tree run together in one batched step, each attending to
        the prefix and its own ancestors only (a tree mask over draft nodes, step.DraftMask),
        and their top-k candidates are new nodes. Which nodes enter and run is the builder's choice:
          joint  every candidate enters; the `top_k` most probable depth d - 1 nodes (among the tree's `budget`
                 most probable so far) run; the proposal is the `budget` most probable nodes (best_subtree)
          c2t    a candidate enters when the classifier's confidence in it passes beta (trees/c2t.py), and every
                 node that entered runs; the tree stops where no candidate passes or the budget is spent

        Draft KV: a node run at depth >= 2 writes its KV to the root's slot + (1 + how many nodes of its tree ran
        before it), inside the slots the scheduler reserved for verifying the tree, which verification rewrites.
        The policy sees one draft per depth, the most probable new node, and may stop the tree's growth there.
        """
        ts = self.tree
        n, block_rows, temps, ht_proj, policy_s = self._round_inputs(view, rows, policies)
        root = (n - 1).astype(np.int64)  # [R] position (and slot position) of each tree's root
        device = self.prefix.device
        token_ids_cpu = view.token_ids
        grown = [GrowingTree() for _ in rows]
        limit = [min(b, ts.max_depth) for b in budgets]  # deepest depth each tree may keep
        slot_of: list[dict[int, int]] = [{} for _ in rows]  # node -> slot offset from the root (1, 2, ...)
        entropy_of: list[dict[int, float]] = [{} for _ in rows]  # node (-1 = root) -> top-n entropy of its children
        feed = [(e, -1) for e in range(len(rows))]  # (tree, node; -1 = root) run in the next step
        prefix = self._draft_prefix(root, block_rows)  # the trees' prefix K, V, gathered once per layer
        # Slots the scheduler reserved past the root: K - 1 (engine/scheduler.py), so at most K - 1 nodes run.
        room = self.cfg.num_speculative_tokens - 1
        max_seq_len = int(n.max()) + room  # bound on slot positions + 1
        record = [obs for obs in self.driver.observers if obs.wants_tree_features]
        top_n = ENTROPY_TOP_N if (self.c2t is not None or record) else None
        # A draft layer: the roots read each request's carried feature, a node its parent's output (the layer's
        # guess of the next feature); parent_row: (tree, node) -> its parent's row in the last pass's output.
        feats = out_feats = None
        parent_row: dict[tuple[int, int], int] = {}
        if self.prefix.reads_features:
            feats = self._carried(view, rows, self.prefix.exit.feat_norm.weight, self.prefix.exit.feature_width)
        for depth in range(1, max(limit) + 1):
            req = [e for e, _ in feed]
            tokens = [int(token_ids_cpu[rows[e], n[e] - 1]) if node < 0 else grown[e].tokens[node] for e, node in feed]
            slot_pos = [int(root[e]) + (slot_of[e][node] if node >= 0 else 0) for e, node in feed]
            idx = torch.tensor(req, device=device)
            mask = None if depth == 1 else self._draft_mask(feed, grown, slot_of, root, prefix)
            if feats is not None and depth > 1:
                feats = out_feats[torch.tensor([parent_row[f] for f in feed], device=device)]  # [F, H]
            t_pass = time.perf_counter()
            hidden, residual = self.prefix.forward(
                block_rows[idx], torch.tensor(tokens, device=device),
                torch.from_numpy(root[req] + depth - 1).to(device), max_seq_len,
                slot_positions=torch.tensor(slot_pos, device=device), tree_mask=mask, features=feats)
            self.driver.faults.point("draft")
            logits, vocab, normed = self.prefix.head(hidden, residual)  # [F, V'], ..., [F, H]
            stats = entropy_topk(logits, 1.0, k=ts.top_k, top_n=top_n)  # top_ids, top_probs [F, k]
            top_ids = stats.top_ids if vocab is None else vocab[stats.top_ids]
            ids, probs = top_ids.tolist(), stats.top_probs.tolist()
            if top_n is not None:
                for (e, node), h in zip(feed, stats.top_n_entropy.tolist()):
                    entropy_of[e][node] = h
            self.stats.draft_passes += 1
            self.stats.draft_pass_seconds += time.perf_counter() - t_pass
            if feats is not None:
                out_feats = hidden + residual  # [F, H]
                if depth == 1:  # this pass wrote the layer's KV of each root (the feed then skips that row)
                    self._primed.update({view.req_ids[i]: (self._steps, int(root[e])) for e, i in enumerate(rows)})
            tp = time.perf_counter()
            conf = self._confidence(logits, None if temps is None else temps[idx], len(feed))
            scores = [None] * len(feed)
            if ht_proj is not None:
                scores = self.calibration.score(ht_proj[idx], normed, depth).tolist()
            if self.c2t is not None:
                added = self._c2t_layer(feed, grown, entropy_of, ids, probs, depth)
            else:
                added = {}
                for f, (e, node) in enumerate(feed):
                    add_children(grown[e], node, ids[f], probs[f])
                    added.setdefault(e, []).append((len(grown[e].parents) - len(ids[f]), f))  # its best candidate
                    if feats is not None:
                        parent_row.update({(e, c): f for c in range(len(grown[e].parents) - len(ids[f]),
                                                                     len(grown[e].parents))})
            if feats is not None and self.c2t is not None:  # C2T's new nodes, each with its parent's row
                parent_row.update({(e, c): f for e, new in added.items() for c, f in new})
            feed = []
            for e, new in added.items():
                if not new:  # C2T: no candidate passed; the tree ends one depth up
                    limit[e] = depth - 1
                    continue
                first, f = max(new, key=lambda nf: grown[e].probs[nf[0]])  # the most probable new node
                if not policies[e].accept(depth, *conf[f], scores[f]):
                    limit[e] = depth - 1  # this depth is dropped; the tree stops growing
                    continue
                if depth >= limit[e] or not policies[e].keep_drafting(depth):
                    limit[e] = depth
                    continue
                if self.c2t is not None:
                    run = [i for i, _ in new] if len(grown[e].parents) < ts.budget else []
                else:
                    run = to_expand(grown[e], depth, ts.top_k, ts.budget)
                for node in run[:room - len(slot_of[e])]:
                    slot_of[e][node] = len(slot_of[e]) + 1
                    feed.append((e, node))
            policy_s += time.perf_counter() - tp
            if not feed:
                break
        req_ids = view.req_ids
        for e, row in enumerate(rows):
            if limit[e] < 1:
                continue
            tree, order = best_subtree(grown[e], ts.budget, limit[e])
            tree_tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
            plans[row] = DraftPlan(tuple(tree_tokens), tuple(parents))
            for obs in record:  # each node: (joint probability, its parent's top-n entropy, depth)
                g = grown[e]
                obs.tree_features(req_ids[row], np.array(
                    [(g.probs[i], entropy_of[e][g.parents[i]], g.depths[i]) for i in order], dtype=np.float32),
                    np.array(parents, dtype=np.int64))
        return policy_s

    def _c2t_layer(self, feed, grown, entropy_of, ids, probs, depth) -> dict[int, list[tuple[int, int]]]:
        """C2T's pruning of one layer: score the top-k children of every node run in this step with one classifier
        call, add those above beta (at most second_top_k per tree, within its budget) to their trees. Returns, per
        tree of the step, its new nodes as (node, feed row of their parent)."""
        t0 = time.perf_counter()
        ts = self.tree
        cand = [(f, tok, (1.0 if node < 0 else grown[e].probs[node]) * p)
                for f, (e, node) in enumerate(feed) for tok, p in zip(ids[f], probs[f])]
        feats = node_features([c[2] for c in cand], [entropy_of[feed[c[0]][0]][feed[c[0]][1]] for c in cand],
                              [depth] * len(cand))
        conf = confidence(self.c2t, feats.to(self.c2t["w1"].device)).tolist()
        by_tree: dict[int, list[int]] = {}
        for c, (f, _, _) in enumerate(cand):
            by_tree.setdefault(feed[f][0], []).append(c)
        added: dict[int, list[tuple[int, int]]] = {}
        for e, cs in by_tree.items():
            keep = select_layer([conf[c] for c in cs], ts.beta, ts.second_top_k, ts.budget - len(grown[e].parents))
            added[e] = []
            for j in sorted(keep):  # parents first, each parent's children best first
                f, tok, joint = cand[cs[j]]
                g, parent = grown[e], feed[f][1]
                g.parents.append(parent)
                g.tokens.append(tok)
                g.probs.append(joint)
                g.depths.append(depth)
                added[e].append((len(g.parents) - 1, f))
        self.stats.c2t_seconds += time.perf_counter() - t0
        return added

    @staticmethod
    def _draft_prefix(root, block_rows):
        """DraftPrefix of the call's trees: key positions 0..root of each (root [T], block_rows [T, max_blocks])."""
        root = torch.as_tensor(root, dtype=torch.long)
        pos = torch.arange(int(root.max()) + 1).expand(len(root), -1)
        return DraftPrefix(block_rows.cpu(), torch.where(pos <= root[:, None], pos, 0))

    @staticmethod
    def _draft_mask(feed, grown, slot_of, root, prefix):
        """DraftMask for a step running `feed` [(tree, node)]: each row sees its tree's prefix and root and the
        slots of its own ancestors-or-self (every ancestor ran in an earlier step, so it has a slot)."""
        by_tree: dict[int, list[int]] = {}
        for f, (e, _) in enumerate(feed):
            by_tree.setdefault(e, []).append(f)
        trees = list(by_tree)
        p = prefix.positions.shape[1]
        m = max(len(fs) for fs in by_tree.values())
        n = max(len(slot_of[e]) for e in trees)
        rows = torch.zeros(len(trees), m, dtype=torch.long)
        valid = torch.zeros(len(trees), m, dtype=torch.bool)
        node_pos = torch.zeros(len(trees), n, dtype=torch.long)
        visible = torch.zeros(len(trees), m, p + n, dtype=torch.bool)
        for t, e in enumerate(trees):
            r, fs = int(root[e]), by_tree[e]
            rows[t] = fs[0]
            rows[t, :len(fs)] = torch.tensor(fs)
            valid[t, :len(fs)] = True
            node_pos[t] = r  # padding: the root (masked off)
            node_pos[t, :len(slot_of[e])] = torch.arange(r + 1, r + 1 + len(slot_of[e]))
            visible[t, :, :r + 1] = True
            for i, f in enumerate(fs):
                node = feed[f][1]
                while node >= 0:
                    visible[t, i, p + slot_of[e][node] - 1] = True
                    node = grown[e].parents[node]
        return DraftMask(len(feed), prefix, torch.tensor(trees), rows, valid, node_pos, visible,
                         roots=torch.tensor([int(root[e]) for e in trees]),
                         tree_lens=torch.tensor([len(slot_of[e]) for e in trees]))

    def _confidence(self, logits, temps, rows: int) -> list:
        """[(top probability, entropy)] of each row's draft distribution at its temperature, for policies that
        ask (needs_confidence); (None, None) otherwise."""
        if temps is None:
            return [(None, None)] * rows
        entropy, top_prob, _, _, _ = entropy_topk(logits, temps, k=1)
        return torch.stack([top_prob, entropy], 1).tolist()

    def _target_projection(self, view: BatchView, rows: list[int]) -> torch.Tensor | None:
        """Target side of the predictor for the drafting rows [B, 10], from the output row that produced each
        request's last sampled token (requests.bonus_rows: in tree mode the row of the last accepted node)."""
        if self.calibration is None:
            return None
        hidden = self.driver.taps.hidden
        if hidden is None:
            raise RuntimeError("thompson-cali: the worker did not hand over the target's hidden states")
        h = hidden[torch.tensor([self.driver.outcomes[i].row for i in rows], device=hidden.device)]
        for obs in self.driver.observers:
            obs.target_rows([view.sampled[i][-1] for i in rows], h)
        return self.calibration.project_target(h)

    def config(self) -> dict:
        return {"exit_layer": self.cfg.exit_layer, "exit_head": self.exit_head,
                "exit_kv_layers": self.prefix.exit_kv_layers() if self.prefix is not None else [],
                # what a draft layer's weights run as here ("int8" only where the setting asks and the kernel exists)
                "draft_weights": ("int8" if self.prefix is not None and self.prefix.exit is not None
                                  and self.prefix.exit.int8 else "float"),
                "plain_requests": len(self._stale)}
