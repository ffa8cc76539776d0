"""Evaluation prompt sets from pinned wheels: HumanEval, MT-Bench and the workload mix (mix.py)."""

from vllm_adaspec.data.prompts import (
    PROMPT_SETS,
    WORKLOAD_MIX,
    apply_chat_template,
    load_humaneval,
    load_mtbench_first_turns,
    load_prompts,
)

__all__ = ["PROMPT_SETS", "WORKLOAD_MIX", "apply_chat_template", "load_humaneval", "load_mtbench_first_turns", "load_prompts"]
