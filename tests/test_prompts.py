import pytest

from vllm_adaspec.data import (
    PROMPT_SETS,
    apply_chat_template,
    load_humaneval,
    load_mtbench_first_turns,
    load_prompts,
)


class EchoTokenizer:
    """Records the conversations it is asked to render."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"


def test_humaneval_all_164():
    prompts = load_humaneval()
    assert len(prompts) == 164
    assert all("def " in p and ('"""' in p or "'''" in p) for p in prompts)
    assert prompts[0].lstrip().startswith("from typing import List")
    assert load_humaneval(3) == prompts[:3]


def test_humaneval_instruct_wraps_the_code():
    raw, wrapped = load_humaneval(2), load_humaneval(2, instruct=True)
    assert all(r in w and "```python" in w for r, w in zip(raw, wrapped, strict=True))


def test_mtbench_80_first_turns():
    turns = load_mtbench_first_turns()
    assert len(turns) == 80 and len(set(turns)) == 80
    assert all(isinstance(t, str) and len(t) > 10 for t in turns)
    assert turns[0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert load_mtbench_first_turns(5) == turns[:5]


def test_bad_n():
    with pytest.raises(ValueError):
        load_humaneval(-1)


def test_apply_chat_template_one_user_turn():
    assert apply_chat_template(EchoTokenizer(), ["a", "b"]) == ["user:a|assistant:", "user:b|assistant:"]
    assert apply_chat_template(EchoTokenizer(), ["a"], system="s") == ["system:s|user:a|assistant:"]


def test_load_prompts_by_name():
    assert set(PROMPT_SETS) == {"humaneval", "mtbench", "repetitive"}
    assert load_prompts("humaneval", 2, EchoTokenizer()) == load_humaneval(2)  # completions: raw
    assert load_prompts("mtbench", 2, EchoTokenizer())[0].startswith("user:Compose")
    assert load_prompts("mtbench", 2) == load_mtbench_first_turns(2)
    with pytest.raises(ValueError, match="humaneval"):
        load_prompts("gsm8k")


def test_repetitive_workload_is_one_instruction_over_many_stdlib_functions():
    from vllm_adaspec.data.prompts import REPETITIVE_INSTRUCTION

    ps = load_prompts("repetitive", None)
    head = REPETITIVE_INSTRUCTION.split("{src}")[0]
    assert len(ps) >= 100 and all(p.startswith(head) for p in ps)
    assert len(set(ps)) == len(ps)  # different functions
    assert load_prompts("repetitive", 3, EchoTokenizer())[0].startswith("user:Add type hints")  # a chat set


def test_real_chat_template_smollm2():
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    from vllm_adaspec.models import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m-instruct"))
    (text,) = apply_chat_template(tok, load_mtbench_first_turns(1))
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids[1] != ids[0]  # no doubled BOS
