"""Import vllm_adaspec from this checkout where it is not installed (the device machine runs a bare copy of the
tree): the package from vllm_adaspec/, and its kernels from the top-level kernels/ folder, where setup.py installs
them (`vllm_adaspec.kernels`)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def use_checkout() -> None:
    try:  # installed (pip install -e . maps kernels/ itself)
        import vllm_adaspec.kernels  # noqa: F401
        return
    except ImportError:
        pass
    sys.path.insert(0, str(ROOT))
    import vllm_adaspec

    # a submodule is looked up along the package's __path__: the checkout's root holds kernels/
    vllm_adaspec.__path__.append(str(ROOT))
    import vllm_adaspec.kernels  # noqa: F401
