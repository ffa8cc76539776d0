"""The learned draft on the target's features (training/draft_layer.py), without an engine, on a small random Llama:
the training-time test's attention is a draft chain's, so the replay's batched chains equal chains drafted one step
at a time with each step's own keys; both families train (loss down, held-out agreement up) on a corpus the target
wrote."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from vllm_adaspec.training.draft_layer import build, chain_drafts, ttt_mask


def test_the_training_time_mask_is_a_draft_chains_attention():
    m = ttt_mask(6, 3, "cpu")  # step 3, 6 positions: true rows, step-2 rows, step-3 rows
    assert m.shape == (6, 18)
    p = 4  # the chain starting at 2: true rows 0..2, its step-2 row at 3, itself at 4
    assert m[p, :6].nonzero().flatten().tolist() == [0, 1, 2]
    assert m[p, 6:12].nonzero().flatten().tolist() == [3]
    assert m[p, 12:].nonzero().flatten().tolist() == [4]


@pytest.fixture(scope="module")
def layer(tiny_llama):
    torch.manual_seed(0)
    m = build("layer", tiny_llama, np.arange(300), depth=3)
    with torch.no_grad():
        for p in m.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)  # away from the identity start: chains that differ
    return m.eval()


def test_batched_chains_equal_chains_drafted_one_step_at_a_time(layer):
    """chain_drafts drafts from every position at once with the training-time mask; one chain at a time, each step
    attends to the true rows up to its start and its own earlier steps' keys, as a drafter with a KV cache does."""
    g = torch.Generator().manual_seed(1)
    t, k, h = 12, 3, layer.s.hidden
    feats = torch.randn(t, h, generator=g)
    tokens = torch.randint(0, 300, (t,), generator=g)
    layer.vocab = torch.arange(300)
    got = chain_drafts(layer, "layer", feats, tokens, k)
    with torch.no_grad():
        pos = torch.arange(t)[None]
        g1, true_kv = layer.attend(layer.inputs(feats[None], tokens[None]), pos, [], None)
        for start in range(t - k + 1):
            keys = [(true_kv[0][:, :, :start + 1], true_kv[1][:, :, :start + 1])]
            cur_g, cur_tok = g1[:, start:start + 1], int(layer.logits(g1[0, start]).argmax())
            want = [cur_tok]
            for d in range(1, k):
                u = layer.inputs(cur_g, torch.tensor([[cur_tok]]))
                mask = torch.ones(1, start + 1 + d, dtype=torch.bool)
                cur_g, kv = layer.attend(u, torch.tensor([[start + d]]), [(torch.cat([a for a, _ in keys], 2),
                                                                          torch.cat([b for _, b in keys], 2))], mask)
                keys.append(kv)
                cur_tok = int(layer.logits(cur_g[0, 0]).argmax())
                want.append(cur_tok)
            assert got[start].tolist() == want, (start, got[start].tolist(), want)


def test_a_draft_tree_from_top_k_holds_the_chain_and_branches_like_it(layer):
    """tree_drafts: the all-first-children path is the greedy chain; a node's children are what a chain drafts from
    it (its second child's subtree is the chain fed that token); probabilities are the layer's, best first."""
    from vllm_adaspec.training.draft_layer import tree_drafts

    g = torch.Generator().manual_seed(2)
    t, h = 12, layer.s.hidden
    feats, tokens = torch.randn(t, h, generator=g), torch.randint(0, 300, (t,), generator=g)
    layer.vocab = torch.arange(300)
    chain = chain_drafts(layer, "layer", feats, tokens, 3)
    assert all(torch.equal(ids[:, 0], chain[:, j]) for j, (ids, _) in enumerate(tree_drafts(layer, feats, tokens,
                                                                                              (1, 1, 1))))
    (i1, p1), (i2, p2), (i3, p3) = tree_drafts(layer, feats, tokens, (2, 2, 1))
    assert i1.shape == (t, 2) and i2.shape == (t, 4) and i3.shape == (t, 4)
    ok = slice(0, t - 2)  # starts with all three depths inside the sequence
    assert torch.equal(i1[:, 0], chain[:, 0]) and torch.equal(i2[ok, 0], chain[ok, 1]) and torch.equal(i3[ok, 0],
                                                                                                       chain[ok, 2])
    assert (p1[:, 0] >= p1[:, 1]).all() and (p2[ok, 0] >= p2[ok, 1]).all() and (p1.sum(1) <= 1 + 1e-6).all()
    # the second depth-1 child's first child, drafted one step at a time from that token
    with torch.no_grad():
        pos = torch.arange(t)[None]
        g1, kv = layer.attend(layer.inputs(feats[None], tokens[None]), pos, [], None)
        for start in range(t - 2):
            keys = (kv[0][:, :, :start + 1], kv[1][:, :, :start + 1])
            u = layer.inputs(g1[:, start:start + 1], i1[start:start + 1, 1][None])
            g2, _ = layer.attend(u, torch.tensor([[start + 1]]), [keys], torch.ones(1, start + 2, dtype=torch.bool))
            assert int(layer.logits(g2[0, 0]).argmax()) == int(i2[start, 2]), start


