"""C2T tree growth (trees/c2t.py) as pure functions on known small trees; no vLLM."""

import numpy as np
import pytest
import torch

from vllm_adaspec.trees.c2t import confidence, grow_c2t, init_classifier, node_features, select_layer

# A draft model as a table: path -> (top tokens, their probabilities, entropy of the distribution).
TABLE = {
    (): ([1, 2, 3], [0.7, 0.2, 0.1], 0.8),
    (1,): ([4, 5], [0.9, 0.05], 0.4),
    (2,): ([6, 7], [0.5, 0.4], 1.0),
    (3,): ([8], [1.0], 0.0),
    (1, 4): ([9, 10], [0.6, 0.3], 0.9),
    (1, 5): ([11], [0.5], 1.2),
    (2, 6): ([12], [0.9], 0.3),
    (2, 7): ([13], [0.9], 0.3),
}


def children_of(path):
    return TABLE.get(path, ([], [], 0.0))


def joint_only(feats):  # a classifier that trusts the joint probability alone: C = P
    return feats[:, 0]


def paths_of(tree):
    out, toks, par = [], tree.tokens.tolist(), tree.parents.tolist()
    for i in range(len(toks)):
        p, j = [], i
        while j >= 0:
            p.append(toks[j])
            j = par[j]
        out.append(tuple(reversed(p)))
    return out


def test_layers_keep_the_children_above_beta_and_stop_when_none_passes():
    tree, t = grow_c2t(children_of, joint_only, beta=0.3, top_k=2, max_depth=5, budget=16)
    # depth 1: 1 (.7) passes, 2 (.2) fails; depth 2: (1,4) .63 passes, (1,5) .035 fails; depth 3: (1,4,9) .378
    # passes, (1,4,10) .189 fails; depth 4: no children -> stop
    assert paths_of(tree) == [(1,), (1, 4), (1, 4, 9)]
    assert t.probs == pytest.approx([0.7, 0.63, 0.378]) and t.depths == [1, 2, 3]
    assert all(-1 <= q < i for i, q in enumerate(tree.parents.tolist()))


def test_top_k_limits_which_children_are_scored_and_lower_beta_branches():
    tree, _ = grow_c2t(children_of, joint_only, beta=0.12, top_k=2, max_depth=5, budget=16)
    # token 3 (.1) is never scored with top_k 2; at beta .12: depth 1 {1 .7, 2 .2}, depth 2 {(1,4) .63} ((1,5) .035,
    # (2,6) .1, (2,7) .08 fail), depth 3 {(1,4,9) .378, (1,4,10) .189}
    assert paths_of(tree) == [(1,), (2,), (1, 4), (1, 4, 9), (1, 4, 10)]
    chain, _ = grow_c2t(children_of, joint_only, beta=0.12, top_k=1, max_depth=5, budget=16)  # dynamic draft length
    assert paths_of(chain) == [(1,), (1, 4), (1, 4, 9)]


def test_second_pruning_max_depth_and_budget_cap_the_tree():
    wide, _ = grow_c2t(children_of, joint_only, beta=0.01, top_k=3, max_depth=5, budget=16)
    assert len(wide) > 6
    second, _ = grow_c2t(children_of, joint_only, beta=0.01, top_k=3, max_depth=5, budget=16, second_top_k=1)
    assert paths_of(second) == [(1,), (1, 4), (1, 4, 9)]  # one node per layer: the most confident
    shallow, _ = grow_c2t(children_of, joint_only, beta=0.01, top_k=3, max_depth=1, budget=16)
    assert paths_of(shallow) == [(1,), (2,), (3,)]
    capped, _ = grow_c2t(children_of, joint_only, beta=0.01, top_k=3, max_depth=5, budget=4)
    assert len(capped) == 4 and paths_of(capped)[:3] == [(1,), (2,), (3,)]
    assert select_layer([0.2, 0.9, 0.5, 0.05], beta=0.1, second_top_k=None, room=2) == [1, 2]
    with pytest.raises(ValueError, match="beta"):
        grow_c2t(children_of, joint_only, beta=1.5, top_k=2, max_depth=3, budget=4)


def test_classifier_is_a_two_layer_ffn_over_three_features():
    params = init_classifier(seed=0)
    assert params["w1"].shape == (3, 48) and params["w2"].shape == (48, 1)
    f = node_features([0.5, 0.01], [0.3, 2.0], [1, 4])
    assert f.shape == (2, 3) and f.dtype == torch.float32
    got = confidence(params, f)
    want = torch.sigmoid(torch.relu(f.double() @ params["w1"].double() + params["b1"].double())
                         @ params["w2"].double() + params["b2"].double())[:, 0]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert ((got > 0) & (got < 1)).all()
    # any scorer plugs into growth: the classifier itself grows a tree
    tree, _ = grow_c2t(children_of, lambda x: confidence(params, x), beta=0.0, top_k=2, max_depth=2, budget=8)
    assert 1 <= len(tree) <= 6


