import json

import pytest

from vllm_adaspec.data import (
    PROMPT_SETS,
    WORKLOAD_MIX,
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
    assert set(PROMPT_SETS) == {"humaneval", "mtbench", "repetitive", *WORKLOAD_MIX}
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


MIX_TYPES = ("summarization", "translation", "rag", "math", "code_edit", "chat", "agent")


def test_workload_mix_is_seven_task_types_plus_humaneval_and_mtbench():
    assert WORKLOAD_MIX == (*MIX_TYPES, "humaneval", "mtbench")


@pytest.mark.parametrize("name", MIX_TYPES)
def test_mix_loaders_are_deterministic_conversations_that_fit_the_context(name):
    from vllm_adaspec.data.mix import MIX

    convs = MIX[name]()
    assert len(convs) >= 20, len(convs)  # enough for 8 prompts per type in benchmarks and 6 demo rounds
    assert MIX[name](3) == convs[:3] and convs == MIX[name]()  # the same prompts, in the same order, every time
    texts = set()
    for conv in convs:
        assert conv and all(set(m) == {"role", "content"} and m["content"] for m in conv)
        assert conv[-1]["role"] == "user" and {m["role"] for m in conv} <= {"system", "user", "assistant"}
        assert sum(len(m["content"]) for m in conv) < 6500  # about 1600 tokens at most: room for 256 new ones
        texts.add(json.dumps(conv))
    assert len(texts) == len(convs)  # no prompt twice (suffix caches would replay it)
    rendered = load_prompts(name, 2, EchoTokenizer())
    assert rendered[0].endswith("|assistant:") and rendered[0].count("user:") >= 1


def test_mix_prompts_are_what_each_type_says():
    from vllm_adaspec.data.mix import gsm_problem, load_agent, load_chat, load_code_edit, load_rag, load_translation

    assert load_translation(1)[0][0]["content"].startswith("Translate the following German text into English.")
    rag = load_rag(1)[0][0]["content"]
    assert "\n\nQuestion: " in rag and "[1] " in rag and "\n\n[2] " in rag  # retrieved passages, numbered
    assert "```python\ndef " in load_code_edit(1)[0][0]["content"]
    chat = load_chat(1)[0]
    assert [m["role"] for m in chat][:3] == ["user", "assistant", "user"]
    agent = load_agent(1)[0]
    assert agent[0]["role"] == "system" and [m["role"] for m in agent[1:]] == ["user", "assistant"] * 3 + ["user"]
    assert all(json.loads(m["content"])["name"] for m in agent if m["role"] == "assistant")  # JSON tool calls
    text, answer = gsm_problem(0)
    assert gsm_problem(0) == (text, answer) and gsm_problem(1) != gsm_problem(0) and isinstance(answer, int)


def test_the_training_split_never_holds_an_evaluation_prompt():
    """Self-distillation's ShareGPT conversations (data/mix.sharegpt_training) lie past the head the workload mix's
    chat prompts come from: no conversation (ShareGPT splits long ones into parts: no part) is in both, no training
    request repeats an evaluation request, and `training_prompts` mixes them with stdlib / template prompts, never a
    HumanEval or MT-Bench prompt."""
    from vllm_adaspec.data.mix import _sharegpt_head, load_chat, sharegpt_training, sharegpt_training_prompts
    from vllm_adaspec.training.distill import training_prompts

    head = {c["id"].split("_")[0] for c in _sharegpt_head()}
    tail = [c["id"] for c in sharegpt_training(limit=3000)]
    assert len(tail) == 3000 and not any(t.split("_")[0] in head for t in tail)
    train = sharegpt_training_prompts(2000)
    assert len(train) == 2000 and all(p[-1]["role"] == "user" for p in train)
    # (requests of a few words, "continue" and the like, are in both: none of them longer than 40 characters)
    chats = load_chat()
    asked = {m["content"] for p in chats for m in p if m["role"] == "user" and len(m["content"]) > 40}
    assert not any(m["content"] in asked for p in train for m in p if m["role"] == "user")
    assert not any(p == e for p in train for e in chats)
    mixed = training_prompts(400, 0, EchoTokenizer(), "mix", exclude=set(load_humaneval()))
    assert len(mixed) == 400 and training_prompts(400, 0, EchoTokenizer(), "mix") == mixed  # deterministic
    assert 250 <= sum(p.startswith("user:") for p in mixed) < 400  # ShareGPT's three quarters + templates
    evaluation = set(load_humaneval()) | set(load_mtbench_first_turns())
    assert not any(e.strip()[:100] in p for p in mixed for e in evaluation)


def test_training_prompts_of_the_mix_kinds_are_never_evaluation_prompts():
    """data/mix.training_tasks draws each kind from records its evaluation loader never takes (by stride, seed or
    file position), and the default distillation source mixes them with ShareGPT's training split and templates."""
    from vllm_adaspec.data import mix
    from vllm_adaspec.training.distill import training_prompts

    train = mix.training_tasks(1000, seed=0)
    assert len(train) == 1000 and mix.training_tasks(1000, seed=0) == train  # deterministic
    evaluation = [p for kind in mix.MIX for p in mix.MIX[kind]()]
    seen = {json.dumps(p) for p in evaluation}
    assert not any(json.dumps(p) in seen for p in train)
    # no evaluation document, passage set, function or problem inside a training prompt either
    bodies = {m["content"].split("\n\n", 1)[-1][:300] for p in evaluation for m in p if m["role"] == "user"}
    assert not any(b in m["content"] for p in train for m in p for b in bodies if len(b) > 80)
    kinds = {k: sum(p[0]["content"].startswith(prefix) for p in train) for k, prefix in
             (("translation", "Translate"), ("summarization", "Summarize"), ("rag", "Answer the question"),
              ("math", "Solve"))}
    assert all(n >= 10 for n in kinds.values()) and kinds["math"] >= 150, kinds  # every kind, in shares
    assert len(mix.training_summarization()) + len(mix.load_summarization()) == len(mix._acl_papers())  # the rest
    assert mix._language("Ich habe das nicht gesehen, und die Leute sind mit mir in der Stadt für ein Jahr.") == \
        "German" and mix._language("I have not seen the people in the city for a year, and that is it.") is None
    prompts = training_prompts(200, 0, EchoTokenizer())
    assert 100 <= sum(p.startswith("user:") for p in prompts) < 200  # ShareGPT and the mix's kinds, then templates