def _corpus(folder, model, sequences=24, prompt=8, length=48, seed=0):
    """A corpus in `adaspec distill`'s layout: random prompts over 300 tokens, each continued greedily by the target
    (as `adaspec distill` has the target write its own text)."""
    from vllm_adaspec.training.layers import read_hf_tensors, rms_norm, target_prefix_layers

    stack = target_prefix_layers(model, 4)
    t = read_hf_tensors(model, ["model.norm.weight", "model.embed_tokens.weight"])
    rng = np.random.default_rng(seed)
    seqs = [list(rng.integers(0, 300, prompt)) for _ in range(sequences)]
    with torch.no_grad():
        for _ in range(length - prompt):
            ids = torch.tensor(seqs)
            h = stack(ids, torch.arange(ids.shape[1])[None].expand_as(ids), (4,))[4][:, -1]
            nxt = (rms_norm(h, t["model.norm.weight"], 1e-6) @ t["model.embed_tokens.weight"].T).argmax(-1)
            for s_, x in zip(seqs, nxt.tolist()):
                s_.append(x)
    tokens = np.asarray([x for s_ in seqs for x in s_], np.int32)
    offsets = np.arange(0, len(tokens) + 1, length, dtype=np.int64)
    top1 = np.asarray([x for s_ in seqs for x in s_[prompt:]], np.int32)[:, None]  # greedy: the top-1 is the token
    folder.mkdir()
    np.savez(folder / "shard-00000.npz", tokens=tokens, offsets=offsets, prompt_lens=np.full(sequences, prompt, np.int32),
             sampled=np.zeros(sequences, bool), topk_ids=top1, topk_logp=np.zeros(top1.shape, np.float16))
    return seqs


@pytest.fixture(scope="module")
def corpus(tiny_llama, tmp_path_factory):
    """(folder, sequences): one corpus the target wrote, for both families"""
    folder = tmp_path_factory.mktemp("draft-corpus") / "data"
    return folder, _corpus(folder, tiny_llama)


def test_features_are_the_final_normed_state_and_labels_the_corpus_top1(tiny_llama, corpus):
    from vllm_adaspec.training.distill import load_shards
    from vllm_adaspec.training.draft_layer import feature_cache, target_features

    data, seqs = corpus
    feats, labels, count = feature_cache(tiny_llama, str(data), load_shards(str(data)), 0, progress=False)
    assert count == len(seqs) and feats.shape == (len(seqs) * 48, 128)
    for i in (0, 5):
        want_f, want_l = target_features(tiny_llama, 4, np.asarray(seqs[i]))  # float32 prefill
        got_f, got_l = np.asarray(feats[48 * i:48 * (i + 1)], np.float32), labels[48 * i:48 * (i + 1)]
        # bfloat16 prefill against float32: the same state within bfloat16's rounding over 4 layers
        assert np.abs(got_f - want_f).mean() < 0.05 * np.abs(want_f).mean()
        # a generated position's label is the corpus' token after it; a prompt position's, the prefill's argmax
        assert got_l[7:47].tolist() == seqs[i][8:48]
        assert (got_l[:7] == want_l[:7]).mean() >= 6 / 7
        assert got_l[47] == -1  # the last token has no next one in the corpus
        # labels of the first `labelled` positions only: the same argmax there, -1 after
        _, some = target_features(tiny_llama, 4, np.asarray(seqs[i]), labelled=7)
        assert some[:7].tolist() == want_l[:7].tolist() and (some[7:] == -1).all()


