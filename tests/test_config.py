"""The `adaspec` settings: parsing and validation, without vLLM."""

import re

import pytest

from vllm_adaspec.config import AdaspecConfig, AdaspecConfigError, parse_adaspec_config, resolve_config

LLAMA = {"architectures": ["LlamaForCausalLM"], "num_layers": 30, "num_speculative_tokens": 5}


def test_defaults_resolve_against_the_model():
    cfg = parse_adaspec_config({})
    assert cfg == AdaspecConfig()
    r = resolve_config(cfg, **LLAMA)
    assert (r.exit_layer, r.num_layers, r.num_speculative_tokens, r.policy) == (7, 30, 5, "fixed")


def test_policy_object_carries_parameters():
    cfg = parse_adaspec_config({"adaspec": {"policy": {"name": "adaedl", "gamma": 0.3, "lambda0": 0.4}}})
    r = resolve_config(cfg, **LLAMA)
    assert (r.policy, r.policy_params) == ("adaedl", {"gamma": 0.3, "lambda0": 0.4})


def test_explicit_values_are_kept():
    r = resolve_config(parse_adaspec_config({"adaspec": {"exit_layer": 6, "policy": "fixed"}, "other": 1}), **LLAMA)
    assert r.exit_layer == 6


@pytest.mark.parametrize(
    "section, words",
    [
        ({"exit_layers": 6}, ["unknown key", "'exit_layers'", "allowed keys: exit_layer, policy, exit_head, cost_model"]),
        ({"exit_layer": "six"}, ["['exit_layer']", "must be an integer", "str 'six'"]),
        ({"exit_layer": True}, ["['exit_layer']", "must be an integer", "bool"]),
        ({"exit_layer": 6.0}, ["['exit_layer']", "must be an integer", "float"]),
        ({"exit_layer": 0}, ["['exit_layer']", ">= 1", "got 0"]),
        ({"policy": "greedy"}, ["['policy']", "must be one of fixed, thompson-beta, thompson-cali, adaedl, max-confidence",
                                "'greedy'"]),
        ({"policy": {"gamma": 0.2}}, ["['policy']", "needs a 'name'"]),
        ({"policy": {"name": "adaedl", "gama": 0.2}}, ["['policy']", "no parameter(s) 'gama'", "takes: gamma,"]),
        ({"policy": {"name": "adaedl", "beta2": 1.0}}, ["['policy']['beta2']", "must be a finite number in [0, 1)", "got 1.0"]),
        ({"policy": {"name": "thompson-beta", "alpha0": "1"}}, ["['policy']['alpha0']", "must be a finite number in [1e-6, 1e6]", "str '1'"]),
        ({"policy": {"name": "fixed", "k": 3}}, ["['policy']", "takes: none"]),
        ({"speed_guard": "yes"}, ["['speed_guard']", "must be true or false", "str 'yes'", "older name of 'cost_model'"]),
        ({"cost_model": "fast"}, ["['cost_model']", "must be one of 'online', 'prior', 'off'", "'fast'"]),
        ({"cost_model": True}, ["['cost_model']", "must be one of", "True"]),
        ({"cost_model": "off", "speed_guard": False}, ["['cost_model']", "not both"]),
        ({"exit_head": ""}, ["['exit_head']", "'auto', 'none' or a checkpoint folder"]),
    ],
)
def test_bad_settings_name_the_key_and_what_is_allowed(section, words):
    with pytest.raises(AdaspecConfigError) as e:
        parse_adaspec_config({"adaspec": section})
    for w in words:
        assert w in str(e.value), (w, str(e.value))


@pytest.mark.parametrize("section, proposer, expected", [
    ({}, "early_exit", "online"), ({}, "multi_branch", "online"), ({"cost_model": "prior"}, "multi_branch", "prior"),
    ({"cost_model": "off"}, "early_exit", "off"),
    # the older name keeps its meaning: on = the cost model, off = drafts sized as before (MultiBranchProposer's
    # shipped curve; early exit: the policy's length)
    ({"speed_guard": True}, "early_exit", "online"), ({"speed_guard": False}, "early_exit", "off"),
    ({"speed_guard": False}, "multi_branch", "prior"),
])
def test_cost_model_setting(section, proposer, expected):
    assert parse_adaspec_config({"adaspec": section}, proposer=proposer).cost_model == expected


def test_section_must_be_a_mapping():
    with pytest.raises(AdaspecConfigError, match=r"additional_config\['adaspec'\] must be a JSON object"):
        parse_adaspec_config({"adaspec": [6]})


def test_exit_layer_must_leave_layers_for_verification():
    with pytest.raises(AdaspecConfigError, match=r"1 <= exit_layer < 30 \(the model has 30 layers\), got 30"):
        resolve_config(parse_adaspec_config({"adaspec": {"exit_layer": 30}}), **LLAMA)


@pytest.mark.parametrize("k", [0, -2])
def test_k_must_be_positive(k):
    with pytest.raises(AdaspecConfigError, match=rf"num_speculative_tokens'\] must be >= 1, got {k}"):
        resolve_config(AdaspecConfig(), **{**LLAMA, "num_speculative_tokens": k})


def test_k_is_required():
    with pytest.raises(AdaspecConfigError, match="num_speculative_tokens'] is required"):
        resolve_config(AdaspecConfig(), **{**LLAMA, "num_speculative_tokens": None})


def test_unsupported_architecture_is_named():
    with pytest.raises(AdaspecConfigError, match=r"\['GPT2LMHeadModel'\] is not supported.*LlamaForCausalLM"):
        resolve_config(AdaspecConfig(), **{**LLAMA, "architectures": ["GPT2LMHeadModel"]})


