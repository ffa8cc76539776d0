"""Tensor-parallel ranks emulated in one process: two threads, each a rank with its own tree runtime, fault guard
and random streams (its seeded requests' generators and its default generator), meeting in `FaultGuard.sync` as
vLLM's ranks meet in an all-reduce. Every step both ranks get the same trees and logits, as real ranks do. A fault
on rank 1 alone, in verifying a tree on the host (the CPU runtime, seeded requests at temperature 1) or in the
row-draw kernel's launch (the GPU runtime on CPU tensors, its kernels interpreted, unseeded sampled trees), must
leave both ranks committing the same tokens at every step and holding the same random streams: vLLM's first tokens
kept on every rank, the streams rewound, the kernel's fallback drawing from the launch's key. The engine test with
two real ranks is tests/test_engine_parallel.py."""

import threading
from types import SimpleNamespace

import numpy as np
import torch

from conftest import load_interpreted
from vllm_adaspec.runtime.base import plan_step
from vllm_adaspec.runtime.cpu import CPUTreeRuntime as TreeRuntime
from vllm_adaspec.faults import FaultGuard
from vllm_adaspec.step import DraftPlan

V = 48  # a small vocabulary with real entropy at every row: trees are accepted often and drawn differently
REQ_IDS = ["a", "b", "c"]


class Ranks:
    """Two ranks in two threads; one runs at a time (the lock: Triton's interpreter and torch's default generator are
    process-wide), and `sync` is their elementwise max, as `EnginePort.largest_over_ranks`."""

    def __init__(self):
        self.lock, self.barrier = threading.Lock(), threading.Barrier(2)
        self.values = [None, None]
        self.local = threading.local()  # .rank, .generator: this thread's rank and its default generator

    def sync(self, values):
        r = self.local.rank
        self.values[r] = list(values)
        self.lock.release()
        self.barrier.wait()
        out = [max(a, b) for a, b in zip(*self.values)]
        self.barrier.wait()
        self.lock.acquire()
        return out

    def run(self, step_fns, generators):
        results, errors = [None, None], []

        def body(r):
            self.local.rank, self.local.generator = r, generators[r]
            try:
                with self.lock:
                    results[r] = step_fns[r]()
            except BaseException as e:  # noqa: BLE001 (re-raised in the test's thread)
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            raise errors[0]
        return results


def guard(ranks: Ranks, rank: int, place: str, passes: set) -> FaultGuard:
    g = FaultGuard(10 ** 6, {place: set(passes)})
    g.inject_rank, g.rank, g.sync = 1, rank, ranks.sync
    return g


def vllm_first_tokens(generator_of):
    """vLLM's sampler as the tree sampler calls it (every request a tree: no drafts left in its metadata), at
    temperature 1: each request's token sampled at its bonus row (its root's) from its own generator."""
    def stock(meta, draft_probs, logits, sm):
        rows = logits[meta.bonus_logits_indices.long()].float()
        out = torch.full((len(meta.num_draft_tokens), meta.max_spec_len + 1), -1, dtype=torch.int32)
        for i in range(len(rows)):
            out[i, 0] = int(torch.multinomial(torch.softmax(rows[i], -1), 1, generator=generator_of(sm, i)))
        return SimpleNamespace(sampled_token_ids=out, logprobs_tensors=None)
    return stock


def random_step(g: torch.Generator):
    """Three trees of 2..6 nodes (tokens from four ids: siblings often repeat) and the forward's logits, each row
    peaked on one of the tree's tokens so that drafts get accepted."""
    plans, spec = {}, {}
    for r in REQ_IDS:
        n = int(torch.randint(2, 7, (), generator=g))
        parents = [-1, -1] + [int(torch.randint(-1, i, (), generator=g)) for i in range(2, n)]  # a tree, not a chain
        tokens = torch.randint(0, 4, (n,), generator=g).tolist()
        plans[r], spec[r] = DraftPlan(tuple(tokens), tuple(parents)), tokens
    rows = [len(spec[r]) + 1 for r in REQ_IDS]
    logits = torch.randn(sum(rows), V, generator=g)
    logits[:, :4] += 5.0
    return plans, spec, rows, logits


def metadata_of(spec, rows):
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    starts = np.concatenate([[0], np.cumsum(rows)])
    drafts = [t for r in REQ_IDS for t in spec[r]]
    target = [int(starts[k]) + j for k, r in enumerate(REQ_IDS) for j in range(len(spec[r]))]
    bonus = [int(starts[k + 1]) - 1 for k in range(len(REQ_IDS))]
    num = [len(spec[r]) for r in REQ_IDS]
    return SpecDecodeMetadata(i32(drafts), num, i32(np.cumsum(num).tolist()), i32(np.cumsum(rows).tolist()),
                              i32(target), i32(bonus), i32(list(range(int(starts[-1])))))


