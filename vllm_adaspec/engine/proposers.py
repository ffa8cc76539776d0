"""The classes vLLM instantiates for `speculative_config.model = "vllm_adaspec.<Name>"` (with the VllmConfig only):
a driver (proposers/driver.py) around one drafter, given the settings checked once at start-up (engine/startup.py),
so drafters read no config file again and import nothing of vLLM."""

from __future__ import annotations

from vllm_adaspec.engine.startup import settings_for, settle_gpu_trees
from vllm_adaspec.proposers.driver import Driver
from vllm_adaspec.proposers.early_exit import EarlyExitDrafter
from vllm_adaspec.proposers.multi_branch import MultiBranchDrafter
from vllm_adaspec.proposers.probe import ProbeDrafter


class _Engine(Driver):
    def __init__(self, vllm_config):
        from vllm_adaspec.engine.plugin import disabled

        if disabled() is not None:  # (the plugin patched nothing in this process: no worker of ours runs it)
            raise RuntimeError(f"vllm_adaspec is disabled: {disabled()}. Its proposers cannot run here.")
        # vLLM builds its proposer in the worker's model runner, once the device is set and before the model: on
        # CUDA the tree backends are registered and vLLM's choice of backend for this model is checked here
        settle_gpu_trees(vllm_config)
        super().__init__(vllm_config, settings_for(vllm_config, self.proposer))


class EarlyExitProposer(_Engine):
    proposer, drafter_cls = "early_exit", EarlyExitDrafter


class MultiBranchProposer(_Engine):
    proposer, drafter_cls = "multi_branch", MultiBranchDrafter


class ProbeProposer(_Engine):
    proposer, drafter_cls = "probe", ProbeDrafter
