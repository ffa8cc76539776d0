"""Bad settings fail when the engine is built, in the caller's process, with one message naming what is wrong (each
case builds an engine in the test session's engine host, which must report the error and go on serving). Every case
is its own test id; the engines are built once, by a module fixture, and each test reads its case's error."""

import json
import shutil

import pytest

pytestmark = pytest.mark.engine

EE = "vllm_adaspec.EarlyExitProposer"
MB = "vllm_adaspec.MultiBranchProposer"
CASES = {
    "unknown key": ({"model": EE, "num_speculative_tokens": 3}, {"adaspec": {"exit_layr": 6}}, {},
                    ["unknown key(s) 'exit_layr'", "allowed keys: exit_layer, policy, exit_head, cost_model"]),
    "exit head not a string": ({"model": EE, "num_speculative_tokens": 3}, {"adaspec": {"exit_head": 5}}, {},
                               ["['exit_head']: must be 'auto', 'none' or a checkpoint folder; got 5"]),
    "exit head missing": ({"model": EE, "num_speculative_tokens": 3}, {"adaspec": {"exit_head": "/no/such/head"}}, {},
                          ["'/no/such/head' is not an exit-head checkpoint folder", "adaspec train exit-layer"]),
    "wrong type": ({"model": EE, "num_speculative_tokens": 3}, {"adaspec": {"exit_layer": "6"}}, {},
                   ["['exit_layer']: must be an integer, got str '6'"]),
    "exit layer too deep": ({"model": EE, "num_speculative_tokens": 3}, {"adaspec": {"exit_layer": 31}}, {},
                            ["['exit_layer']: must satisfy 1 <= exit_layer < 30 (the model has 30 layers), got 31"]),
    "unknown policy": ({"model": EE, "num_speculative_tokens": 3}, {"adaspec": {"policy": "thompson"}}, {},
                       ["['policy']: must be one of fixed, thompson-beta, thompson-cali, adaedl, max-confidence", "got 'thompson'"]),
    "cali on the untrained exit": ({"model": EE, "num_speculative_tokens": 3},
                                   {"adaspec": {"exit_head": "none", "policy": "thompson-cali"}}, {},
                                   ["policy 'thompson-cali' needs a trained exit head"]),
    "unknown proposer": ({"model": "vllm_adaspec.EarlyExit", "num_speculative_tokens": 3}, {}, {},
                         ["'vllm_adaspec.EarlyExit' is not an adaspec proposer; known: vllm_adaspec.EarlyExitProposer, "
                          "vllm_adaspec.MultiBranchProposer"]),
    "tree budget over K": ({"model": EE, "num_speculative_tokens": 4}, {"adaspec": {"tree": {"budget": 8}}}, {},
                           ["['tree']['budget'] = 8 needs speculative_config['num_speculative_tokens'] >= 8", "got 4"]),
    # K = 0 is vLLM's own refusal (its config validation runs before ours); K above what vLLM verifies is ours
    "K below 1": ({"model": EE, "num_speculative_tokens": 0}, {}, {},
                  ["num_speculative_tokens", "Input should be greater than 0"]),
    "K above 128": ({"model": MB, "num_speculative_tokens": 129}, {}, {},
                    ["speculative_config['num_speculative_tokens'] must be in 1..128", "got 129"]),
    "unknown pool": ({"model": MB, "num_speculative_tokens": 8}, {"adaspec": {"pools": ["context", "ngram"]}}, {},
                     ["['pools']: unknown pool(s) 'ngram'; known: context, suffix, recycled, corpus"]),
    "early-exit key for multibranch": ({"model": MB, "num_speculative_tokens": 8}, {"adaspec": {"exit_layer": 6}},
                                       {}, ["unknown key(s) 'exit_layer' for MultiBranchProposer",
                                            "allowed keys: pools, corpus, medusa, policy, cost_model, tree, acceptance"]),
    "model policy for multibranch": ({"model": MB, "num_speculative_tokens": 8}, {"adaspec": {"policy": "adaedl"}},
                                     {}, ["'adaedl' reads a drafting model's distribution"]),
    "multibranch budget over K": ({"model": MB, "num_speculative_tokens": 4}, {"adaspec": {"tree": {"budget": 8}}},
                                  {}, ["['tree']['budget'] = 8 needs speculative_config['num_speculative_tokens'] >= 8"]),
    "foreign worker": ({"model": EE, "num_speculative_tokens": 3}, {}, {"worker_cls": "my.Worker"},
                       ["installs its own worker", "worker_cls='my.Worker'", "Remove --worker-cls"]),
    "unsupported model": ({"model": EE, "num_speculative_tokens": 3}, {}, {"gpt2": True},
                          ["['GPT2LMHeadModel'] is not supported by early-exit drafting", "LlamaForCausalLM"]),
    # README's refusals: a scheduler of the user's own, pipeline parallelism, medusa under tensor parallelism
    "foreign scheduler": ({"model": MB, "num_speculative_tokens": 8}, {}, {"scheduler_cls": "my.Scheduler"},
                          ["installs its own scheduler", "scheduler_cls='my.Scheduler'"]),
    "pipeline parallelism": ({"model": EE, "num_speculative_tokens": 3}, {}, {"pipeline_parallel_size": 2},
                             ["parallel_config['pipeline_parallel_size']: must be 1 with vllm_adaspec", "got 2"]),
    # (the tiny Llama: SmolLM2's 9 heads do not split over 2 ranks, which vLLM refuses first)
    "medusa under TP 2": ({"model": MB, "num_speculative_tokens": 8}, {"adaspec": {"pools": ["context", "medusa"]}},
                          {"tensor_parallel_size": 2, "distributed_executor_backend": "mp", "tiny_llama": True},
                          ["['pools']: 'medusa' needs tensor_parallel_size 1", "got 2"]),
}
HEAD_CASES = ["exit head wrong N", "exit head other model", "exit head other weights", "corpus for another tokenizer",
              "medusa for another model", "typical acceptance on chains", "cali without predictor"]


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory, smollm2):
    """A config-only GPT-2 folder: enough for vLLM to build its config, and an architecture we refuse."""
    d = tmp_path_factory.mktemp("gpt2")
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 4, "n_embd": 64, "n_head": 4,
           "n_positions": 512, "vocab_size": 49152, "torch_dtype": "float32"}
    (d / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{smollm2}/{f}", d / f)
    return str(d)


@pytest.fixture(scope="module")
def head_cases(tmp_path_factory, smollm2):
    """Checkpoints that do not fit: the shipped head with another N asked, or edited to claim another model."""
    from vllm_adaspec.heads import find_shipped, load_exit_head

    shipped = find_shipped(json.load(open(f"{smollm2}/config.json")))
    n = load_exit_head(shipped, tensors=False)[0]["exit_layer"]
    spec = {"model": EE, "num_speculative_tokens": 3}
    out = {"exit head wrong N": (spec, {"adaspec": {"exit_head": shipped, "exit_layer": n + 1}}, {},
                                 [f"['exit_layer'] = {n + 1}, but exit head", f"trained on the first {n} layers"])}
    for name, key, words in (("exit head other model", "config_hash", ["not for this model"]),
                             ("exit head other weights", "weights_fingerprint",
                              ["different weights", "adaspec train exit-layer"])):
        d = tmp_path_factory.mktemp(key)
        shutil.copy(f"{shipped}/exit_head.safetensors", d)
        meta = json.load(open(f"{shipped}/exit_head.json"))
        meta["base_model"][key] = "0123456789abcdef"
        (d / "exit_head.json").write_text(json.dumps(meta))
        out[name] = (spec, {"adaspec": {"exit_head": str(d)}}, {}, words)
    d = tmp_path_factory.mktemp("no_calibration")
    for f in ("exit_head.safetensors", "exit_head.json"):
        shutil.copy(f"{shipped}/{f}", d)
    # A corpus table built for another tokenizer (the shipped one, its fingerprint edited).
    from vllm_adaspec.pools.corpus import CorpusTable, find_corpus

    table = CorpusTable.load(find_corpus(smollm2))
    table.meta = {**table.meta, "tokenizer": "0123456789abcdef", "model": "other-model"}
    other = tmp_path_factory.mktemp("corpus_other") / "corpus.npz"
    table.save(str(other))
    out["corpus for another tokenizer"] = (
        {"model": MB, "num_speculative_tokens": 8}, {"adaspec": {"pools": ["context", "corpus"], "corpus": str(other)}},
        {}, [f"['corpus']: {other} was built for another tokenizer (other-model", "adaspec build corpus"])
    # Medusa heads trained for another model (the shipped ones, their config hash edited), and typical acceptance
    # where nothing is verified as a tree.
    from vllm_adaspec.heads.medusa import find_medusa

    medusa = find_medusa(json.load(open(f"{smollm2}/config.json")))
    foreign = tmp_path_factory.mktemp("medusa_other")
    shutil.copy(f"{medusa}/medusa.safetensors", foreign)
    meta = json.load(open(f"{medusa}/medusa.json"))
    meta["base_model"]["config_hash"] = "0123456789abcdef"
    (foreign / "medusa.json").write_text(json.dumps(meta))
    out["medusa for another model"] = (
        {"model": MB, "num_speculative_tokens": 8}, {"adaspec": {"pools": ["medusa"], "medusa": str(foreign)}}, {},
        ["['medusa']:", "(config hash 0123456789abcdef), not for this model", "adaspec train medusa"])
    out["typical acceptance on chains"] = (spec, {"adaspec": {"acceptance": "typical"}}, {},
                                           ["['acceptance']: 'typical' applies to token trees"])
    out["cali without predictor"] = (spec, {"adaspec": {"exit_head": str(d), "policy": "thompson-cali"}}, {},
                                     ["needs a calibration predictor in the exit head folder", "no calibration.json",
                                      "adaspec train calibration"])
    return out


@pytest.fixture(scope="module")
def startup_errors(smollm2, gpt2_folder, tiny_llama, head_cases, engines) -> dict:
    """case name -> what building its engine reported (one engine host, one engine per case)."""
    assert sorted(head_cases) == sorted(HEAD_CASES)
    out = {}
    for name, (spec, add, extra, words) in {**CASES, **head_cases}.items():
        extra = dict(extra)
        model = gpt2_folder if extra.pop("gpt2", False) else tiny_llama if extra.pop("tiny_llama", False) else smollm2
        out[name] = (engines.run({"model": model, "expect_error": True, "batches": [],
                                  "engine": {"dtype": "float32", "kv_cache_memory_bytes": 2**28,
                                             "speculative_config": spec, "additional_config": add, **extra}}),
                     words)
    return out


@pytest.mark.parametrize("name", list(CASES) + HEAD_CASES)
def test_bad_input_fails_at_startup_with_a_message_naming_it(name, startup_errors):
    got, words = startup_errors[name]
    assert "error" in got, f"{name}: the engine started"
    for w in words:
        assert w in got["error"], f"{name}: {w!r} not in {got['error']!r}"
