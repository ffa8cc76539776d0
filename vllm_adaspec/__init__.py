"""vllm-adaspec: self-speculative decoding for vLLM.

`import vllm_adaspec` stays light (no vLLM import): proposer classes load on first attribute access, which is
how vLLM resolves `speculative_config.model = "vllm_adaspec.EarlyExitProposer"`.
"""

__version__ = "0.1.0"

# the classes vLLM instantiates (engine/proposers.py); the drafters themselves are in vllm_adaspec/proposers/
_LAZY = {"EarlyExitProposer": "vllm_adaspec.engine.proposers",
         "MultiBranchProposer": "vllm_adaspec.engine.proposers",
         "ProbeProposer": "vllm_adaspec.engine.proposers"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vllm_adaspec' has no attribute {name!r}")
