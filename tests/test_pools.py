"""Candidate pools as pure functions: what each proposes for known token histories (no vLLM, no model)."""

import numpy as np
import pytest

from vllm_adaspec.pools.context import ContextIndex, propose_context
from vllm_adaspec.pools.corpus import CorpusTable, build_table, propose_corpus
from vllm_adaspec.pools.recycled import RecycleTable, propose_recycled


def as_paths(c):
    """{root-to-node token tuple: prob given parent} of a Candidates tree."""
    out, path = {}, {}
    for i, (t, p, q) in enumerate(zip(c.tokens, c.parents, c.probs)):
        path[i] = (path[p] if p >= 0 else ()) + (t,)
        out[path[i]] = q
    return out


def test_context_keeps_every_match_and_weights_continuations():
    idx = ContextIndex(max_n=3)
    #            a  b  c  X  ...  a  b  c  Y  ...  a  b  c  X  ...  a  b  c
    idx.extend([1, 2, 3, 10, 11, 1, 2, 3, 20, 21, 1, 2, 3, 10, 12, 1, 2, 3])
    n, ends = idx.matches()
    assert n == 3 and ends == [3, 8, 13]  # positions right after each earlier "1 2 3" (not the current one)
    c = propose_context(idx, depth=2)
    paths = as_paths(c)
    assert paths[(10,)] == pytest.approx(2 / 3) and paths[(20,)] == pytest.approx(1 / 3)  # vLLM's ngram: 10 only
    assert paths[(10, 11)] == pytest.approx(0.5) and paths[(10, 12)] == pytest.approx(0.5)
    assert paths[(20, 21)] == 1.0
    assert c.pool == "context" and set(c.evidence) == {3}  # evidence: the match length


def test_context_falls_back_to_shorter_matches_and_is_incremental():
    idx = ContextIndex(max_n=4)
    idx.extend([5, 6, 7])
    assert idx.matches() == (0, [])  # nothing repeats yet
    assert len(propose_context(idx, depth=4)) == 0
    idx.extend([9, 6])  # "6" occurred before (followed by 7); "9 6" did not
    assert idx.matches() == (1, [2])
    assert as_paths(propose_context(idx, depth=3)) == {(7,): 1.0, (7, 9): 1.0, (7, 9, 6): 1.0}


def test_context_matches_are_every_earlier_occurrence_of_the_longest_repeated_suffix():
    """ContextIndex.matches against its definition, by brute force, on random token streams fed in pieces (small
    vocabularies: many repeats): the longest n <= max_n whose last n tokens occurred before, and the position right
    after every such occurrence (the current one excluded), increasing."""
    rng = np.random.default_rng(0)

    def brute(toks, max_n):
        size = len(toks)
        for n in range(min(max_n, size), 0, -1):
            ends = [p for p in range(n, size) if toks[p - n:p] == toks[size - n:]]
            if ends:
                return n, ends
        return 0, []

    for trial in range(300):
        max_n, idx, toks = int(rng.integers(1, 6)), None, []
        idx = ContextIndex(max_n=max_n)
        for _ in range(int(rng.integers(1, 8))):
            piece = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(0, 40))).tolist()
            idx.extend(piece if trial % 2 else np.array(piece, dtype=np.int32))
            toks += piece
            assert idx.matches() == brute(toks, max_n), (trial, toks)
        assert idx.tokens.tolist() == toks


def test_context_caps_matches_and_nodes():
    idx = ContextIndex(max_n=1)
    idx.extend([x for t in range(100) for x in (1, t + 100)] + [1])
    c = propose_context(idx, depth=1, max_matches=10)
    assert len(c) == 10 and all(p == pytest.approx(0.1) for p in c.probs)  # the 10 most recent matches
    assert sorted(c.tokens) == list(range(190, 200))
    assert len(propose_context(idx, depth=1, max_matches=50, max_nodes=7)) == 7


def test_recycled_walks_the_latest_top_k_breadth_first():
    table = RecycleTable(vocab_size=100, k=3)
    table.update(np.array([5, 7]), np.array([[7, 8, 9], [1, 2, 3]]), np.array([[0.6, 0.3, 0.05], [0.9, 0.05, 0.01]]))
    table.update(np.array([7]), np.array([[4, 2, 1]]), np.array([[0.7, 0.2, 0.1]]))  # the latest row wins
    c = propose_recycled(table, 5, depth=2, width=2, min_prob=0.1)
    paths = as_paths(c)
    assert paths == {(7,): pytest.approx(0.6), (8,): pytest.approx(0.3), (7, 4): pytest.approx(0.7),
                     (7, 2): pytest.approx(0.2)}  # 9 (0.05) and 8's unknown successors are left out
    assert c.parents == [-1, -1, 0, 0]  # breadth-first
    assert len(propose_recycled(table, 42, depth=3)) == 0  # a token never verified has no successors