def test_the_soft_label_loss_is_cross_entropy_against_the_targets_top_k():
    from vllm_adaspec.training.draft_layer import _soft_ce

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 12, generator=g)
    hard = torch.tensor([3, 0, 7, 11, 2])
    one_hot_ids = torch.stack([hard, torch.full_like(hard, -1)], 1)
    assert _soft_ce(logits, one_hot_ids, torch.tensor([[1.0, 0.3]] * 5)) == pytest.approx(
        float(torch.nn.functional.cross_entropy(logits, hard)), rel=1e-5)  # ids outside the vocabulary drop out
    ids, p = torch.tensor([[1, 4]] * 5), torch.tensor([[0.6, 0.2]] * 5)  # renormalized to 0.75 / 0.25
    want = -(0.75 * logits.log_softmax(-1)[:, 1] + 0.25 * logits.log_softmax(-1)[:, 4]).mean()
    assert _soft_ce(logits, ids, p) == pytest.approx(float(want), rel=1e-5)


def test_distribution_labels_are_the_targets_next_distribution_over_the_draft_vocabulary(layer):
    """labels "distribution": the loss is KL(softmax(head(f_{t+1})) || the draft's), 0 where the draft's logits are
    the target's, and the positions without a label (-1) drop out."""
    from vllm_adaspec.training.draft_layer import _losses

    g = torch.Generator().manual_seed(1)
    feats, tokens = torch.randn(2, 9, 128, generator=g), torch.randint(0, 300, (2, 9), generator=g)
    feats = feats / feats.pow(2).mean(-1, keepdim=True).sqrt()  # unit RMS: the draft's norm (weight 1) leaves them
    labels = torch.randint(0, 300, (2, 9), generator=g)
    labels[:, -1] = -1
    to_sub = torch.arange(50_000)
    loss, _ = _losses(layer, "layer", feats, tokens, labels, to_sub, 1, 0.0, "distribution")
    with torch.no_grad():
        (g1,) = layer.unroll(feats, tokens, 1)
        p = torch.softmax(feats[:, 1:] @ layer.head.T, -1)  # the target's distribution after f_{t+1}
        logq = torch.log_softmax(layer.logits(g1)[:, :-1], -1)
    want = (p * (p.log() - logq)).sum(-1).mean()
    assert float(loss.detach()) == pytest.approx(float(want), rel=1e-4) and float(want) > 0.01
    orig, norm = layer.unroll, layer.norm.detach().clone()
    layer.norm.data.fill_(1.0)
    layer.unroll = lambda f, x, d: [torch.cat([f[:, 1:], f[:, -1:]], 1)]  # a draft that outputs f_{t+1}: KL 0
    try:
        zero, _ = _losses(layer, "layer", feats, tokens, labels, to_sub, 1, 0.0, "distribution")
    finally:
        layer.unroll = orig
        layer.norm.data.copy_(norm)
    assert abs(float(zero)) < 1e-5


def test_several_corpus_folders_train_as_their_concatenation(tiny_llama, corpus, tmp_path):
    from vllm_adaspec.training.distill import load_shards
    from vllm_adaspec.training.draft_layer import corpus_features

    data, seqs = corpus
    second = tmp_path / "second"
    more = _corpus(second, tiny_llama, sequences=5, seed=3)
    s1, f1, l1, c1 = corpus_features(tiny_llama, str(data), 0, progress=False)
    s2, f2, l2, c2 = corpus_features(tiny_llama, f"{data},{second}", 0, progress=False)
    assert c2 == c1 + 5 == len(seqs) + len(more) and len(s2) == c2
    assert s2.tokens.tolist() == [x for q in seqs + more for x in q]
    assert np.array_equal(f2[:len(f1)], f1) and np.array_equal(l2[:len(l1)], l1)
    assert s2.topk_ids.shape[0] == s1.topk_ids.shape[0] + load_shards(str(second)).topk_ids.shape[0]
    # max_tokens takes folders in order: the first folder's first sequence only
    s3, f3, _, c3 = corpus_features(tiny_llama, f"{data},{second}", 0, max_tokens=40, progress=False)
    assert c3 == 1 and f3.shape[0] == 48


