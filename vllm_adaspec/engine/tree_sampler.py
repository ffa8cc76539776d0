"""Tree rows' sampling: which requests may be verified as trees, and the runner's rejection sampler wrapped so
that tree requests are verified node by node (trees/verify.py) while chain requests keep vLLM's result."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import numpy as np
import torch

from vllm_adaspec.engine.vllm_surface import vllm_object
from vllm_adaspec.runtime.base import chain_indices
from vllm_adaspec.trees import DraftTree, verify_greedy, verify_sample_match, verify_typical


SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy


def dummy_batch(input_batch, rows: int) -> bool:
    """Whether a sampler call over `rows` batch rows is one of vLLM's profile / warm-up runs (`_dummy_sampler_run`:
    dummy drafts for requests the input batch does not hold; at start-up it holds none)."""
    return len(input_batch.req_ids) != rows


def tree_verifiable(sp) -> bool:
    """Which requests the tree sampler verifies exactly: every sampling setting they carry is applied per tree row
    (`row_logits`). Thinking budgets, watermarking and logprob_token_ids need vLLM's own per-request sampler state:
    such requests draft chains."""
    return (sp is not None and not getattr(sp, "watermarking", None)
            and getattr(sp, "thinking_token_budget", None) is None and not getattr(sp, "logprob_token_ids", None))


def plain_rows(sp) -> str | None:
    """"greedy" or "sampled" for requests whose rows need nothing but an argmax, or a draw after temperature, top-k
    and top-p from the global generator (no seed, penalty, word list, bias, min_p, min_tokens, grammar or
    log-probs): a device runtime verifies their trees together, on the device (trees/batch.py). None otherwise."""
    if (sp is None or not tree_verifiable(sp) or needs_own_sampler(sp)
            or (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) != (0.0, 0.0, 1.0)
            or sp.bad_words or sp.allowed_token_ids or sp.min_tokens or sp.structured_outputs is not None
            or sp.logprobs is not None):
        return None
    if sp.temperature < SAMPLING_EPS:
        return "greedy"
    return "sampled" if sp.seed is None else None


def needs_own_sampler(sp) -> bool:
    """min_p and logit_bias: vLLM's chain verification ignores them (it refuses them with speculation), the tree
    sampler applies them; such requests draft trees or nothing."""
    return sp is not None and (sp.min_p > SAMPLING_EPS or bool(sp.logit_bias))


@dataclass
class RowSampling:
    """One tree request's sampling, from vLLM's sampling metadata (its batch row) and its SamplingParams."""
    temperature: float  # < SAMPLING_EPS: greedy
    top_k: int | None = None
    top_p: float | None = None
    min_p: float = 0.0
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)  # committed output tokens (the root last)
    prompt: torch.Tensor | None = None  # [P] (penalties only)
    penalties: tuple[float, float, float] | None = None  # presence, frequency, repetition
    banned: torch.Tensor | None = None  # [V] bool: outside allowed_token_ids
    bad_words: list[list[int]] = field(default_factory=list)
    logit_bias: dict | None = None
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()
    structured: bool = False
    grammar: torch.Tensor | None = None  # [n + 1, V] bool allowed, per row (engine/grammar.py)

    @property
    def plain(self) -> bool:
        """Only temperature / top-k / top-p: the rows need no per-path processing."""
        return (self.penalties is None and self.banned is None and not self.bad_words and not self.logit_bias
                and len(self.output) >= self.min_tokens and self.grammar is None)


def row_histories(tree: DraftTree, output: list[int]) -> list[list[int]]:
    """The output tokens each verification row follows: the root row the committed output, node i's row the output
    and the tokens from the root to node i (breadth-first: a parent before its children)."""
    rows = [list(output)]
    for tok, parent in zip(tree.tokens.tolist(), tree.parents.tolist()):
        rows.append(rows[parent + 1] + [tok])
    return rows


def row_logits(logits: torch.Tensor, tree: DraftTree, s: RowSampling) -> torch.Tensor:
    """logits [n + 1, V] (the tree's verification rows, float32, modified in place) -> what vLLM's sampler argmaxes
    or samples from at each row (v1/sample/sampler.py, in its order: allowed tokens, bad words, logit bias and
    min_tokens, penalties), each row with the output tokens of its own path, as plain decoding would have them.
    The grammar's mask comes first (vLLM applies it before its sampler)."""
    if s.grammar is not None:
        logits.masked_fill_(~s.grammar[:logits.shape[0]], -math.inf)
    if s.plain:
        return logits
    apply_bad_words = vllm_object("apply_bad_words")
    apply_all_penalties = vllm_object("apply_all_penalties")

    hist = row_histories(tree, s.output)
    rows = logits.shape[0]
    if s.banned is not None:
        logits.masked_fill_(s.banned, -math.inf)
    if s.bad_words:
        apply_bad_words(logits, {r: s.bad_words for r in range(rows)}, hist)
    if s.logit_bias:
        ids = torch.tensor(list(s.logit_bias), dtype=torch.long)
        logits[:, ids] += torch.tensor(list(s.logit_bias.values()), dtype=torch.float32)
    short = [r for r in range(rows) if len(hist[r]) < s.min_tokens]
    if short and s.stop_ids:
        stop = torch.tensor(s.stop_ids, dtype=torch.long)
        for r in short:
            kept = logits[r, stop].clone()
            logits[r, stop] = -math.inf
            if s.structured and torch.isneginf(logits[r]).all():  # as vLLM: a grammar that must stop may stop
                logits[r, stop] = kept
    if s.penalties is not None:
        presence, frequency, repetition = (torch.full((rows,), v, dtype=torch.float32) for v in s.penalties)
        logits = apply_all_penalties(logits, s.prompt.expand(rows, -1), presence, frequency, repetition, hist)
    return logits


def sampling_probs(x: torch.Tensor, s: RowSampling) -> torch.Tensor:
    """Processed logits [rows, V] of a sampled request -> the distribution vLLM samples from: temperature, min_p,
    top-k / top-p (modified in place)."""
    x = x.div_(s.temperature)
    if s.min_p > SAMPLING_EPS:  # MinPLogitsProcessor
        probs = torch.softmax(x, dim=-1)
        x.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * s.min_p, -math.inf)
    return torch.softmax(top_k_top_p(x, s.top_k, s.top_p), dim=-1)


