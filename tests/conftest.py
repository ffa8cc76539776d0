import os
import sys

import pytest


def _import_triton_language_interpreted() -> None:
    """Triton decorates its own library (tl.sum, tl.max, tl.argmax: jit functions) once, when triton.language is
    first imported, and a kernel run by the interpreter can call them only if that happened in interpreter mode. No
    test compiles a kernel for a device (this machine has none), so the test process imports it that way first,
    whatever a test imports later (a kernel module in compiled mode, vLLM)."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    except ImportError:
        pass
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


_import_triton_language_interpreted()


def _one_core_per_worker() -> None:
    """Under pytest-xdist (README's test command: a worker per core) each worker and the engines it starts keep to
    a core of their own: two engines binding their OpenMP threads to the same cores would each spin-wait on the
    other's. A test that binds its engine itself (tensor parallelism: a core per rank) keeps its binding."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...
    if not worker or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[int(worker[2:]) % len(cores)])
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # this process's torch (references, statistics)


_one_core_per_worker()

SPEC = "vllm_adaspec.EarlyExitProposer"

# Mixed lengths (one ~400-token prompt, two sharing a long prefix for prefix caching), raw and chat-style.
LONG_CODE = "\n".join(
    f"def helper_{i}(values):\n    \"\"\"Return the {i}-th transform of values.\"\"\"\n    return [v * {i} + {i % 7} for v in values]\n"
    for i in range(14)
)
PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    LONG_CODE + "\ndef combine(values):\n",
    "import numpy as np\n\ndef softmax(x):\n    \"\"\"Numerically stable softmax.\"\"\"\n",
    LONG_CODE + "\nclass Pipeline:\n",
    "<|im_start|>user\nExplain what a hash table is in two sentences.<|im_end|>\n<|im_start|>assistant\n",
    "1, 2, 3, 4, 5,",
    "Once upon a time, in a small village by the mountains,",
    "SELECT name, COUNT(*) FROM orders",
]
MAX_TOKENS = [16, 64, 40, 96, 8, 72, 32, 128, 24, 56]

# Short prompts with long generations: they are all admitted, then outgrow a small KV cache (preemption).
GROW_PROMPTS = [
    "Count from one to fifty in words:",
    "List twenty animals, one per line:\n",
    "def bubble_sort(items):",
    "Here is a long story about a robot who learns to paint.",
    "The history of the printing press",
    "# A command line tool that renames files\nimport argparse\n",
    "Write a recipe for bread:\n",
    "Dear team, I am writing to",
]
GROW_MAX_TOKENS = [120] * len(GROW_PROMPTS)

ENGINE = {"dtype": "float32", "max_model_len": 1024, "seed": 0, "enforce_eager": True}


def greedy_batch(prompts=PROMPTS, max_tokens=MAX_TOKENS, repeat=1):
    return {
        "prompts": prompts,
        "params": [{"temperature": 0.0, "max_tokens": m, "ignore_eos": False} for m in max_tokens],
        "repeat": repeat,
    }


# The mixed batch's conversations, a turn further (harness: "continue" from the job's first batch, which must be the
# mixed batch): each prompt followed by its greedy output, 24 tokens more. Blocks of the first turn's output are
# in the prefix cache by then.
NEXT_TURN = {"continue": 0, "params": [{"temperature": 0.0, "max_tokens": 24, "ignore_eos": False}]}


def assert_identical(run, plain):
    for i, (got, want) in enumerate(zip(run["token_ids"], plain["token_ids"])):
        assert got == want, f"prompt {i} diverged at token {next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))}"
    assert [len(t) for t in run["token_ids"]] == [len(t) for t in plain["token_ids"]]


def spec_engine(exit_layer: int, k: int, **extra):
    return {
        **ENGINE,
        "speculative_config": {"model": SPEC, "num_speculative_tokens": k},
        # No cost model: it would switch slow drafting off; these tests want every drafting path exercised.
        "additional_config": {"adaspec": {"exit_layer": exit_layer, "cost_model": "off"}},
        **extra,
    }


