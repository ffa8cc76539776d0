"""Triton kernels, each file holding the kernel, its launcher and a plain torch reference used by its tests.

This folder installs as `vllm_adaspec.kernels` (the top-level import name `kernels` belongs to another PyPI
package). Tests run the kernels on CPU with TRITON_INTERPRET=1 against float64 references.
"""