TOP_P_CANDIDATES = 1024  # top-p without top-k looks among this many first (a full sort only if they fall short)


def top_k_top_p(x: torch.Tensor, k: int | None, p: float | None) -> torch.Tensor:
    """vLLM's top-k / top-p mask (apply_top_k_top_p: tokens below the k-th largest value out, ties kept; then, in
    what is left, a token out when the more probable tokens already hold p of the mass), on x [rows, V] in place,
    without sorting the vocabulary: the kept set lies in the top k (or the top TOP_P_CANDIDATES), which topk finds.
    vLLM sorts every row, about 12 ms per tree request of 5 rows here, the dominant cost of sampled tree verification
    on CPU."""
    V = x.shape[-1]
    k = None if k is None or k <= 0 or k >= V else int(k)
    p = None if p is None or p >= 1.0 else float(p)
    if k is None and p is None:
        return x
    vals, _ = x.topk(k or min(V, TOP_P_CANDIDATES), dim=-1)  # [rows, c], descending
    if k is not None:
        x.masked_fill_(x < vals[:, -1:], -math.inf)
    if p is None:
        return x
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    probs = torch.exp(vals - lse)  # [rows, c]: the candidates' share of the (top-k masked) row
    before = probs.cumsum(dim=-1) - probs  # mass of the more probable candidates
    if k is None and bool((before[:, -1] + probs[:, -1] < p).any()):  # the candidates hold less than p: sort
        apply_top_k_top_p = vllm_object("apply_top_k_top_p")

        return apply_top_k_top_p(x, None, torch.full((x.shape[0],), p, dtype=torch.float32))
    kept = (before < p).sum(dim=-1, keepdim=True)  # [rows, 1] >= 1: the most probable always stays
    cut = vals.gather(-1, kept - 1)  # the smallest kept value
    return x.masked_fill_(x < cut, -math.inf)


