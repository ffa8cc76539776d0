"""Scheduler that reserves KV slots for the drafter.

The drafter runs the target's own first N layers on draft tokens and writes their KV into the target's cache
at the positions the next verification will overwrite anyway. Those positions lie past what the target was
scheduled for, so blocks for them must be allocated: vLLM does this for EAGLE through `num_lookahead_tokens`,
which it leaves at 0 for custom proposers.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler


class AdaspecScheduler(Scheduler):
    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        # The bonus token and K-1 drafts get KV during drafting: K slots past the scheduled tokens.
        self.num_lookahead_tokens = max(self.num_lookahead_tokens, vllm_config.speculative_config.num_speculative_tokens)
