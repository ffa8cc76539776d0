"""What our workers add to vLLM's: give the drafter its engine port, install the runner hooks it declares it needs,
and report each step's schedule to it.

A custom proposer gets no request ids, block tables, KV caches or verification results through vLLM's interface;
the port (engine/port.py) and the hooks (engine/runner_hooks.py) supply them. The worker classes live one per
platform, each importing only its own vLLM worker (engine/cpu_worker.py, engine/gpu_worker.py: vLLM's CPU worker
module replaces process-wide torch functions such as torch.cuda.Event when imported, which a CUDA worker must never
see). `engine.plugin` selects them for adaspec configs.
"""

from __future__ import annotations

from vllm_adaspec.metrics import SnapshotWriter


class AdaspecWorkerMixin:
    _adaspec_snapshots = None

    def init_device(self):
        super().init_device()
        from vllm_adaspec import observers as obs
        from vllm_adaspec.engine.port import EnginePort

        runner = self.model_runner
        drafter = runner.drafter  # an adaspec proposer: the plugin installs this worker only for those
        observers = obs.from_env(compute_logits=lambda h: runner.model.compute_logits(h))
        # before the model (and its attention layers) is built: the platform's tree backend and runtime
        runtime = self.tree_runtime(observers, drafter.faults) if drafter.needs.trees else None
        port = EnginePort(runner, runtime, observers)
        if runtime is not None:
            runtime.plain = plain_rows_under(drafter.cfg.acceptance.name, port)
        drafter.attach(port)  # before load_model: drafters load through it
        if self.parallel_config.tensor_parallel_size > 1:  # a fault on one rank is a fault on all (faults.py)
            drafter.faults.sync, drafter.faults.rank = port.largest_over_ranks, port.tp_rank()
        # One writer per engine: tensor-parallel rank 0 (every rank drafts the same).
        self._adaspec_snapshots = (SnapshotWriter(f"dp{self.parallel_config.data_parallel_rank}")
                                   if self.rank == 0 else None)

    def tree_runtime(self, observers, faults):
        """This platform's tree backend registered, and its tree runtime (each worker class says which)."""
        raise NotImplementedError

    def load_model(self, *args, **kwargs):
        super().load_model(*args, **kwargs)
        from vllm_adaspec.engine import runner_hooks

        runner = self.model_runner
        port = runner.drafter.port
        if port.runtime is not None:
            from vllm_adaspec.config import AdaspecConfigError
            from vllm_adaspec.engine.tree_backend import attach_runtime

            try:
                attached, total = attach_runtime(self.vllm_config.compilation_config.static_forward_context,
                                                 port.runtime, self.vllm_config.model_config.dtype)
            except (RuntimeError, ValueError) as e:  # the GPU runtime's start-up check of its kernel
                raise AdaspecConfigError(f"vllm_adaspec: token trees cannot run on this engine: {e}") from e
            if attached < total:  # a tree forward through such a layer would attend causally: never start so
                raise AdaspecConfigError(f"vllm_adaspec: {total - attached} of the model's {total} attention layers "
                                         "got an attention backend without a tree path; token trees cannot run")
        runner_hooks.install(runner, runner.drafter, port)

    def initialize_from_config(self, *args, **kwargs):
        super().initialize_from_config(*args, **kwargs)
        # vLLM resolves the CUDA graph mode against the attention backends here; a FULL graph would replay the tree
        # rows' attention without running it (engine/startup.graph_mode_problem)
        from vllm_adaspec.config import AdaspecConfigError
        from vllm_adaspec.engine.startup import graph_mode_problem

        runtime = self.model_runner.drafter.port.runtime
        problem = graph_mode_problem(self.vllm_config.compilation_config.cudagraph_mode, runtime is not None)
        if problem:
            raise AdaspecConfigError(f"vllm_adaspec: {problem}")
        if runtime is not None:  # the tree kernel's variants on the engine's own caches (nothing compiles later)
            runner = self.model_runner
            runtime.ready(runner.kv_caches, runner.input_batch.block_table[0].block_table.gpu)

    def compile_or_warm_up_model(self, *args, **kwargs):
        out = super().compile_or_warm_up_model(*args, **kwargs)
        self.model_runner.drafter.warm_up()  # (after vLLM's warm-up: the KV cache exists, no request holds it)
        return out

    def execute_model(self, scheduler_output):
        drafter = self.model_runner.drafter
        drafter.on_schedule(
            scheduled=scheduler_output.num_scheduled_tokens,
            spec_tokens=scheduler_output.scheduled_spec_decode_tokens,
            finished=scheduler_output.finished_req_ids,
            prompts={r.req_id: r.prompt_token_ids for r in scheduler_output.scheduled_new_reqs
                     if r.prompt_token_ids is not None},
        )
        out = super().execute_model(scheduler_output)
        # vLLM launched the forward (sampling and propose come in sample_tokens): on a GPU the host waits until the
        # sampler reads the results, so the drafter's per-request work runs now, off the step's critical path
        drafter.while_forward()
        if self._adaspec_snapshots is not None:  # for the server's /metrics (engine/metrics.py)
            # written at once when requests finished (after while_forward freed their state): an idle server then
            # shows it freed
            self._adaspec_snapshots.maybe_write(drafter.snapshot, force=bool(scheduler_output.finished_req_ids))
        return out

    def sample_tokens(self, grammar_output):
        out = super().sample_tokens(grammar_output)
        runtime = self.model_runner.drafter.port.runtime
        failed = runtime.take_failed() if runtime is not None else None
        if failed and out is not None:  # finished with an error by our scheduler (engine/scheduler.py)
            out.adaspec_failed = failed
        return out

    def adaspec_stats(self) -> dict:
        """Drafter counters (drafting time, passes, tokens); `LLM.collective_rpc("adaspec_stats")` reads them."""
        return self.model_runner.drafter.get_stats()


def plain_rows_under(acceptance: str, port):
    """req_id -> "greedy" / "sampled" / None: which trees a device runtime may verify in one batch. Sampled trees only
    under exact acceptance (`typical`, lossy and opt-in, goes through the tree sampler)."""
    def plain(req_id: str):
        kind = port.traits(req_id).plain
        return kind if kind == "greedy" or acceptance == "exact" else None

    return plain
