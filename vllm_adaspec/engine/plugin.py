"""`vllm.general_plugins` entry point.

vLLM calls `register()` in every process it starts (front end, engine core, each worker), so it must be
idempotent and cheap. It wraps `VllmConfig.__post_init__`: when the speculative config names an adaspec
proposer, every start-up check (engine/startup.py) runs right there (so bad input fails at start-up, in the
user's process) and our worker and scheduler classes are put into the config, which travels to every process.
Users never pass --worker-cls or --scheduler-cls.

On CPU it also corrects vLLM's rejection-sampling expand op (engine/cpu_sampling_fix.py) for every
speculative method, vLLM's own included: the bug makes sampled output wrong whenever drafts are verified.
"""

from __future__ import annotations

from vllm_adaspec.config import AdaspecConfigError
from vllm_adaspec.engine.startup import check_engine, proposer_kind
from vllm_adaspec.engine.vllm_surface import SUPPORTED, supported, vllm_object
from vllm_adaspec.metrics import ensure_stats_dir

STOCK_WORKERS = {
    "cpu": "vllm.v1.worker.cpu_worker.CPUWorker",
    "gpu": "vllm.v1.worker.gpu_worker.Worker",
}
OUR_WORKERS = {
    "cpu": "vllm_adaspec.engine.cpu_worker.AdaspecCPUWorker",
    "gpu": "vllm_adaspec.engine.gpu_worker.AdaspecGPUWorker",
}
# where they lived before (both in engine/worker.py): a config that names them there still means ours
OLD_WORKERS = {"cpu": "vllm_adaspec.engine.worker.AdaspecCPUWorker", "gpu": "vllm_adaspec.engine.worker.AdaspecGPUWorker"}
OUR_SCHEDULER = "vllm_adaspec.engine.scheduler.AdaspecScheduler"


_state = {"disabled": None}  # why the plugin is off in this process (one warning said so), or None


def register() -> None:
    """Idempotent. On a vLLM release the plugin does not support, or where one of the things it patches is missing,
    it patches nothing and warns once: vLLM works as without the plugin, and an engine configured with an adaspec
    proposer fails at start-up saying why (`disabled`)."""
    if _state["disabled"] is not None:
        return
    problem = unsupported_vllm()
    targets = None
    if problem is None:
        try:
            targets = patch_targets()
        except Exception as e:  # (AttributeError, ImportError: a target vLLM renamed or moved)
            problem = f"a part of vLLM it patches is missing here ({type(e).__name__}: {e})"
    if problem is not None:
        _state["disabled"] = problem
        import logging

        logging.getLogger("vllm_adaspec").warning("vllm_adaspec is disabled: %s; vLLM runs without it", problem)
        return
    config_cls, sampling_cls, platform_cls = targets
    from vllm_adaspec.engine import cpu_sampling_fix

    if platform_cls is not None:
        cpu_sampling_fix.install(platform_cls)  # vLLM-CPU's rejection sampler is wrong at temperature > 0 without it
    install_request_checks(sampling_cls)

    if getattr(config_cls.__post_init__, "_adaspec_hook", False):
        return
    original = config_cls.__post_init__

    def __post_init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        configure(self)

    __post_init__._adaspec_hook = True  # type: ignore[attr-defined]
    config_cls.__post_init__ = __post_init__


def disabled() -> str | None:
    """Why the plugin is off in this process (an unsupported vLLM, a missing patch target), or None."""
    return _state["disabled"]


def unsupported_vllm() -> str | None:
    """Why this vLLM is not one the plugin supports (engine/vllm_surface.SUPPORTED: on another release it patches
    nothing), or None."""
    if supported():
        return None
    version = getattr(vllm_object("vllm"), "__version__", "unknown")
    return f"it supports vLLM {', '.join(SUPPORTED)}, this is vLLM {version}"


def patch_targets() -> tuple:
    """Every object `register` patches, resolved before anything is patched (an AttributeError or ImportError
    names the one missing): VllmConfig (its __post_init__), SamplingParams (its _validate_spec_decode) and, on CPU,
    the platform class (its register_triton_kernel_overrides)."""
    VllmConfig, SamplingParams = vllm_object("VllmConfig"), vllm_object("SamplingParams")
    current_platform = vllm_object("current_platform")
    for cls, name in ((VllmConfig, "__post_init__"), (SamplingParams, "_validate_spec_decode")):
        if not callable(getattr(cls, name, None)):
            raise AttributeError(f"{cls.__name__}.{name}")
    platform_cls = None
    if current_platform.is_cpu():
        platform_cls = type(current_platform)
        if not callable(getattr(platform_cls, "register_triton_kernel_overrides", None)):
            raise AttributeError(f"{platform_cls.__name__}.register_triton_kernel_overrides")
    return VllmConfig, SamplingParams, platform_cls


def install_request_checks(sampling_cls) -> None:
    """Requests are checked where vLLM checks them (SamplingParams.verify, in the front end: a ValueError there is
    the client's 400). For adaspec engines, vLLM's speculation check is replaced: per-request controls in
    `extra_args` (controls.py) are checked, with the field named; min_p and logit_bias, which vLLM refuses under
    speculation (its chain verification ignores them), are accepted: the plugin verifies such requests' drafts
    with its tree sampler, which applies them, or drafts none for them (proposers/driver.py). Other speculative
    configs keep vLLM's check."""
    original = sampling_cls._validate_spec_decode
    if getattr(original, "_adaspec_hook", False):
        return

    def _validate_spec_decode(self, speculative_config):
        if not _is_adaspec(speculative_config):
            return original(self, speculative_config)
        VLLMValidationError = vllm_object("VLLMValidationError")

        from vllm_adaspec.controls import ControlError, parse_controls

        try:
            parse_controls(self.extra_args)
        except ControlError as e:
            raise VLLMValidationError(str(e), parameter=e.key, value=(self.extra_args or {}).get(e.key)) from None

    _validate_spec_decode._adaspec_hook = True  # type: ignore[attr-defined]
    sampling_cls._validate_spec_decode = _validate_spec_decode


def _is_adaspec(speculative_config) -> bool:
    return (speculative_config is not None and getattr(speculative_config, "method", None) == "custom_class"
            and str(speculative_config.model or "").startswith("vllm_adaspec."))


def configure(vllm_config) -> None:
    """Run every start-up check (engine/startup.py) and install our worker/scheduler. A no-op for configs that
    don't use adaspec; an `adaspec` section without an adaspec proposer is refused."""
    if check_engine(vllm_config, proposer_kind(vllm_config)) is None:
        return
    _install(vllm_config)
    ensure_stats_dir()  # where the engine's drafter leaves its statistics for this process (metrics.py)


def _install(vllm_config) -> None:
    current_platform = vllm_object("current_platform")
    kind = "cpu" if current_platform.is_cpu() else "gpu"
    parallel = vllm_config.parallel_config
    if parallel.worker_cls in (STOCK_WORKERS[kind], "auto", OLD_WORKERS[kind]):
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