def verify_tree_request(tree: DraftTree, logits: torch.Tensor, s: RowSampling,
                        acceptance=None) -> tuple[list[int], int, torch.Tensor]:
    """logits [n + 1, V] at the request's verification rows -> (accepted nodes, bonus token, the processed logits
    [n + 1, V]: what the rows were argmaxed or sampled from).

    Sampling uses sample-and-match, not recursive rejection sampling: the drafters pick a node's children
    deterministically (top-k), and for a fixed set S of distinct children no lossless rule can move on with
    probability above p(S), which sample-and-match reaches. RRS (trees.verify_rrs) pays only for children drawn
    i.i.d. from the draft distribution."""
    x = row_logits(logits.float().clone(), tree, s)
    if s.temperature < SAMPLING_EPS:
        return (*verify_greedy(tree, x.argmax(dim=-1)), x)
    probs = sampling_probs(x, s)
    if acceptance is not None and acceptance.name == "typical":
        return (*verify_typical(tree, probs, acceptance.epsilon, acceptance.delta, s.generator), x)
    return (*verify_sample_match(tree, probs, s.generator), x)


def accept_one_more(tree: DraftTree, path: list[int], bonus: int, logits: torch.Tensor) -> tuple[list[int], int]:
    """NOT lossless, on purpose (the sampling tests' negative control): accept the first child of the last accepted
    node that verification rejected, and take the argmax of its row as the bonus."""
    last = path[-1] if path else -1
    kids = [j for j, parent in enumerate(tree.parents.tolist()) if parent == last]
    if not kids:
        return path, bonus
    return path + [kids[0]], int(logits[kids[0] + 1].argmax())


def chains_only(metadata, sampling_metadata, tree_rows: set[int], staged=None) -> tuple:
    """(SpecDecodeMetadata, draft_probs, SamplingMetadata) for vLLM's rejection sampler with the drafts of the
    batch rows `tree_rows` taken out: such a row keeps one output row, its root's (the first row it scheduled), as
    vLLM's bonus row. The output keeps the original width (max_spec_len), where the tree rows' tokens go.
    staged: `chain_indices`' arrays already on the device (keep, cu drafts, cu sampled, tree rows, their roots'
    draft rows) with the host list of drafts per row: no copy to the device here."""
    SpecDecodeMetadata = vllm_object("SpecDecodeMetadata")

    device = metadata.target_logits_indices.device
    if staged is None:
        keep, num, cu_draft, cu_sampled = chain_indices(metadata.num_draft_tokens, tree_rows)
        rows = sorted(tree_rows)
        firsts = [int(np.sum(metadata.num_draft_tokens[:i])) for i in rows]
        keep, cu_draft, cu_sampled, rows, firsts = (torch.as_tensor(np.asarray(x), dtype=torch.long).to(device)
                                                    for x in (keep, cu_draft, cu_sampled, rows, firsts))
    else:
        keep, cu_draft, cu_sampled, rows, firsts, num = staged
    bonus = metadata.bonus_logits_indices.clone()
    bonus[rows] = metadata.target_logits_indices[firsts]
    reduced = SpecDecodeMetadata(metadata.draft_token_ids[keep], num, cu_draft.to(metadata.cu_num_draft_tokens.dtype),
                                 cu_sampled.to(metadata.cu_num_sampled_tokens.dtype),
                                 metadata.target_logits_indices[keep], bonus, metadata.logits_indices)
    reduced.max_spec_len = metadata.max_spec_len
    sm = sampling_metadata
    if sm.spec_token_ids is not None:  # penalties and bad words read each row's drafts
        sm = replace(sm, spec_token_ids=[[] if i in tree_rows else d for i, d in enumerate(sm.spec_token_ids)])
    return reduced, None, sm


