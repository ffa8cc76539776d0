"""Worker subclasses: hand the model runner to an adaspec drafter and report each step's schedule to it.

A custom proposer gets no request ids, block tables or KV caches through vLLM's interface; the drafter reads
them from the runner it is attached to. Selected automatically by `engine.plugin` for adaspec configs.
"""

from __future__ import annotations

import os

from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker

from vllm_adaspec.metrics import SnapshotWriter


class _AdaspecWorkerMixin:
    _adaspec_snapshots = None

    def init_device(self):
        super().init_device()
        runner = self.model_runner
        drafter = getattr(runner, "drafter", None)
        if hasattr(drafter, "attach_runner"):
            drafter.attach_runner(runner)
        # One writer per engine: tensor-parallel rank 0 (every rank drafts the same).
        self._adaspec_snapshots = (SnapshotWriter(f"dp{self.parallel_config.data_parallel_rank}")
                                   if hasattr(drafter, "stats") and self.rank == 0 else None)
        if getattr(drafter, "wants_target_hidden", False):
            # vLLM hands a custom proposer no hidden states; pass the sampled rows' final hidden states through.
            propose = runner.propose_draft_token_ids

            def propose_with_hidden(scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                    sample_hidden_states, aux_hidden_states, spec_decode_metadata, *rest, **kw):
                drafter.set_target_output(
                    sample_hidden_states,
                    None if spec_decode_metadata is None else list(spec_decode_metadata.num_draft_tokens))
                return propose(scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                               sample_hidden_states, aux_hidden_states, spec_decode_metadata, *rest, **kw)

            runner.propose_draft_token_ids = propose_with_hidden
        if getattr(drafter, "wants_verified_logits", False):  # steps without drafts feed the drafter's table too
            runner.sampler = SamplerTap(runner.sampler, drafter.on_verified_logits)
        if getattr(drafter, "tree_mode", False):
            _install_tree_verification(runner, drafter)
        elif getattr(drafter, "wants_verified_logits", False):  # chains, but the drafter reads verified rows
            runner.rejection_sampler = tv_sampler(runner.rejection_sampler, drafter)

    def execute_model(self, scheduler_output):
        drafter = getattr(self.model_runner, "drafter", None)
        if hasattr(drafter, "on_schedule"):
            drafter.on_schedule(
                scheduled=scheduler_output.num_scheduled_tokens,
                spec_tokens=scheduler_output.scheduled_spec_decode_tokens,
                finished=scheduler_output.finished_req_ids,
            )
            if self._adaspec_snapshots is not None:  # for the server's /metrics (engine/metrics.py)
                # written at once when requests finished: an idle server then shows their state freed
                self._adaspec_snapshots.maybe_write(drafter.snapshot, force=bool(scheduler_output.finished_req_ids))
        return super().execute_model(scheduler_output)

    def adaspec_stats(self) -> dict:
        """Drafter counters (drafting time, passes, tokens); `LLM.collective_rpc("adaspec_stats")` reads them."""
        drafter = getattr(self.model_runner, "drafter", None)
        return drafter.get_stats() if hasattr(drafter, "get_stats") else {}


def _install_tree_verification(runner, drafter) -> None:
    """Tree mode: depth positions after `_prepare_inputs`, tree-mask attention, tree rejection sampling + KV
    compaction (engine/tree_verification.py)."""
    from vllm_adaspec.engine import tree_verification as tv

    tv.install_cpu_attention_patch()
    prepare = runner._prepare_inputs
    check_branches = os.environ.get("VLLM_ADASPEC_CHECK_BRANCH_SLOTS") == "1"  # tests: branch KV never committed

    def prepare_inputs(scheduler_output, *args, **kwargs):
        result = prepare(scheduler_output, *args, **kwargs)
        step = None
        if drafter.pending_trees and scheduler_output.scheduled_spec_decode_tokens:
            num_reqs = runner.input_batch.num_reqs
            step = tv.plan_step(
                runner.input_batch.req_ids[:num_reqs], runner.query_start_loc.np[:num_reqs + 1], runner.positions,
                scheduler_output.scheduled_spec_decode_tokens, drafter.pending_trees,
                scheduler_output.total_num_scheduled_tokens)
        keep = set(getattr(drafter, "tree_holders", ())) | ({r.req_id for r in step.requests} if step else set())
        tv.retain_sequence_kv(keep, stale=set(scheduler_output.scheduled_cached_reqs.resumed_req_ids))
        if check_branches:
            tv.forget_branch_slots(scheduler_output.finished_req_ids)
            num_reqs = runner.input_batch.num_reqs
            tv.check_branch_slots(runner.input_batch.req_ids[:num_reqs], runner.query_start_loc.np[:num_reqs + 1],
                                  runner.positions, step)
        if step is not None:
            tv.shrink_tree_seq_lens(step, runner.seq_lens)
        tv.set_step(step)
        return result

    runner._prepare_inputs = prepare_inputs
    runner.rejection_sampler = tv_sampler(runner.rejection_sampler, drafter)


def tv_sampler(stock, drafter):
    """vLLM's rejection sampler wrapped: tree rows verified as trees, and (for drafters that ask) the logits of
    every verified row handed to the drafter."""
    from vllm_adaspec.engine import tree_verification as tv

    return tv.TreeRejectionSampler(stock, drafter.on_tree_paths,
                                   drafter.on_verified_logits if getattr(drafter, "wants_verified_logits", False)
                                   else None, acceptance=drafter.cfg.acceptance)


class SamplerTap:
    """vLLM's sampler for steps without drafts, its logits [requests, V] handed to the drafter first."""

    def __init__(self, stock, on_logits):
        self.stock, self.on_logits = stock, on_logits

    def __call__(self, logits, sampling_metadata, *args, **kw):
        self.on_logits(logits, None)  # before sampling, which may scale or mask the logits in place
        return self.stock(logits, sampling_metadata, *args, **kw)

    def __getattr__(self, name):  # everything else (warm-up, logprobs modes) is vLLM's
        return getattr(self.stock, name)


class AdaspecCPUWorker(_AdaspecWorkerMixin, CPUWorker):
    pass


class AdaspecGPUWorker(_AdaspecWorkerMixin, Worker):
    pass
