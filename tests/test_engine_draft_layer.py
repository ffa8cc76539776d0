"""EarlyExitProposer with the shipped draft layer (an exit head on all of SmolLM2's layers that reads the target's
features: its final hidden state and, fused with it, the residual streams after some earlier layers, which vLLM returns
from the forward as EAGLE-3's auxiliary hidden states: training/draft_layer.py, engine/drafting.py `feed`), end to
end in vLLM's default compiled mode (the auxiliary outputs are part of the compiled graph): greedy output equals plain
decoding on the mixed batch (prefills, prefix caching) and on its next turn, and the engine's drafts are the torch
reference's: rounds and acceptance equal a torch replay of the same layer, its weights int8 as the engine's default
runs them, on the same text (a feature read one row off, a depth missing or out of order, a KV row fed from the wrong
feature or a wrong int8 row, drafts garbage)."""

import pytest

from conftest import ENGINE, MAX_TOKENS, NEXT_TURN, PROMPTS, SPEC, assert_identical, greedy_batch

pytestmark = pytest.mark.engine

K = 6
TREE = {"budget": 6, "top_k": 2}  # max_depth 3: two children per node, the 6 most probable nodes verified
TREE_TOKENS = [min(m, 64) for m in MAX_TOKENS]  # the mixed batch's outputs, cut: greedy, they are plain's prefixes


def draft_layer_folder() -> str:
    from vllm_adaspec.heads import SHIPPED_DIR

    import os

    return os.path.join(SHIPPED_DIR, "smollm2-135m-instruct-draft-layer")


@pytest.fixture(scope="module")
def draft_layer_runs(smollm2, tree_engines):
    """One engine in vLLM's default (compiled) mode, K drafts every round (no cost model, fixed length): the mixed
    batch with chains (each request asks for them), its next turn and the mixed batch again with token trees (its
    outputs at most 64 tokens)."""
    engine = {k: v for k, v in ENGINE.items() if k != "enforce_eager"}
    spec = {**engine, "speculative_config": {"model": SPEC, "num_speculative_tokens": K},
            "additional_config": {"adaspec": {"exit_head": draft_layer_folder(), "cost_model": "off",
                                              "policy": "fixed", "tree": TREE}}}
    chains = greedy_batch()
    chains["params"] = [{**p, "extra_args": {"adaspec_speculation": "chain"}} for p in chains["params"]]
    trees = greedy_batch(max_tokens=TREE_TOKENS)
    res = tree_engines.run({"model": smollm2, "engine": spec, "batches": [chains, NEXT_TURN, trees]})
    return [b["runs"][0] for b in res["batches"]]


def _sequences(smollm2, run):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    seqs = []
    for p, out, plen in zip(PROMPTS, run["token_ids"], run["prompt_lens"]):
        ids = tok(p)["input_ids"]
        assert len(ids) == plen
        seqs.append((plen, ids + list(out)))
    return seqs


def _int8_layer(smollm2):
    from vllm_adaspec.training.draft_layer import load_draft_layer, with_int8_weights

    layer, vocab = load_draft_layer(smollm2, draft_layer_folder())
    # the default on this CPU: the layer's weights as int8 rows (kernels/int8_linear.py); the reference computes so
    return with_int8_weights(layer), vocab


def test_draft_layer_is_lossless_and_drafts_what_a_torch_replay_predicts(smollm2, plain_greedy, draft_layer_runs):
    run, next_turn, _ = draft_layer_runs
    assert_identical(run, plain_greedy["mixed"])
    assert_identical(next_turn, plain_greedy["next_turn"])
    st = run["adaspec"]
    assert st["drafter_faults"] == 0 and st["config"]["exit_kv_layers"] == ["adaspec_exit.layers.30.self_attn.attn"]
    assert st["tree_verified"] == 0  # every request asked for chains
    assert st["config"]["draft_weights"] == "int8"
    layer, vocab = _int8_layer(smollm2)
    assert len(layer.feature_layers) > 1  # the shipped layer fuses several depths: the auxiliary path is tested
    # the torch reference on the same text: from every position, a chain of K drafts, decoded K a round
    rounds, accepted = reference_rounds(smollm2, layer, vocab, _sequences(smollm2, run))
    engine_rounds = sum(st["round_lengths"][1:])
    # the engine's rounds are the reference's (K drafts from the same text), up to float32 noise between vLLM's
    # kernels and torch's and each request's first row (position 0 reads no feature)
    assert engine_rounds == pytest.approx(rounds, rel=0.05), (engine_rounds, rounds)
    assert st["accepted_drafts"] / engine_rounds == pytest.approx(accepted / rounds, rel=0.1), (st, accepted, rounds)
    assert accepted / rounds > 0.5, accepted / rounds  # a layer that drafts (0 = nothing accepted)
    # every decode step's first committed row was written by the step before's first draft pass and is not run
    # again (the acceptance above is what proves that KV right)
    assert st["feed_rows_reused"] >= 0.9 * engine_rounds, st


