"""The pool interface (pools/__init__.py): every pool behind start / extend / stop / propose, the registry and the
PoolSet the drafter holds. The side-by-side test replays the calls MultiBranchProposer made before the interface
(its per-pool feeding, `_candidates`, `_medusa_candidates`, recycled updates, branch harvests) next to a PoolSet
on the same synthetic requests and asserts bit-identical candidates. No vLLM, no model."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_adaspec.pools import POOLS, Candidates, Pool, PoolSet, Taps, TailPool, make_pools
from vllm_adaspec.pools.branches import BranchesPool, GramCache, harvest, init_branches, propose_branches
from vllm_adaspec.pools.context import ContextIndex, ContextPool, propose_context
from vllm_adaspec.pools.corpus import CorpusPool, build_table, propose_corpus
from vllm_adaspec.pools.medusa import MAX_NODES, MedusaPool, propose_medusa, ranked_tokens, sparse_tree
from vllm_adaspec.pools.recycled import RecycledPool, RecycleTable, propose_recycled
from vllm_adaspec.pools.suffix import suffix_available

V = 64  # vocabulary of the synthetic requests
ALL = tuple(POOLS) if suffix_available() else tuple(p for p in POOLS if p != "suffix")


class FakeHeads:
    """Medusa heads as the pool sees them (engine/medusa_heads.MedusaHeads' interface): K heads over a draft
    vocabulary of V' full ids, token-conditioned when `embed` is set."""

    def __init__(self, hidden: int = 8, k: int = 3, draft_vocab: int = 20, token_input: bool = True, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.w = torch.randn(k, hidden, draft_vocab, generator=g)  # [K, H, V']
        self.vocab = torch.randperm(V, generator=g)[:draft_vocab]  # [V'] full ids
        self.accuracy = [[0.6, 0.2, 0.1, 0.05], [0.4, 0.2, 0.1], [0.3, 0.1]]
        table = torch.randn(V, hidden, generator=g)  # [V, H]
        self.embed = (lambda ids: table[ids]) if token_input else None

    def logits(self, h: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor:
        x = h if e is None else h + e  # [R, H]
        return torch.einsum("rh,khv->rkv", x, self.w)  # [R, K, V']


class OldDrafter:
    """MultiBranchProposer's pool calls before the interface, verbatim (a request's tokens: prompt + committed)."""

    def __init__(self, pools, corpus, heads, num_branches, branch_length, seed_of):
        self.pools, self.num_branches, self.branch_length, self.seed_of = pools, num_branches, branch_length, seed_of
        self.recycled = RecycleTable(V) if "recycled" in pools else None
        self.suffix = None
        if "suffix" in pools:
            from vllm_adaspec.pools.suffix import SuffixPool

            self.suffix = SuffixPool()
        self.corpus = corpus if "corpus" in pools else None
        self.medusa = heads if "medusa" in pools else None
        self.medusa_trees = {}
        self.requests = {}

    def before_draft(self, req_id, token_ids: np.ndarray, num_prompt: int, n: int) -> None:
        st = self.requests.get(req_id)
        if st is None:
            st = self.requests[req_id] = SimpleNamespace(req_id=req_id, context=ContextIndex(), seen=0, grams=None,
                                                         branches=[], branches_sent=[])
            if self.num_branches:
                st.grams = GramCache()
                st.branches = init_branches(token_ids[:num_prompt].tolist(), self.num_branches, self.branch_length,
                                            "prompt", self.seed_of(req_id), V)
            if self.suffix is not None:
                st.seen = num_prompt
                self.suffix.start(req_id, token_ids[:st.seen])
        if self.suffix is not None:
            self.suffix.extend(req_id, token_ids[st.seen:n])
            st.seen = n
        st.context.extend(token_ids[len(st.context.tokens):n].tolist())

    def candidates(self, st, budget: int) -> list:
        out = {}
        toks = st.context.tokens
        if "context" in self.pools:
            out["context"] = propose_context(st.context, depth=budget)
        if self.suffix is not None:  # SuffixPool.propose then: `speculate` now
            out["suffix"] = self.suffix.speculate(st.req_id, np.asarray(toks[-self.suffix.max_depth:]),
                                                  max_nodes=budget)
        if self.recycled is not None:
            out["recycled"] = propose_recycled(self.recycled, toks[-1], depth=budget)
        if self.corpus is not None:
            out["corpus"] = propose_corpus(self.corpus, toks[-2:], depth=budget)
        if st.grams is not None:
            out["branches"] = propose_branches(st.grams, toks[-1], depth=budget)
        return list(out.values())

    def medusa_candidates(self, h: torch.Tensor, last_tokens: list[int], budgets: list[int]) -> list:
        m = self.medusa
        trees = []
        for budget in budgets:
            if budget not in self.medusa_trees:
                self.medusa_trees[budget] = sparse_tree(m.accuracy, min(budget, MAX_NODES))  # (the cap: session 22)
            trees.append(self.medusa_trees[budget])
        width = max(t.max_rank for t in trees)
        e = None
        if m.embed is not None:
            e = m.embed(torch.tensor(last_tokens, device=h.device))
        probs = m.logits(h, e).float().softmax(-1)
        top_p, top_i = probs.topk(width, dim=-1)
        top_ids, top_p = m.vocab[top_i].cpu().numpy(), top_p.cpu().numpy()
        return [propose_medusa(t, top_ids[e], top_p[e]) for e, t in enumerate(trees)]

    def draft(self, req_ids, budgets, h, last_tokens) -> list[list[Candidates]]:
        medusa = self.medusa_candidates(h, last_tokens, budgets) if self.medusa is not None else None
        return [self.candidates(self.requests[r], b) + ([medusa[e]] if medusa is not None else [])
                for e, (r, b) in enumerate(zip(req_ids, budgets))]

    def finished(self, req_id) -> None:
        if self.requests.pop(req_id, None) is not None and self.suffix is not None:
            self.suffix.stop(req_id)


def synthetic_stream(rng: np.random.Generator, length: int) -> np.ndarray:
    """Tokens that repeat themselves (so every pool finds matches): phrases drawn from a small set, some noise."""
    phrases = [rng.integers(0, V, size=rng.integers(3, 7)) for _ in range(5)]
    out = []
    while len(out) < length:
        out.extend(phrases[rng.integers(len(phrases))].tolist())
        if rng.random() < 0.3:
            out.append(int(rng.integers(V)))
    return np.array(out[:length], dtype=np.int64)


def top_k_of(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The drafter's reduction of verified rows' logits [N, V] to the recycled table's top-k (on_verified_logits)."""
    top, ids = logits.topk(k, dim=-1)
    probs = torch.exp(top - torch.logsumexp(logits, dim=-1, keepdim=True))
    return ids.numpy(), probs.numpy()


@pytest.mark.parametrize("names", [ALL, ("corpus", "context"), ("recycled",), ("medusa", "branches")])
def test_pool_set_proposes_what_the_old_per_pool_calls_did(names):
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(0)
    corpus = build_table([synthetic_stream(rng, 200) for _ in range(4)], vocab_size=V, k=3, min_count=1)
    heads = FakeHeads()
    seed_of = lambda req_id: sum(map(ord, req_id))  # noqa: E731
    nb = 2 if "branches" in names else 0
    old = OldDrafter(names, corpus, heads, nb, 3, seed_of)
    new = PoolSet(make_pools(names, vocab_size=V, corpus_table=corpus, medusa_heads=heads, num_branches=nb,
                             branch_length=3, branch_seed=seed_of))
    assert new.names == tuple(p for p in POOLS if p in names)  # merge order: the registry's, whatever the config's
    # five requests: a prompt, then 1-3 committed tokens a step; "c" arrives after "a" finished (suffix: global tree)
    streams = {r: synthetic_stream(rng, 90) for r in "abcde"}
    prompts = {"a": 30, "b": 12, "c": 40, "d": 1, "e": 25}
    arrive = {"a": 0, "b": 0, "c": 9, "d": 3, "e": 12}
    leave = {"a": 8, "b": 20, "c": 20, "d": 15, "e": 20}
    done = dict(prompts)
    compared = 0
    for step in range(20):
        live = [r for r in streams if arrive[r] <= step < leave[r]]
        for r in live:
            if r not in new:
                new.start(r, streams[r][:prompts[r]])
            done[r] += int(rng.integers(1, 4))
            old.before_draft(r, streams[r], prompts[r], done[r])
            new.extend(r, streams[r][new.fed[r]:done[r]])
            assert new.fed[r] == done[r]
        budgets = [int(rng.integers(1, 13)) for _ in live]
        h = torch.randn(len(live), 8, generator=g)  # [R, H]
        last = [int(streams[r][done[r] - 1]) for r in live]
        want = old.draft(live, budgets, h, last)
        got = new.propose(live, budgets, Taps(hidden=h, last_tokens=last))
        assert got == want  # Candidates are dataclasses: tokens, parents, probs, keys compared exactly
        compared += sum(len(c) for row in got for c in row)
        if new.logits_k:  # a verification: its rows' top-k refresh the recycled table
            rows = torch.randn(2 * len(live), V, generator=g)  # [N, V]
            follows = rng.integers(0, V, size=len(rows))
            ids, probs = top_k_of(rows, new.logits_k)
            old.recycled.update(follows, ids, probs)
            new.observe_logits(follows, ids, probs)
        if nb:  # every request carried its branches; the target's argmax at their rows (sometimes cut)
            bp = new.get("branches")
            for r in live:
                st = old.requests[r]
                st.branches_sent, sent = st.branches, bp.branches_of(r)
                assert sent == st.branches
                predicted = rng.integers(0, V, size=sum(map(len, sent)) - int(rng.integers(0, 2))).tolist()
                st.branches, added = harvest(st.branches_sent, predicted, st.grams, 3)
                assert new.observe_branches(r, sent, predicted) == added
                assert bp.branches_of(r) == st.branches and bp.grams[r].grams == st.grams.grams
        for r in [r for r in live if step + 1 == leave[r]]:
            old.finished(r)
            new.stop(r)
    assert compared > 200  # the pools did propose: equal non-trivial trees, not equal empty ones
    assert len(new) == 0 and all(n == 0 for n in new.live().values())  # nothing left behind


def test_registry_lists_every_pool_and_what_it_needs():
    from vllm_adaspec.config import DEFAULT_POOLS
    from vllm_adaspec.trees.trie import MAX_POOLS

    assert list(POOLS) == ["context", "suffix", "recycled", "corpus", "branches", "medusa"]
    assert [p for p, s in POOLS.items() if s.needs_hidden] == ["medusa"]
    assert {p: s.logits_k for p, s in POOLS.items() if s.logits_k} == {"recycled": 8}
    assert [p for p, s in POOLS.items() if s.needs_trees] == ["branches"]
    assert {p: s.file_key for p, s in POOLS.items() if s.file_key} == {"corpus": "corpus", "medusa": "medusa"}
    assert POOLS["suffix"].needs_package == "arctic-inference"
    assert DEFAULT_POOLS == ("context", "suffix", "corpus", "medusa")
    # a bit of the calibration key per pool: a pool past MAX_POOLS needs the key widened (trees/trie.py)
    assert len(POOLS) <= MAX_POOLS, f"{len(POOLS)} pools, calibration keys hold {MAX_POOLS}: widen trees/trie.py"
    pools = make_pools(ALL, vocab_size=V, corpus_table=build_table([[1, 2, 3]], V, min_count=1),
                       medusa_heads=FakeHeads())
    assert [p.name for p in pools] == list(ALL) and all(isinstance(p, Pool) for p in pools)
    assert all(type(p).__name__ == POOLS[p.name].cls for p in pools)
    s = PoolSet(pools)
    assert s.needs_hidden and s.logits_k == 8
    assert not PoolSet(make_pools(["context", "corpus"], vocab_size=V, corpus_table=build_table([], V))).needs_hidden
    assert PoolSet(make_pools(["context"], vocab_size=V)).logits_k == 0
    with pytest.raises(ValueError, match="unknown pool.*'ngram'.*known: context, suffix"):
        make_pools(["ngram"], vocab_size=V)
    with pytest.raises(ValueError, match="corpus pool needs its file loaded: pass corpus_table"):
        make_pools(["corpus"], vocab_size=V)
    with pytest.raises(ValueError, match="medusa pool needs its file loaded: pass medusa_heads"):
        make_pools(["medusa"], vocab_size=V)


def test_corpus_pool_loads_its_table_from_a_path(tmp_path):
    build_table([[1, 2, 3, 4]] * 3, vocab_size=V, min_count=1).save(str(tmp_path / "c.npz"))
    pool = CorpusPool(str(tmp_path / "c.npz"))
    pool.start("r", [9, 1])
    pool.extend("r", np.array([2], dtype=np.int32))
    assert pool.tails["r"] == [1, 2] and all(type(t) is int for t in pool.tails["r"])  # no int32 key overflow
    (c,) = pool.propose(["r"], [2], Taps(None, [2]))
    assert c.tokens == [3, 4]


def test_tail_pools_keep_the_last_tokens_across_prompt_and_extends():
    pool = RecycledPool(V)
    pool.start("r", np.array([5, 6, 7]))
    assert pool.tails["r"] == [7]
    pool.extend("r", [])
    pool.extend("r", np.array([8, 9]))
    assert pool.tails["r"] == [9]
    two = CorpusPool(build_table([], V))
    two.start("r", [4])  # a one-token prompt: the walk falls back to one-token contexts
    assert two.tails["r"] == [4]
    two.extend("r", [5])
    two.extend("r", [6, 7, 8])
    assert two.tails["r"] == [7, 8]
    assert isinstance(two, TailPool) and two.live() == 1
    two.stop("r")
    two.stop("never started")
    assert two.live() == 0


def test_branches_pool_owns_each_requests_branches_and_grams():
    pool = BranchesPool(2, 2, "prompt", V, seed=lambda r: 3)
    pool.start("r", np.arange(10, 20))
    sent = pool.branches_of("r")
    assert sent == init_branches(list(range(10, 20)), 2, 2, "prompt", 3, V)
    assert pool.observe_branches("r", sent, []) == 0 and pool.observe_branches("r", [], [1]) == 0  # nothing ran
    assert pool.observe_branches("r", sent, [1, 2, 3, 4]) == 4 and pool.grams_held() == 4
    assert pool.branches_of("r") == [[sent[0][1], 2], [sent[1][1], 4]]
    pool.extend("r", [sent[0][0]])  # the request's last token is the first branch's key: its grams come back
    (c,) = pool.propose(["r"], [2], Taps(None, [sent[0][0]]))
    assert c.tokens == [sent[0][1], 2, 1] and c.probs == [0.5, 1.0, 0.5]  # grams (x1, 2) and (1,), most recent first
    off = BranchesPool(0, 2, "prompt", V)  # no branches (no tree verification): proposes nothing, never fails
    off.start("r", [1, 2])
    assert off.branches_of("r") == [] and len(off.propose(["r"], [4], Taps(None, [2]))[0]) == 0
    pool.stop("r")
    assert pool.live() == 0 and pool.branches_of("r") == [] and pool.grams_held() == 0


def test_medusa_pool_builds_each_budgets_tree_once_and_needs_hidden_states():
    heads = FakeHeads(token_input=False)
    pool = MedusaPool(heads)
    h = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    got = pool.propose(["a", "b", "c"], [4, 6, 4], Taps(h, [1, 2, 3]))
    assert [len(c) for c in got] == [4, 6, 4] and pool.tree(4) is pool.trees[4] and set(pool.trees) == {4, 6}
    assert pool.last_top_ids.shape[:2] == (3, 3)  # [R, K, width]
    (big,) = pool.propose(["a"], [16], Taps(h[:1], [1]))  # a request's budget past the cap: the cap's best paths
    assert len(big) == MAX_NODES and pool.tree(16) is pool.trees[MAX_NODES]
    assert all(t in heads.vocab.tolist() for c in got for t in c.tokens)  # full ids, not draft-vocabulary indices
    assert pool.live() == 0 and pool.propose([], [], Taps(h[:0], [])) == []
    # one tree for every request: gathered for the batch at once, the same candidates as request by request
    same = pool.propose(["a", "b", "c"], [6, 6, 6], Taps(h, [1, 2, 3]))
    top_ids, top_p = ranked_tokens(heads, h, [1, 2, 3], pool.tree(6).max_rank)
    assert same == [propose_medusa(pool.tree(6), top_ids[r].numpy(), top_p[r].numpy()) for r in range(3)]
    assert len({id(c.parents) for c in same}) == 3  # each request's lists its own
    with pytest.raises(RuntimeError, match="did not hand over the target's hidden states"):
        pool.propose(["a"], [4], Taps(None, [1]))


def test_context_pool_indexes_prompt_and_output_as_one_request():
    pool, idx = ContextPool(), ContextIndex()
    pool.start("r", np.array([1, 2, 3, 9]))
    pool.extend("r", np.array([1, 2]))
    idx.extend([1, 2, 3, 9, 1, 2])
    assert pool.index["r"].tokens.tolist() == idx.tokens.tolist() == [1, 2, 3, 9, 1, 2]
    assert pool.index["r"].matches() == idx.matches() == (2, [2])
    assert pool.propose(["r"], [3], Taps(None, [2])) == [propose_context(idx, depth=3)]


def test_pool_set_fans_lifecycle_out_and_counts_nodes_per_pool():
    s = PoolSet(make_pools(["context", "recycled"], vocab_size=V))
    s.start("r", [1, 2, 3, 1, 2])
    s.extend("r", [])
    assert "r" in s and s.fed["r"] == 5 and s.live() == {"context": 1, "recycled": 1}
    s.observe_logits(np.array([2]), np.array([[3, 4] + [-1] * 6]), np.array([[0.9, 0.05] + [0.0] * 6]))
    (row,) = s.propose(["r"], [2], Taps(None, [2]))
    assert [len(c) for c in row] == [2, 2] and s.nodes == {"context": 2, "recycled": 2}  # 1 2 -> 3 1; 2 -> 3 | 4
    assert s.observe_branches("r", [[1]], [2]) == 0  # no branches pool: nobody harvests
    s.stop("r")
    assert "r" not in s and s.live() == {"context": 0, "recycled": 0}


class EchoPool(Pool):
    """A pool declared in a test: proposes the request's last token again."""
    name = "echo"

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    @classmethod
    def from_build(cls, build):
        return cls(build.vocab_size)

    def propose(self, requests, budgets, taps):
        return [Candidates([t], [-1], [0.5], [0], "echo") for t in taps.last_tokens]


def test_a_pool_declared_in_the_registry_alone_is_known_everywhere(monkeypatch):
    """The registry is the single source: a pool added to it (nothing else) is accepted by the config, is a
    failpoint of fault injection, is built by make_pools in merge order, and what it needs reaches the drafter's
    needs and start-up's file lookup (engine/startup.py reads `file_key`; FILE_FINDERS names a finder per key)."""
    import vllm_adaspec.pools as pools
    from vllm_adaspec.config import parse_adaspec_config
    from vllm_adaspec.engine.startup import FILE_FINDERS
    from vllm_adaspec.faults import parse_injection
    from vllm_adaspec.pools import PoolSpec

    monkeypatch.setitem(pools.POOLS, "echo", PoolSpec("test_pool_interface:EchoPool", "echo", logits_k=3))
    cfg = parse_adaspec_config({"adaspec": {"pools": ["echo", "context"]}}, "multi_branch")
    assert cfg.pools == ("echo", "context")
    assert parse_injection("echo@2") == {"echo": {2}}
    built = make_pools(["echo", "context"], vocab_size=V)
    assert [p.name for p in built] == ["context", "echo"] and isinstance(built[1], EchoPool)
    specs = [pools.POOLS[p] for p in cfg.pools]
    assert max(s.logits_k for s in specs) == 3
    # every file a pool declares has a finder at start-up
    assert {s.file_key for s in pools.POOLS.values() if s.file_key} <= set(FILE_FINDERS)
