"""MultiBranchProposer inside vLLM (CPU, float32, SmolLM2): candidate trees verified as token trees.

- greedy output equals plain decoding on the mixed batch (prompt lengths, prefix-cache hits on the second pass,
  requests finishing at different lengths), with trees actually verified and every pool (all five in one engine)
  contributing accepted tokens; the second pass also meets a global suffix tree and recycled table that already know its text;
- a batch mixing greedy tree requests, chain-only requests (a penalty: they draft the best path as a chain) and
  seeded sampling keeps greedy rows identical, and 64 seeded samples keep the target distribution;
- under preemption and chunked prefill (a tiny KV cache) the output is still plain decoding's, and the per-request
  pool state of every finished request is gone.
Self-Draft branches (pools/branches.py) ride in both engines (on top of every other pool): their rows run in the
verification forwards, feed the branches pool, which gets tokens accepted, and no committed position is ever read
from a branch row's KV (VLLM_ADASPEC_CHECK_BRANCH_SLOTS); the medusa engine below runs without branches, so
branches on and off both give plain decoding's tokens."""

import pytest

from conftest import (BANNED_FIRST, BIASED_SEEDS, COPY_OR_NOT, COPYING, ENGINE, FEATURE_NAMES, FEATURES_BATCH,
                      GROW_MAX_TOKENS, OWN_SETTINGS_BATCH,
                      GROW_PROMPTS, GUARD_BATCH, TREE_FEATURES, TREE_MIX, assert_features_match, assert_identical,
                      FRUIT_MIN_P, FRUIT_REGEX, greedy_batch, joined, samples, sampling_batch, target_pvalues)

pytestmark = pytest.mark.engine

MB = "vllm_adaspec.MultiBranchProposer"
EVERY_POOL = ("context", "suffix", "recycled", "corpus", "medusa", "branches")
BRANCHES = {"branches": 2, "branch_length": 3}
CHECK_BRANCHES = {"VLLM_ADASPEC_CHECK_BRANCH_SLOTS": "1"}
# Faults injected into the every-pool engine (vllm_adaspec/faults.py): one in each pool's propose (medusa: its heads),
# the trie, planning a step's trees, verifying a tree request and compaction, all early in its first batch; each is
# contained (that step decodes plainly for the requests concerned), below the fault limit, so drafting goes on.
INJECTED = {"context": 3, "suffix": 6, "recycled": 9, "corpus": 12, "medusa": 15, "branches": 18, "trie": 40,
            "tree_plan": 24, "tree_verify": 60, "compaction": 30}
INJECT = {"VLLM_ADASPEC_INJECT_FAULTS": ",".join(f"{place}@{n}" for place, n in INJECTED.items())}


def mb_engine(budget=8, **extra):
    # the shipped cost curve, not refitted: node choice does not depend on how fast this machine happens to be
    settings = {"cost_model": "prior", "tree": {"budget": budget}, **extra.pop("settings", {})}
    k = budget + settings.get("branches", 0) * settings.get("branch_length", 0)
    return {**ENGINE, "speculative_config": {"model": MB, "num_speculative_tokens": k},
            "additional_config": {"adaspec": settings}, **extra}


def assert_branches_ran_and_never_leaked(st):
    assert st["branch_rows"] > 20 and st["branch_grams"] > 20, st
    checks = st["branch_slot_checks"]
    assert checks["checked"] > 20 and checks["violations"] == 0, checks


@pytest.fixture(scope="module")
def mb_runs(smollm2, tree_engines):
    batches = {"mixed": greedy_batch(), "again": greedy_batch(), "tree_mix": TREE_MIX, "features": FEATURES_BATCH}
    # at most 8 requests at a time: with 64 at once this CPU is compute-bound and no draft pays for its row
    engine = mb_engine(max_num_seqs=8, settings={"pools": list(EVERY_POOL), **BRANCHES, "fault_limit": 50})
    res = tree_engines.run({"model": smollm2, "engine": engine, "batches": list(batches.values()),
                            "env": {**CHECK_BRANCHES, **INJECT, "VLLM_ADASPEC_RECORD_DRAFTS": "1"}})
    return {name: b["runs"][0] for name, b in zip(batches, res["batches"])}


