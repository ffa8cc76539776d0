"""Tree attention as vLLM attention backends, registered with vLLM's `register_backend` (no class patching): one
subclass per vLLM backend whose impl runs vLLM's kernel for every row, then lets the worker's tree runtime
overwrite the rows of tree requests (engine/cpu_tree_backend.py on CPU; engine/gpu_tree_backend.py for
FlashAttention and Triton on CUDA). Layers whose impl has no runtime attached (engines without trees, layers built
before attachment) run vLLM's kernel only. Registration happens in the worker process before the model is built.
This module imports no backend of vLLM's (each platform's module imports its own).
"""

from __future__ import annotations
from vllm_adaspec.engine.vllm_surface import vllm_object

CPU_TREE_BACKEND = "vllm_adaspec.engine.cpu_tree_backend.TreeCPUAttentionBackend"
# vLLM's backend -> its tree subclass (the backends vLLM picks on CUDA for the models trees support)
GPU_TREE_BACKENDS = (("FLASH_ATTN", "vllm_adaspec.engine.gpu_tree_backend.TreeFlashAttentionBackend"),
                     ("TRITON_ATTN", "vllm_adaspec.engine.gpu_tree_backend.TreeTritonAttentionBackend"))


class TreeAttentionMixin:
    """Before a vLLM attention impl in the MRO: vLLM's forward, then the tree runtime's rows."""
    tree_runtime = None  # the worker's tree runtime, set per layer by `attach_runtime`

    @staticmethod
    def tree_isa(layer):
        return None  # the KV layout variant the runtime needs (vLLM's CPU backend has several)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if self.tree_runtime is not None and attn_metadata is not None:
            self.tree_runtime.attend(self.tree_isa(layer), self.scale, query, key, value, kv_cache, attn_metadata,
                                     output)
        return out


def register_cpu() -> None:
    """Make vLLM's CPU platform pick the tree backend in this process (before the model is built)."""
    AttentionBackendEnum, register_backend = vllm_object("AttentionBackendEnum"), vllm_object("register_backend")

    if AttentionBackendEnum.CPU_ATTN.get_path() != CPU_TREE_BACKEND:
        register_backend(AttentionBackendEnum.CPU_ATTN, CPU_TREE_BACKEND)
        _forget_choices()


def register_gpu() -> None:
    """Make vLLM's CUDA platform pick a tree subclass wherever it would pick FlashAttention or Triton."""
    AttentionBackendEnum, register_backend = vllm_object("AttentionBackendEnum"), vllm_object("register_backend")

    changed = False
    for name, path in GPU_TREE_BACKENDS:
        if AttentionBackendEnum[name].get_path() != path:
            register_backend(AttentionBackendEnum[name], path)
            changed = True
    if changed:
        _forget_choices()


def _forget_choices() -> None:
    # vLLM caches its backend choice per process; an engine built earlier in this process (tests run several)
    # would otherwise keep the stock class.
    selector = vllm_object("attention_selector")

    selector._cached_get_attn_backend.cache_clear()


def gpu_tree_support(vllm_config) -> str | None:
    """After `register_gpu`, in the worker before the model is built: the backend vLLM's selector gives the model's
    decoder attention layers (their head size, dtype and KV-cache dtype, under this config). None when it is a tree
    backend; else why trees cannot run here."""
    set_current_vllm_config = vllm_object("set_current_vllm_config")
    get_attn_backend = vllm_object("get_attn_backend")

    mc = vllm_config.model_config
    with set_current_vllm_config(vllm_config):
        backend = get_attn_backend(mc.get_head_size(), mc.dtype, vllm_config.cache_config.cache_dtype)
    if issubclass(backend.get_impl_cls(), TreeAttentionMixin):
        return None
    return (f"vLLM chose the {backend.get_name()} attention backend for this model, which has no tree path "
            f"(FlashAttention and Triton have one: --attention-backend FLASH_ATTN or TRITON_ATTN)")


def attach_runtime(static_forward_context: dict, runtime, dtype) -> tuple[int, int]:
    """Point every tree-capable attention layer of the model at the worker's runtime (`dtype`: the model's); returns
    (layers attached, attention layers in all)."""
    impls, total = [], 0
    for layer in static_forward_context.values():
        impl = getattr(layer, "impl", None)
        if impl is None or not hasattr(layer, "kv_cache"):
            continue
        total += 1
        if isinstance(impl, TreeAttentionMixin):
            impl.tree_runtime = runtime
            impls.append(impl)
    runtime.attached(impls, dtype)
    return len(impls), total