def test_tree_settings_parse_and_default_depth():
    cfg = parse_adaspec_config({"adaspec": {"tree": {"budget": 7, "top_k": 3}}})
    assert (cfg.tree.budget, cfg.tree.top_k, cfg.tree.max_depth) == (7, 3, 3)
    assert parse_adaspec_config({"adaspec": {"tree": {"budget": 8, "depth": 6}}}).tree.max_depth == 6
    assert parse_adaspec_config({}).tree is None
    r = resolve_config(cfg, **{**LLAMA, "num_speculative_tokens": 7})
    assert r.tree == cfg.tree


@pytest.mark.parametrize("tree, words", [
    (4, ["tree", "object"]),
    ({"top_k": 2}, ["tree", "budget"]),
    ({"budget": 0}, ["budget", "1..128"]),
    ({"budget": 4, "top_k": 0}, ["top_k", "1..16"]),
    ({"budget": 4, "depth": 5}, ["depth", "1..budget"]),
    ({"budget": 4, "width": 2}, ["unknown", "width"]),
    ({"budget": True}, ["['tree']['budget']", "integer", "bool True"]),
    ({"budget": 4, "builder": "eagle"}, ["builder", "'joint'", "'c2t'", "eagle"]),
    ({"budget": 4, "beta": 0.5}, ["'beta'", "c2t"]),
    ({"budget": 4, "builder": "joint", "second_top_k": 2}, ["'second_top_k'", "c2t"]),
    ({"budget": 4, "builder": "c2t", "beta": 1.0}, ["beta", "[0, 1)"]),
    ({"budget": 4, "builder": "c2t", "beta": "high"}, ["beta", "'high'"]),
    ({"budget": 4, "builder": "c2t", "second_top_k": 5}, ["second_top_k", "1..budget"]),
    ({"budget": 4, "depth": 2, "max_depth": 3}, ["max_depth", "depth", "not both"]),
])
def test_bad_tree_settings_are_named(tree, words):
    with pytest.raises(AdaspecConfigError) as e:
        parse_adaspec_config({"adaspec": {"tree": tree}})
    assert all(w in str(e.value) for w in words), str(e.value)


def test_c2t_builder_settings_and_its_classifier_checked_at_start_up(tmp_path):
    cfg = parse_adaspec_config({"adaspec": {"tree": {"budget": 12, "builder": "c2t", "beta": 0.3, "top_k": 3,
                                                     "second_top_k": 4}}})
    t = cfg.tree
    assert (t.builder, t.beta, t.top_k, t.second_top_k, t.max_depth) == ("c2t", 0.3, 3, 4, 6)  # min(B, 6)
    assert parse_adaspec_config({"adaspec": {"tree": {"budget": 8, "builder": "c2t", "max_depth": 5}}}).tree.max_depth == 5
    assert parse_adaspec_config({"adaspec": {"tree": {"budget": 8}}}).tree.builder == "joint"
    # Start-up: the untrained exit has no classifier; a head folder without c2t.json names the trainer.
    cfg = parse_adaspec_config({"adaspec": {"exit_head": "none", "tree": {"budget": 4, "builder": "c2t"}}})
    with pytest.raises(AdaspecConfigError, match=r"\['tree'\]\['builder'\]: 'c2t' needs .*untrained exit"):
        resolve_config(cfg, **LLAMA, hf_config=object())


def test_tree_budget_needs_that_many_speculative_tokens():
    cfg = parse_adaspec_config({"adaspec": {"tree": {"budget": 16}}})
    with pytest.raises(AdaspecConfigError, match=r"budget.*= 16.*num_speculative_tokens.*>= 16.*got 5"):
        resolve_config(cfg, **LLAMA)


def test_each_proposer_takes_the_common_keys_and_its_own():
    mb = parse_adaspec_config({"adaspec": {"pools": ["context", "recycled"], "tree": {"budget": 6}}},
                              proposer="multi_branch")
    assert mb.pools == ("context", "recycled") and mb.tree.budget == 6
    r = resolve_config(mb, **{**LLAMA, "num_speculative_tokens": 8, "architectures": ["GPT2LMHeadModel"]},
                       proposer="multi_branch")  # model-free: any architecture
    assert r.tree.budget == 6 and r.pools == ("context", "recycled")
    assert resolve_config(parse_adaspec_config({}, proposer="multi_branch"), **{**LLAMA, "num_speculative_tokens": 4},
                          proposer="multi_branch").tree.budget == 4  # default budget capped at K
    with pytest.raises(AdaspecConfigError, match=r"'exit_layer'.* for MultiBranchProposer \('exit_layer' belong"):
        parse_adaspec_config({"adaspec": {"exit_layer": 6}}, proposer="multi_branch")
    with pytest.raises(AdaspecConfigError, match=r"'pools'.* for EarlyExitProposer"):
        parse_adaspec_config({"adaspec": {"pools": ["context"]}})
    with pytest.raises(AdaspecConfigError, match=r"'top_k'.* for MultiBranchProposer; allowed: budget"):
        parse_adaspec_config({"adaspec": {"tree": {"budget": 4, "top_k": 2}}}, proposer="multi_branch")
    with pytest.raises(AdaspecConfigError, match=r"unknown pool\(s\) 'ngram'; known: context, suffix"):
        parse_adaspec_config({"adaspec": {"pools": ["ngram"]}}, proposer="multi_branch")
    with pytest.raises(AdaspecConfigError, match="non-empty list"):
        parse_adaspec_config({"adaspec": {"pools": "context"}}, proposer="multi_branch")
    with pytest.raises(AdaspecConfigError, match=r"\['corpus'\]: names a file but 'corpus' is not in pools"):
        parse_adaspec_config({"adaspec": {"pools": ["context"], "corpus": "/t/corpus.npz"}}, proposer="multi_branch")
    with pytest.raises(AdaspecConfigError, match=r"\['corpus'\]: must be 'auto' or the path"):
        parse_adaspec_config({"adaspec": {"pools": ["corpus"], "corpus": 3}}, proposer="multi_branch")
    assert parse_adaspec_config({"adaspec": {"pools": ["corpus"], "corpus": "/t"}}, proposer="multi_branch").corpus == "/t"
    with pytest.raises(AdaspecConfigError, match=r"\['medusa'\]: names a file but 'medusa' is not in pools"):
        parse_adaspec_config({"adaspec": {"pools": ["suffix"], "medusa": "/heads"}}, proposer="multi_branch")
    with pytest.raises(AdaspecConfigError, match=r"\['medusa'\]: must be 'auto' or the path of a Medusa heads folder"):
        parse_adaspec_config({"adaspec": {"pools": ["medusa"], "medusa": None}}, proposer="multi_branch")
    with pytest.raises(AdaspecConfigError, match=r"'adaedl' reads a drafting model's distribution"):
        resolve_config(parse_adaspec_config({"adaspec": {"policy": "adaedl"}}, proposer="multi_branch"),
                       **LLAMA, proposer="multi_branch")
    with pytest.raises(AdaspecConfigError, match=r"\['budget'\] = 8 needs .*>= 8"):
        resolve_config(parse_adaspec_config({"adaspec": {"tree": {"budget": 8}}}, proposer="multi_branch"),
                       **{**LLAMA, "num_speculative_tokens": 4}, proposer="multi_branch")


