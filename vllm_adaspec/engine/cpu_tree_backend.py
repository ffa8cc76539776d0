"""Tree attention on vLLM's CPU backend: `TreeCPUAttentionBackend` is vLLM's CPU backend whose impl runs vLLM's
kernel for every row, then lets the worker's tree runtime (runtime/) overwrite the rows of tree
requests with tree-masked attention. Registered in place of CPU_ATTN by engine/tree_backend.register_cpu (the CPU
platform resolves its backend by `AttentionBackendEnum.CPU_ATTN.get_path()`, which honours overrides)."""

from __future__ import annotations

from vllm_adaspec.engine.tree_backend import TreeAttentionMixin
from vllm_adaspec.engine.vllm_surface import vllm_object

CPUAttentionBackend, CPUAttentionBackendImpl = vllm_object("CPUAttentionBackend"), vllm_object("CPUAttentionBackendImpl")


class TreeCPUAttentionImpl(TreeAttentionMixin, CPUAttentionBackendImpl):
    @staticmethod
    def tree_isa(layer):
        return layer.isa  # vLLM's CPU KV layout depends on it (runtime/cpu_kv.py)


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        return TreeCPUAttentionImpl
