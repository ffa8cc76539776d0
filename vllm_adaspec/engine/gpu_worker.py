"""The adaspec worker on GPUs: vLLM's GPU worker with the drafter's port and hooks (engine/worker.py). Imports
nothing of vLLM's CPU worker, whose import replaces torch.cuda.Event, streams, pin_memory and memory queries with
CPU stand-ins (tests/test_workers.py checks that importing this module leaves them alone)."""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker

from vllm_adaspec.engine.worker import AdaspecWorkerMixin


class AdaspecGPUWorker(AdaspecWorkerMixin, Worker):
    pass