def test_corpus_table_counts_successors_and_prefers_two_token_contexts(tmp_path):
    seqs = [[1, 2, 3, 4], [1, 2, 3, 5], [9, 2, 3, 6], [9, 2, 3, 6], [7, 2, 3, 4]]
    t = build_table(seqs, vocab_size=20, k=2, min_count=1, meta={"tokenizer": "x"})
    ids, probs, n = t.successors(2, 3)
    assert n == 2 and sorted(ids.tolist()) == [4, 6] and probs.tolist() == pytest.approx([0.4, 0.4])
    ids, probs, n = t.successors(11, 3)  # "11 3" never seen: fall back to "3"
    assert n == 1 and ids.tolist()[0] in (4, 6)
    t.save(str(tmp_path / "c.npz"))
    again = CorpusTable.load(str(tmp_path / "c.npz"))
    assert again.meta["tokenizer"] == "x" and again.successors(1, 2)[0].tolist() == [3, -1]
    c = propose_corpus(again, [1, 2], depth=2, width=1)
    assert as_paths(c) == {(3,): pytest.approx(1.0), (3, 4): pytest.approx(0.4, abs=1e-3)}  # 4, 6 tie at 2/5 (float16)


def test_the_context_match_compiled_is_the_python_one():
    """The context pool's matching and trie in one compiled pass (propose_context_compiled): the same nodes,
    probabilities and match length as propose_context, over random token streams (few and > 32 matches)."""
    from vllm_adaspec.pools.context import ContextIndex, propose_context, propose_context_compiled

    rng = np.random.default_rng(1)
    matched = 0
    for trial in range(300):
        index = ContextIndex(max_n=int(rng.integers(1, 5)))
        alphabet = int(rng.choice([2, 3, 8, 50]))
        index.extend(rng.integers(0, alphabet, size=int(rng.integers(1, 300))))
        for _ in range(3):
            depth, matches, nodes = int(rng.integers(1, 20)), int(rng.integers(1, 10)), int(rng.integers(1, 17))
            got = propose_context_compiled(index, depth, matches, nodes)
            assert got == propose_context(index, depth, matches, nodes), trial
            matched += len(got) > 0
            index.extend(rng.integers(0, alphabet, size=int(rng.integers(1, 4))).tolist())
    assert matched > 500


def test_the_corpus_walk_compiled_is_the_python_one():
    """The corpus pool walks a step's requests in one compiled pass (propose_corpus_batch): the same nodes,
    probabilities and evidence as propose_corpus, request by request, over random tables and contexts."""
    from vllm_adaspec.pools.corpus import propose_corpus_batch

    rng = np.random.default_rng(0)
    for trial in range(30):
        seqs = [rng.integers(0, 12, size=rng.integers(2, 40)).tolist() for _ in range(rng.integers(1, 30))]
        t = build_table(seqs, vocab_size=12, k=int(rng.integers(1, 5)), min_count=int(rng.integers(1, 3)))
        contexts = [rng.integers(0, 14, size=rng.integers(1, 3)).tolist() for _ in range(8)]
        depths = rng.integers(1, 17, size=8).tolist()
        for width, max_nodes, min_prob in ((2, 8, 0.1), (3, 5, 0.0), (1, 16, 0.3)):
            got = propose_corpus_batch(t, contexts, depths, width, max_nodes, min_prob)
            want = [propose_corpus(t, c, d, width, max_nodes, min_prob) for c, d in zip(contexts, depths)]
            assert got == want, trial
    assert sum(len(c) for c in got) > 0


def test_suffix_pool_returns_a_tree_with_conditional_probabilities():
    from vllm_adaspec.pools.suffix import SuffixPool

    pool = SuffixPool(max_spec_factor=4.0, min_token_prob=0.0)
    pool.start("a", np.array([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 9]))
    pool.extend("a", np.array([7]))
    c = pool.speculate("a", np.array([1, 2, 3, 4, 9, 7, 1, 2, 3]), max_nodes=8)
    paths = as_paths(c)
    assert paths[(4,)] == pytest.approx(2 / 3) and paths[(5,)] == pytest.approx(1 / 3)  # two root branches
    assert paths[(4, 1)] == pytest.approx(0.5) and paths[(4, 9)] == pytest.approx(0.5)  # given the parent
    pool.stop("a")
    assert "a" not in pool.cache.active_requests


def test_suffix_pool_reading_arctics_trees_in_place_equals_its_public_methods():
    # SuffixPool calls the cache's trees directly (arctic-inference 0.1.1's layout); the cache's own methods are the
    # definition: the same candidates over random requests, outputs and evictions from the global tree
    from vllm_adaspec.pools.suffix import SuffixPool

    rng = np.random.default_rng(5)
    fast, public = SuffixPool(max_cached_requests=3), SuffixPool(max_cached_requests=3)
    public._trees = None
    assert fast._trees is not None  # (the pinned arctic-inference: the fast path is what runs)
    live = []
    for step in range(400):
        if len(live) < 4 or rng.random() < 0.03:  # a new request (the oldest cached outputs evicted past 3)
            r = f"r{step}"
            prompt = rng.integers(0, 12, int(rng.integers(1, 60)))
            for pool in (fast, public):
                pool.start(r, prompt)
            live.append(r)
        if len(live) > 6:
            gone = live.pop(int(rng.integers(len(live))))
            for pool in (fast, public):
                pool.stop(gone)
        r = live[int(rng.integers(len(live)))]
        new = rng.integers(0, 12, int(rng.integers(1, 4))).tolist()
        for pool in (fast, public):
            pool.extend(r, new)
        budget = int(rng.integers(1, 17))
        got, want = fast.speculate(r, fast.tails[r], budget), public.speculate(r, public.tails[r], budget)
        assert (got.tokens, got.parents, got.probs, got.evidence) == (want.tokens, want.parents, want.probs,
                                                                      want.evidence)