@pytest.fixture(scope="session")
def smollm2() -> str:
    from vllm_adaspec.models import fetch_model

    return str(fetch_model("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def tiny_llama(smollm2, tmp_path_factory):
    """A small random Llama with SmolLM2's tokenizer whose heads split over 2 ranks (4 heads, 2 KV heads; SmolLM2
    has 9): tensor-parallel tests."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import shutil

    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper logits than the default init: fewer float32 near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model.save_pretrained(out, safe_serialization=True)
    for f in os.listdir(smollm2):
        if f.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(smollm2, f), out)
    return str(out)


def _host():
    """An EngineHost; with ADASPEC_TEST_JOB_LOG=FILE each job's test, wall time and per-batch seconds are appended
    to FILE (where the suite's minutes go)."""
    import json
    import time

    from vllm_adaspec.harness import EngineHost

    log = os.environ.get("ADASPEC_TEST_JOB_LOG")

    class Timed(EngineHost):
        def run(self, job):
            t0 = time.perf_counter()
            res = super().run(job)
            if log:
                with open(log, "a") as f:
                    f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST"),
                                        "seconds": round(time.perf_counter() - t0, 1),
                                        "spec": job.get("engine", {}).get("speculative_config"),
                                        "batches": [[round(r.get("seconds", 0), 1) for r in b["runs"]]
                                                    for b in res.get("batches", [])]}) + "\n")
            return res

    return Timed()


@pytest.fixture(scope="session")
def engines():
    """Single-process eager engines, built one after another in one child (harness.EngineHost): the child's
    interpreter and vLLM import are paid once per session. Tree-mode engines use `tree_engines` (tree mode patches
    vLLM's CPU attention process-wide)."""
    host = _host()
    yield host
    host.close()


@pytest.fixture(scope="session")
def tree_engines():
    host = _host()
    yield host
    host.close()


SEEDED = [{"temperature": 0.8, "top_p": 0.95, "seed": 1000 + i, "max_tokens": 32} for i in range(6)]
# A greedy / sampled mix: rows 3.. are greedy and must equal plain decoding whatever the sampled rows do.
SAMPLED_MIX = {"prompts": PROMPTS[:6], "params": SEEDED[:3] + [{"temperature": 0.0, "max_tokens": 48}] * 3}
# Sampled output with power (tests/stats.py sampled_positions_pvalues): a prompt whose next tokens have real entropy
# (first token: 13 tokens above 1%, the top one 7%) and whose answer copies from it (drafts get accepted), thousands
# of 4-token continuations at T = 1 with top-k and top-p, half of them seeded (disjoint seeds, per request), compared
# position by position with the target's exact conditional distribution (computed in plain torch). The same test
# must reject a deliberately biased verifier (VLLM_ADASPEC_BIASED_VERIFIER_SEEDS: requests seeded from there accept
# a rejected tree node now and then; vllm_adaspec/faults.py).
FRUIT_PROMPT = ("<|im_start|>user\nWrite five random fruit names, one per line: apple, banana, cherry, ...<|im_end|>\n"
                "<|im_start|>assistant\n")
FRUIT_SAMPLING = {"temperature": 1.0, "top_k": 40, "top_p": 0.95, "max_tokens": 4, "ignore_eos": True}
VOCAB = 49152  # SmolLM2's
# The same prompt under a grammar (structured output: candidates pruned by it, tree rows masked by it) and under
# min_p (which only the tree sampler applies): their samples against the target's distribution under those settings
FRUIT_REGEX = "(Apple|Banana|Cherry|Mango|Grape|Orange|Kiwi|Pear|Peach|Plum|Lemon|Lime)(\n(Apple|Banana|Cherry|Mango|Grape|Orange|Kiwi|Pear|Peach|Plum|Lemon|Lime)){4}"
FRUIT_MIN_P = 0.1
BIASED_SEEDS = 5_000_000