def test_a_host_verification_fault_on_one_rank_leaves_both_ranks_committing_the_same_tokens():
    """Seeded requests at temperature 1, host verification (sample-and-match draws from each request's own
    generator, as many as it walks): rank 1 faults at `tree_verify` on five steps of 150. Each rank's committed tokens
    and generators must equal the other's after every step (before: the faulting rank kept vLLM's root sample where
    the other wrote its tree verdict, and drew less: 197 of 200 steps differed from then on)."""
    from vllm_adaspec.engine.tree_sampler import TreeRejectionSampler

    ranks = Ranks()
    samplers, gens = [], []
    for rank in (0, 1):
        per_request = {i: torch.Generator().manual_seed(100 + i) for i in range(len(REQ_IDS))}
        rt = TreeRuntime(faults=guard(ranks, rank, "tree_verify", {7, 40, 41, 90, 133}))
        port = SimpleNamespace(runner=SimpleNamespace(input_batch=SimpleNamespace(req_ids=REQ_IDS)),
                               sampling_params=lambda r: None, output=lambda row: [])
        samplers.append(TreeRejectionSampler(vllm_first_tokens(lambda sm, i: sm.generators[i]), rt, port=port))
        gens.append(per_request)
    g = torch.Generator().manual_seed(0)
    longer = 0
    for step_no in range(150):
        plans, spec, rows, logits = random_step(g)

        def one_step(rank):
            rt = samplers[rank].runtime
            qs = np.concatenate([[0], np.cumsum(rows)])
            step = plan_step(REQ_IDS, qs, np.array([30, 40, 50]), spec, plans, int(qs[-1]))
            step.slot_mapping = torch.arange(int(qs[-1]))
            rt.step = step
            sm = SimpleNamespace(all_greedy=False, temperature=torch.ones(3), top_k=None, top_p=None,
                                 generators=gens[rank], no_penalties=True, prompt_token_ids=None,
                                 allowed_token_ids_mask=None, bad_words_token_ids={}, max_num_logprobs=None,
                                 spec_token_ids=None)
            return lambda: samplers[rank](metadata_of(spec, rows), None, logits.clone(), sm).sampled_token_ids

        t0, t1 = ranks.run([one_step(0), one_step(1)], [torch.Generator(), torch.Generator()])
        assert torch.equal(t0, t1), (step_no, t0.tolist(), t1.tolist())
        for i in gens[0]:
            assert torch.equal(gens[0][i].get_state(), gens[1][i].get_state()), (step_no, i)
        longer += int((t0[:, 1] >= 0).sum())
    counts = [s.runtime.faults.count for s in samplers]
    assert counts == [5, 5], counts  # each fault counted on both ranks
    assert samplers[0].runtime.faults.by_place == {"on another tensor-parallel rank": 5}
    assert longer > 60  # the trees were verified, most steps committing more than one token


def test_a_row_draw_kernel_fault_on_one_rank_leaves_both_ranks_committing_the_same_tokens(triton_interpret,
                                                                                          monkeypatch):
    """The GPU runtime on CPU tensors (its row-draw and verification kernels interpreted), unseeded sampled trees
    verified in one batch (each launch keyed by one draw from the default generator): rank 1's row-draw launch
    fails on three steps of twelve. Both ranks commit the same tokens at every step and keep one default stream."""
    import vllm_adaspec.runtime.gpu as gtr
    import vllm_adaspec.engine.tree_sampler as ts
    from vllm_adaspec.runtime.gpu import GPUTreeRuntime
    from vllm_adaspec.engine.tree_sampler import TreeRejectionSampler

    ranks = Ranks()
    rd, tv = load_interpreted("row_draws"), load_interpreted("tree_verify")
    # each rank's default generator: the thread's (one process holds both ranks here)
    monkeypatch.setattr(rd, "new_seed", lambda device: torch.randint(1 << 62, (1,), dtype=torch.int64,
                                                                      generator=ranks.local.generator))
    monkeypatch.setattr(ts, "default_generator", lambda device: ranks.local.generator)
    monkeypatch.setattr(gtr, "row_draws", rd)
    monkeypatch.setattr(gtr, "tree_verify", tv)
    samplers = []
    for rank in (0, 1):
        rt = GPUTreeRuntime("cpu", faults=guard(ranks, rank, "draw_kernel", {2, 5, 9}), plain=lambda r: "sampled")
        rt.heads, rt.draw_kernel = (4, 2, 16), True
        port = SimpleNamespace(runner=SimpleNamespace(input_batch=SimpleNamespace(req_ids=REQ_IDS)),
                               sampling_params=lambda r: None, output=lambda row: [])
        samplers.append(TreeRejectionSampler(vllm_first_tokens(lambda sm, i: ranks.local.generator), rt, port=port))
    defaults = [torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)]
    g = torch.Generator().manual_seed(1)
    longer = 0
    for step_no in range(12):
        plans, spec, rows, logits = random_step(g)

        def one_step(rank):
            def run():
                rt = samplers[rank].runtime
                qs = np.concatenate([[0], np.cumsum(rows)])
                t = int(qs[-1])
                rt.begin_step(REQ_IDS, qs, np.array([30, 40, 50]), torch.zeros(t, dtype=torch.long), spec, plans, t,
                              torch.zeros(3, dtype=torch.int32), set(), set())
                rt.step.slot_mapping = torch.arange(t)
                sm = SimpleNamespace(all_greedy=False, temperature=torch.ones(3), top_k=None, top_p=None,
                                     generators={}, no_penalties=True, prompt_token_ids=None,
                                     allowed_token_ids_mask=None, bad_words_token_ids={}, max_num_logprobs=None,
                                     spec_token_ids=None)
                out = samplers[rank](metadata_of(spec, rows), None, logits.clone(), sm).sampled_token_ids
                rt.take_results()
                return out
            return run

        t0, t1 = ranks.run([one_step(0), one_step(1)], defaults)
        assert torch.equal(t0, t1), (step_no, t0.tolist(), t1.tolist())
        assert torch.equal(defaults[0].get_state(), defaults[1].get_state()), step_no
        longer += int((t0[:, 1] >= 0).sum())
    assert [s.runtime.faults.count for s in samplers] == [3, 3]
    assert samplers[1].runtime.kernel_fallbacks == 3 and samplers[0].runtime.kernel_fallbacks == 0
    assert longer > 5