def test_greedy_identical_and_every_pool_is_accepted(mb_runs, plain_greedy):
    first, again = mb_runs["mixed"], mb_runs["again"]
    assert_identical(first, plain_greedy["mixed"])
    assert_identical(again, plain_greedy["mixed"])
    st = again["adaspec"]
    assert st["config"]["pools"] == list(EVERY_POOL) and st["config"]["tree_mode"], st["config"]
    assert st["tree_verified"] > 5 and st["tree_kv_moves"] > 0, st  # accepted nodes off the first path moved
    # recycled: the verified rows' logits reached the drafter; medusa: the sampled rows' hidden states did
    for pool in EVERY_POOL:
        assert first["adaspec"]["pool_accepted"][pool] + st["pool_accepted"][pool] > 0, (pool, st["pool_accepted"])
    assert_branches_ran_and_never_leaked(first["adaspec"])
    # the nodes chosen compiled (trees/step_choice.py), none by the Python choice after a fault of it
    assert first["adaspec"]["compiled_choices"] > 20 and first["adaspec"]["choice_faults"] == 0, first["adaspec"]
    # branch rows are not verified drafts: adaspec's own acceptance counts only tree nodes
    assert first["adaspec"]["verified_drafts"] <= first["adaspec"]["chosen_nodes"]
    m1, m2 = first["metrics"], again["metrics"]
    assert m1["vllm:spec_decode_num_accepted_tokens"] > 100, m1
    # the second pass's prompts hit the prefix cache (all of them were seen): trees over cached prefixes
    assert m2["vllm:prefix_cache_hits"] > 0.5 * m2["vllm:prefix_cache_queries"], m2
    # The second pass meets outputs it has seen (the global suffix tree): it must accept more per draft.
    assert (m2["vllm:spec_decode_num_accepted_tokens"] / m2["vllm:spec_decode_num_drafts"]
            > m1["vllm:spec_decode_num_accepted_tokens"] / m1["vllm:spec_decode_num_drafts"]), (m1, m2)


def test_injected_faults_are_contained_counted_and_drafting_goes_on(mb_runs, plain_greedy):
    """Every failpoint of this engine raised once (INJECTED) inside the first batch; that batch's greedy output is
    still plain decoding's (test_greedy_identical_and_every_pool_is_accepted), every request finished, and the
    faults are counted where /metrics reads them (vllm:adaspec_drafter_faults_total, from the same statistics)."""
    first, last = mb_runs["mixed"], mb_runs["features"]
    assert first["adaspec"]["drafter_faults"] == len(INJECTED), first["adaspec"]["faults_by_place"]
    assert sum(run["adaspec"]["drafter_faults"] for run in mb_runs.values()) == len(INJECTED), {
        name: run["adaspec"]["faults_by_place"] for name, run in mb_runs.items()}
    places = last["adaspec"]["faults_by_place"]  # cumulative, by where the fault was contained
    assert places == {"drafting": 7, "planning the step's token trees": 1,
                      "compacting the accepted tree nodes' KV": 1,
                      **{k: 1 for k in places if k.startswith("verifying request")}}, places
    assert all(run["adaspec"]["drafting_off"] == 0 for run in mb_runs.values())
    assert all(len(t) > 0 for t in first["token_ids"]) and len(first["token_ids"]) == len(plain_greedy["mixed"]["token_ids"])
    # drafting went on after the faults: the later batches still verify trees and accept drafts
    assert last["adaspec"]["tree_verified"] > 5 and mb_runs["again"]["adaspec"]["accepted_drafts"] > 50


