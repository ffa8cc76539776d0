"""Tree attention on vLLM's CPU backend: `TreeCPUAttentionBackend` is vLLM's CPU backend whose impl runs vLLM's
kernel for every row, then lets the worker's tree runtime (engine/tree_runtime.py) overwrite the rows of tree
requests with tree-masked attention. Registered in place of CPU_ATTN by engine/tree_backend.register_cpu (the CPU
platform resolves its backend by `AttentionBackendEnum.CPU_ATTN.get_path()`, which honours overrides)."""

from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from vllm_adaspec.engine.tree_backend import TreeAttentionMixin


class TreeCPUAttentionImpl(TreeAttentionMixin, CPUAttentionBackendImpl):
    @staticmethod
    def tree_isa(layer):
        return layer.isa  # vLLM's CPU KV layout depends on it (engine/cpu_kv.py)


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        return TreeCPUAttentionImpl
