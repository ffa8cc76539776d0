"""The adaspec worker on GPUs: vLLM's GPU worker with the drafter's port and hooks (engine/worker.py). Imports
nothing of vLLM's CPU worker, whose import replaces torch.cuda.Event, streams, pin_memory and memory queries with
CPU stand-ins (tests/test_workers.py checks that importing this module leaves them alone).

Token trees: when vLLM's model runner builds the proposer (the device set, the model not yet built), the tree
subclasses of vLLM's FlashAttention and Triton backends are registered (engine/tree_backend.py) and vLLM's own
selector is asked which backend the model's layers will get (engine/startup.settle_gpu_trees). Where it is neither
(FlashInfer on Blackwell, say), trees are off for this engine before the drafter exists: MultiBranchProposer drafts
chains (said once in the log), and settings that need trees (early exit's `tree`, `branches`, `typical` acceptance)
fail start-up naming the key, as on a platform without trees."""

from __future__ import annotations

from vllm_adaspec.engine.vllm_surface import vllm_object
from vllm_adaspec.engine.worker import AdaspecWorkerMixin

Worker = vllm_object("GPUWorker")


class AdaspecGPUWorker(AdaspecWorkerMixin, Worker):
    def tree_runtime(self, observers, faults):
        from vllm_adaspec.runtime.gpu import GPUTreeRuntime, tree_kernel_shape

        return GPUTreeRuntime(self.model_runner.device, observers, faults=faults,
                              top_k_top_p=vllm_object("apply_top_k_top_p"), **tree_kernel_shape(self.vllm_config))