def test_the_feature_cache_prefills_only_the_shards_it_lacks(tiny_llama, corpus, tmp_path):
    """Features are cached per corpus shard: a grown corpus prefills its new shards only, an interrupted prefill's
    leftovers are ignored, and rows read across shards are the shards' concatenation."""
    import shutil

    from vllm_adaspec.training.distill import load_shards
    from vllm_adaspec.training.draft_layer import feature_cache

    data, seqs = corpus
    grown = tmp_path / "grown"
    grown.mkdir()
    shutil.copy(data / "shard-00000.npz", grown / "shard-00000.npz")
    first, lab1, c1 = feature_cache(tiny_llama, str(grown), load_shards(str(grown)), 0, progress=False)
    shard0 = grown / "features-N4" / "shard-00000.npy"
    stamp = shard0.stat().st_mtime_ns
    shutil.copy(data / "shard-00000.npz", grown / "shard-00001.npz")  # the corpus grew by a shard
    (grown / "features-N4" / "shard-00001.npy.999.tmp.npy").write_bytes(b"half a prefill")
    both, lab2, c2 = feature_cache(tiny_llama, str(grown), load_shards(str(grown)), 0, progress=False)
    assert shard0.stat().st_mtime_ns == stamp and c2 == 2 * c1 and len(both) == 2 * len(first)
    n = len(first)
    assert np.array_equal(both[n - 5:n + 5], np.concatenate([first[n - 5:n], first[0:5]]))
    assert np.array_equal(lab2, np.concatenate([lab1, lab1]))
    assert np.array_equal(np.asarray(both), np.concatenate([np.asarray(first)] * 2))
    # a third shard without features: cached_only trains on the two before it and prefills nothing
    shutil.copy(data / "shard-00000.npz", grown / "shard-00002.npz")
    two, _, c4 = feature_cache(tiny_llama, str(grown), load_shards(str(grown)), 0, progress=False, cached_only=True)
    assert c4 == c2 and len(two) == len(both) and not (grown / "features-N4" / "shard-00002.npy").exists()
    # max_tokens within the first shard reads that shard only
    part, _, c3 = feature_cache(tiny_llama, str(grown), load_shards(str(grown)), 0, max_tokens=100, progress=False)
    assert c3 == 2 and len(part) == 96 and len(part.parts) == 1


def test_fused_features_start_as_the_last_layer_alone_and_share_its_cache(tiny_llama, corpus, tmp_path):
    """Features of several depths (EAGLE-3's low / middle / high) are cached once; a draft reading fewer of them reads
    that cache's columns; the fused layer starts out drafting exactly as the one on the last layer alone."""
    from vllm_adaspec.training.distill import load_shards
    from vllm_adaspec.training.draft_layer import ColumnView, feature_cache

    import shutil

    data, seqs = tmp_path / "data", corpus[1]
    data.mkdir()
    shutil.copy(corpus[0] / "shard-00000.npz", data / "shard-00000.npz")  # no cache yet
    shards = load_shards(str(data))
    fused, lab2, _ = feature_cache(tiny_llama, str(data), shards, (2, 4), progress=False)
    last, lab1, _ = feature_cache(tiny_llama, str(data), shards, 0, progress=False)
    assert fused.shape == (len(seqs) * 48, 256) and last.shape == (len(seqs) * 48, 128)
    assert all(isinstance(p, ColumnView) for p in last.parts) and not (data / "features-N4").exists()
    assert np.array_equal(last[0:96], np.asarray(fused[0:96])[:, 128:]) and np.array_equal(lab1, lab2)
    vocab = np.arange(300)
    one, two = build("layer", tiny_llama, vocab, 2, 0), build("layer", tiny_llama, vocab, 2, (2, 4))
    two.load_state_dict(one.state_dict(), strict=False)
    f = torch.from_numpy(np.asarray(fused[0:48], np.float32))[None]
    x = torch.from_numpy(np.asarray(seqs[0][1:] + seqs[0][-1:], np.int64))[None]
    with torch.no_grad():
        for a, b in zip(one.unroll(f[..., 128:], x, 2), two.unroll(f, x, 2)):
            torch.testing.assert_close(one.logits(a), two.logits(b), atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="last layer"):
        build("layer", tiny_llama, vocab, 2, (4, 2))


