"""The adaspec worker on CPU: vLLM's CPU worker with the drafter's port and hooks (engine/worker.py). Imported only
on the CPU platform (vLLM's CPU worker module patches torch process-wide when imported)."""

from __future__ import annotations

from vllm_adaspec.engine.vllm_surface import vllm_object
from vllm_adaspec.engine.worker import AdaspecWorkerMixin

CPUWorker = vllm_object("CPUWorker")


class AdaspecCPUWorker(AdaspecWorkerMixin, CPUWorker):
    def tree_runtime(self, observers, faults):
        from vllm_adaspec.engine.tree_backend import register_cpu
        from vllm_adaspec.runtime.cpu import CPUTreeRuntime

        register_cpu()
        # vLLM's CPU cache-write op: the runtime discovers vLLM's CPU KV layout with it (runtime/cpu_kv.py)
        return CPUTreeRuntime(observers, faults=faults, cache_write=vllm_object("custom_ops").cpu_attn_reshape_and_cache)