def test_at_the_fault_limit_speculation_stops_and_requests_finish_as_plain(smollm2, plain_greedy, tree_engines):
    """fault_limit 3: a fault in the context pool, one in verifying a tree and one in planning a step's trees turn
    speculation off for the engine's life; every request finishes with plain decoding's tokens, the next batch
    drafts nothing and no per-request state is left."""
    engine = mb_engine(settings={"pools": ["context"], "cost_model": "off", "fault_limit": 3})
    flush = {"prompts": ["Hi"], "params": [{"temperature": 0.0, "max_tokens": 8}]}
    res = tree_engines.run({"model": smollm2, "engine": engine, "batches": [GUARD_BATCH, flush],
                            "env": {"VLLM_ADASPEC_INJECT_FAULTS": "context@4,tree_verify@12,tree_plan@20"}})
    run, after = (b["runs"][0] for b in res["batches"])
    assert_identical(run, plain_greedy["guard"])
    st = run["adaspec"]
    assert st["drafter_faults"] == 3 and st["drafting_off"] == 1, st
    assert set(st["faults_by_place"]) == {"drafting", "planning the step's token trees"} | {
        k for k in st["faults_by_place"] if k.startswith("verifying request")}, st["faults_by_place"]
    assert st["accepted_drafts"] > 0 and st["tree_verified"] > 0, st  # it drafted trees until the limit
    assert after["metrics"]["vllm:spec_decode_num_drafts"] == 0, after["metrics"]  # off for good
    assert after["texts"][0] and after["adaspec"]["drafter_faults"] == 0
    live = after["adaspec"]["live"]
    assert after["adaspec"]["tracked_requests"] == 0 and not any(live.values()), (after["adaspec"], live)


# Dense faults at every failpoint of the tree path, `tree_only` (verifying a request whose settings only the tree
# sampler applies) included, through a batch of such requests: each contained fault must leave the requests it hits
# with a token their settings allow (vLLM's first token from the root row, every setting applied), never vLLM's
# chain verdict, which applies none of them to draft rows.
TREE_FAILPOINTS = {"tree_plan": 4, "tree_verify": 5, "tree_only": 3, "compaction": 4}  # every n-th pass faults
DENSE_FAULTS = {"VLLM_ADASPEC_INJECT_FAULTS": ",".join(f"{place}@{k}" for place, n in TREE_FAILPOINTS.items()
                                                       for k in range(n, 400, n))}


@pytest.fixture(scope="module")
def own_settings_run(smollm2, tree_engines):
    engine = mb_engine(max_num_seqs=8, settings={"pools": ["context", "suffix"], "cost_model": "off",
                                                 "fault_limit": 10**6})
    res = tree_engines.run({"model": smollm2, "engine": engine, "batches": [OWN_SETTINGS_BATCH], "env": DENSE_FAULTS})
    return res["batches"][0]["runs"][0]


def test_faults_at_every_tree_failpoint_never_commit_a_token_a_request_forbids(smollm2, own_settings_run,
                                                                               plain_greedy):
    """logit_bias banning each request's own top token, min_p, a JSON grammar and bad words, greedy, every tree
    failpoint faulting every few passes: the output is plain decoding's with the same settings, token for token; no
    banned token and no bad word anywhere; the JSON parses; every failpoint was hit, `tree_only` included."""
    import json

    from transformers import AutoTokenizer

    run, plain = own_settings_run, plain_greedy["own_settings"]
    assert_identical(run, plain)
    for k, (i, banned) in enumerate(BANNED_FIRST.items()):
        assert plain_greedy["mixed"]["token_ids"][i][0] == banned  # each bias bans the request's own top token
        assert banned not in run["token_ids"][k], (k, banned)
    json.loads(run["texts"][4])
    tok = AutoTokenizer.from_pretrained(smollm2)
    for word in OWN_SETTINGS_BATCH["params"][5]["bad_words"]:
        ids = tok.encode(word, add_special_tokens=False)
        out = run["token_ids"][5]
        assert not any(out[j:j + len(ids)] == ids for j in range(len(out))), (word, ids)
    st = run["adaspec"]
    places = st["faults_by_place"]
    assert places.get("planning the step's token trees", 0) > 3, places
    assert places.get("compacting the accepted tree nodes' KV", 0) > 2, places
    verifying = sum(n for p, n in places.items() if p.startswith("verifying request"))
    assert verifying > 10, places  # tree_verify and tree_only faults on single requests
    assert st["tree_verified"] > 20 and st["accepted_drafts"] > 20, st  # trees still verified between the faults