def test_a_fused_layer_saves_as_an_exit_head_that_drafts_the_same(tiny_llama, corpus, tmp_path):
    """A layer on fused features is written as the exit head EarlyExitProposer loads (its depths in the meta, the
    per-depth norms and the fuse map with the layer): loaded back, it drafts what was trained."""
    from vllm_adaspec.heads import load_exit_head
    from vllm_adaspec.training.draft_layer import DraftTrainSettings, _config, _save_as_exit_head, load_draft_layer

    torch.manual_seed(0)
    vocab = np.arange(300)
    m = build("layer", tiny_llama, vocab, 2, (2, 4))
    with torch.no_grad():
        for p in (m.fuse.weight, m.part_norm, m.fc.weight, m.layer.self_attn.o_proj.weight):
            p.add_(0.05 * torch.randn_like(p))
        for p in m.parameters():  # (checkpoints are bfloat16; the embedding and head rows are the target's)
            if p.requires_grad:
                p.copy_(p.to(torch.bfloat16))
    st = DraftTrainSettings(model=tiny_llama, data=str(corpus[0]), out=str(tmp_path / "head"), feature_layer=(2, 4))
    _save_as_exit_head(st, _config(tiny_llama), m, vocab, (2, 4))
    meta, _ = load_exit_head(st.out, tensors=False)
    assert meta["feature_layers"] == [2, 4] and meta["input"] == "features" and meta["exit_layer"] == 4
    back, vocab2 = load_draft_layer(tiny_llama, st.out)
    assert back.feature_layers == (2, 4) and np.array_equal(vocab, vocab2)
    f, x = torch.randn(1, 12, 256), torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        for a, b in zip(m.unroll(f, x, 2), back.unroll(f, x, 2)):
            torch.testing.assert_close(m.logits(a), back.logits(b))


@pytest.mark.parametrize("family", ["layer", "mlp"])
def test_both_families_learn_the_targets_next_tokens(tiny_llama, corpus, tmp_path, family):
    from vllm_adaspec.training.draft_layer import DraftTrainSettings, replay, train_draft_layer

    data, seqs = corpus
    st = DraftTrainSettings(model=tiny_llama, data=str(data), out=str(tmp_path / family), family=family,
                            depth=2, draft_vocab=512, epochs=20, lr=3e-3, batch_tokens=1024, holdout_every=6,
                            labels="distribution" if family == "layer" else "argmax")
    report = train_draft_layer(st, progress=False, log=lambda *a: None)
    # a random target's text does not generalize across sequences (its tokens spread over 49k ids): learning is read
    # off the training curve (loss, top-1 agreement at each depth), which must move well
    first, last = report["curve"][:3], report["curve"][-3:]  # (step, loss, top-1 by depth), a few batches each
    loss0, loss1 = np.mean([c[1] for c in first]), np.mean([c[1] for c in last])
    top0, top1 = np.mean([c[2][0] for c in first]), np.mean([c[2][0] for c in last])
    assert loss1 < 0.9 * loss0 and top1 > top0 + 0.05, report["curve"]
    # the layer on the last layer's features is an exit head EarlyExitProposer loads (exit_layer = L, reads features)
    saved = "exit_head.safetensors" if family == "layer" else "draft_layer.safetensors"
    assert (tmp_path / family / saved).exists()
    # the replay drafts chains of 3 (past the depths trained, for the MLP) from every position of a continuation
    res = replay(report["model"], family, report["vocab_ids"], tiny_llama, [(8, seqs[0]), (8, seqs[6])], k=3)
    assert res["positions"] == 2 * 39 and len(res["accept_at_depth"]) == 3
    a = res["accept_at_depth"]
    assert a[0] >= a[1] >= a[2] and res["tau_by_k"][1] == pytest.approx(1 + a[0], abs=0.35), res


def test_training_goes_on_from_a_checkpoint_it_wrote(tiny_llama, corpus, tmp_path):
    """`init` starts from a checkpoint's weights and draft vocabulary: before its first step the second run agrees
    with the target exactly as the first ended (same held-out split), and a checkpoint of another shape is refused."""
    from vllm_adaspec.heads import load_exit_head
    from vllm_adaspec.training.draft_layer import DraftTrainSettings, train_draft_layer

    data, _ = corpus
    st = DraftTrainSettings(model=tiny_llama, data=str(data), out=str(tmp_path / "a"), feature_layer=(2, 4), depth=2,
                            draft_vocab=400, epochs=4, lr=3e-3, batch_tokens=1024, holdout_every=6, amp=False)
    first = train_draft_layer(st, progress=False, log=lambda *a: None)
    assert first["agreement_after"] != first["agreement_before"]  # it trained: the warm start has something to keep
    go_on = replace(st, out=str(tmp_path / "b"), init=st.out, draft_vocab=50, epochs=1)
    second = train_draft_layer(go_on, progress=False, log=lambda *a: None)
    # (checkpoints are bfloat16: a near-tie may flip)
    assert second["agreement_before"] == pytest.approx(first["agreement_after"], abs=0.02), (first, second)
    vocab_a = load_exit_head(st.out)[1]["draft_vocab"]
    assert torch.equal(load_exit_head(go_on.out)[1]["draft_vocab"], vocab_a) and len(vocab_a) == 400
    with pytest.raises(ValueError, match="layers"):
        train_draft_layer(replace(go_on, feature_layer=0, out=str(tmp_path / "c")), progress=False)


