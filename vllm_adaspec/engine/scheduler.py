"""The scheduler for adaspec engines: vLLM's, with KV slots reserved for drafting and token trees of
structured-output requests left intact.

Lookahead slots: the early-exit drafter runs the target's own first N layers on draft tokens and writes their KV
into the target's cache at the positions the next verification will overwrite anyway. Those positions lie past
what the target was scheduled for, so blocks for them must be allocated: vLLM does this for EAGLE through
`num_lookahead_tokens`, which it leaves at 0 for custom proposers.

Grammars: vLLM checks a structured-output request's drafts as a chain (keeping the longest valid prefix) and
masks each verification row with the grammar state after the drafts before it. A token tree's nodes are in
breadth-first order, not a chain: the worker checked them per path against its copy of the grammar and masks
their rows itself (engine/grammar.py). The worker names those requests on each step's draft ids
(`adaspec_trees`); for them this scheduler keeps the drafts as they are and leaves every row after the root's
unmasked. The committed tokens advance vLLM's own matcher as for any request.

Failed requests: where the tree sampler could give a request no token its settings allow (engine/tree_sampler.py),
the step commits nothing for it and the worker names it on the step's output (`adaspec_failed`); it is finished
with an error (FINISHED_ERROR: the client's request fails, a 500 on the server), the way vLLM finishes a request
whose grammar failed to compile. The other requests go on.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from vllm_adaspec.engine.vllm_surface import vllm_object

Scheduler = vllm_object("Scheduler")

logger = logging.getLogger("vllm_adaspec")


class AdaspecScheduler(Scheduler):
    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        # The bonus token and K-1 drafts get KV during drafting: K slots past the scheduled tokens.
        self.num_lookahead_tokens = max(self.num_lookahead_tokens, vllm_config.speculative_config.num_speculative_tokens)
        self._grammar_trees: frozenset[str] = frozenset()  # requests whose scheduled drafts are trees

    def update_draft_token_ids(self, draft_token_ids) -> None:
        trees = getattr(draft_token_ids, "adaspec_trees", frozenset())
        self._grammar_trees = trees
        if not trees:
            return super().update_draft_token_ids(draft_token_ids)
        chains = [(r, d) for r, d in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids) if r not in trees]
        super().update_draft_token_ids(replace(draft_token_ids, req_ids=[r for r, _ in chains],
                                               draft_token_ids=[d for _, d in chains]))
        for req_id, spec in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            request = self.requests.get(req_id)
            if req_id not in trees or request is None or request.is_finished():
                continue
            # as vLLM, without the chain check: the worker kept only nodes its grammar copy accepts
            request.spec_token_ids = [] if request.is_prefill_chunk else list(spec)

    def get_grammar_bitmask(self, scheduler_output):
        spec = scheduler_output.scheduled_spec_decode_tokens
        trees = [r for r in self._grammar_trees if spec.get(r)]
        if not trees:
            return super().get_grammar_bitmask(scheduler_output)
        # vLLM masks a row after the first placeholder (-1) draft with the permissive mask: the root's row keeps the
        # grammar's mask, the node rows are masked by the worker, per path
        masked = {**spec, **{r: [-1] * len(spec[r]) for r in trees}}
        out = super().get_grammar_bitmask(replace(scheduler_output, scheduled_spec_decode_tokens=masked))
        if out is not None and out.num_acceptable_drafts is not None:
            out.num_acceptable_drafts = [len(spec.get(r, ())) if r in trees else n
                                         for r, n in zip(out.structured_output_request_ids, out.num_acceptable_drafts)]
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        failed = getattr(model_runner_output, "adaspec_failed", None)
        if failed:
            for req_id, why in failed.items():
                logger.error("vllm_adaspec: request %s finished with an error: %s", req_id, why)
            # vLLM finishes these with FINISHED_ERROR after the step's outputs (as a grammar that failed to compile)
            self.grammar_compile_error_reqs.update(r for r in failed if r in self.requests)
        return super().update_from_output(scheduler_output, model_runner_output)
