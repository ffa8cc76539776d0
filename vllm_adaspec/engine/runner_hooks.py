"""Every wrap of vLLM's model runner, installed in one place, from what the drafter declares it needs
(step.Needs). Each says why vLLM offers no hook for it. They only collect feedback into the engine port or steer
the tree runtime; the drafter reads the port at its next propose call.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from vllm_adaspec.engine.tree_sampler import TreeRejectionSampler, dummy_batch
from vllm_adaspec.engine.vllm_surface import vllm_object
from vllm_adaspec.step import ForwardRows


def install(runner, drafter, port) -> None:
    needs = drafter.needs
    # vLLM hands a custom proposer neither the target's hidden states nor how many rows each request took in the
    # verification it just ran (needed to find each request's bonus row): both are read off propose's own call.
    propose = runner.propose_draft_token_ids
    keep_hidden = needs.target_hidden
    keep_rows = needs.forward_rows
    step = {"proposed": False}
    if needs.aux_layers:
        # vLLM returns the residual streams after some layers for EAGLE-3 drafters only: asked for here, after the
        # model loaded and before its first forward (which compiles the graph, outputs included)
        if not hasattr(runner.model, "set_aux_hidden_state_layers"):
            from vllm_adaspec.config import AdaspecConfigError

            raise AdaspecConfigError(f"vllm_adaspec: {type(runner.model).__name__} cannot return the hidden states of "
                                     f"layers {list(needs.aux_layers)} that the draft layer reads")
        runner.model.set_aux_hidden_state_layers(needs.aux_layers)
        runner.use_aux_hidden_state_outputs = True

    def propose_with_feedback(scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                              sample_hidden_states, aux_hidden_states, spec_decode_metadata, *rest, **kw):
        step["proposed"] = True
        if keep_hidden:
            port.taps.hidden = sample_hidden_states
        if keep_rows and rest:  # rest[0]: the forward's attention layout (vLLM's CommonAttentionMetadata)
            # (vLLM keeps the auxiliary states in ascending layer order, the order the draft layer reads them)
            parts = (*aux_hidden_states, hidden_states) if needs.aux_layers else (hidden_states,)
            port.taps.forward = ForwardRows(parts, runner.input_ids.gpu, runner.positions,
                                            rest[0].query_start_loc_cpu.numpy().copy())
        port.verified_rows = None if spec_decode_metadata is None else list(spec_decode_metadata.num_draft_tokens)
        return propose(scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, sample_hidden_states,
                       aux_hidden_states, spec_decode_metadata, *rest, **kw)

    runner.propose_draft_token_ids = propose_with_feedback

    # In a step where the longest request plus a full draft would pass max_model_len, vLLM does not call the
    # drafter and schedules K drafts of token 0 for every request instead. vLLM's chain sampler would verify them,
    # ignoring min_p and logit bias (a wrong token for such requests) and spending K rows per request on
    # nothing: a step the drafter was not asked about drafts nothing.
    take_drafts = runner.take_draft_token_ids

    def take_only_proposed_drafts():
        out = take_drafts()
        if out is not None and not step["proposed"]:
            out = replace(out, draft_token_ids=[[] for _ in out.req_ids])
            drafter.not_asked()
        step["proposed"] = False
        return out

    runner.take_draft_token_ids = take_only_proposed_drafts

    logits_tap = LogitsTap(runner, port, needs.verified_logits) if needs.verified_logits else None
    if logits_tap is not None:
        # Steps without drafts never reach the rejection sampler: their logits are read before vLLM's sampler,
        # which may scale or mask them in place.
        runner.sampler = SamplerTap(runner.sampler, logits_tap)
    runtime = port.runtime
    if runtime is not None or logits_tap is not None:
        # vLLM verifies drafts as chains only and offers no hook after verification: tree requests are verified
        # here (vLLM's result stands for chains), then their KV is compacted; verified rows' logits are tapped.
        runner.rejection_sampler = TreeRejectionSampler(runner.rejection_sampler, runtime, drafter.cfg.acceptance,
                                                        logits_tap, port=port,
                                                        tree_only=lambda r: (r in drafter.grammar_trees
                                                                             or port.traits(r).own_sampler))
    # vLLM builds only the min_tokens logits processor when speculation is on (it refuses min_p and logit_bias):
    # the plugin accepts them (engine/plugin.py) and verifies such requests' drafts itself, so the sampler of steps
    # without drafts (and of rows without drafts) needs vLLM's own min_p and logit_bias processors back.
    install_builtin_logits_processors(runner)
    if runtime is None:
        return
    # The scheduler checks and masks drafts as a chain unless it knows they are a tree (engine/scheduler.py): each
    # step's draft ids carry the structured-output requests whose drafts are trees.
    take = runner.take_draft_token_ids

    def take_draft_token_ids():
        out = take()
        if out is not None and drafter.grammar_trees:
            out.adaspec_trees = frozenset(drafter.grammar_trees)
        return out

    runner.take_draft_token_ids = take_draft_token_ids
    # No hook sits between the runner's input preparation and the forward: tree rows need depth positions and
    # their own seq_lens before attention metadata is built.
    prepare = runner._prepare_inputs

    def prepare_inputs(scheduler_output, *args, **kwargs):
        result = prepare(scheduler_output, *args, **kwargs)
        num_reqs = runner.input_batch.num_reqs
        runtime.begin_step(runner.input_batch.req_ids[:num_reqs], runner.query_start_loc.np[:num_reqs + 1],
                           runner.input_batch.num_computed_tokens_cpu[:num_reqs], runner.positions,
                           scheduler_output.scheduled_spec_decode_tokens, drafter.plans,
                           scheduler_output.total_num_scheduled_tokens, runner.seq_lens, drafter.tree_holders,
                           set(scheduler_output.scheduled_cached_reqs.resumed_req_ids))
        return result

    runner._prepare_inputs = prepare_inputs


def install_builtin_logits_processors(runner) -> None:
    PIN_MEMORY = vllm_object("PIN_MEMORY")
    BUILTIN_LOGITS_PROCESSORS, LogitsProcessors = vllm_object("BUILTIN_LOGITS_PROCESSORS"), vllm_object("LogitsProcessors")

    batch = runner.input_batch
    have = {type(p) for p in batch.logitsprocs.all}
    if all(cls in have for cls in BUILTIN_LOGITS_PROCESSORS) or runner.is_pooling_model:
        return
    made = [cls(runner.vllm_config, runner.device, PIN_MEMORY) for cls in BUILTIN_LOGITS_PROCESSORS
            if cls not in have]
    batch.logitsprocs = LogitsProcessors([*batch.logitsprocs.all, *made])


class LogitsTap:
    """The target's top-k next tokens at every sampled row, with the token each row follows, into the port's taps.

    Rows of a step without drafts (metadata None): one per request, following its last committed token. With
    drafts: per request its root's row, then each draft's row (the last is the bonus row)."""

    def __init__(self, runner, port, k: int):
        self.runner, self.port, self.k = runner, port, k

    def __call__(self, logits: torch.Tensor, metadata) -> None:
        b = self.runner.input_batch
        n = logits.shape[0]
        if metadata is not None and dummy_batch(b, len(metadata.cu_num_draft_tokens)):
            return  # vLLM's profile / warm-up runs: dummy drafts for an empty batch
        roots = [int(b.token_ids_cpu[i, b.num_tokens_no_spec[i] - 1]) for i in range(b.num_reqs)]
        if metadata is None:  # one row per request
            m = min(n, b.num_reqs)
            req_ids, tokens, rows = list(b.req_ids[:m]), roots[:m], list(range(m))
        else:
            cu = [0] + metadata.cu_num_draft_tokens.tolist()
            drafts = metadata.draft_token_ids.tolist()
            target, bonus = metadata.target_logits_indices.tolist(), metadata.bonus_logits_indices.tolist()
            req_ids, tokens, rows = [], [], []
            for i in range(len(cu) - 1):
                rows += target[cu[i]:cu[i + 1]] + [bonus[i]]
                tokens += [roots[i]] + drafts[cu[i]:cu[i + 1]]
                req_ids += [b.req_ids[i]] * (cu[i + 1] - cu[i] + 1)
        if not rows:
            return
        x = logits[torch.tensor(rows, device=logits.device)].float()  # [R, V]
        top, ids = x.topk(self.k, dim=-1)
        probs = torch.exp(top - torch.logsumexp(x, dim=-1, keepdim=True))
        self.port.taps.logits_topk.append((req_ids, np.asarray(tokens), ids.cpu().numpy(), probs.cpu().numpy()))


class SamplerTap:
    """vLLM's sampler for steps without drafts, its logits [requests, V] tapped first."""

    def __init__(self, stock, tap):
        self.stock, self.tap = stock, tap

    def __call__(self, logits, sampling_metadata, *args, **kw):
        self.tap(logits, None)  # before sampling, which may scale or mask the logits in place
        return self.stock(logits, sampling_metadata, *args, **kw)

    def __getattr__(self, name):  # everything else (warm-up, logprobs modes) is vLLM's
        return getattr(self.stock, name)