def test_draft_layer_trees_are_lossless_and_draft_what_a_torch_replay_predicts(smollm2, plain_greedy,
                                                                                draft_layer_runs):
    """Token trees from the draft layer's top-k per depth (a node reads its parent's output as its feature and
    attends to the prefix and its own ancestors only): greedy output equals plain decoding, and the engine's
    acceptance is a torch replay's of the same layer building the same trees (a node fed the wrong parent's
    feature, a sibling's KV seen, or a tree's accepted path fed to the layer's KV in the wrong order drafts garbage
    below depth 1)."""
    run = draft_layer_runs[2]
    plain = plain_greedy["mixed"]["token_ids"]
    assert run["token_ids"] == [out[:m] for out, m in zip(plain, TREE_TOKENS)]
    st = run["adaspec"]
    assert st["drafter_faults"] == 0 and st["tree_verified"] > 100, st
    layer, vocab = _int8_layer(smollm2)
    rounds, accepted, hist = reference_tree_rounds(smollm2, layer, vocab, _sequences(smollm2, run))
    # verified trees by the depth of their accepted path (a request's last proposal, made as it finished, is never
    # verified: rounds proposed would count it)
    depths = st["tree_accepted_depth"]
    engine_rounds, engine_accepted = sum(depths), sum(d * n for d, n in enumerate(depths))
    assert engine_rounds == pytest.approx(rounds, rel=0.05), (depths, hist)
    assert engine_accepted / engine_rounds == pytest.approx(accepted / rounds, rel=0.1), (depths, hist)
    # every depth: a node below depth 1 reading a wrong feature or seeing a sibling's KV empties the deep end
    assert all(n == pytest.approx(r, abs=0.05 * rounds) for n, r in zip(depths, hist)), (depths, hist)
    assert accepted / rounds > 1.0, accepted / rounds  # trees of depth 3 accept more than a token a round here
    assert st["feed_rows_reused"] >= 0.9 * engine_rounds, st  # each tree's root KV came from its first pass


def reference_rounds(model_dir, layer, vocab, seqs) -> tuple[int, int]:
    """Greedy decoding of each (prompt length, prompt + output) with K drafts a round from the torch draft layer, as
    the engine runs it: the prefill commits the first output token, then each round drafts a chain of K from the
    feature of the row before the last committed token and commits the accepted drafts + 1. (rounds, accepted)."""
    import numpy as np
    import torch

    from vllm_adaspec.training.draft_layer import chain_drafts, target_features

    layer.vocab = torch.as_tensor(vocab, dtype=torch.long)
    rounds = accepted = 0
    for plen, ids in seqs:
        ids = np.asarray(ids)
        f, _ = target_features(model_dir, layer.feature_layers, ids)
        x = torch.from_numpy(np.concatenate([ids[1:], ids[-1:]]).astype(np.int64))
        drafts = layer.vocab[chain_drafts(layer, "layer", torch.from_numpy(f.astype(np.float32)), x, K)].numpy()
        c = plen + 1  # committed tokens after the prefill
        while c < len(ids):
            truth = ids[c:c + K]
            a = int(np.cumprod(drafts[c - 2, :len(truth)] == truth).sum())
            a = min(a, len(ids) - c - 1)  # the output ends: its last token is a round's bonus, never a draft
            rounds, accepted = rounds + 1, accepted + a
            c += a + 1
    return rounds, accepted



def reference_tree_rounds(model_dir, layer, vocab, seqs) -> tuple[int, int]:
    """Greedy decoding of each (prompt length, prompt + output) with the engine's joint tree builder on the torch
    layer's full binary tree of top-2 drafts (tree_drafts): depth by depth, children of the nodes run, the top_k most
    probable nodes of the newest depth among the budget's best run next (at most K - 1 of them), the budget's most
    probable nodes verified; each round commits the accepted path + 1. (rounds, accepted, rounds by accepted
    depth)."""
    import numpy as np
    import torch

    from vllm_adaspec.training.draft_layer import target_features, tree_drafts
    from vllm_adaspec.trees import GrowingTree, add_children, best_subtree, to_expand

    budget, top_k = TREE["budget"], TREE["top_k"]
    limit, room = -(-budget // top_k), budget - 1
    layer.vocab = torch.as_tensor(vocab, dtype=torch.long)
    rounds = accepted = 0
    hist = [0] * (limit + 1)
    for plen, ids in seqs:
        ids = np.asarray(ids)
        f, _ = target_features(model_dir, layer.feature_layers, ids)
        x = torch.from_numpy(np.concatenate([ids[1:], ids[-1:]]).astype(np.int64))
        levels = tree_drafts(layer, torch.from_numpy(f.astype(np.float32)), x, (top_k,) * limit)
        c = plen + 1
        while c < len(ids):
            t = c - 2  # the root is ids[c - 1]; its drafts start at the row before
            g, ref = GrowingTree(), {}  # ref: grown node -> its index in tree_drafts' level
            feed, ran = [-1], 0
            for depth in range(1, limit + 1):
                lid, lp = levels[depth - 1]
                for node in feed:
                    b = 0 if node < 0 else ref[node]
                    first = len(g.parents)
                    add_children(g, node, vocab[lid[t, b * top_k:(b + 1) * top_k].numpy()].tolist(),
                                 lp[t, b * top_k:(b + 1) * top_k].tolist())
                    ref.update({first + i: b * top_k + i for i in range(top_k)})
                if depth >= limit:
                    break
                feed = to_expand(g, depth, top_k, budget)[:room - ran]
                ran += len(feed)
                if not feed:
                    break
            tree, _ = best_subtree(g, budget, limit)
            tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
            truth, a, at = ids[c:c + limit], 0, -1
            while a < len(truth):
                nxt = [j for j, (p, tk) in enumerate(zip(parents, tokens)) if p == at and tk == truth[a]]
                if not nxt:
                    break
                at, a = nxt[0], a + 1
            a = min(a, len(ids) - c - 1)  # the output ends: its last token is a round's bonus, never a draft
            hist[a] += 1
            rounds, accepted = rounds + 1, accepted + a
            c += a + 1
    return rounds, accepted, hist