def test_request_features_work_as_without_speculation(mb_runs, plain_greedy):
    """conftest.FEATURES through trees (with branches): penalties, logprobs, min_tokens, logit bias, min_p, bad and
    allowed words and grammars (JSON schema, regex) on tree rows, each request verified as trees and giving plain
    decoding's tokens and log-probs; the grammars' candidates were checked before they were chosen."""
    run = mb_runs["features"]
    assert_features_match(run, plain_greedy["features"])
    st = run["adaspec"]
    assert st["tree_verified"] > 5 and run["metrics"]["vllm:spec_decode_num_drafts"] > 20, st
    # the engine's ids are the request ids with "-" and 8 random characters appended
    trees = [sum(n for r, n in st["tree_rounds_by_request"].items() if r.rsplit("-", 1)[0] == ext) for ext in run["request_ids"]]
    assert all(trees[FEATURE_NAMES.index(name)] > 0 for name in TREE_FEATURES), dict(zip(FEATURE_NAMES, trees))
    assert st["grammar_checked"] > 0 and st["grammar_pruned"] > 0, st
    # the bias changed the output (the same prompt without it is the mixed batch's fourth request)
    biased = run["completions"][FEATURE_NAMES.index("logit_bias")][0]
    assert biased != plain_greedy["mixed"]["token_ids"][3][:len(biased)] and 1398 not in biased


