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
        ({"policy": {"name": "adaedl", "beta2": 1.0}}, ["['policy']", "beta2 must be in [0, 1)", "got 1.0"]),
        ({"policy": {"name": "thompson-beta", "alpha0": "1"}}, ["['policy']", "'alpha0' must be a number"]),
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
    ({"budget": True}, ["tree.budget", "integer"]),
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
    for bad, words in (("lossy", "must be 'exact', 'typical'"), ({"name": "typical", "epsilon": 0}, "epsilon must be"),
                       ({"name": "typical", "delta": True}, "delta must be"),
                       ({"name": "typical", "eps": 0.1}, "unknown key(s) 'eps'")):
        with pytest.raises(AdaspecConfigError, match=r"\['acceptance'\]: " + re.escape(words)):
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
    with pytest.raises(AdaspecConfigError, match=r"= 161, but vLLM verifies at most 128"):
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
