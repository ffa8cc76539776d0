"""The classes vLLM instantiates for `speculative_config.model = "vllm_adaspec.<Name>"` (with the VllmConfig only):
each hands its drafter the settings checked once at start-up (engine/startup.py), so drafters read no config file
again and import nothing of vLLM."""

from __future__ import annotations

from vllm_adaspec.engine.startup import settings_for
from vllm_adaspec.proposers import early_exit, multi_branch, probe


class EarlyExitProposer(early_exit.EarlyExitProposer):
    def __init__(self, vllm_config):
        super().__init__(vllm_config, settings_for(vllm_config, self.proposer))


class MultiBranchProposer(multi_branch.MultiBranchProposer):
    def __init__(self, vllm_config):
        super().__init__(vllm_config, settings_for(vllm_config, self.proposer))


class ProbeProposer(probe.ProbeProposer):
    def __init__(self, vllm_config):
        super().__init__(vllm_config, settings_for(vllm_config, self.proposer))
