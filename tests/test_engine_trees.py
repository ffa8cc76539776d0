"""Token trees inside vLLM (CPU), end to end on SmolLM2 with the shipped exit head:
- greedy tree decoding is token-identical to plain decoding on the mixed batch (prefills, prefix caching, trees),
  and a tree of 8 nodes accepts more per step than a chain of 8;
- C2T trees (tree.builder "c2t", the shipped classifier) stay identical too, with thompson-cali reading the
  target's hidden state at the row of the last accepted node, the tree path's per-request KV copies under their cap
  (requests past it draft chains), and the records `adaspec train c2t` learns from;
- vLLM's default compiled mode (no enforce_eager: inductor, and the profile run at start-up) starts early exit with
  trees and keeps greedy output identical, and a next turn served from the prefix cache, tree-decoded output
  included, equals plain decoding's (README's own `adaspec serve` command, MultiBranchProposer with its
  defaults in compiled mode: test_server.py's soak; vLLM finding the plugin by its entry point: test_wheel.py)."""

import pytest

from conftest import ENGINE, NEXT_TURN, SPEC, assert_identical, greedy_batch

pytestmark = pytest.mark.engine


def tree_engine(budget=8, top_k=2, k=8, engine=None, **settings):
    # The shipped head (N = 6) drafts; no cost model (trees keep their budget with it anyway).
    tree = {"budget": budget, "top_k": top_k, **settings.pop("tree", {})}
    return {**ENGINE, "speculative_config": {"model": SPEC, "num_speculative_tokens": k},
            "additional_config": {"adaspec": {"cost_model": "off", "tree": tree, **settings}}, **(engine or {})}


def test_c2t_trees_with_thompson_cali_under_preemption_and_chunked_prefill(
        smollm2, plain_greedy, tree_engines):
    # C2T trees (the shipped classifier keeps a node when its confidence passes beta; trees vary in size) stay
    # token-identical to plain decoding. VLLM_ADASPEC_CHECK_TARGET_ROWS: with greedy decoding the row thompson-cali
    # reads must give the request's last token again under the LM head; a tree's bonus comes from its last accepted
    # node's row, not from root + depth. kv_copy_tokens 700: one ~420-token prompt's copy (~600 positions with
    # slack) fits, two do not, so the other long request drafts chains while the first holds its copy.
    # VLLM_ADASPEC_RECORD_TREES: what `adaspec train c2t` reads (features and labels of every verified tree).
    # A small KV cache (32 MiB: ~700 positions in 32-token blocks) and 64 tokens per step: the long prompts are
    # prefilled in chunks and requests are preempted and resumed (their KV recomputed, their copies dropped).
    engine = tree_engine(policy="thompson-cali", tree={"kv_copy_tokens": 700, "builder": "c2t", "beta": 0.2,
                                                       "top_k": 3},
                         engine={"kv_cache_memory_bytes": 32 * 2**20, "block_size": 32, "max_num_batched_tokens": 64,
                                 "max_model_len": 640})
    res = tree_engines.run({"model": smollm2, "engine": engine, "batches": [greedy_batch()],
                            "env": {"VLLM_ADASPEC_CHECK_TARGET_ROWS": "1", "VLLM_ADASPEC_RECORD_TREES": "1"}})
    run = res["batches"][0]["runs"][0]
    assert_identical(run, plain_greedy["mixed"])
    assert run["metrics"]["vllm:num_preemptions"] > 0, "no preemption happened: the test did not test it"
    st = run["adaspec"]
    assert st["prefill_chunk_rows"] > 0, "no prompt was prefilled in chunks: the test did not test it"
    assert st["tree_verified"] > 20 and st["tree_kv_moves"] > 0, st  # paths left the spine: the case under test
    assert st["row_checks"] > 20 and st["row_mismatches"] == 0, st
    assert st["tree_capped"] > 0, st
    assert 0 < st["tree_kv_copy_peak"] <= 700, st
    # The classifier chose the nodes: tree sizes vary below the budget, and its time is a sliver of drafting.
    recs = st["tree_records"]
    sizes = [len(f) for f, _, _ in recs]
    assert len(recs) > 20 and len(set(sizes)) > 2 and max(sizes) <= 8 and sum(sizes) / len(sizes) < 7, sizes
    assert 0 < st["c2t_seconds"] < 0.1 * st["draft_seconds"], st
    for feats, accepted, parents in recs:  # features as the classifier saw them; labels close under parents
        assert all(1 <= f[2] <= 8 and 0 < f[0] <= 1 and f[1] >= 0 for f in feats)
        assert all(parents[i] < 0 or accepted[parents[i]] for i in range(len(accepted)) if accepted[i])