def test_logits_tap_covers_plain_steps_requests_without_drafts_and_every_verified_row():
    # The recycled table must fill from steps without drafts too: otherwise "pools": ["recycled"] never drafts.
    from types import SimpleNamespace

    import torch

    from vllm_adaspec.engine.runner_hooks import LogitsTap
    from vllm_adaspec.step import Taps

    tokens = np.array([[1, 7, 0], [2, 3, 0], [4, 9, 0]])  # committed: a ..7, p ..3 (prefill), b ..9
    batch = SimpleNamespace(req_ids=["a", "p", "b"], num_reqs=3, token_ids_cpu=tokens,
                            num_tokens_no_spec=np.array([2, 2, 2]))
    port = SimpleNamespace(taps=Taps())
    tap = LogitsTap(SimpleNamespace(input_batch=batch), port, k=2)
    logits = torch.randn(5, 16)
    tap(logits[:3], None)  # plain step: one row per request, following its last committed token
    req_ids, toks, ids, probs = port.taps.logits_topk[0]
    assert req_ids == ["a", "p", "b"] and toks.tolist() == [7, 3, 9]
    want = torch.softmax(logits[:3], -1).topk(2, dim=-1)
    assert ids.tolist() == want.indices.tolist() and np.allclose(probs, want.values.numpy(), atol=1e-6)
    # a: 2 drafts (rows 0, 1, bonus 2); p: none (row 3); b: no drafts (bonus row 4 only)
    meta = SimpleNamespace(cu_num_draft_tokens=torch.tensor([2, 2, 2]), draft_token_ids=torch.tensor([11, 12]),
                           target_logits_indices=torch.tensor([0, 1]), bonus_logits_indices=torch.tensor([2, 3, 4]))
    tap(logits, meta)
    req_ids, toks, ids, _ = port.taps.logits_topk[1]
    assert req_ids == ["a", "a", "a", "p", "b"] and toks.tolist() == [7, 11, 12, 3, 9]
    assert ids.tolist() == torch.softmax(logits, -1).topk(2, dim=-1).indices.tolist()


def test_find_corpus_matches_the_tokenizer_and_names_what_is_wrong(tmp_path, monkeypatch, smollm2):
    from transformers import AutoTokenizer

    from vllm_adaspec.config import AdaspecConfigError
    from vllm_adaspec.pools import corpus

    fp = corpus.tokenizer_fingerprint(AutoTokenizer.from_pretrained(smollm2))
    mine = build_table([[1, 2, 3]] * 3, vocab_size=49152, meta={"tokenizer": fp, "model": "mine"})
    other = build_table([[1, 2, 3]] * 3, vocab_size=49152, meta={"tokenizer": "0123456789abcdef", "model": "other"})
    (tmp_path / "shipped" / "a").mkdir(parents=True)
    (tmp_path / "shipped" / "b").mkdir()
    other.save(str(tmp_path / "shipped" / "a" / "corpus.npz"))
    monkeypatch.setattr(corpus, "SHIPPED_DIR", str(tmp_path / "shipped"))
    monkeypatch.setenv("ADASPEC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(AdaspecConfigError, match=r"'corpus' has no table for this tokenizer .*shipped or built: a "
                                                 r"\(tokenizer 0123456789abcdef\).*adaspec build corpus"):
        corpus.find_corpus(smollm2)
    # `adaspec build corpus` writes to the cache, where "auto" finds it too.
    built = corpus.built_dir(smollm2)
    import os
    os.makedirs(built)
    mine.save(os.path.join(built, "corpus.npz"))
    assert corpus.find_corpus(smollm2) == os.path.join(built, "corpus.npz")
    # An explicit path: a folder or the file, checked against the tokenizer.
    assert corpus.find_corpus(smollm2, built) == os.path.join(built, "corpus.npz")
    with pytest.raises(AdaspecConfigError, match=r"\['corpus'\]: .*a/corpus.npz was built for another tokenizer "
                                                 r"\(other, fingerprint 0123456789abcdef; this model's is " + fp):
        corpus.find_corpus(smollm2, str(tmp_path / "shipped" / "a"))
    with pytest.raises(AdaspecConfigError, match=r"cannot read a corpus table at '/no/such.npz'"):
        corpus.find_corpus(smollm2, "/no/such.npz")


def test_stdlib_sources_leave_out_tests_and_third_party_code():
    from vllm_adaspec.training.corpus_table import stdlib_sources

    files = stdlib_sources()
    assert len(files) > 300 and any(f.endswith("/json/decoder.py") for f in files)
    assert not any("/site-packages/" in f or "/test/" in f or "/idlelib/" in f for f in files)
    assert files == sorted(files)