def test_suffix_pool_without_arctic_inference_names_the_package(monkeypatch):
    import vllm_adaspec.pools.suffix as suffix

    monkeypatch.setattr(suffix, "suffix_available", lambda: False)
    with pytest.raises(AdaspecConfigError, match=r"\['pools'\]: 'suffix' needs the package arctic-inference==0.1.1"):
        resolve_config(parse_adaspec_config({}, proposer="multi_branch"), **LLAMA, proposer="multi_branch")
    r = resolve_config(parse_adaspec_config({"adaspec": {"pools": ["context"]}}, proposer="multi_branch"), **LLAMA,
                       proposer="multi_branch")
    assert r.pools == ("context",)


def test_acceptance_is_exact_unless_typical_is_asked_for_with_valid_thresholds():
    from vllm_adaspec.config import Acceptance

    assert parse_adaspec_config({}).acceptance == Acceptance("exact")
    got = parse_adaspec_config({"adaspec": {"acceptance": {"name": "typical", "epsilon": 0.2}, "tree": {"budget": 4}}})
    assert got.acceptance == Acceptance("typical", 0.2, 0.3)
    assert parse_adaspec_config({"adaspec": {"acceptance": "typical"}}, proposer="multi_branch").acceptance.name == "typical"
    for bad, words in (("lossy", ": must be 'exact', 'typical'"),
                       ({"name": "typical", "epsilon": 0}, "['epsilon']: must be a finite number in (0, 1], got 0"),
                       ({"name": "typical", "delta": True}, "['delta']: must be a finite number in (0, 1], got bool"),
                       ({"name": "typical", "eps": 0.1}, ": unknown key(s) 'eps'")):
        with pytest.raises(AdaspecConfigError, match=r"\['acceptance'\]" + re.escape(words)):
            parse_adaspec_config({"adaspec": {"acceptance": bad}}, proposer="multi_branch")
    with pytest.raises(AdaspecConfigError, match=r"\['acceptance'\]: 'typical' applies to token trees"):
        resolve_config(parse_adaspec_config({"adaspec": {"acceptance": "typical"}}), **LLAMA)


def test_draft_branches_are_checked_against_the_draft_slots_at_start_up():
    def mb(section, k=20):
        return resolve_config(parse_adaspec_config({"adaspec": section}, proposer="multi_branch"),
                              **{**LLAMA, "num_speculative_tokens": k}, proposer="multi_branch")

    r = mb({"branches": 2, "branch_length": 3, "tree": {"budget": 8}}, k=14)
    assert (r.branches, r.branch_length, r.branch_init) == (2, 3, "prompt") and r.pools[-1] == "branches"
    assert mb({"branches": 2, "branch_length": 4}, k=20).tree.budget == 12  # default budget: what K leaves
    assert mb({}).branches == 0 and "branches" not in mb({}).pools
    with pytest.raises(AdaspecConfigError, match=r"2 \* 3 \+ 8 = 14 rows per request, more than the .*"
                                                 r"num_speculative_tokens'\] = 12 .*raise num_speculative_tokens to 14"):
        mb({"branches": 2, "branch_length": 3, "tree": {"budget": 8}}, k=12)
    with pytest.raises(AdaspecConfigError, match=r"num_speculative_tokens'\] must be in 1..128 .*got 161"):
        mb({"branches": 10, "branch_length": 16}, k=161)
    for section, words in [({"branches": -1}, r"\['branches'\]: must be in 0..32"),
                           ({"branches": 2, "branch_length": 0}, r"\['branch_length'\]: must be in 1..16"),
                           ({"branches": "2"}, r"\['branches'\]: must be an integer"),
                           ({"branches": 2, "branch_init": "zeros"}, r"\['branch_init'\]: must be one of 'prompt', 'random'"),
                           ({"branch_length": 3}, r"\['branches'\]: is 0 \(off\), so 'branch_length'"),
                           ({"pools": ["context", "branches"]}, r"\['pools'\]: lists 'branches'.*set 'branches'")]:
        with pytest.raises(AdaspecConfigError, match=words):
            parse_adaspec_config({"adaspec": section}, proposer="multi_branch")
    with pytest.raises(AdaspecConfigError, match=r"'branches'.* for EarlyExitProposer"):
        parse_adaspec_config({"adaspec": {"branches": 2}})


# --- every number finite and in range; start-up checks (engine/startup.py) on a fake engine config ---------------