def compiled(engine: dict) -> dict:
    """vLLM's default mode: no enforce_eager (the model compiled by inductor, piecewise around attention), and at
    start-up vLLM's profile run, whose dummy sampler run sends dummy drafts for an empty batch through the rejection
    sampler (our tree sampler): what every GPU start does too."""
    return {k: v for k, v in engine.items() if k != "enforce_eager"}


def test_greedy_tree_decoding_in_vllms_default_compiled_mode_is_identical_to_plain(smollm2, plain_greedy,
                                                                                    tree_engines):
    # Early exit with token trees and the shipped head in vLLM's default mode: the target is compiled by inductor
    # (piecewise), with the forward hook feeding the exit layer's KV traced into its graph (it holds no branch on
    # per-step data: engine/exit_head.py; one that froze or dropped it would leave the exit layer's KV stale and
    # drafts useless), and start-up runs the profile run through the tree sampler. Greedy output equals eager plain
    # decoding on the mixed batch (prefills, prefix caching, trees; float32: inductor's fusions keep every token of
    # these prompts), accepted paths leave the first-child spine (KV compaction), trees keep landing.
    # (Request features on trees: test_engine_multibranch.py, the same tree sampler; eager tree mode: the C2T test
    # above and test_engine_multibranch.py.)
    # the same requests again, each asking for chains (adaspec_speculation): 8 drafts a round from the same head
    chains = greedy_batch()
    chains["params"] = [{**p, "extra_args": {"adaspec_speculation": "chain"}} for p in chains["params"]]
    # Then the mixed batch's conversations a turn further (NEXT_TURN: each prompt followed by its tree-decoded
    # output): the prefix cache serves the first turn's full blocks, output included, which tree decoding wrote
    # (nodes at depth positions, accepted paths compacted): they must be what plain decoding writes.
    res = tree_engines.run({"model": smollm2, "engine": compiled(tree_engine()),
                            "batches": [greedy_batch(), chains, NEXT_TURN]})
    run, chain_run, next_turn = (b["runs"][0] for b in res["batches"])
    assert_identical(run, plain_greedy["mixed"])
    assert_identical(chain_run, plain_greedy["mixed"])
    assert_identical(next_turn, plain_greedy["next_turn"])
    # every full block of the conversations so far came from the cache (a request reuses at most (P - 1) // 128
    # blocks of its P prompt tokens: CPU blocks are 128 tokens), more than the first turn's prompts alone fill: blocks
    # holding tree-decoded output were served (the long prompt of 420 tokens and its 96 outputs fill a fourth)
    bs = 128
    with_outputs = sum((p - 1) // bs * bs for p in next_turn["prompt_lens"])
    prompts_only = sum(p // bs * bs for p in run["prompt_lens"])
    hits = next_turn["metrics"]["vllm:prefix_cache_hits"]
    assert hits >= with_outputs > prompts_only, (hits, with_outputs, prompts_only)
    st = run["adaspec"]
    assert st["tree_verified"] > 20 and st["drafter_faults"] == 0, st
    assert st["tree_kv_moves"] > 0, "no accepted path left the first-child spine: compaction was not exercised"
    assert sum(st["tree_accepted_depth"][1:]) > 0.2 * st["tree_verified"], st
    # Drafting under the tree mask: a tree of 8 nodes must accept more per step than a chain of 8 drafts (measured
    # 0.89 vs 0.68 tokens, compiled); nodes drafted past a wrong mask would be garbage and lose that.
    cst = chain_run["adaspec"]
    assert cst["tree_verified"] == 0 and cst["verified_drafts"] > 0, cst
    tree_rate = st["accepted_drafts"] / st["tree_rounds"]
    chain_rate = cst["accepted_drafts"] / (cst["verified_drafts"] / 8)
    assert tree_rate > 1.15 * chain_rate, (tree_rate, chain_rate, st["tree_accepted_depth"])