def test_a_run_cut_short_resumes_where_it_stopped_and_ends_as_an_uncut_one(tiny_llama, corpus, tmp_path, monkeypatch):
    """Progress is saved (OUT/train-state.pt) while training: run again with the same settings, a run killed
    mid-way goes on from its last save and ends with the weights an uncut run ends with; other settings are refused
    by name, and the state is gone once the checkpoint is written."""
    from vllm_adaspec.training import draft_layer as dl

    data, _ = corpus
    st = dl.DraftTrainSettings(model=tiny_llama, data=str(data), out=str(tmp_path / "uncut"), depth=2,
                               draft_vocab=300, epochs=2, lr=3e-3, batch_tokens=1024, holdout_every=6, amp=False)
    whole = dl.train_draft_layer(st, progress=False, log=lambda *a: None)
    assert whole["steps"] >= 4
    cut = dl.replace(st, out=str(tmp_path / "cut"), save_minutes=0.0)
    saves, real_save = [], dl._save_state

    def save_then_die(path, *a, **k):
        real_save(path, *a, **k)
        saves.append(a[-1]["step"])
        if len(saves) == 2:
            raise KeyboardInterrupt  # the session's hard end

    monkeypatch.setattr(dl, "_save_state", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        dl.train_draft_layer(cut, progress=False, log=lambda *a: None)
    assert saves == [1, 2] and (tmp_path / "cut" / dl.TRAIN_STATE).exists()
    with pytest.raises(ValueError, match="lr differ"):
        dl.train_draft_layer(dl.replace(cut, lr=1e-3), progress=False, log=lambda *a: None)
    monkeypatch.setattr(dl, "_save_state", real_save)
    said = []
    again = dl.train_draft_layer(cut, progress=False, log=said.append)
    assert any("resuming" in s and "at step 2 of" in s for s in said), said
    assert again["agreement_before"] == whole["agreement_before"] and again["curve"][0] == whole["curve"][0]
    for k, v in dl._trainable(whole["model"]).items():
        torch.testing.assert_close(dl._trainable(again["model"])[k], v, rtol=1e-5, atol=1e-6)
    assert not (tmp_path / "cut" / dl.TRAIN_STATE).exists()


def test_training_windows_start_a_few_prompt_tokens_before_each_response():
    from vllm_adaspec.training.draft_layer import _windows

    offsets, plens = np.array([0, 500, 600]), np.array([400, 20])
    # the first label of sequence 0's response sits at position 399 (it predicts token 400)
    assert _windows(offsets, 2, 256, plens, 64) == [(335, 500), (500, 600)]
    assert _windows(offsets, 2, 256, plens, -1) == [(0, 256), (256, 500), (500, 600)]


def test_the_default_features_are_eagle3s_low_middle_and_high_depths_and_the_last():
    from vllm_adaspec.training.draft_layer import fused_layers, parse_feature_layers

    assert fused_layers(30) == (2, 15, 27, 30)  # the shipped layer's (SmolLM2)
    assert fused_layers(24) == (2, 12, 21, 24)  # Qwen2.5-0.5B
    assert fused_layers(4) == (1, 2, 4)
    assert parse_feature_layers("auto") == "auto" and parse_feature_layers("2+15,30") == (2, 15, 30)


def test_a_dead_prefills_partial_files_are_deleted_and_a_live_ones_kept(tmp_path):
    import os
    import subprocess

    from vllm_adaspec.training.draft_layer import _remove_dead_partials

    dead = subprocess.Popen(["true"])  # a process that has exited: its pid is free (not reused this fast)
    dead.wait()
    live = subprocess.Popen(["sleep", "30"])
    try:
        names = {"dead": f"shard-00003.npy.{dead.pid}.tmp.npy", "dead_labels": f"shard-00003.labels.npy.{dead.pid}.tmp.npy",
                 "live": f"shard-00004.npy.{live.pid}.tmp.npy", "done": "shard-00001.npy"}
        for n in names.values():
            (tmp_path / n).write_bytes(b"x")
        gone = _remove_dead_partials(str(tmp_path))
        assert sorted(os.path.basename(g) for g in gone) == sorted([names["dead"], names["dead_labels"]])
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names["live"], names["done"]])
    finally:
        live.kill()