import json  # noqa: E402
import os  # noqa: E402
import pickle  # noqa: E402
from types import SimpleNamespace  # noqa: E402

INF, NAN = float("inf"), float("nan")


def refused(section, proposer="early_exit", **resolve):
    """The one-line message a bad section gets from parse (and resolve, with `resolve` arguments)."""
    with pytest.raises(AdaspecConfigError) as e:
        cfg = parse_adaspec_config({"adaspec": section}, proposer=proposer)
        if resolve:
            resolve_config(cfg, **{**LLAMA, **resolve}, proposer=proposer)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("section, proposer, key, allowed", [
    # vLLM's JSON parser takes Infinity and NaN: betavariate(inf, .) hung the worker; an infinite gamma or sigma_m
    # never drafted
    ({"policy": {"name": "thompson-beta", "alpha0": INF}}, "early_exit", "['policy']['alpha0']", "[1e-6, 1e6], got inf"),
    ({"policy": {"name": "thompson-beta", "beta0": NAN}}, "multi_branch", "['policy']['beta0']", "got nan"),
    ({"policy": {"name": "thompson-beta", "alpha0": 0}}, "early_exit", "['policy']['alpha0']", "[1e-6, 1e6], got 0"),
    ({"policy": {"name": "adaedl", "gamma": INF}}, "early_exit", "['policy']['gamma']", "[1e-6, 100], got inf"),
    ({"policy": {"name": "thompson-cali", "sigma_m": INF}}, "early_exit", "['policy']['sigma_m']", "[1e-6, 1000]"),
    ({"policy": {"name": "thompson-cali", "theta0": -INF}}, "early_exit", "['policy']['theta0']", "[0, 1], got -inf"),
    ({"policy": {"name": "max-confidence", "lambda0": True}}, "early_exit", "['policy']['lambda0']", "got bool True"),
    ({"policy": {"name": "adaedl", "alpha": 0}}, "early_exit", "['policy']['alpha']", "(0, 1], got 0"),
    ({"policy": {"name": "adaedl", "eps": [0.1]}}, "early_exit", "['policy']['eps']", "got list [0.1]"),
    ({"tree": {"budget": INF}}, "early_exit", "['tree']['budget']", "must be an integer, got float inf"),
    ({"tree": {"budget": 4.0}}, "multi_branch", "['tree']['budget']", "must be an integer, got float 4.0"),
    ({"tree": {"budget": 10**30}}, "early_exit", "['tree']['budget']", "1..128"),
    ({"tree": {"budget": 4, "top_k": -1}}, "early_exit", "['tree']['top_k']", "1..16"),
    ({"tree": {"budget": 4, "builder": "c2t", "beta": NAN}}, "early_exit", "['tree']['beta']", "[0, 1), got nan"),
    ({"tree": {"budget": 4, "builder": "c2t", "beta": -0.5}}, "early_exit", "['tree']['beta']", "[0, 1)"),
    ({"tree": {"budget": 4, "kv_copy_tokens": 2**40}}, "multi_branch", "['tree']['kv_copy_tokens']",
     "1..2147483647"),
    ({"tree": {"budget": 4, "kv_copy_tokens": 0}}, "early_exit", "['tree']['kv_copy_tokens']", "1..2147483647"),
    pytest.param({"tree": {"budget": 4, "max_depth": 10**5000}}, "early_exit", "['tree']['max_depth']",
                 "integer of 16610 bits", id="huge-max_depth"),  # no repr in Python 3.11
    ({"acceptance": {"name": "typical", "epsilon": INF}}, "multi_branch", "['acceptance']['epsilon']", "(0, 1]"),
    ({"acceptance": {"name": "typical", "delta": NAN}}, "early_exit", "['acceptance']['delta']", "got nan"),
    ({"branches": True}, "multi_branch", "['branches']", "must be an integer, got bool True"),
    ({"branches": 2, "branch_length": 10**9}, "multi_branch", "['branch_length']", "1..16"),
    ({"branches": 33}, "multi_branch", "['branches']", "0..32"),
    ({"exit_layer": INF}, "early_exit", "['exit_layer']", "must be an integer, got float inf"),
    pytest.param({"exit_layer": -10**5000}, "early_exit", "['exit_layer']", ">= 1", id="huge-exit_layer"),
    ({"cost_model": {"online": 1}}, "early_exit", "['cost_model']", "'online', 'prior', 'off'"),
    ({"pools": [["context"]]}, "multi_branch", "['pools']", "unknown pool(s) ['context']"),
    ({"pools": ["context"], "corpus": {"path": 1}}, "multi_branch", "['corpus']", "'auto' or the path"),
    ({"tree": {"budget": 4, 7: 1}}, "early_exit", "['tree']", "unknown key(s) 7"),
    ({1: 2, "x": 3}, "early_exit", "additional_config['adaspec']:", "unknown key(s) 'x', 1"),
])
def test_every_number_is_finite_and_in_a_stated_range(section, proposer, key, allowed):
    msg = refused(section, proposer)
    assert msg.startswith(f"additional_config['adaspec']{key}" if key.startswith("[") else key), msg
    assert allowed in msg, msg


def test_numbers_in_range_are_accepted_as_floats():
    cfg = parse_adaspec_config({"adaspec": {"policy": {"name": "thompson-beta", "alpha0": 1, "beta0": 1e6},
                                            "tree": {"budget": 128, "kv_copy_tokens": 2**31 - 1}}})
    assert cfg.policy_params == {"alpha0": 1.0, "beta0": 1e6} and cfg.tree.kv_copy_tokens == 2**31 - 1
    assert parse_adaspec_config({"adaspec": {"tree": {"budget": 4, "builder": "c2t", "beta": -0.0}}}).tree.beta == 0