def default_generator(device) -> torch.Generator:
    """The generator vLLM's sampler draws from for requests without a seed, on `device`."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def generator_states(device, generators: dict, rows) -> list:
    """[(generator, its state)] of the default generator on `device` and the seeded generators of batch `rows`
    (vLLM's sampling metadata's {row: generator}): what tree verification may draw from."""
    gens = [default_generator(device)] + [generators[i] for i in sorted(rows) if i in generators]
    return [(g, g.get_state()) for g in gens]


def restore_generators(states: list) -> None:
    for g, state in states:
        g.set_state(state)


class TreeRejectionSampler:
    """Stands in for the runner's rejection sampler: vLLM's for chain rows, tree verification for tree rows (the
    tree runtime's step), then KV compaction; the log-probs of tree requests' committed tokens are rewritten from
    their path's rows. `on_logits(logits, metadata)`: every verified row's logits, after verification (for drafters
    that read them). `port`: the engine port (engine/port.py): each request's sampling params, committed output and
    grammar copy.

    What a request commits when something fails (faults.py), never a token its settings forbid:
    - vLLM's own sampler draws every tree request's first token at its root row, with every setting of the request
      applied (`chains_only`: to vLLM the request has no drafts; the plugin gives vLLM's sampler back its min_p and
      logit_bias processors: runner_hooks.install_builtin_logits_processors). A request whose tree verification
      fails keeps that token alone. So does a request whose drafts only this sampler may verify (`tree_only`:
      min_p, logit_bias, a grammar over tree rows) when its drafts were not planned as a tree (a fault in
      planning): vLLM's chain verification, which applies none of those to draft rows, never sees its drafts.
    - Should taking the trees out of vLLM's chain verification itself fail, vLLM verifies every draft as a chain:
      tree requests and tree-only requests then keep vLLM's first token only (its root row: right for every setting
      vLLM applies), resampled here from the root row where vLLM ignores one of the request's settings; a request
      for which even that fails commits nothing and is finished with an error (`runtime.failed`, engine/scheduler.py)
      rather than given a token its settings forbid.
    - Tensor parallelism: every rank ends the step with the same tokens and the same random streams. On a fault on
      any rank every rank keeps vLLM's first tokens (saved before verification: the ranks that verified wrote their
      verdict over them) and rewinds the generators verification drew from; a request failed on one rank fails on
      all."""

    def __init__(self, stock, runtime, acceptance=None, on_logits=None, port=None, tree_only=None):
        self.stock = stock
        self.runtime = runtime  # runtime/base.TreeRuntime, or None (chains only)
        self.acceptance = acceptance  # config.Acceptance: "exact" (lossless) or "typical" (lossy, opt-in)
        self.on_logits = on_logits
        self.port = port
        # req_id -> True when vLLM's chain verdict would be wrong for it (min_p, logit_bias, a grammar tree)
        self.tree_only = tree_only or (lambda req_id: False)

    def __call__(self, metadata, draft_probs, logits, sampling_metadata):
        if self.port is not None and dummy_batch(self.port.runner.input_batch, len(metadata.num_draft_tokens)):
            # vLLM's profile and warm-up runs (`_dummy_sampler_run`): dummy drafts for an empty batch, no plan
            return self.stock(metadata, draft_probs, logits, sampling_metadata)
        step = self.runtime.take_step() if self.runtime is not None else None
        loose = self._loose_tree_only(step, metadata) if self.runtime is not None and self.port is not None else []
        if step is None and not loose:
            out = self.stock(metadata, draft_probs, logits, sampling_metadata)
        else:
            out = self._verify(step, loose, metadata, draft_probs, logits, sampling_metadata)
        if self.on_logits is not None:
            self.on_logits(logits, metadata)
        return out

    def __getattr__(self, name):  # everything else (warm-up hooks, logprobs helpers) is vLLM's
        return getattr(self.stock, name)

    def _loose_tree_only(self, step, metadata) -> list[int]:
        """Batch rows with drafts that only this sampler may verify but that are not in the step's trees (a fault in
        planning them, or a plan the scheduler's drafts no longer match). Where the requests' settings cannot be
        read, every row with drafts outside the step: none of them accepts a draft this step (lossless)."""
        in_step = {r.row for r in step.requests} if step is not None else ()
        drafted = [i for i, n in enumerate(metadata.num_draft_tokens) if n and i not in in_step]
        if not drafted:
            return []
        try:
            req_ids = self.port.runner.input_batch.req_ids
            return [i for i in drafted if self.tree_only(req_ids[i])]
        except Exception as e:
            self.runtime.faults.record("reading which requests only the tree sampler may verify", e)
            return drafted

    def _verify(self, step, loose: list[int], metadata, draft_probs, logits, sm):
        """vLLM's sampler for the chains and every root row, then the step's trees verified here (class docstring)."""
        faults = self.runtime.faults
        before = faults.count
        roots = ({r.row for r in step.requests} if step is not None else set()) | set(loose)
        chains = None
        if draft_probs is None:  # (a custom proposer hands vLLM no draft probabilities)
            try:
                staged = self.runtime.staged_chains(step) if step is not None and not loose else None
                chains = chains_only(metadata, sm, roots, staged)
            except Exception as e:
                faults.record("taking the step's token trees out of vLLM's chain verification", e)
        out = self.stock(chains[0], None, logits, chains[2]) if chains else self.stock(metadata, draft_probs, logits, sm)
        tokens = out.sampled_token_ids  # [B, max_spec_len + 1] int32, -1 padded
        firsts = tokens[:, 0].clone()  # each row's first token as vLLM drew it (its root row's, for tree rows)
        # under TP, the random streams as vLLM's sampler left them (equal on every rank)
        rng = generator_states(logits.device, sm.generators, roots) if faults.sync is not None else None
        failed: set[int] = set()
        compacted = False
        if chains is None:
            # (their first tokens as _first_tokens_of_chains left them: vLLM's, or sampled again with every setting)
            failed = self._first_tokens_of_chains(sorted(roots), out, metadata, logits, sm)
            if step is not None:
                self.runtime.fail_step(step, tokens[:, 0])
        elif step is not None and step.broken:  # the forward did not run the planned step (TreeRuntime.attend)
            failed = {r.row for r in step.requests}
            self._first_tokens_only(step, tokens, firsts)
        elif step is not None:
            compacted = self._verify_trees(step, out, metadata, logits, sm, firsts)
        # tensor parallelism (every rank, every step with trees: a collective): a fault on any rank, every rank keeps
        # only the step's first tokens and its random streams as vLLM's sampler left them, so the ranks' KV, drafters
        # and later draws stay equal (positions past root + 1 are scratch then, whatever compaction moved)
        if faults.sync is not None:
            anywhere, flags = faults.agree_rows(faults.count > before, "verifying the step's token trees",
                                                [int(i in failed) for i in range(tokens.shape[0])])
            failed = {i for i, f in enumerate(flags) if f}
            if anywhere:
                restore_generators(rng)
                if step is not None and compacted:
                    self._first_tokens_only(step, tokens, firsts)
        if failed:
            self._fail_requests(failed, tokens)
        return out

    def _first_tokens_of_chains(self, rows: list[int], out, metadata, logits, sm) -> set[int]:
        """vLLM verified every draft as a chain (taking the trees out failed): the tree and tree-only `rows` keep
        their first token only (vLLM's, from the root row, right for every setting vLLM applies there, the root row's
        grammar mask included), sampled again from the root row here where vLLM ignores one of the request's
        settings (min_p, logit_bias). Returns the rows for which even that failed."""
        tokens = out.sampled_token_ids
        cu = np.cumsum(metadata.num_draft_tokens).tolist()
        req_ids = self.port.runner.input_batch.req_ids
        failed = set()
        for i in rows:
            tokens[i, 1:] = -1
            try:
                if not needs_own_sampler(self.port.sampling_params(req_ids[i])):
                    continue
                root = int(metadata.target_logits_indices[cu[i - 1] if i else 0])
                empty = DraftTree(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
                s = self.row_sampling(SimpleNamespace(row=i, req_id=req_ids[i]), sm, empty, grammar=False)
                _, first, processed = verify_tree_request(empty, logits[root:root + 1], s)
                tokens[i, 0] = first
                if out.logprobs_tensors is not None and sm.max_num_logprobs is not None:
                    self._rewrite_logprobs(out.logprobs_tensors, sm.max_num_logprobs, tokens.shape[1],
                                           [(i, logits[root:root + 1], processed, tokens[i, :1])])
            except Exception as e:
                self.runtime.faults.record(f"sampling request {req_ids[i]}'s first token from its root row", e)
                failed.add(i)
        return failed

    def _fail_requests(self, rows: set[int], tokens) -> None:
        """These rows commit nothing and their requests are finished with an error (engine/scheduler.py): the only
        token left to give them would be one their settings may forbid."""
        req_ids = self.port.runner.input_batch.req_ids if self.port is not None else []
        for i in sorted(rows):
            tokens[i].fill_(-1)
            if i < len(req_ids):
                self.runtime.failed[req_ids[i]] = ("vllm_adaspec could not sample this request's next token with "
                                                   "all of its sampling settings applied")

    def row_sampling(self, r, sm, tree: DraftTree, grammar: bool = True) -> RowSampling:
        """The tree request `r` (batch row r.row) as its sampling needs it: vLLM's sampling metadata for what it
        holds per batch row, the request's SamplingParams for the rest. grammar: mask the rows with the request's
        grammar copy (False: the rows are masked already, as vLLM masks a root row)."""
        i = r.row
        t = 0.0 if sm.all_greedy or sm.temperature is None else float(sm.temperature[i])
        s = RowSampling(t, None if sm.top_k is None else int(sm.top_k[i]),
                        None if sm.top_p is None else float(sm.top_p[i]), generator=sm.generators.get(i))
        sp = self.port.sampling_params(r.req_id) if self.port is not None else None
        if not sm.no_penalties and sm.prompt_token_ids is not None:
            pen = (float(sm.presence_penalties[i]), float(sm.frequency_penalties[i]),
                   float(sm.repetition_penalties[i]))
            if pen != (0.0, 0.0, 1.0):
                s.penalties, s.prompt = pen, sm.prompt_token_ids[i]
        if sm.allowed_token_ids_mask is not None and bool(sm.allowed_token_ids_mask[i].any()):
            s.banned = sm.allowed_token_ids_mask[i]
        s.bad_words = (sm.bad_words_token_ids or {}).get(i, [])
        if sp is not None:
            s.min_p, s.logit_bias = float(sp.min_p), (sp.logit_bias or None)
            s.min_tokens, s.stop_ids = int(sp.min_tokens), tuple(sp.all_stop_token_ids)
            s.structured = sp.structured_outputs is not None
        if s.penalties is not None or s.bad_words or s.min_tokens or s.structured:  # they read the output
            s.output = self.port.output(i)
            if s.structured and grammar:
                s.grammar = self.port.grammar_rows(r.req_id, s.output, tree)
                if s.grammar is None:  # a structured request without its grammar copy must not be verified here
                    raise RuntimeError(f"request {r.req_id}: no grammar copy for its tree")
        return s

    def _verify_trees(self, step, out, metadata, logits, sampling_metadata, firsts) -> bool:
        """out.sampled_token_ids [B, max_spec_len + 1] int32, -1 padded: vLLM's result, rewritten for the tree
        rows (and their log-probs, when the batch asks for them); firsts [B]: vLLM's first tokens. Returns whether
        compaction ran.

        Faults are contained (faults.py). A request whose verification fails keeps only vLLM's first token, which
        vLLM's sampler drew at its root row (`chains_only`: the row attends to the prefix and itself alone, so that
        token is the one plain decoding samples there, every sampling setting applied). A fault in compaction turns every
        tree request of the step into that: positions past root + 1 are then scratch, whatever was moved there."""
        tokens = out.sampled_token_ids
        cu = np.cumsum(metadata.num_draft_tokens).tolist()  # a host list: no wait for the device
        target_idx, bonus_idx = metadata.target_logits_indices, metadata.bonus_logits_indices
        faults = self.runtime.faults
        want_logprobs = out.logprobs_tensors is not None and sampling_metadata.max_num_logprobs is not None
        results, logprob_rows, committed = {}, [], {}
        # plain trees verified together on the device (runtime/gpu.py; the CPU runtime batches none)
        batched, verdict = set(self.runtime.batched(step)), None
        if batched:
            try:
                faults.point("tree_verify")
                verdict = self.runtime.verify_batched(step, logits, tokens, sampling_metadata)
            except Exception as e:  # vLLM's first tokens stand, nothing more
                faults.record("verifying the step's plain token trees in one batch", e)
                rows = [step.requests[k].row for k in batched]
                tokens[rows, 1:] = -1
                tokens[rows, 0] = firsts[rows]
                first = firsts.tolist()  # (a read of the device: a fault path only)
                results.update({i: ([], int(first[i]), []) for i in rows})
        for k, r in enumerate(step.requests):
            if k in batched:
                continue
            i = r.row
            try:
                faults.point("tree_verify")
                if self.tree_only(r.req_id):
                    faults.point("tree_only")
                first = cu[i - 1] if i else 0
                rows = torch.cat([target_idx[first:cu[i]], bonus_idx[i:i + 1]])
                m = r.num_verified  # the verified nodes; rows past them are draft branches, only read
                tree = r.tree if m == len(r.tree) else DraftTree(r.tree.tokens[:m], r.tree.parents[:m])
                s = self.row_sampling(r, sampling_metadata, tree)
                path, bonus, processed = verify_tree_request(tree, logits[rows[:m + 1]], s, self.acceptance)
                if faults.biased(s.generator):  # the sampling tests' negative control only (faults.py)
                    path, bonus = accept_one_more(tree, path, bonus, logits[rows[:m + 1]])
                predicted = logits[rows[m + 1:]].argmax(dim=-1).tolist() if m < len(r.tree) else []
                row = r.tree.tokens[path].tolist() + [bonus]
                if want_logprobs:  # committed token j was sampled at the root's row (j = 0) or node path[j-1]'s
                    at = [0] + [1 + node for node in path]
                    logprob_rows.append((i, logits[rows[at]], processed[at], len(row)))
            except Exception as e:  # vLLM's first token stands, nothing more
                faults.record(f"verifying request {r.req_id}'s token tree", e)
                tokens[i, 1:] = -1
                results[i] = ([], int(firsts[i]), [])  # (a read of the device: a fault path only)
                continue
            committed[i] = row
            results[i] = (path, row[-1], predicted)
        # the host-verified requests' tokens into vLLM's sampled tokens, in one staged copy (no wait for the device)
        try:
            written = self.runtime.write_rows(tokens, committed) if committed else {}
        except Exception as e:  # vLLM's first tokens stand for them, nothing more
            faults.record("writing the host-verified token trees' tokens", e)
            written = {}
            for i in committed:
                tokens[i, 1:] = -1
                tokens[i, 0] = firsts[i]
                results[i] = ([], int(firsts[i]), [])
        if logprob_rows:
            self._rewrite_logprobs(out.logprobs_tensors, sampling_metadata.max_num_logprobs, tokens.shape[1],
                                   [(i, raw, processed, written[i][:n]) for i, raw, processed, n in logprob_rows
                                    if i in written])
        try:
            self.runtime.finish_step(step, results, verdict)
        except Exception as e:
            faults.record("compacting the accepted tree nodes' KV", e)
            self._first_tokens_only(step, tokens, firsts)
            return False
        return True

    def _first_tokens_only(self, step, tokens, firsts) -> None:
        """Every tree request of the step keeps only vLLM's first token (its root row's: a correct sample)."""
        rows = [r.row for r in step.requests]
        tokens[rows, 1:] = -1
        tokens[rows, 0] = firsts[rows]
        self.runtime.fail_step(step, tokens[:, 0])

    def _rewrite_logprobs(self, lp, k: int, width: int, requests: list) -> None:
        """vLLM computed each request's log-probs at its chain rows (flattened [B * width, k + 1]); a tree request's
        committed tokens come from its path's rows. Raw modes (vLLM's default) read the logits as the model gave them
        (after the grammar's mask, as vLLM's do), processed modes what the tokens were sampled from."""
        stock = self.stock
        for i, raw, processed, committed in requests:
            x = (processed if stock.is_processed_logprobs_mode else raw).float()
            x = x if stock.is_logits_logprobs_mode else stock.sampler.compute_logprobs(x)
            got = stock.sampler.gather_logprobs(x, k, committed.to(torch.int64))
            at = slice(i * width, i * width + len(committed))
            lp.logprob_token_ids[at] = got.logprob_token_ids.to(lp.logprob_token_ids.dtype)
            lp.logprobs[at] = got.logprobs.to(lp.logprobs.dtype)
            lp.selected_token_ranks[at] = got.selected_token_ranks.to(lp.selected_token_ranks.dtype)
