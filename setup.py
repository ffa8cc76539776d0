"""Packages (the rest of the metadata is in pyproject.toml).

Every package under vllm_adaspec/ is found: nothing to forget when a folder is added (tests/test_wheel.py builds the
wheel and imports every module from it). Data folders without __init__.py (shipped heads, corpus tables) are package
data, not packages. The Triton kernels live in the repository's top-level kernels/ folder and install as
`vllm_adaspec.kernels`: a top-level import name `kernels` would collide with the PyPI package of that name.
"""
from setuptools import find_packages, setup

KERNELS = {f"vllm_adaspec.kernels{sub}": f"kernels{sub.replace('.', '/')}"
           for sub in [""] + [f".{p}" for p in find_packages("kernels")]}

setup(packages=find_packages(include=["vllm_adaspec", "vllm_adaspec.*"]) + sorted(KERNELS),
      package_dir=KERNELS)
