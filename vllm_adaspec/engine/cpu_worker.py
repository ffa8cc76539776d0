"""The adaspec worker on CPU: vLLM's CPU worker with the drafter's port and hooks (engine/worker.py). Imported only
on the CPU platform (vLLM's CPU worker module patches torch process-wide when imported)."""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_adaspec.engine.worker import AdaspecWorkerMixin


class AdaspecCPUWorker(AdaspecWorkerMixin, CPUWorker):
    def tree_runtime(self, observers, faults):
        from vllm_adaspec.engine.tree_backend import register_cpu
        from vllm_adaspec.engine.tree_runtime import TreeRuntime

        register_cpu()
        return TreeRuntime(observers, faults=faults)
