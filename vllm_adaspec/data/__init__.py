"""Evaluation prompt sets (HumanEval, MT-Bench) from pinned wheels."""

from vllm_adaspec.data.prompts import (
    PROMPT_SETS,
    apply_chat_template,
    load_humaneval,
    load_mtbench_first_turns,
    load_prompts,
)

__all__ = ["PROMPT_SETS", "apply_chat_template", "load_humaneval", "load_mtbench_first_turns", "load_prompts"]
