"""Triton kernels, each file holding the kernel, its launcher and a plain torch reference used by its tests.

This folder is the repository's top-level kernels/ and installs as `vllm_adaspec.kernels` (setup.py: the top-level
import name `kernels` belongs to another PyPI package); a bare checkout imports it through
benchmarks/checkout.py. Tests run the kernels on CPU with TRITON_INTERPRET=1 against float64 references.
"""
