"""vllm-adaspec: self-speculative decoding for vLLM.

`import vllm_adaspec` stays light (no vLLM import): proposer classes load on first attribute access, which is
how vLLM resolves `speculative_config.model = "vllm_adaspec.EarlyExitProposer"`.
"""

__version__ = "0.1.0"

_LAZY = {"EarlyExitProposer": "vllm_adaspec.proposers.early_exit",
         "MultiBranchProposer": "vllm_adaspec.proposers.multi_branch",
         "ProbeProposer": "vllm_adaspec.proposers.probe"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vllm_adaspec' has no attribute {name!r}")