def sampling_batch(n: int, seed0: int | None = None, per_request: int = 256, **more) -> dict:
    """n samples of FRUIT_PROMPT. Unseeded: n / per_request requests with `n = per_request` (vLLM prefills the
    prompt once per request and samples its children apart). Seeded: n requests seeded seed0, seed0 + 1, ...
    (vLLM-CPU 0.32 fails seeded requests with n > 1: "CPU Generator does not use offset"). Samples: `samples(run)`."""
    if seed0 is None:
        params = [{**FRUIT_SAMPLING, **more, "n": per_request} for _ in range(n // per_request)]
    else:
        params = [{**FRUIT_SAMPLING, **more, "seed": seed0 + i} for i in range(n)]
    return {"prompts": [FRUIT_PROMPT] * len(params), "params": params}


def joined(*batches) -> dict:
    return {"prompts": [p for b in batches for p in b["prompts"]], "params": [q for b in batches for q in b["params"]]}


def samples(run, requests=slice(None)) -> list:
    """Every completion of a sampling_batch run (of the requests selected), request by request."""
    return [c for completions in run["completions"][requests] for c in completions]


def target_pvalues(model_dir: str, samples: list, subsets: dict, constrained: dict | None = None) -> dict:
    """{name: p-values by position} for each subset {name: sample indices} of `samples` (FRUIT_PROMPT
    continuations), against the target's exact conditional distribution (computed once for all samples sampled
    with FRUIT_SAMPLING alone, once per subset named in `constrained` {name: {"min_p": ..., "regex": ...}}: the
    distribution under those settings too)."""
    from stats import expectations, regex_masks, sampled_positions_pvalues, target_topk

    def reference(rows, min_p=0.0, regex=None):
        allowed = regex_masks(model_dir, regex, VOCAB) if regex else None
        return target_topk(model_dir, FRUIT_PROMPT, [samples[i] for i in rows], FRUIT_SAMPLING["temperature"],
                           FRUIT_SAMPLING["top_k"], FRUIT_SAMPLING["top_p"], min_p=min_p, allowed=allowed)

    constrained = constrained or {}
    plain_rows = sorted({i for name, rows in subsets.items() if name not in constrained for i in rows})
    ids, probs = reference(plain_rows) if plain_rows else (None, None)
    where = {i: j for j, i in enumerate(plain_rows)}
    out = {}
    for name, rows in subsets.items():
        rows = list(rows)
        if name in constrained:
            sub_ids, sub_probs = reference(rows, **constrained[name])
        else:
            sub_ids, sub_probs = ids[[where[i] for i in rows]], probs[[where[i] for i in rows]]
        out[name] = sampled_positions_pvalues([samples[i] for i in rows],
                                              *expectations(sub_ids, sub_probs, VOCAB))
        print(f"{name}: p-values by position {['%.3g' % p for p in out[name]]}")
    return out


def assert_keeps_the_target_distribution(model_dir: str, samples: list, subsets: dict) -> None:
    for name, pvalues in target_pvalues(model_dir, samples, subsets).items():
        assert min(pvalues) > 1e-4, (name, pvalues)


# Greedy rows, rows with a penalty (each tree row sees the penalty state of its own path) and sampled rows in one
# batch.
TREE_MIX = {"prompts": PROMPTS[:6],
            "params": [{"temperature": 0.0, "max_tokens": 40}] * 2
            + [{"temperature": 0.0, "max_tokens": 40, "repetition_penalty": 1.2}] * 2
            + [{"temperature": 0.8, "top_p": 0.95, "seed": 7 + i, "max_tokens": 40} for i in range(2)]}


# Every request feature that meets speculation, one greedy request each (FEATURE_NAMES): served with speculation
# they must give plain decoding's tokens (and log-probs). The last request runs into max_model_len (ENGINE's 1024):
# its prompt leaves 13 positions and max_tokens is unset, so drafts near the end must be cut by the scheduler.
JSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
               "required": ["name", "age"]}
EDGE_PROMPT = "one two three four five six seven eight nine ten " * 101  # 1011 tokens with SmolLM2's tokenizer
FEATURES = [
    ("logprobs", PROMPTS[0], {"logprobs": 3, "max_tokens": 24}),
    ("prompt_logprobs", PROMPTS[1], {"prompt_logprobs": 2, "max_tokens": 16}),
    ("presence / frequency penalties", PROMPTS[3], {"presence_penalty": 0.6, "frequency_penalty": 0.4, "max_tokens": 40}),
    ("repetition penalty", PROMPTS[5], {"repetition_penalty": 1.3, "max_tokens": 40}),
    ("min_tokens", "<|im_start|>user\nSay OK.<|im_end|>\n<|im_start|>assistant\n", {"min_tokens": 12, "max_tokens": 24}),
    ("stop string", PROMPTS[3], {"stop": ["\n\n"], "max_tokens": 64}),
    ("stop token ids", PROMPTS[0], {"stop_token_ids": [198], "max_tokens": 64}),
    # vLLM refuses n > 1 at temperature 0; top_k = 1 at temperature 1 samples the argmax (greedy by another name)
    ("n = 2", PROMPTS[2], {"n": 2, "temperature": 1.0, "top_k": 1, "seed": 0, "max_tokens": 24}),
    ("json schema", "<|im_start|>user\nGive a person as JSON with name and age.<|im_end|>\n<|im_start|>assistant\n",
     {"structured_outputs": {"json": JSON_SCHEMA}, "max_tokens": 40}),
    ("regex", "The year the first moon landing happened was",
     {"structured_outputs": {"regex": " [0-9]{4}\\."}, "max_tokens": 12}),
    # vLLM refuses these two under speculation (its chain verification ignores them): the plugin accepts them and
    # verifies such requests' drafts in the tree path only (logit_bias bans " list" here: the output differs)
    ("logit_bias", PROMPTS[3], {"logit_bias": {1398: -50.0}, "max_tokens": 40}),
    ("min_p", PROMPTS[4], {"min_p": 0.2, "max_tokens": 32}),
    ("bad_words", PROMPTS[5], {"bad_words": ["values"], "max_tokens": 40}),
    ("allowed_token_ids", PROMPTS[7], {"allowed_token_ids": [28, 198, 216, *range(32, 42)], "max_tokens": 40}),
    ("max_model_len", EDGE_PROMPT, {"max_tokens": None}),
]
# Features that the tree sampler verifies (every one but n = 2's seeded sampling at top_k 1, which draws chains as
# often as trees, and the request that runs into max_model_len): their requests must draft trees in tree engines.
TREE_FEATURES = [name for name in [n for n, _, _ in FEATURES] if name not in ("n = 2", "max_model_len")]
FEATURE_NAMES = [name for name, _, _ in FEATURES]
FEATURES_BATCH = {"prompts": [p for _, p, _ in FEATURES],
                  "params": [{"temperature": 0.0, "ignore_eos": False, **params} for _, _, params in FEATURES]}


def assert_features_match(run, plain):
    """Per feature: the tokens of every completion, why it stopped and (where asked) the top log-probs."""
    for i, name in enumerate(FEATURE_NAMES):
        assert run["completions"][i] == plain["completions"][i], name
        assert run["finish_reasons"][i] == plain["finish_reasons"][i], name
        for key in ("request_logprobs", "prompt_logprobs"):
            got, want = run[key][i], plain[key][i]
            assert (got is None) == (want is None), (name, key)
            # one entry per position (none missing: zip would drop them), each with the same tokens ranked and
            # log-probs equal up to float32 batch-order noise
            assert len(got or []) == len(want or []), (name, key, len(got or []), len(want or []))
            for g, w in zip(got or [], want or [], strict=True):
                assert (g is None) == (w is None), (name, key, g, w)
                if w is not None:
                    assert len(g) == len(w) and [t for t, _ in g] == [t for t, _ in w], (name, key, g, w)
                    assert max(abs(a - b) for (_, a), (_, b) in zip(g, w, strict=True)) < 2e-3, (name, key, g, w)
    edge = FEATURE_NAMES.index("max_model_len")
    assert run["finish_reasons"][edge] == ["length"] and 0 < len(run["completions"][edge][0]) <= 27


# Requests whose settings only the tree sampler applies to draft rows (vLLM's chain verification ignores logit_bias
# and min_p, and a grammar tree's node rows are masked by the plugin), greedy, each under faults in the tree path
# (test_engine_multibranch.py): logit_bias banning the request's own top first token (BANNED_FIRST: its plain,
# unbiased greedy first token, from the mixed batch), min_p, a JSON grammar, bad words.
BANNED_FIRST = {0: 472, 3: 3725, 7: 216}  # PROMPTS index -> its greedy first token without bias
OWN_SETTINGS = [
    *[(PROMPTS[i], {"logit_bias": {t: -100.0}}) for i, t in BANNED_FIRST.items()],
    (PROMPTS[5], {"min_p": 0.3}),
    ("<|im_start|>user\nGive a person as JSON with name and age.<|im_end|>\n<|im_start|>assistant\n",
     {"structured_outputs": {"json": JSON_SCHEMA}}),
    (PROMPTS[8], {"bad_words": [" the", " village"]}),
]
OWN_SETTINGS_BATCH = {"prompts": [p for p, _ in OWN_SETTINGS],
                      "params": [{"temperature": 0.0, "max_tokens": 40, **q} for _, q in OWN_SETTINGS]}


# Four requests of equal length: one batch size throughout (the cost model's known answer for early exit).
GUARD_BATCH = {"prompts": PROMPTS[:4], "params": [{"temperature": 0.0, "max_tokens": 64, "ignore_eos": True}]}


# The cost model's known answer: two requests copy a long passage (drafts of their own prompt are accepted), two
# write something new from a short request (no candidate worth a row), all four in one batch.
PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He cleaned the great lens, trimmed "
           "the wick and wound the clockwork that turned the light. Ships passing the rocky point counted the "
           "flashes, three short and one long, and knew exactly where they were. In winter the storms shook the "
           "tower and salt spray reached the gallery, but the light never failed. When the keeper retired, the "
           "village gave him a brass telescope, and he spent his last years watching the ships from his garden.")
