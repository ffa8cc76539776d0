"""Tensor parallelism (TP = 2 on this CPU build: multiprocess workers, one core each): every rank drafts, and the
ranks must draft identically (same drafts, same trees, same cost-model choices) or their attention diverges and
their collectives deadlock. SmolLM2-135M has 9 attention heads (not divisible by 2), so this runs a small random
Llama with SmolLM2's tokenizer (4 heads, 2 KV heads, float32). Greedy output must equal plain TP = 2 decoding for
MultiBranchProposer (step cost model on: its step times are rank-local, rank 0's are used everywhere; Self-Draft
branches on, so every step verifies a tree with branch rows), and per-rank drafting statistics, including a digest of every draft proposed, must be equal
across the ranks, with faults injected on rank 1 alone (contained on both ranks, counted on both). Seeded requests
at temperature 1 ride in the batch: with tree_verify faults on rank 1 alone both ranks must still commit the same
tokens at every step (a digest of every committed token, per rank), and a second run with the same seeds and faults
must write the same text (tests/test_ranks_agree.py emulates the same with the row-draw kernel's launch).""" 

import pytest

from conftest import ENGINE, MAX_TOKENS, PROMPTS, assert_identical

pytestmark = pytest.mark.engine

TP = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp", "max_num_seqs": 6}
# four greedy requests (compared with plain TP = 2 decoding) and two seeded ones at temperature 1 (verified by the
# tree sampler on the host: a fault there on one rank alone used to leave the ranks' tokens and streams apart)
BATCH = {"prompts": PROMPTS[:6],
         "params": [{"temperature": 0.0, "max_tokens": m} for m in MAX_TOKENS[:4]]
         + [{"temperature": 1.0, "seed": 11 + i, "max_tokens": 48} for i in range(2)]}
GREEDY = 4
# (not `chosen_nodes` and `branch_rows`: the drafter counts what it chose as it chooses, also in the call whose drafts
# every rank then dropped for rank 1's drafting fault; what was proposed to vLLM is `draft_digest`)
RANK_EQUAL = ("committed_digest", "propose_calls", "decode_rows", "draft_tokens", "tree_nodes", "tree_verified",
              "accepted_drafts", "verified_drafts", "draft_digest", "round_lengths", "tree_accepted_depth",
              "draft_steps", "cost_observations", "step_costs")


# Faults injected on rank 1 only (faults.py): in drafting (a pool), planning a step's trees, verifying a tree and
# compaction. Each must turn that step's drafts (or trees) off on both ranks, counted on both: a rank drafting or
# verifying alone would make the ranks' attention differ (wrong tokens, or collectives out of step: a hang).
RANK1_FAULTS = {"VLLM_ADASPEC_INJECT_FAULTS": "context@6,tree_plan@9,tree_verify@14,tree_verify@15,tree_verify@16,"
                                             "tree_verify@17,tree_verify@40,compaction@20",
                "VLLM_ADASPEC_INJECT_FAULTS_RANK": "1"}
NUM_FAULTS = 8


def run(model, engine, env=None):
    from vllm_adaspec.harness import default_env, run_engine

    # vLLM's automatic binding wants a NUMA node per CPU worker; this machine has one: a core per rank instead
    env = {**default_env(), "VLLM_CPU_OMP_THREADS_BIND": "0|1", **(env or {})}
    return run_engine({"model": model, "engine": {**ENGINE, **TP, **engine}, "batches": [BATCH], "all_ranks": True},
                      env=env, timeout=600)["batches"][0]["runs"][0]


def greedy_rows(r):
    return {"token_ids": r["token_ids"][:GREEDY]}


def test_tp2_drafts_identically_on_both_ranks_and_output_equals_plain_tp2(tiny_llama):
    plain = run(tiny_llama, {})
    # MultiBranchProposer covers what TP can break: trees (tree attention on each rank's heads, KV compaction per
    # rank), branch rows and the cost model's rank-local timings. Early-exit trees under TP = 2 were run the same
    # way by hand (identical output and drafts, session 12's closing note) and are left out to keep the suite short.
    arms = [({"model": "vllm_adaspec.MultiBranchProposer", "num_speculative_tokens": 20},
             {"branches": 2, "branch_length": 2})]
    for spec, settings in arms:
        engine = {"speculative_config": spec, "additional_config": {"adaspec": settings}}
        got, again = run(tiny_llama, engine, RANK1_FAULTS), run(tiny_llama, engine, RANK1_FAULTS)
        assert_identical(greedy_rows(got), greedy_rows(plain))
        ranks = got["adaspec_ranks"]
        assert len(ranks) == 2 and ranks[0]["tree_verified"] > 20 and ranks[0]["accepted_drafts"] > 0, ranks[0]
        # the faults happened on rank 1 and count on both ranks alike
        assert ranks[0]["drafter_faults"] == ranks[1]["drafter_faults"] == NUM_FAULTS, (
            ranks[0]["faults_by_place"], ranks[1]["faults_by_place"])
        assert ranks[0]["faults_by_place"] == {"on another tensor-parallel rank": NUM_FAULTS}, ranks[0]["faults_by_place"]
        # the tree_verify faults hit the sampled requests too (host-verified: their own generators)
        assert sum(n for p, n in ranks[1]["faults_by_place"].items() if p.startswith("verifying request")) == 5
        # both ranks committed the same tokens at every step, drafted alike, and a second run with the same seeds
        # and faults wrote the same text, sampled requests included
        for key in RANK_EQUAL:
            assert ranks[0].get(key) == ranks[1].get(key), (spec["model"], key, ranks[0].get(key), ranks[1].get(key))
        assert ranks[0]["committed_digest"] != 0
        assert got["token_ids"] == again["token_ids"]
