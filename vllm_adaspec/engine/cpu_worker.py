"""The adaspec worker on CPU: vLLM's CPU worker with the drafter's port and hooks (engine/worker.py). Imported only
on the CPU platform (vLLM's CPU worker module patches torch process-wide when imported)."""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_adaspec.engine.worker import AdaspecWorkerMixin


class AdaspecCPUWorker(AdaspecWorkerMixin, CPUWorker):
    pass