COPY_OR_NOT = {"prompts": [f"<|im_start|>user\nRepeat this text exactly, word for word:\n\n{PASSAGE}<|im_end|>\n"
                           "<|im_start|>assistant\n",
                           "<|im_start|>user\nTell me about the history of Rome.<|im_end|>\n<|im_start|>assistant\n",
                           f"<|im_start|>user\nCopy the following paragraph:\n\n{PASSAGE}<|im_end|>\n"
                           "<|im_start|>assistant\n",
                           "<|im_start|>user\nWhat are the benefits of regular exercise?<|im_end|>\n"
                           "<|im_start|>assistant\n"],
               # the writing requests stop when the copying ones would: every step of theirs shares the batch with both
               "params": [{"temperature": 0.0, "max_tokens": m, "ignore_eos": True} for m in (96, 16, 96, 16)]}
COPYING = (0, 2)  # which of COPY_OR_NOT's requests copy


@pytest.fixture(scope="session")
def plain_greedy(smollm2, engines):
    """Reference: vLLM without speculation, same engine settings, every batch the engine tests compare with."""
    res = engines.run({"model": smollm2, "engine": ENGINE,
                       "batches": [greedy_batch(), greedy_batch(GROW_PROMPTS, GROW_MAX_TOKENS), SAMPLED_MIX,
                                   TREE_MIX, GUARD_BATCH, FEATURES_BATCH, COPY_OR_NOT, OWN_SETTINGS_BATCH,
                                   NEXT_TURN]})
    runs = [b["runs"][0] for b in res["batches"]]
    return dict(zip(["mixed", "grow", "sampled_mix", "tree_mix", "guard", "features",
                     "copy_or_not", "own_settings", "next_turn"], runs))