def test_trained_classifier_recalls_accepted_nodes_and_keeps_few_others():
    import numpy as np

    from vllm_adaspec.training.c2t_trainer import fit_classifier, recall_and_positive_rate

    # Synthetic trees: a node is accepted with probability joint * 0.9^depth, more often at low entropy.
    rng = np.random.default_rng(0)
    n = 40000
    joint = rng.beta(0.4, 2.0, n)
    ent = rng.uniform(0.0, 5.0, n)
    depth = rng.integers(1, 8, n)
    acc = rng.random(n) < joint * 0.9 ** depth * np.exp(-0.2 * ent)
    feats = np.stack([joint, ent, depth], 1)
    params = fit_classifier(feats[:32000], acc[:32000], epochs=30, seed=0)
    recall, rate = recall_and_positive_rate(params, feats[32000:], acc[32000:], beta=0.2)
    # A random pick keeps accepted nodes at the rate it keeps any node (recall = rate); measured 0.73 at 0.32.
    assert recall > 0.6 and recall > 1.8 * rate and rate > 0.1, (recall, rate)
    # The classifier learned the direction of each feature.
    from vllm_adaspec.trees.c2t import confidence, node_features

    c = confidence(params, node_features([0.9, 0.1, 0.9, 0.9], [0.5, 0.5, 4.5, 0.5], [1, 1, 1, 7]))
    assert c[0] > c[1] and c[0] > c[2] and c[0] > c[3], c
    with pytest.raises(ValueError, match="accepted and rejected"):
        fit_classifier(feats[:10], np.zeros(10, bool))


def test_classifier_checkpoint_is_tied_to_its_exit_head(tmp_path):
    from safetensors.torch import save_file

    from vllm_adaspec.config import AdaspecConfigError
    from vllm_adaspec.heads.c2t import load_c2t, save_c2t

    head = tmp_path / "head"
    head.mkdir()
    save_file({"x": torch.ones(2)}, str(head / "exit_head.safetensors"))
    with pytest.raises(AdaspecConfigError, match=r"\['tree'\]\['builder'\]: 'c2t' needs a classifier .*no c2t.json"):
        load_c2t(str(head))
    params = init_classifier(seed=3)
    save_c2t(str(head), params, {"beta_report": {}})
    meta, t = load_c2t(str(head))
    assert torch.equal(t["w1"], params["w1"]) and meta["format"] == "vllm-adaspec/c2t/1"
    save_file({"x": torch.zeros(2)}, str(head / "exit_head.safetensors"))  # the head was retrained
    with pytest.raises(AdaspecConfigError, match="trained for another version of that exit head"):
        load_c2t(str(head))
    with pytest.raises(AdaspecConfigError, match="untrained exit"):
        load_c2t(None)


def test_replay_counts_what_each_selection_verifies_and_accepts():
    from vllm_adaspec.training.c2t_trainer import c2t_keep, joint_top, replay_trees

    # Root -> a (0.6) -> c (0.3); root -> b (0.3) -> d (0.25). The target accepted b, then d.
    parents = np.array([-1, -1, 0, 1])
    feats = np.array([[0.6, 1.0, 1], [0.3, 1.0, 1], [0.3, 0.5, 2], [0.25, 0.5, 2]], dtype=np.float32)
    accepted = np.array([False, True, False, True])
    tree = [(feats, accepted, parents)]
    assert replay_trees(tree, joint_top(1)) == (1.0, 1.0)  # only a: nothing accepted
    assert replay_trees(tree, joint_top(3)) == (2.0, 3.0)  # a, b, c: b accepted, d not verified
    assert replay_trees(tree, joint_top(4)) == (3.0, 4.0)
    # A classifier that passes every node deeper than... here: joint probability above 0.28 (w1 picks feature 0).
    params = {"w1": torch.tensor([[1.0], [0.0], [0.0]]), "b1": torch.tensor([-0.28]), "w2": torch.tensor([[1000.0]]),
              "b2": torch.tensor([-1e-3])}
    # Passes a, b, c (0.3 > 0.28) but not d: tau 2 with 3 nodes; with c's parent dropped, c would go too.
    assert replay_trees(tree, c2t_keep(params, 0.5)) == (2.0, 3.0)
    params["b1"] = torch.tensor([-0.4])  # only a passes
    assert replay_trees(tree, c2t_keep(params, 0.5)) == (1.0, 1.0)
