"""Tree attention as vLLM attention backends, registered with vLLM's `register_backend` (no class patching).

`TreeCPUAttentionBackend` is vLLM's CPU backend whose impl runs vLLM's kernel for every row, then lets the
worker's tree runtime (engine/tree_runtime.py) overwrite the rows of tree requests with tree-masked attention.
Layers whose impl has no runtime attached (engines without trees, layers built before attachment) run vLLM's kernel
only. The override is registered in the worker process before the model is built (the CPU platform resolves its
backend by `AttentionBackendEnum.CPU_ATTN.get_path()`, which honours overrides).
"""

from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    tree_runtime = None  # engine/tree_runtime.TreeRuntime, set per layer by `attach_runtime`

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if self.tree_runtime is not None and attn_metadata is not None:
            self.tree_runtime.attend(layer.isa, self.scale, query, key, value, kv_cache, attn_metadata, output)
        return out


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[CPUAttentionBackendImpl]:
        return TreeCPUAttentionImpl


def register() -> None:
    """Make vLLM's CPU platform pick the tree backend in this process (before the model is built)."""
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    path = f"{TreeCPUAttentionBackend.__module__}.{TreeCPUAttentionBackend.__qualname__}"
    if AttentionBackendEnum.CPU_ATTN.get_path() == path:
        return
    register_backend(AttentionBackendEnum.CPU_ATTN, path)
    # vLLM caches its backend choice per process; an engine built earlier in this process (tests run several)
    # would otherwise keep the stock class.
    selector._cached_get_attn_backend.cache_clear()


def attach_runtime(static_forward_context: dict, runtime) -> int:
    """Point every tree-capable attention layer of the model at the worker's runtime; returns how many."""
    n = 0
    for layer in static_forward_context.values():
        impl = getattr(layer, "impl", None)
        if isinstance(impl, TreeCPUAttentionImpl):
            impl.tree_runtime = runtime
            n += 1
    return n