def pytest_collection_modifyitems(config, items):
    # Engine tests are slow; run the fast unit tests first so failures show up early.
    items.sort(key=lambda it: 1 if it.get_closest_marker("engine") else 0)


def load_interpreted(module: str):
    """A private copy of a kernel module whose Triton kernels run in the interpreter (TRITON_INTERPRET=1 on CPU).

    Triton reads TRITON_INTERPRET when a kernel is decorated (and again while launching), so the module is loaded
    afresh with it set and the variable is restored at once: engine child processes must not inherit it. Tests
    that launch kernels set it for their duration with the `triton_interpret` fixture."""
    import importlib.util

    spec = importlib.util.find_spec(f"vllm_adaspec.kernels.{module}")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        mod = importlib.util.module_from_spec(importlib.util.spec_from_file_location(f"_interp_{module}", spec.origin))
        sys.modules[mod.__name__] = mod  # dataclasses look their module up there
        mod.__spec__.loader.exec_module(mod)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    return mod


def random_trees(count: int, g, most: int = 40, vocab: int = 4) -> list:
    """Random draft trees of 0..most nodes over `vocab` tokens (a small vocabulary: many equal siblings); a parent
    is any earlier node (or the root) 70% of the time, else the previous node (deep chains)."""
    import torch

    from vllm_adaspec.trees import DraftTree

    out = []
    for _ in range(count):
        n = int(torch.randint(0, most + 1, (), generator=g))
        parents = [int(torch.randint(-1, i, (), generator=g)) if torch.rand((), generator=g) < 0.7 else i - 1
                   for i in range(n)]
        out.append(DraftTree(torch.randint(0, vocab, (n,), generator=g), torch.tensor(parents, dtype=torch.long)))
    return out


@pytest.fixture
def triton_interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def gpu_kernels(triton_interpret, monkeypatch):
    """The GPU tree runtime's three kernels (tree attention, verification, KV compaction) under the interpreter;
    returns the tree-attention module."""
    import vllm_adaspec.runtime.gpu as gtr

    ta = load_interpreted("tree_attention")
    monkeypatch.setattr(gtr, "kernels", ta)
    monkeypatch.setattr(gtr, "tree_verify", load_interpreted("tree_verify"))
    monkeypatch.setattr(gtr, "kv_compaction", load_interpreted("kv_compaction"))
    return ta
