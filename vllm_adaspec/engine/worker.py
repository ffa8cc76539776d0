"""Worker subclasses: hand the model runner to an adaspec drafter and report each step's schedule to it.

A custom proposer gets no request ids, block tables or KV caches through vLLM's interface; the drafter reads
them from the runner it is attached to. Selected automatically by `engine.plugin` for adaspec configs.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker


class _AdaspecWorkerMixin:
    def init_device(self):
        super().init_device()
        drafter = getattr(self.model_runner, "drafter", None)
        if hasattr(drafter, "attach_runner"):
            drafter.attach_runner(self.model_runner)

    def execute_model(self, scheduler_output):
        drafter = getattr(self.model_runner, "drafter", None)
        if hasattr(drafter, "on_schedule"):
            drafter.on_schedule(
                scheduled=scheduler_output.num_scheduled_tokens,
                spec_tokens=scheduler_output.scheduled_spec_decode_tokens,
                finished=scheduler_output.finished_req_ids,
            )
        return super().execute_model(scheduler_output)

    def adaspec_stats(self) -> dict:
        """Drafter counters (drafting time, passes, tokens); `LLM.collective_rpc("adaspec_stats")` reads them."""
        drafter = getattr(self.model_runner, "drafter", None)
        return drafter.get_stats() if hasattr(drafter, "get_stats") else {}


class AdaspecCPUWorker(_AdaspecWorkerMixin, CPUWorker):
    pass


class AdaspecGPUWorker(_AdaspecWorkerMixin, Worker):
    pass
