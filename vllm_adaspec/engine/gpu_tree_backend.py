"""Tree attention on vLLM's GPU backends: FlashAttention and Triton, the backends vLLM picks on CUDA for Llama,
Qwen2 and Mistral models (FlashAttention where it is available, Triton otherwise). Each is a subclass of vLLM's
whose impl runs vLLM's kernel for every row (chain requests' rows are vLLM's own result, untouched), then lets the
worker's GPU tree runtime (runtime/gpu.py) write the rows of tree requests with the tree-attention
kernel (kernels/tree_attention.py). Registered in place of FLASH_ATTN and TRITON_ATTN by
engine/tree_backend.register_gpu; the metadata builders are vLLM's.

CUDA graphs: the tree rows change every step and are written by a kernel launched from Python, so no full graph may
hold them. The builders report full-graph support for decode batches of single tokens only, with which vLLM
resolves a speculative engine to piecewise graphs (attention runs eagerly between graphed pieces, as with vLLM's
own backends that lack full-graph support): steps without drafts lose FULL_AND_PIECEWISE's one-graph decode.
"""

from __future__ import annotations

from vllm_adaspec.engine.tree_backend import TreeAttentionMixin
from vllm_adaspec.engine.vllm_surface import vllm_object

AttentionCGSupport = vllm_object("AttentionCGSupport")
FlashAttentionBackend, FlashAttentionImpl, FlashAttentionMetadataBuilder = (
    vllm_object(n) for n in ("FlashAttentionBackend", "FlashAttentionImpl", "FlashAttentionMetadataBuilder"))
TritonAttentionBackend, TritonAttentionImpl, TritonAttentionMetadataBuilder = (
    vllm_object(n) for n in ("TritonAttentionBackend", "TritonAttentionImpl", "TritonAttentionMetadataBuilder"))

TREE_CG_SUPPORT = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


def _graph_support(base_builder) -> classmethod:
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        own = base_builder.get_cudagraph_support(vllm_config, kv_cache_spec)
        return own if own.value < TREE_CG_SUPPORT.value else TREE_CG_SUPPORT

    return classmethod(get_cudagraph_support)


class TreeFlashAttentionImpl(TreeAttentionMixin, FlashAttentionImpl):
    pass


class TreeFlashAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
    get_cudagraph_support = _graph_support(FlashAttentionMetadataBuilder)


class TreeFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[FlashAttentionImpl]:
        return TreeFlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[FlashAttentionMetadataBuilder]:
        return TreeFlashAttentionMetadataBuilder


class TreeTritonAttentionImpl(TreeAttentionMixin, TritonAttentionImpl):
    pass


class TreeTritonAttentionMetadataBuilder(TritonAttentionMetadataBuilder):
    get_cudagraph_support = _graph_support(TritonAttentionMetadataBuilder)


class TreeTritonAttentionBackend(TritonAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[TritonAttentionImpl]:
        return TreeTritonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TritonAttentionMetadataBuilder]:
        return TreeTritonAttentionMetadataBuilder