@pytest.mark.parametrize("k, words", [
    (10**9, "must be in 1..128 (vLLM verifies at most 128 drafts per request and step), got 1000000000"),
    (129, "must be in 1..128"), (True, "must be an integer, got bool True"), (4.0, "must be an integer, got float"),
    (INF, "got float inf"), pytest.param(10**5000, "must be in 1..128", id="huge"),
])
def test_num_speculative_tokens_is_capped_at_what_vllm_verifies(k, words):
    for proposer in ("early_exit", "multi_branch", "probe"):
        msg = refused({}, proposer, num_speculative_tokens=k)
        assert msg.startswith("speculative_config['num_speculative_tokens'] ") and words in msg, msg


# A fake VllmConfig: the attributes engine/startup.py reads, nothing else (no vLLM, no model).
OTHER_MODEL = SimpleNamespace(architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=30,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                              vocab_size=1000, rms_norm_eps=1e-5, rope_theta=1e4, tie_word_embeddings=True)


# The fields that make OTHER_MODEL the SmolLM2 heads ship for (its config hash).
SMOL_SHAPE = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                  vocab_size=49152, rms_norm_eps=9.999999747378752e-06, rope_theta=100000.0)


def engine(section=None, proposer="vllm_adaspec.EarlyExitProposer", k=4, *, spec=True, tp=1, pp=1, batched=2048,
           hf=OTHER_MODEL, extra=None, dcp=1, cascade=False):
    return SimpleNamespace(
        additional_config={**({"adaspec": section} if section is not None else {}), **(extra or {})},
        speculative_config=(SimpleNamespace(method="custom_class", model=proposer, num_speculative_tokens=k)
                            if spec is True else spec),
        model_config=SimpleNamespace(hf_text_config=hf, architectures=hf.architectures, tokenizer=None,
                                     is_submodel_config=False, runner_type="generate",
                                     disable_cascade_attn=not cascade),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp, tensor_parallel_size=tp,
                                        decode_context_parallel_size=dcp, prefill_context_parallel_size=1),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=batched),
        cache_config=SimpleNamespace(cache_dtype="auto"))


MB = "vllm_adaspec.MultiBranchProposer"


def platform(name: str):
    return SimpleNamespace(is_cpu=lambda: name == "cpu", is_cuda=lambda: name == "cuda", device_name=name)


@pytest.fixture
def startup(monkeypatch):
    """engine/startup.py on a CPU platform, with the suffix pool available (no vLLM, no arctic-inference needed)."""
    import vllm_adaspec.pools.suffix as suffix
    from vllm_adaspec.engine import startup as module

    import vllm_adaspec.pools.corpus as corpus

    def find_corpus(tokenizer, setting="auto"):  # no tokenizer to fingerprint here: the fake model has no table
        if setting == "auto":
            raise AdaspecConfigError("additional_config['adaspec']['pools']: 'corpus' has no table for this tokenizer")
        return setting

    monkeypatch.setattr(module, "_platform", lambda: platform("cpu"))
    monkeypatch.setattr(suffix, "suffix_available", lambda: True)
    monkeypatch.setattr(corpus, "find_corpus", find_corpus)
    return module


def start(startup, vc):
    return startup.check_engine(vc, startup.proposer_kind(vc))


def start_refused(startup, vc) -> str:
    with pytest.raises(AdaspecConfigError) as e:
        start(startup, vc)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def test_the_engine_checks_pass_and_their_result_travels_with_the_config(startup):
    vc = engine({"exit_head": "none", "policy": {"name": "adaedl", "gamma": 0.3}})
    got = start(startup, vc)
    assert (got.exit_layer, got.policy_params, got.exit_head) == (7, {"gamma": 0.3}, None)
    assert startup.settings_for(vc, "early_exit") is got  # the worker gets the front end's result
    copy = pickle.loads(pickle.dumps(vc))  # how the config reaches the engine-core and worker processes
    startup_check = startup._check_all
    startup._check_all = lambda *a: pytest.fail("checked again in the worker")
    try:
        assert startup.settings_for(copy, "early_exit") == got
    finally:
        startup._check_all = startup_check
    from vllm_adaspec.config import carried_settings

    assert carried_settings(copy, "early_exit") == got  # the same without the engine glue (drafters are pure)
    assert carried_settings(copy, "multi_branch") is None  # kept for another proposer: not these settings
    assert got.checked and got.tree_unsupported is None  # the engine's answers ride along
    vc.additional_config["adaspec"]["exit_layer"] = 5  # a changed config is checked again, not served stale
    assert carried_settings(vc, "early_exit") is None
    assert startup.settings_for(vc, "early_exit").exit_layer == 5


from pydantic import ConfigDict, Field  # noqa: E402
from pydantic.dataclasses import dataclass as pydantic_dataclass  # noqa: E402


@pydantic_dataclass(config=ConfigDict(extra="forbid", arbitrary_types_allowed=True))
class PydanticConfig:  # vLLM's @config decorator on VllmConfig, reduced to one field
    additional_config: dict = Field(default_factory=dict)


def test_the_result_survives_pickling_a_pydantic_config_like_vllms():
    # VllmConfig is a pydantic dataclass (extra="forbid"); an attribute set after __init__ is kept by pickle and
    # deepcopy (how vLLM hands the config to its processes) and left out of its fields, hash and repr.
    import copy
    import dataclasses

    from vllm_adaspec.config import KEPT

    c = PydanticConfig({"adaspec": {"policy": "fixed"}})
    object.__setattr__(c, KEPT, ("fp", resolve_config(parse_adaspec_config(c.additional_config), **LLAMA)))
    for twin in (pickle.loads(pickle.dumps(c)), copy.deepcopy(c)):
        assert getattr(twin, KEPT) == getattr(c, KEPT)
    assert [f.name for f in dataclasses.fields(c)] == ["additional_config"]
    json.dumps(c.additional_config)  # what VllmConfig.compute_hash does with it: untouched