def test_mixed_tree_chain_and_sampled_rows(mb_runs, plain_greedy):
    mix = mb_runs["tree_mix"]
    assert mix["token_ids"][:4] == plain_greedy["tree_mix"]["token_ids"][:4]  # greedy trees, penalised chains
    assert mix["adaspec"]["tree_verified"] > 5 and mix["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0


# samples: honest trees (UNSEEDED of them unseeded, n = 256 per request; the rest seeded, one request each), under
# a grammar, with min_p, and through a biased verifier (seeded). Seeded requests each prefill the prompt (it is
# shorter than a KV block, so the prefix cache cannot share it): most of the engine's work, so most samples are not.
HONEST, UNSEEDED, CONSTRAINED, BIASED = 896, 768, 128, 128


@pytest.fixture(scope="module")
def sampled_trees(smollm2, tree_engines):
    """896 samples (128 seeded) through tree verification with top-k and top-p, in the same batch 128 under a
    grammar (FRUIT_REGEX), 128 with min_p, and 128 whose verifier is deliberately biased (seeded from
    BIASED_SEEDS): one engine, no cost model (every candidate runs); p-values against the target's exact
    distribution under each subset's settings."""
    batch = joined(sampling_batch(UNSEEDED), sampling_batch(HONEST - UNSEEDED, seed0=900_000),
                   sampling_batch(CONSTRAINED, per_request=CONSTRAINED, structured_outputs={"regex": FRUIT_REGEX}),
                   sampling_batch(CONSTRAINED, per_request=CONSTRAINED, min_p=FRUIT_MIN_P),
                   sampling_batch(BIASED, seed0=BIASED_SEEDS))
    # the KV copies uncapped: every drafting request verifies a tree (the default cap, an eighth of the cache, sends
    # most of 256 concurrent requests down the chain path)
    engine = mb_engine(budget=4, max_num_seqs=256, settings={"pools": ["context", "suffix"], "cost_model": "off",
                                                             "tree": {"budget": 4, "kv_copy_tokens": 2**24}})
    run = tree_engines.run({"model": smollm2, "engine": engine, "batches": [batch],
                            "env": {"VLLM_ADASPEC_BIASED_VERIFIER_SEEDS": str(BIASED_SEEDS)}})["batches"][0]["runs"][0]
    got = samples(run)  # unseeded (n = 256 per request), seeded (one request each), grammar, min_p, biased
    assert len(got) == HONEST + 2 * CONSTRAINED + BIASED
    grammar = range(HONEST, HONEST + CONSTRAINED)
    min_p = range(HONEST + CONSTRAINED, HONEST + 2 * CONSTRAINED)
    pvalues = target_pvalues(smollm2, got, {"trees, all": range(HONEST), "trees, seeded": range(UNSEEDED, HONEST),
                                            "trees, unseeded": range(UNSEEDED), "trees, grammar": grammar,
                                            "trees, min_p": min_p,
                                            "biased verifier": range(HONEST + 2 * CONSTRAINED, len(got))},
                             constrained={"trees, grammar": {"regex": FRUIT_REGEX},
                                          "trees, min_p": {"min_p": FRUIT_MIN_P}})
    return run, pvalues


def test_tree_verification_keeps_the_target_distribution(sampled_trees):
    """Sample-and-match over trees, after the glue's top-k / top-p and per-request generators, position by position
    against the target's exact conditional distribution; seeded and unseeded requests also apart; under a grammar
    (candidates pruned, every tree row masked by its path's grammar state) and with min_p (applied by the tree
    sampler only), against the distribution those settings give."""
    run, pvalues = sampled_trees
    st = run["adaspec"]
    # drafts went through as trees and were accepted
    print("trees:", {k: st[k] for k in ("tree_verified", "accepted_drafts", "verified_drafts", "decode_rows",
                                        "tree_capped")})
    assert st["tree_verified"] > 800 and st["accepted_drafts"] > 600, st
    for name in ("trees, all", "trees, seeded", "trees, unseeded", "trees, grammar", "trees, min_p"):
        assert min(pvalues[name]) > 1e-4, (name, pvalues[name])
    assert st["grammar_checked"] > 0, st  # the grammar's requests drafted trees whose candidates it checked


def test_the_same_test_rejects_a_biased_verifier(sampled_trees):
    """Power: requests whose verifier accepts a rejected node now and then (in the same batch) fail the same test."""
    pvalues = sampled_trees[1]["biased verifier"]
    assert pvalues[0] > 1e-4, pvalues  # the first token comes from the root row: no draft decides it
    assert min(pvalues[1:]) < 1e-6, pvalues


def test_preemption_and_chunked_prefill_stay_exact_and_state_is_freed(smollm2, plain_greedy, tree_engines):
    engine = mb_engine(kv_cache_memory_bytes=19 * 2**20, block_size=32, max_model_len=320, max_num_batched_tokens=64,
                       # the tree path's KV copies may hold the whole tiny cache (default: an eighth of it, which
                       # would send these requests down the chain path, where branches cannot ride)
                       settings={"tree": {"budget": 8, "kv_copy_tokens": 4096}, "branches": 2, "branch_length": 2,
                                 "branch_init": "random"})
    flush = {"prompts": ["Hi"], "params": [{"temperature": 0.0, "max_tokens": 2}]}  # steps once more after them
    res = tree_engines.run({"model": smollm2, "engine": engine, "env": CHECK_BRANCHES,
                            "batches": [greedy_batch(GROW_PROMPTS, GROW_MAX_TOKENS), flush]})["batches"]
    run, after = res[0]["runs"][0], res[1]["runs"][0]
    assert_identical(run, plain_greedy["grow"])
    assert run["metrics"]["vllm:num_preemptions"] > 0, "no preemption happened: the test did not test it"
    assert run["adaspec"]["prefill_chunk_rows"] > 0, "no prompt was prefilled in chunks: the test did not test it"
    assert run["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0
    assert run["adaspec"]["tree_verified"] > 20, run["adaspec"]
    assert_branches_ran_and_never_leaked(run["adaspec"])
    st = after["adaspec"]
    # every request of the batch finished and the engine stepped again: nothing per request is left of them
    # (policies, pools and their branch grams, suffix trees, KV copies); only the flush request may still be counted
    assert st["tracked_requests"] <= 1 and st["pool_requests"] <= 1 and st["suffix_active"] <= 1, st
    # gauges, as they stand after the flush: KV copy and branch grams of the flush request at most ("Hi" + 2 tokens:
    # a copy of copy_capacity(~20 positions) = 89; 2 branches * 2 rows * 2 steps of grams)
    assert st["kv_copies"] <= 89 and st["gram_entries"] <= 8, st


@pytest.fixture(scope="module")
def medusa_runs(smollm2, tree_engines):
    """Medusa heads alone (the shipped ones), with typical acceptance turned on: greedy requests are untouched by
    it, tree-verified sampled requests use it, penalised requests verify chains with vLLM's sampler."""
    engine = mb_engine(budget=4, max_num_seqs=8, settings={"pools": ["medusa"], "acceptance": "typical"})
    batches = [greedy_batch(), TREE_MIX]
    res = tree_engines.run({"model": smollm2, "engine": engine, "batches": batches,
                            "env": {"VLLM_ADASPEC_RECORD_DRAFTS": "1", "VLLM_ADASPEC_CHECK_TARGET_ROWS": "1"}})
    return [b["runs"][0] for b in res["batches"]]


def test_medusa_heads_draft_from_the_right_rows_and_greedy_stays_exact(smollm2, medusa_runs, plain_greedy):
    from vllm_adaspec.heads.medusa import find_medusa
    from vllm_adaspec.training.medusa_trainer import medusa_top1

    run, mix = medusa_runs
    assert_identical(run, plain_greedy["mixed"])
    assert mix["token_ids"][:4] == plain_greedy["tree_mix"]["token_ids"][:4]  # greedy and penalised rows
    assert mix["adaspec"]["config"]["acceptance"] == "typical", mix["adaspec"]["config"]
    st = run["adaspec"]  # the greedy batch: its rows re-produce their tokens (sampled / penalised rows need not)
    assert st["config"]["pools"] == ["medusa"], st["config"]
    # The hidden state each step drafts from is the row that sampled the request's last token (the LM head on it
    # re-produces that token), in chains and trees alike ...
    assert st["row_checks"] > 100 and st["row_mismatches"] == 0, (st["row_checks"], st["row_mismatches"])
    # ... and the heads on it compute what a plain-torch reference computes.
    folder = find_medusa(__import__("json").load(open(f"{smollm2}/config.json")))
    agree = total = 0
    for req_id, recs in st["medusa_top1"].items():
        tokens = st["first_drafts"][req_id]["tokens"]
        ref = medusa_top1(smollm2, folder, tokens)
        for n, top in recs:  # n committed tokens: the last was sampled from the row of token n - 1 (index n - 2)
            if n <= len(tokens):
                agree, total = agree + (ref[n - 2] == top), total + 1
    assert total > 100 and agree / total > 0.97, (agree, total)
    # Medusa drafts are accepted (the heads predict): a broken row or head would sit near 0.
    m = run["metrics"]
    assert m["vllm:spec_decode_num_accepted_tokens"] / m["vllm:spec_decode_num_drafts"] > 0.3, m


def test_cost_model_drafts_for_the_requests_whose_drafts_pay(smollm2, plain_greedy, tree_engines):
    """A batch whose answer is known: two requests copy a passage of their prompt (the context and suffix pools
    predict them), two write something new (their candidates are rare guesses). The online cost model prices every
    row from this engine's own step times and takes nodes by their calibrated chance across the batch: the copying
    requests draft in most of their steps and get many tokens per step; the others verify few rows. Whatever the
    machine, the old per-batch guard could only switch all four on or off together."""
    engine = mb_engine(budget=16, settings={"pools": ["context", "suffix"], "cost_model": "online"})
    run = tree_engines.run({"model": smollm2, "engine": engine, "batches": [COPY_OR_NOT],
                            "env": {"VLLM_ADASPEC_RECORD_DRAFTS": "1"}})["batches"][0]["runs"][0]
    assert_identical(run, plain_greedy["copy_or_not"])
    st = run["adaspec"]
    assert st["config"]["cost_model"] == "online" and st["cost_observations"] > 10, st
    # [decode steps, rounds with drafts, drafts, accepted] by prompt (the engine's ids extend the outputs' ids)
    per = {i: next(v for k, v in st["per_request"].items() if k.split("-")[0] == rid)
           for i, rid in enumerate(run["request_ids"])}
    copy_rows = min(per[i][2] / per[i][0] for i in COPYING)  # drafted rows per step of the copying requests
    for i, (steps, rounds, drafted, accepted) in per.items():
        if i in COPYING:  # drafts in most steps, several tokens per step
            assert rounds > 0.6 * steps and accepted > 1.5 * steps, (i, per)
        else:  # drafts in at most half of its steps, a fifth of the rows per step the copying requests get
            assert rounds <= 0.5 * steps and drafted / steps < copy_rows / 5, (i, per)
