"""Training prompts for self-distillation, built from material on this machine (never the evaluation sets).

Two kinds, matching the two evaluation styles:
- code: functions of the Python standard library that have a docstring. As a raw completion (signature +
  docstring, like HumanEval) or as a chat request to implement / explain / test / document it.
- chat: hand-written instruction templates crossed with hand-written topics (writing, reasoning, STEM,
  humanities, role-play, extraction), rendered with the model's chat template.

Deterministic: the same seed gives the same prompts in the same order on any machine with the same Python.
HumanEval and MT-Bench prompts are filtered out by exact text if they were to appear.
"""

from __future__ import annotations

import random
import textwrap

from vllm_adaspec.data.stdlib import stdlib_functions

__all__ = ["stdlib_functions", "code_prompts", "chat_prompts", "build_prompts"]

CODE_REQUESTS = (
    "Write a Python function `{name}{sig}` that does the following:\n\n{doc}",
    "Implement `{name}{sig}` in Python. Specification:\n{doc}\nReply with the code and a short explanation.",
    "Explain step by step what this Python function does and when one would use it.\n\n```python\n{src}\n```",
    "Write three pytest unit tests for this function.\n\n```python\n{src}\n```",
    "Suggest a clearer docstring for this function and explain your changes.\n\n```python\n{src}\n```",
    "Rewrite this function to be shorter and easier to read, keeping its behaviour.\n\n```python\n{src}\n```",
)

CHAT_TEMPLATES = (
    "Write a short blog post about {t}.",
    "Explain {t} to a ten-year-old.",
    "Give me five interesting facts about {t}.",
    "What are the pros and cons of {t}? Answer as a list.",
    "Write a poem about {t}.",
    "Compose a formal email to a colleague proposing a workshop on {t}.",
    "Pretend you are a tour guide and describe {t} to a group of visitors.",
    "Summarize the history of {t} in one paragraph.",
    "Write a dialogue between a teacher and a student about {t}.",
    "What are common misconceptions about {t}? Correct each one.",
    "Create a study plan for learning about {t} in four weeks.",
    "Describe {t} using only simple words, then give a one-sentence summary.",
    "Write a persuasive paragraph arguing that everyone should know about {t}.",
    "List three open questions about {t} and why they matter.",
    "Write a short story in which {t} plays an important role.",
    "Compare {t} with a related idea and explain the differences in a table.",
    "You are a journalist. Write the headline and first paragraph of a news article about {t}.",
    "Give a step-by-step explanation of how {t} works.",
    "Write a product description for a board game about {t}.",
    "Extract the key terms a beginner needs to understand {t} and define each in one line.",
)

TOPICS = (
    "photosynthesis", "the water cycle", "plate tectonics", "black holes", "the immune system", "compound interest",
    "supply and demand", "the printing press", "the French Revolution", "the Silk Road", "renewable energy",
    "machine learning", "public key cryptography", "the Pythagorean theorem", "prime numbers", "probability",
    "climate change", "volcanoes", "honeybees", "coral reefs", "the human brain", "vaccines", "electric cars",
    "the Roman Empire", "ancient Egypt", "jazz music", "impressionist painting", "the Olympic Games",
    "chess openings", "sourdough baking", "urban gardening", "minimalism", "time management", "public speaking",
    "the stock market", "inflation", "the theory of evolution", "DNA replication", "the speed of light",
    "quantum computing", "the internet", "operating systems", "databases", "version control with git",
    "recursion", "sorting algorithms", "graph theory", "the scientific method", "statistics", "game theory",
    "the solar system", "the Moon landing", "marine biology", "rainforests", "deserts", "migration of birds",
    "the Renaissance", "Shakespeare's plays", "Greek mythology", "the history of writing", "world languages",
    "meditation", "sleep", "nutrition", "marathon training", "teamwork", "negotiation", "leadership",
    "recycling", "3D printing", "robotics", "space exploration", "the periodic table", "chemical reactions",
    "electricity", "magnetism", "bridges", "earthquakes", "weather forecasting", "maps and navigation",
    "libraries", "museums", "film making", "photography", "podcasts", "social media", "online privacy",
)

SYSTEM_CHAT_EXTRA = (
    "Solve: a train travels {a} km in {b} hours. What is its average speed? Explain your reasoning.",
    "If I have {a} apples and give away {b}, then buy twice as many as I have left, how many do I have?",
    "What is {a} multiplied by {b}? Show the long multiplication.",
    "Is {a} a prime number? Explain how you checked.",
    "Convert {a} degrees Celsius to Fahrenheit and explain the formula.",
)


def _raw_completion(name: str, sig: str, doc: str) -> str:
    body = textwrap.indent(doc, "    ").lstrip()
    return f'def {name}{sig}:\n    """{body}\n    """\n'


def code_prompts(rng: random.Random, n: int) -> list[tuple[str, bool]]:
    """n (prompt, wants_chat_template) pairs from stdlib functions; a third are raw completions."""
    funcs = list(stdlib_functions())
    rng.shuffle(funcs)
    out = []
    for i in range(n):
        name, sig, doc, src = funcs[i % len(funcs)]
        if i % 3 == 0:
            out.append((_raw_completion(name, sig, doc), False))
        else:
            tpl = CODE_REQUESTS[rng.randrange(len(CODE_REQUESTS))]
            out.append((tpl.format(name=name, sig=sig, doc=doc, src=src), True))
    return out


def chat_prompts(rng: random.Random, n: int) -> list[tuple[str, bool]]:
    """n chat requests: template x topic, plus a few arithmetic word problems with random numbers."""
    combos = [(t, topic) for t in CHAT_TEMPLATES for topic in TOPICS]
    rng.shuffle(combos)
    out = []
    for i in range(n):
        if i % 10 == 9:
            tpl = SYSTEM_CHAT_EXTRA[rng.randrange(len(SYSTEM_CHAT_EXTRA))]
            out.append((tpl.format(a=rng.randrange(2, 500), b=rng.randrange(2, 60)), True))
        else:
            tpl, topic = combos[i % len(combos)]
            out.append((tpl.format(t=topic), True))
    return out


def build_prompts(n: int, seed: int = 0, tokenizer=None, code_fraction: float = 0.5,
                  exclude: set[str] | None = None) -> list[str]:
    """n training prompts (code and chat interleaved), chat ones rendered with `tokenizer`'s template.

    `exclude`: prompt texts never to emit (the evaluation sets); checked before templating.
    """
    from vllm_adaspec.data.prompts import apply_chat_template

    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    n_code = round(n * code_fraction)
    pairs = code_prompts(rng, n_code) + chat_prompts(rng, n - n_code)
    rng.shuffle(pairs)
    exclude = exclude or set()
    pairs = [p for p in pairs if p[0] not in exclude]
    if tokenizer is None:
        return [p for p, _ in pairs]
    chat_idx = [i for i, (_, chat) in enumerate(pairs) if chat]
    rendered = apply_chat_template(tokenizer, [pairs[i][0] for i in chat_idx])
    out = [p for p, _ in pairs]
    for i, r in zip(chat_idx, rendered):
        out[i] = r
    return out