def test_an_adaspec_section_without_an_adaspec_proposer_is_refused(startup):
    msg = start_refused(startup, engine({"policy": "fixed"}, spec=None))
    assert msg.startswith("additional_config['adaspec'] is set, but there is no speculative_config"), msg
    assert "'vllm_adaspec.MultiBranchProposer'" in msg and "'vllm_adaspec.EarlyExitProposer'" in msg
    ngram = SimpleNamespace(method="ngram", model=None, num_speculative_tokens=3)
    assert "speculative_config has method 'ngram'" in start_refused(startup, engine({}, spec=ngram))
    assert start(startup, engine(None, spec=None)) is None  # plain runs: nothing to check
    assert start(startup, engine(None, spec=ngram, extra={"other_plugin": 1})) is None
    # configs vLLM derives from a checked one (a submodel view, a draft model's runner) are not checked again
    view = engine({"policy": "fixed"}, spec=None)
    view.model_config.is_submodel_config = True
    assert start(startup, view) is None
    draft = engine({"policy": "fixed"}, spec=None)
    draft.model_config.runner_type = "draft"
    assert start(startup, draft) is None


def test_engine_limits_are_start_up_errors(startup):
    assert start_refused(startup, engine({"exit_head": "none"}, pp=2)).startswith(
        "parallel_config['pipeline_parallel_size']: must be 1")
    msg = start_refused(startup, engine({"exit_head": "none"}, k=20, batched=16))
    assert msg.startswith("speculative_config['num_speculative_tokens'] must be in 1..15 here") and "16" in msg, msg
    assert start(startup, engine({"exit_head": "none"}, k=15, batched=16)).num_speculative_tokens == 15
    msg = start_refused(startup, engine({"pools": ["context", "medusa"]}, MB, k=8, tp=2))
    assert msg.startswith("additional_config['adaspec']['pools']: 'medusa' needs tensor_parallel_size 1"), msg
    # the default set leaves medusa out under tensor parallelism (and here: no heads, no corpus for this model)
    got = start(startup, engine({"pools": ["context", "suffix"]}, MB, k=8, tp=2))
    assert got.pools == ("context", "suffix") and got.checked


def test_tree_verification_limits_are_start_up_errors(startup, monkeypatch):
    monkeypatch.setattr(startup, "_platform", lambda: platform("xpu"))
    msg = start_refused(startup, engine({"exit_head": "none", "tree": {"budget": 4}}))
    assert msg.startswith("additional_config['adaspec']['tree']: tree verification runs on vLLM's CPU and CUDA"), msg
    msg = start_refused(startup, engine({"pools": ["context"], "branches": 1, "tree": {"budget": 4}}, MB, k=8))
    assert msg.startswith("additional_config['adaspec']['branches']: draft branches ride"), msg
    msg = start_refused(startup, engine({"pools": ["context"], "acceptance": "typical"}, MB, k=8))
    assert msg.startswith("additional_config['adaspec']['acceptance']: 'typical' needs tree verification"), msg
    chains = start(startup, engine({"pools": ["context"]}, MB, k=8))
    assert chains.pools == ("context",) and chains.tree_unsupported.startswith("tree verification runs on")
    # CUDA: trees are not refused at start-up (the worker asks vLLM's selector for the backend: below), except
    # where the KV of a request is split over context-parallel ranks or cascade attention is on
    monkeypatch.setattr(startup, "_platform", lambda: platform("cuda"))
    assert start(startup, engine({"exit_head": "none", "tree": {"budget": 4}})).tree_unsupported is None
    assert start(startup, engine({"pools": ["context"]}, MB, k=8)).tree_unsupported is None
    msg = start_refused(startup, engine({"exit_head": "none", "tree": {"budget": 4}}, dcp=2))
    assert "context-parallel" in msg, msg
    assert "cascade" in start(startup, engine({"pools": ["context"]}, MB, k=8, cascade=True)).tree_unsupported


@pytest.mark.parametrize("setting, value, words", [
    ("use_v2_model_runner", True, "VLLM_USE_V2_MODEL_RUNNER=1: vllm_adaspec hooks into vLLM's V1 model runner"),
    ("async_scheduling", True, "scheduler_config['async_scheduling']: must be off"),
    ("enable_dbo", True, "parallel_config['enable_dbo']: micro-batching"),
    ("ubatch_size", 2, "parallel_config['ubatch_size']: micro-batching"),
    ("cudagraph_mode", "FULL", "compilation_config['cudagraph_mode']: FULL replays"),
    ("cudagraph_mode", "FULL_DECODE_ONLY", "compilation_config['cudagraph_mode']: FULL_DECODE_ONLY replays"),
])
def test_settings_under_which_tree_rows_would_be_skipped_are_start_up_errors(startup, setting, value, words):
    """Each would let a step skip the runner hooks or the tree rows' attention (the requests would commit tokens no
    tree mask computed): refused at start-up naming the setting, whatever vLLM itself turns off today."""
    from vllm.config import CUDAGraphMode

    vc = engine({"pools": ["context"]}, MB, k=8)
    where = {"use_v2_model_runner": vc, "async_scheduling": vc.scheduler_config, "enable_dbo": vc.parallel_config,
             "ubatch_size": vc.parallel_config}
    if setting == "cudagraph_mode":
        vc.compilation_config = SimpleNamespace(cudagraph_mode=CUDAGraphMode[value])
    else:
        setattr(where[setting], setting, value)
    assert start_refused(startup, vc).startswith(words)


def test_vllm_versions_the_plugin_starts_on(startup, monkeypatch, caplog):
    """0.32 (tested) starts silently; 0.33 (compared statically) with one warning line; anything else fails
    start-up naming the version and the tested one."""
    import logging

    vc = lambda: engine({"pools": ["context"]}, MB, k=8)  # noqa: E731
    for version in ("0.32.0", "0.32.1+cpu"):
        monkeypatch.setattr(startup, "_vllm_version", lambda v=version: v)
        assert start(startup, vc()).checked
    monkeypatch.setattr(startup, "_vllm_version", lambda: "0.33.0")
    startup._warned_versions.discard("0.33")
    with caplog.at_level(logging.WARNING, logger="vllm_adaspec"):
        start(startup, vc())
        start(startup, vc())
    said = [r.getMessage() for r in caplog.records if "vLLM 0.33.0 is not tested" in r.getMessage()]
    assert len(said) == 1 and "compared statically with 0.32" in said[0], said
    for version in ("0.31.2", "0.34.0", "1.0.0"):
        monkeypatch.setattr(startup, "_vllm_version", lambda v=version: v)
        msg = start_refused(startup, vc())
        assert f"this is vLLM {version}" in msg and "0.32 (tested)" in msg, msg


def test_the_graph_modes_tree_engines_start_with():
    """vLLM's default FULL_AND_PIECEWISE starts (vLLM lowers its decode graphs to PIECEWISE for the tree backends,
    test_gpu_trees.py resolves it); once resolved, any FULL graph is refused (the worker checks after vLLM's
    resolution); chains never care."""
    from vllm.config import CUDAGraphMode

    from vllm_adaspec.engine.startup import graph_mode_problem

    for mode in CUDAGraphMode:
        before = graph_mode_problem(mode, trees=True, resolved=False)
        after = graph_mode_problem(mode, trees=True)
        assert (before is not None) == (mode.name in ("FULL", "FULL_DECODE_ONLY")), mode
        assert (after is not None) == mode.has_full_cudagraphs(), mode
        assert graph_mode_problem(mode, trees=False) is None


def test_a_gpu_worker_turns_trees_off_where_vllms_backend_has_no_tree_path(startup, monkeypatch):
    """The GPU worker registers the tree backends, then asks vLLM's selector (engine/tree_backend.gpu_tree_support);
    a backend without a tree path gets the start-up rules: MultiBranchProposer drafts chains, settings that need
    trees are refused naming the key, and the drafter built next reads `tree_unsupported`."""
    from vllm_adaspec.config import carried_settings
    from vllm_adaspec.engine import tree_backend

    monkeypatch.setattr(startup, "_platform", lambda: platform("cuda"))
    registered = []
    monkeypatch.setattr(tree_backend, "register_gpu", lambda: registered.append(1))
    answer = {"reason": None}
    monkeypatch.setattr(tree_backend, "gpu_tree_support", lambda vc: answer["reason"])
    mb = engine({"pools": ["context"]}, MB, k=8)
    start(startup, mb)
    startup.settle_gpu_trees(mb)  # FlashAttention or Triton: trees stay on
    assert registered and carried_settings(mb, "multi_branch").tree_unsupported is None
    answer["reason"] = "vLLM chose the FLASHINFER attention backend for this model, which has no tree path"
    startup.settle_gpu_trees(mb)
    assert carried_settings(mb, "multi_branch").tree_unsupported == answer["reason"]
    ee = engine({"exit_head": "none", "tree": {"budget": 4}})
    start(startup, ee)
    with pytest.raises(AdaspecConfigError, match=r"\['tree'\]: vLLM chose the FLASHINFER"):
        startup.settle_gpu_trees(ee)
    chains = engine({"exit_head": "none"})  # early-exit chains never ask
    start(startup, chains)
    registered.clear()
    startup.settle_gpu_trees(chains)
    assert not registered
    monkeypatch.setattr(startup, "_platform", lambda: platform("cpu"))  # CPU: its own backend, nothing to ask
    cpu = engine({"pools": ["context"]}, MB, k=8)
    start(startup, cpu)
    startup.settle_gpu_trees(cpu)
    assert not registered and carried_settings(cpu, "multi_branch").tree_unsupported is None


def test_default_pools_run_what_the_model_has_and_the_worker_does_not_look_again(startup, monkeypatch):
    got = start(startup, engine({}, MB, k=8))  # no corpus table, no Medusa heads for this model: left out
    assert got.pools == ("context", "suffix") and got.checked
    import vllm_adaspec.pools.corpus as corpus

    monkeypatch.setattr(corpus, "find_corpus", lambda *a: pytest.fail("the worker looked for the corpus again"))
    assert startup.usable_pools(got, None) == ("context", "suffix")


def test_a_file_the_user_named_must_be_readable_even_without_a_pools_list(startup, tmp_path):
    msg = start_refused(startup, engine({"corpus": str(tmp_path / "missing.npz")}, MB, k=8))
    assert msg.startswith("additional_config['adaspec']['corpus']: no corpus table at") and "missing.npz" in msg, msg
    msg = start_refused(startup, engine({"medusa": str(tmp_path / "nothing")}, MB, k=8))
    assert msg.startswith("additional_config['adaspec']['medusa']:") and "holds no Medusa heads" in msg, msg


@pytest.mark.parametrize("content, words", [
    (b"PK\x03\x04 a truncated zip", "BadZipFile"), (b"not numpy at all", "cannot read"), (b"", "EOFError"),
    (None, "KeyError"), ("short", "do not fit"),
])
def test_a_corrupt_corpus_table_is_a_start_up_error_naming_the_key_and_file(startup, tmp_path, content, words):
    import numpy as np

    from vllm_adaspec.pools.corpus import CorpusTable

    path = tmp_path / "corpus.npz"
    if content is None:  # a zip of arrays without the table's
        np.savez(path, other=np.zeros(3))
    elif content == "short":  # ids for fewer contexts than keys
        CorpusTable(10, np.arange(3), np.zeros((2, 4), np.int32), np.zeros((2, 4)), np.arange(0), np.zeros((0, 4)),
                    np.zeros((0, 4))).save(str(path))
    else:
        path.write_bytes(content)
    for setting in (str(path), str(tmp_path)):  # the file or its folder
        msg = start_refused(startup, engine({"corpus": setting}, MB, k=8))
        assert msg.startswith("additional_config['adaspec']['corpus']: ") and str(path) in msg and words in msg, msg


def _heads_folder(tmp_path, meta=None, weights=True, text=None):
    import torch

    from vllm_adaspec.heads import config_hash
    from vllm_adaspec.heads.medusa import FORMAT, init_heads, save_medusa

    folder = tmp_path / "heads"
    w = init_heads(2, 64)
    good = {"base_model": {"name": "other", "config_hash": config_hash(OTHER_MODEL), "weights_fingerprint": []},
            "num_heads": 2, "accuracy_by_rank": [[0.5], [0.3]]}
    save_medusa(str(folder), w["w"], w["b"], torch.arange(5), good)
    if meta is not None:
        (folder / "medusa.json").write_text(json.dumps({"format": FORMAT, **meta}))
    if text is not None:
        (folder / "medusa.json").write_text(text)
    if not weights:
        os.remove(folder / "medusa.safetensors")
    elif weights == "truncated":
        (folder / "medusa.safetensors").write_bytes(b"\x10\x00")
    return str(folder)


@pytest.mark.parametrize("kind, words", [
    ("good", None),
    ("not json", "cannot read"), ("a list", "must hold a JSON object"), ("no base_model", "has no 'base_model'"),
    ("no config_hash", "'base_model' has no 'config_hash'"), ("no safetensors", "no medusa.safetensors"),
    ("truncated safetensors", "cannot read"),
])
def test_a_malformed_medusa_folder_is_a_start_up_error_naming_the_key_and_file(startup, tmp_path, kind, words):
    folder = _heads_folder(tmp_path, **{
        "good": {}, "not json": {"text": "{\"format\": "}, "a list": {"text": "[1, 2]"},
        "no base_model": {"meta": {"accuracy_by_rank": []}},
        "no config_hash": {"meta": {"base_model": {}, "accuracy_by_rank": []}},
        "no safetensors": {"weights": False}, "truncated safetensors": {"weights": "truncated"}}[kind])
    for section in ({"medusa": folder}, {"pools": ["context", "medusa"], "medusa": folder}):
        if words is None:
            got = start(startup, engine(section, MB, k=8))
            assert "medusa" in got.pools and got.medusa == folder
            continue
        msg = start_refused(startup, engine(section, MB, k=8))
        assert msg.startswith("additional_config['adaspec']['medusa']: ") and folder in msg and words in msg, msg


def test_a_malformed_exit_head_is_a_start_up_error_naming_the_key_and_file(startup, tmp_path):
    from vllm_adaspec.heads import find_shipped

    shipped = open(os.path.join(find_shipped(SimpleNamespace(**{**vars(OTHER_MODEL), **SMOL_SHAPE})),
                                "exit_head.json")).read()
    for text, weights, words in (("{", b"", "cannot read"),
                                 ("{\"format\": \"vllm-adaspec/exit-head/1\"}", b"", "has no 'base_model'"),
                                 (shipped, None, "has exit_head.json but no exit_head.safetensors"),
                                 (shipped, b"\x00" * 9, "cannot read")):
        (tmp_path / "exit_head.json").write_text(text)
        if weights is None:
            (tmp_path / "exit_head.safetensors").unlink(missing_ok=True)
        else:
            (tmp_path / "exit_head.safetensors").write_bytes(weights)
        msg = start_refused(startup, engine({"exit_head": str(tmp_path)}))
        assert msg.startswith("additional_config['adaspec']['exit_head']: ") and str(tmp_path) in msg, msg
        assert words in msg, msg


def test_each_proposer_has_one_settings_class_over_the_common_part():
    from dataclasses import fields as dc_fields

    from vllm_adaspec.config import (OLD_NAMES, PROPOSER_KEYS, SETTINGS_CLASSES, CommonSettings, ResolvedConfig)
    from vllm_adaspec.policies import PARAM_RANGES, POLICIES, policy_params

    assert ResolvedConfig is CommonSettings
    renamed = {"exit_head": "exit_head_setting"}  # the setting as given; `exit_head` is the folder resolved
    for proposer, keys in PROPOSER_KEYS.items():
        cls = SETTINGS_CLASSES[proposer]
        assert issubclass(cls, CommonSettings)
        names = {f.name for f in dc_fields(cls)}
        assert {renamed.get(k, k) for k in keys if k not in OLD_NAMES} <= names, (proposer, keys)
    for name in POLICIES:  # every policy parameter has its range
        assert set(policy_params(name)) <= set(PARAM_RANGES), name


def test_a_draft_layer_sits_on_every_layer_and_drafts_trees(smollm2):
    # the shipped draft layer reads the target's last features: N = L (30) is its place; token trees from its top-k
    # are accepted (their budget within K)
    import os

    from transformers import AutoConfig

    from vllm_adaspec.heads import SHIPPED_DIR

    folder = os.path.join(SHIPPED_DIR, "smollm2-135m-instruct-draft-layer")
    hf = AutoConfig.from_pretrained(smollm2)
    r = resolve_config(parse_adaspec_config({"adaspec": {"exit_head": folder}}), **LLAMA, hf_config=hf)
    assert (r.exit_layer, r.exit_head) == (30, folder)
    r = resolve_config(parse_adaspec_config({"adaspec": {"exit_head": folder, "tree": {"budget": 4}}}), **LLAMA,
                       hf_config=hf)
    assert (r.exit_layer, r.tree.budget) == (30, 4)
