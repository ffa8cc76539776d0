"""The GPU tree path, everything of it that runs without a GPU.

- The runtime step by step on CPU tensors, against the CPU path on the same trees: node positions and cut seq_lens,
  the tree rows of a layer's attention (the Triton kernel under the interpreter, on vLLM's GPU paged layout) against
  the CPU runtime's masked attention, the batched greedy verdict against `verify_greedy`, compaction against the
  CPU path's moves, the drafter's results.
- The same step on the meta device: a meta tensor has no values, so any read of a device value on the host (a wait
  for the device on a GPU) fails: planning, positions, verification, the chain indices and compaction read none.
- vLLM's real Triton backend (its KV write and attention kernels, interpreted) with the tree subclass on a mixed
  batch of chains, trees and a prefill chunk, against float64; the registration and the CUDA-graph mode vLLM
  resolves for it (a subprocess: vLLM must see Triton as usable from its first import).
- A whole engine (tests/gpu_emulation: vLLM's Triton backend on its GPU layout in a CPU engine, the GPU tree runtime,
  the kernel interpreted): greedy output equal to plain decoding in the same engine, through batched and one-by-one
  verification and compaction.

Not run here (no GPU can carry vLLM on this project's machines): vLLM's FlashAttention subclass forward, CUDA
streams and graphs, the kernel's speed (benchmarks/bench_tree_attention.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import ENGINE, PROMPTS, load_interpreted
from vllm_adaspec.runtime.gpu_kv import compaction_moves, kv_views, move_slots
from vllm_adaspec.runtime.base import plan_step
from vllm_adaspec.runtime.cpu import masked_attention_batch
from vllm_adaspec.step import DraftPlan
from vllm_adaspec.trees import DraftTree, verify_greedy

HQ, HKV, D, BS = 4, 2, 16, 16
# a batch: a chain (vLLM verifies it), two trees (one with equal siblings), a prefill chunk, one more tree
REQ_IDS = ["chain", "tree_a", "tree_b", "prefill", "tree_c"]
PLANS = {"chain": DraftPlan((5, 6, 7), (-1, 0, 1)),
         "tree_a": DraftPlan((11, 12, 13, 14, 15), (-1, -1, 0, 0, 1)),
         "tree_b": DraftPlan((21, 21, 22, 23, 22, 24, 25), (-1, -1, 0, 1, 1, 2, 3)),
         "tree_c": DraftPlan((31, 32, 33, 34), (-1, 0, 1, 0))}
ROWS = [4, 6, 8, 9, 5]  # rows each request schedules (drafts + 1; the prefill chunk 9 prompt tokens)
ROOTS = np.array([40, 23, 70, 0, 5])  # computed tokens: the position of each request's first row


def planned(device="cpu", plain=None):
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    from vllm_adaspec.runtime.gpu import GPUTreeRuntime

    qs = np.concatenate([[0], np.cumsum(ROWS)])
    spec = {r: list(PLANS[r].tokens) for r in REQ_IDS if r in PLANS}
    step = plan_step(REQ_IDS, qs, ROOTS, spec, PLANS, int(qs[-1]))
    # tree_c: verified one by one (the tree sampler), the others in the device batch
    rt = GPUTreeRuntime(device, plain=plain or (lambda req_id: None if req_id == "tree_c" else "greedy"),
                        top_k_top_p=apply_top_k_top_p)  # vLLM's op, as the worker hands it in
    rt.heads = (HQ, HKV, D)
    return rt, step, qs


def paged_cache(g, num_blocks=36, device="cpu"):
    """A layer's cache in the GPU backends' logical layout [blocks, Hkv, block_size, 2 * D], random, and a block
    table giving each request scattered blocks."""
    cache = torch.randn(num_blocks, HKV, BS, 2 * D, generator=g).to(device)
    table = torch.randperm(num_blocks, generator=g)[:len(REQ_IDS) * 6].view(len(REQ_IDS), 6).to(torch.int32)
    return cache, table.to(device)


def slots_of(table, qs):
    pos = np.concatenate([ROOTS[i] + np.arange(n) for i, n in enumerate(ROWS)])
    req = np.repeat(np.arange(len(REQ_IDS)), ROWS)
    blocks = table.cpu()[torch.from_numpy(req), torch.from_numpy(pos // BS)].long()
    return blocks * BS + torch.from_numpy(pos % BS)


@pytest.mark.parametrize("all_batched", [False, True])
def test_the_gpu_runtime_computes_what_the_cpu_path_computes(triton_interpret, monkeypatch, all_batched):
    """all_batched: every tree verified in the device batch (the usual step; compaction takes the verdict's own
    tensors); else tree_c is verified one by one on the host and its path copied in."""
    ta = load_interpreted("tree_attention")
    import vllm_adaspec.runtime.gpu as gtr

    monkeypatch.setattr(gtr, "kernels", ta)  # the kernel under the interpreter

    monkeypatch.setattr(gtr, "tree_verify", load_interpreted("tree_verify"))

    monkeypatch.setattr(gtr, "kv_compaction", load_interpreted("kv_compaction"))
    monkeypatch.setattr(gtr, "row_draws", load_interpreted("row_draws"))
    g = torch.Generator().manual_seed(0)
    rt, step, qs = planned(plain=(lambda req_id: "greedy") if all_batched else None)
    rt.draw_kernel = True  # the rows' argmax from the kernel, as on a GPU (the emulated engine keeps torch's)
    assert [r.req_id for r in step.requests] == ["tree_a", "tree_b", "tree_c"]  # the chain is vLLM's
    positions, seq_lens = torch.from_numpy(np.concatenate([ROOTS[i] + np.arange(n) for i, n in enumerate(ROWS)])), \
        torch.from_numpy(ROOTS + np.array(ROWS)).to(torch.int32)
    rt.begin_step(REQ_IDS, qs, ROOTS, positions, {r: list(p.tokens) for r, p in PLANS.items()}, PLANS, int(qs[-1]),
                  seq_lens, set(), set())
    for r in step.requests:  # root + depth; seq_len cut to the tree's rows
        assert positions[r.start + 1:r.start + 1 + len(r.tree)].tolist() == (r.root_pos + r.tree.depths).tolist()
        assert int(seq_lens[r.row]) == len(r.tree) + 1
    assert positions[:4].tolist() == [40, 41, 42, 43] and int(seq_lens[0]) == 44  # the chain: vLLM's

    # attention: the tree rows of the output, nothing else
    cache, table = paged_cache(g)
    t = int(qs[-1])
    query = torch.randn(t, HQ, D, generator=g)
    output = torch.full((t, HQ, D), 7.0)
    slots = slots_of(table, qs)
    rt.attend(None, 0.25, query, None, None, cache, SimpleNamespace(num_actual_tokens=t, slot_mapping=slots,
                                                                    block_table=table), output)
    k, v = kv_views(cache)
    tree_rows = set()
    for r in rt.step.requests:
        n1 = len(r.tree) + 1
        rows = list(range(r.start, r.start + n1))
        tree_rows |= set(rows)
        pos = torch.arange(r.root_pos + n1)
        blocks, offs = table[r.row, pos // BS].long(), pos % BS
        visible = torch.cat([torch.ones(n1, r.root_pos, dtype=torch.bool), r.mask], 1)
        want = masked_attention_batch(query[rows][None], k[blocks, offs][None], v[blocks, offs][None],
                                      visible[None], 0.25)[0]
        torch.testing.assert_close(output[rows], want, atol=1e-5, rtol=1e-5)
    assert (output[[i for i in range(t) if i not in tree_rows]] == 7.0).all()

    # verification: the batched trees against verify_greedy, vLLM's tokens elsewhere untouched
    logit_rows = int(sum(len(PLANS.get(r, DraftPlan(())).tokens) + 1 for r in REQ_IDS))
    logits = torch.randn(logit_rows, 40, generator=g)
    starts = np.concatenate([[0], np.cumsum(step.num_drafts + 1)])
    for r in rt.step.requests:  # make the target agree with some nodes, so that paths are long
        for j, (tok, parent) in enumerate(zip(r.tree.tokens.tolist(), r.tree.parents.tolist())):
            if j % 3 != 2:
                logits[starts[r.row] + parent + 1, tok % 40] += 8.0
    tokens = torch.full((len(REQ_IDS), 8), 99, dtype=torch.int32)
    verdict = rt.verify_batched(rt.step, logits, tokens, SimpleNamespace(temperature=None, top_k=None, top_p=None))
    want_results = {}
    for k_, r in enumerate(rt.step.requests):
        x = logits[starts[r.row]:starts[r.row] + len(r.tree) + 1].argmax(-1)
        path, bonus = verify_greedy(r.tree, x)
        want_results[r.row] = (path, bonus, [])
        if k_ in rt.step.device.batched:
            committed = r.tree.tokens[path].tolist() + [bonus]
            assert tokens[r.row].tolist() == committed + [-1] * (8 - len(committed)), r.req_id
    assert tokens[0].tolist() == [99] * 8  # the chain: vLLM's
    assert (tokens[4].tolist() == [99] * 8) != all_batched  # tree_c: the sampler's, one by one (unless batched)
    assert max(len(p) for p, _, _ in want_results.values()) >= 2

    # compaction: accepted node at depth d from root + 1 + node to root + d, in every layer; results for the drafter
    before = cache.clone()
    host = {} if all_batched else {4: want_results[4]}  # tree_c's verdict comes from the host path
    rt.step.kv_caches = [cache]
    compacted = []
    compact = rt._compact
    monkeypatch.setattr(rt, "_compact", lambda step, path, count, trees=None: compacted.append(path)
                        or compact(step, path, count, trees))
    rt.finish_step(rt.step, host, verdict)
    assert (compacted[0] is verdict.path) == all_batched  # all batched: no scatter into a new [R, N] tensor
    kb, vb = kv_views(before)
    expect = before.clone()
    ke, ve = kv_views(expect)
    for r in rt.step.requests:
        for d, node in enumerate(want_results[r.row][0], start=1):
            src, dst = slots[r.start + 1 + node], slots[r.start + d]
            ke[dst // BS, dst % BS] = kb[src // BS, src % BS]
            ve[dst // BS, dst % BS] = vb[src // BS, src % BS]
    assert torch.equal(cache, expect)
    results, moves = rt.take_results()
    assert results == want_results
    assert moves == sum(1 for p, _, _ in want_results.values() for d, n in enumerate(p, 1) if n + 1 != d) > 0
    assert rt.batched_total == (3 if all_batched else 2)


class HostToDevice(TorchDispatchMode):
    """Every copy from host memory to the device made under it: (op, non_blocking). A blocking one (or a copy from
    pageable memory) waits for everything queued on the device first."""

    def __init__(self, device: str):
        super().__init__()
        self.device, self.copies = device, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__
        if name.startswith("_to_copy") and args[0].device.type == "cpu" and str(kwargs.get("device")) == self.device:
            self.copies.append((name, bool(kwargs.get("non_blocking", False))))
        elif name.startswith("copy_") and args[1].device.type == "cpu" and args[0].device.type == self.device:
            self.copies.append((name, bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))))
        return func(*args, **kwargs)


def test_the_gpu_plan_is_the_trees_packed_as_the_reference_packers_pack_them():
    """GPUTreeRuntime.prepare builds a step's arrays in one pass over host lists; on random steps (trees of 1-39
    nodes: one and two ancestor words, equal siblings, greedy / sampled / other requests, batch rows without drafts)
    its ancestor bits, node positions and padded trees equal trees.tree.ancestor_words, the trees' depths and
    trees.batch.pack_trees, and the logit rows and the batched trees' rows are where vLLM lays them out."""
    from vllm_adaspec.runtime.gpu import GPUTreeRuntime
    from vllm_adaspec.trees.batch import pack_trees
    from vllm_adaspec.trees.tree import ancestor_words

    g = np.random.default_rng(0)
    for trial in range(60):
        b = int(g.integers(1, 9))
        req_ids = [f"r{i}" for i in range(b)]
        plans = {}
        for r in req_ids:
            if g.random() < 0.8:
                n = int(g.integers(1, 40 if trial % 2 else 17))
                parents = [-1] + [int(g.integers(-1, i)) for i in range(1, n)]
                plans[r] = DraftPlan(tuple(int(t) for t in g.integers(0, 4, n)), tuple(parents), tree_path=True)
        spec = {r: list(p.tokens) for r, p in plans.items()}
        qs = np.concatenate([[0], np.cumsum([1 + len(spec.get(r, ())) for r in req_ids])])
        kinds = {r: ("greedy", "sampled", None)[int(g.integers(0, 3))] for r in req_ids}
        rt = GPUTreeRuntime("cpu", plain=kinds.get, max_rows=65)
        rt.heads, rt.block_q = (32, 8, 128), 4
        step = plan_step(req_ids, qs, g.integers(10, 3000, b), spec, plans, int(qs[-1]))
        if step is None:
            continue
        dev = rt.prepare(step).device
        width = max(len(r.tree) for r in step.requests)
        words = max(1, -(-(width + 1) // 32))
        want_bits = np.concatenate([ancestor_words(r.tree.parents.tolist(), words) for r in step.requests])
        assert np.array_equal(dev.launch.bits.numpy().view(np.uint32), want_bits.astype(np.uint32)), trial
        rows, pos = step.depth_positions()
        assert torch.equal(dev.node_rows, torch.from_numpy(rows)) and torch.equal(dev.node_positions,
                                                                                   torch.from_numpy(pos))
        batched = [step.requests[k] for k in dev.batched]
        assert [kinds[r.req_id] for r in batched] == sorted((kinds[r.req_id] for r in batched),
                                                            key=("greedy", "sampled").index)
        assert set(dev.batched) == {k for k, r in enumerate(step.requests) if kinds[r.req_id]}
        if not batched:
            assert dev.trees is None
            continue
        want = pack_trees([r.tree for r in batched], [r.num_verified for r in batched], width=width)
        for name in ("tokens", "parent_rows", "depths", "valid", "ancestors", "order"):
            assert torch.equal(getattr(dev.trees, name), getattr(want, name)), (trial, name)
        assert dev.batched_rows.tolist() == [r.row for r in batched]
        start = np.concatenate([[0], np.cumsum(step.num_drafts + 1)])
        for got, r in zip(dev.logit_rows.tolist(), batched):
            assert got == [int(start[r.row]) + min(j, len(r.tree)) for j in range(width + 1)]


def _device_fields(dev) -> dict:
    """A DeviceStep's every tensor and host value, its launch's index tensors and split plan included."""
    import dataclasses

    out = {f.name: getattr(dev, f.name) for f in dataclasses.fields(dev) if f.name not in ("launch", "trees", "chains")}
    out.update({f"chains[{i}]": v for i, v in enumerate(dev.chains)})
    if dev.trees is not None:
        out.update({f"trees.{f.name}": getattr(dev.trees, f.name) for f in dataclasses.fields(dev.trees)})
    launch = dev.launch
    out.update({f"launch.{name}": getattr(launch, name) for name in ("prefix_lens", "tree_lens", "cu_rows", "bits",
                                                                      "q_rows", "bt_rows", "block_q", "splits")})
    return out


def assert_same_fields(want: dict, got: dict, trial: int) -> None:
    """Two `_device_fields`: the same names, and each tensor the same dtype, shape and contents (host values equal)."""
    assert want.keys() == got.keys()
    for name, w in want.items():
        v = got[name]
        if isinstance(w, torch.Tensor):
            assert w.dtype == v.dtype and w.shape == v.shape and torch.equal(w, v), (trial, name, w, v)
        else:
            assert w == v, (trial, name, w, v)


def test_the_compiled_gpu_plan_equals_the_python_one_array_for_array():
    """GPUTreeRuntime.prepare plans a step in one compiled pass (trees/step_plan.py, numba) straight into its staging
    buffers; prepare_reference is the Python it replaces. On random steps (1-8 requests; trees of 1-64 nodes: one to
    three ancestor words; few tokens, so equal siblings; draft-branch rows; greedy, sampled and other requests; batch
    rows with chains or no drafts) every array and host value of the step's device side is the same: dtype, shape and
    contents."""
    from vllm_adaspec.runtime.gpu import GPUTreeRuntime
    from vllm_adaspec.trees import step_plan

    assert step_plan.compiled()  # numba comes with vLLM
    g = np.random.default_rng(7)
    checked = 0
    for trial in range(120):
        b = int(g.integers(1, 9))
        req_ids = [f"r{i}" for i in range(b)]
        plans = {}
        most = (5, 17, 40, 65)[trial % 4]
        for r in req_ids:
            u = g.random()
            n = int(g.integers(1, most))
            parents = [-1] + [int(g.integers(-1, i)) if g.random() < 0.6 else i - 1 for i in range(1, n)]
            tokens = tuple(int(t) for t in g.integers(0, 3, n))
            if u < 0.7:  # a tree, some with draft-branch rows (read, not verified)
                branch = int(g.integers(0, n)) if g.random() < 0.3 else 0
                plans[r] = DraftPlan(tokens, tuple(parents), tree_path=True, verified=n - branch)
            elif u < 0.85:  # a chain
                plans[r] = DraftPlan(tokens, None)
        spec = {r: list(p.tokens) for r, p in plans.items()}
        qs = np.concatenate([[0], np.cumsum([1 + len(spec.get(r, ())) for r in req_ids])])
        kinds = {r: ("greedy", "sampled", None)[int(g.integers(0, 3))] for r in req_ids}
        step = plan_step(req_ids, qs, g.integers(10, 3000, b), spec, plans, int(qs[-1]))
        if step is None:
            continue
        rt = GPUTreeRuntime("cpu", plain=kinds.get, max_rows=65)
        rt.heads, rt.block_q = (32, 8, 128), 4
        assert_same_fields(_device_fields(rt.prepare_reference(step).device), _device_fields(rt.prepare(step).device),
                           trial)
        checked += 1
    assert checked > 100


def test_a_runtime_planning_step_after_step_reuses_views_and_reads_each_steps_data():
    """The staging buffer hands arrays of a place and shape seen before their device views again
    (GPUTreeRuntime._plan_views, by groups of one size): one runtime planning 80 steps of few sizes, each equal to a
    fresh runtime's Python plan of the same step, and most groups' views reused."""
    from vllm_adaspec.runtime.gpu import GPUTreeRuntime

    g = np.random.default_rng(11)
    rt = GPUTreeRuntime("cpu", plain=lambda r: "greedy", max_rows=65)
    rt.heads, rt.block_q = (32, 8, 128), 4
    checked = 0
    for trial in range(80):
        b = int(g.integers(1, 3))
        req_ids = [f"r{i}" for i in range(b)]
        plans = {}
        for r in req_ids:
            n = int(g.integers(1, 5))
            parents = tuple([-1] + [int(g.integers(-1, i)) for i in range(1, n)])
            plans[r] = DraftPlan(tuple(int(t) for t in g.integers(0, 50, n)), parents)
        spec = {r: list(p.tokens) for r, p in plans.items()}
        qs = np.concatenate([[0], np.cumsum([1 + len(spec[r]) for r in req_ids])])
        step = plan_step(req_ids, qs, g.integers(10, 3000, b), spec, plans, int(qs[-1]))
        if step is None:  # (chains only)
            continue
        checked += 1
        ref = GPUTreeRuntime("cpu", plain=lambda r: "greedy", max_rows=65)
        ref.heads, ref.block_q = rt.heads, rt.block_q
        assert_same_fields(_device_fields(ref.prepare_reference(step).device), _device_fields(rt.prepare(step).device),
                           trial)
    made = sum(len(v) for v in rt._plan.views)  # groups of views made (six looked up a step, per turn)
    assert checked > 40 and 0 < made < 6 * checked / 2, (checked, made)


def test_a_malformed_plan_raises_instead_of_writing_past_its_buffers():
    """The compiled plan checks its indices: inputs no planned step can have (a parent after its node, which
    DraftTree refuses first) raise IndexError, which begin_step contains as a planning fault; they never write past
    the staging buffers (in a process of its own: an unchecked write could take the process down)."""
    import subprocess
    import sys

    code = """if True:
        import numpy as np
        from vllm_adaspec.trees import step_plan
        a = lambda *x: np.array(x, np.int64)
        layout = step_plan.plan_layout(1, 1, 1, 1, 1, 1, 1)
        try:
            step_plan.plan_arrays(a(40), a(5), a(1), a(1), a(0), a(9), a(0), a(0), a(1), 1, 1,
                                  np.zeros(layout[-1], np.int64), layout)
        except IndexError as e:
            print("IndexError:", e)
        """
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "IndexError: index is out of bounds" in proc.stdout, proc.stdout + proc.stderr


def test_without_numba_or_when_it_fails_the_gpu_plan_is_the_python_one(monkeypatch, caplog):
    """numba comes with vLLM; where it cannot be imported, or its plan fails to compile at start-up, prepare plans in
    Python (the same arrays, slower), said once in the log: the engine starts and serves."""
    from vllm_adaspec.runtime.gpu import GPUTreeRuntime
    from vllm_adaspec.trees import step_plan

    calls = []
    monkeypatch.setattr(GPUTreeRuntime, "prepare_reference", lambda self, step: calls.append(step) or step)
    step = plan_step(["a"], np.array([0, 3]), np.array([5]), {"a": [1, 2]},
                     {"a": DraftPlan((1, 2), (-1, -1), tree_path=True)}, 3)

    def broken():
        raise RuntimeError("no LLVM here")

    monkeypatch.setattr(step_plan, "warm_up", broken)
    rt = GPUTreeRuntime("cpu", max_rows=65)
    assert rt.compiled_plan and not rt.plan_ready() and not rt.plan_ready()
    assert rt.prepare(step) is step and calls == [step]
    assert [r.message for r in caplog.records].count(
        "vllm_adaspec: the compiled tree-step plan failed at start-up (RuntimeError: no LLVM here); steps are planned "
        "in Python") == 1
    monkeypatch.setattr(step_plan, "njit", None)  # numba missing
    rt = GPUTreeRuntime("cpu", max_rows=65)
    assert not rt.compiled_plan and not rt.plan_ready()
    assert rt.prepare(step) is step and calls == [step, step]


def test_nothing_in_the_gpu_step_reads_a_device_value(monkeypatch):
    """On the meta device (tensors without values) a host read of a device value raises: the step from planning to
    compaction, with vLLM's chain indices, greedy and sampled trees verified in the batch, a tree verified on the host
    and an early-exit draft step's plan, runs without one (on a GPU: no wait for the device in the hot path). And
    every copy from the host to the device in it is non-blocking, out of the runtime's staging buffers (pinned on a
    GPU): a blocking copy (`.to(device)` of a host tensor, as the draft step and the host-verified path made) would
    wait for the device too. No kernel runs on meta: the verification and compaction kernels' launches are stood in
    for by their torch paths here (the kernels' own launchers read nothing on the host: benchmarks/device_check.py
    runs them on a GPU under sync debug mode)."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    import vllm_adaspec.runtime.gpu as gtr
    from vllm_adaspec.engine.tree_sampler import chains_only

    ref = gtr.tree_verify.verify_trees_reference
    monkeypatch.setattr(gtr.tree_verify, "verify_trees", lambda b, d, out, rows, block_n=None: ref(b, d, out, rows))
    monkeypatch.setattr(gtr.kv_compaction, "layer_offsets", lambda caches: None)  # the per-layer torch moves
    with HostToDevice("meta") as h2d:
        rt = _meta_step(chains_only, SpecDecodeMetadata)
    assert h2d.copies and all(blocking is True for _, blocking in h2d.copies), h2d.copies
    assert rt.faults.count == 0 and rt.kernel_fallbacks == 0


def _meta_step(chains_only, SpecDecodeMetadata):
    rt, step, qs = planned("meta", plain={"tree_a": "greedy", "tree_b": "sampled"}.get)  # both batched kinds
    t = int(qs[-1])
    positions = torch.zeros(t, dtype=torch.int64, device="meta")
    seq_lens = torch.zeros(len(REQ_IDS), dtype=torch.int32, device="meta")
    spec = {r: list(p.tokens) for r, p in PLANS.items()}
    rt.begin_step(REQ_IDS, qs, ROOTS, positions, spec, PLANS, t, seq_lens, set(), set())
    step = rt.step
    assert step is not None and rt.faults.count == 0 and step.device.launch.bits.device.type == "meta"
    num = [len(PLANS.get(r, DraftPlan(())).tokens) for r in REQ_IDS]
    meta = lambda n, dtype=torch.int32: torch.empty(n, dtype=dtype, device="meta")  # noqa: E731
    md = SpecDecodeMetadata(meta(sum(num)), num, meta(len(num)), meta(len(num)), meta(sum(num)), meta(len(num)),
                            meta(sum(num) + len(num)))
    sm = SimpleNamespace(spec_token_ids=None)
    reduced, _, _ = chains_only(md, sm, {r.row for r in step.requests}, rt.staged_chains(step))
    assert reduced.num_draft_tokens == [3, 0, 0, 0, 0] and reduced.draft_token_ids.shape == (3,)
    tokens = torch.empty(len(REQ_IDS), 8, dtype=torch.int32, device="meta")
    logits = torch.empty(sum(num) + len(num), 50, device="meta")
    sm = SimpleNamespace(temperature=torch.empty(len(REQ_IDS), device="meta"), top_k=meta(len(REQ_IDS)),
                         top_p=torch.empty(len(REQ_IDS), device="meta"))
    assert step.device.batched == [0, 1] and step.device.greedy == 1
    verdict = rt.verify_batched(step, logits, tokens, sm)
    step.slot_mapping = torch.empty(t, dtype=torch.long, device="meta")
    step.kv_caches = [torch.empty(20, HKV, BS, 2 * D, device="meta") for _ in range(3)]
    rt.layers_ready(step.kv_caches)  # at start-up (GPUTreeRuntime.ready)
    written = rt.write_rows(tokens, {4: [32, 33, 3]})  # tree_c's committed tokens, verified on the host
    assert written[4].device.type == "meta"
    rt.finish_step(step, {4: ([0, 1], 3, [])}, verdict)  # tree_c verified on the host: its path is copied in
    assert rt.pending is not None
    # an early-exit draft step over two trees: its launch plan staged to the device
    from vllm_adaspec.proposers.early_exit import EarlyExitDrafter
    from vllm_adaspec.trees import GrowingTree, add_children

    t1, t2 = GrowingTree(), GrowingTree()
    add_children(t1, -1, [5, 6], [0.6, 0.3])
    add_children(t1, 0, [7, 8], [0.5, 0.4])
    add_children(t2, -1, [3, 4], [0.7, 0.2])
    roots = np.array([40, 9])
    prefix = EarlyExitDrafter._draft_prefix(roots, torch.arange(8).view(2, 4))
    mask = EarlyExitDrafter._draft_mask([(0, 2), (1, 0), (0, 3)], [t1, t2], [{0: 1, 1: 2, 2: 3, 3: 4}, {0: 1}],
                                        roots, prefix)
    plan, block_rows = rt.on_device(mask)
    assert plan.bits.device.type == "meta" and block_rows.device.type == "meta" and plan.q_rows.shape == (3,)
    return rt


def test_tree_drafting_steps_attend_over_the_gpu_layout(triton_interpret, monkeypatch):
    """Early exit's tree drafting on the GPU runtime: a draft step's rows see their tree's prefix and their own
    ancestors-or-self among the nodes already run (step.DraftMask, built by the drafter on the host, staged to the
    device once per step as a launch plan of the tree kernel, which reads vLLM's GPU paged layout in place: no
    gathered prefix): equal to causal attention along each row's path."""
    import vllm_adaspec.runtime.gpu as gtr
    from vllm_adaspec.runtime.gpu import GPUTreeRuntime
    from vllm_adaspec.proposers.early_exit import EarlyExitDrafter
    from vllm_adaspec.trees import GrowingTree, add_children

    g = torch.Generator().manual_seed(4)
    roots = np.array([40, 9])  # nodes that ran take slots root + 1, root + 2, ... in the order they ran
    t = GrowingTree()
    add_children(t, -1, [5, 6], [0.6, 0.3])  # A = 0, B = 1 (both ran)
    add_children(t, 0, [7, 8], [0.5, 0.4])  # C = 2, D = 3 under A
    add_children(t, 1, [9, 10], [0.9, 0.1])  # E = 4, F = 5 under B
    t2 = GrowingTree()  # a second tree: only its first child X = 0 runs now
    add_children(t2, -1, [3, 4], [0.7, 0.2])
    slot_of = [{0: 1, 1: 2, 2: 3, 4: 4}, {0: 1}]  # tree 0: C and E run now
    feed = [(0, 2), (1, 0), (0, 4)]
    cache = torch.zeros(12, HKV, BS, 2 * D)
    k, v = kv_views(cache)
    block_rows = torch.randperm(12, generator=g)[:8].view(2, 4)
    kv = []
    for b, r in enumerate(roots):
        kk, vv = torch.randn(r + 5, HKV, D, generator=g), torch.randn(r + 5, HKV, D, generator=g)
        pos = torch.arange(r + 5)
        k[block_rows[b, pos // BS], pos % BS], v[block_rows[b, pos // BS], pos % BS] = kk, vv
        kv.append((kk, vv))
    prefix = EarlyExitDrafter._draft_prefix(roots, block_rows)
    mask = EarlyExitDrafter._draft_mask(feed, [t, t2], slot_of, roots, prefix)
    q = torch.randn(3, HQ, D, generator=g)
    out = torch.zeros(3, HQ, D)
    ta = load_interpreted("tree_attention")
    monkeypatch.setattr(gtr, "kernels", ta)
    monkeypatch.setattr(gtr, "tree_verify", load_interpreted("tree_verify"))
    monkeypatch.setattr(gtr, "kv_compaction", load_interpreted("kv_compaction"))
    rt = GPUTreeRuntime("cpu", max_rows=6)
    rt.heads, rt.block_q = (HQ, HKV, D), ta.tile_rows(6, HQ, HKV)
    with rt.drafting(mask):
        rt.attend(None, 0.125, q, None, None, cache, SimpleNamespace(num_actual_tokens=3), out)
    r0, r1 = roots
    for f, tree, keys in [(0, 0, list(range(r0 + 1)) + [r0 + 1, r0 + 3]), (2, 0, list(range(r0 + 1)) + [r0 + 2, r0 + 4]),
                          (1, 1, list(range(r1 + 2)))]:
        kk, vv = (x[keys].repeat_interleave(HQ // HKV, 1) for x in kv[tree])
        att = torch.softmax(torch.einsum("hd,jhd->hj", q[f], kk) * 0.125, -1)
        torch.testing.assert_close(out[f], torch.einsum("hj,jhd->hd", att, vv), rtol=1e-5, atol=1e-5)


def test_compaction_moves_write_each_destination_once():
    """Moves for every node row: accepted nodes to root + depth, other rows onto themselves, padding onto the root:
    no destination twice (so a scatter cannot race), and applied to a cache, the same as moving the path alone."""
    starts, sizes = torch.tensor([0, 10, 30]), torch.tensor([6, 3, 4])
    path = torch.tensor([[2, 4, -1, -1, -1, -1], [0, 1, 2, -1, -1, -1], [-1] * 6])
    count = torch.tensor([2, 3, 0])
    src, dst = compaction_moves(starts, sizes, path, count)
    real = dst[dst != torch.repeat_interleave(starts, 6)]  # padding goes to the roots
    assert len(set(real.tolist())) == len(real) == int(sizes.sum())
    cache = torch.randn(4, HKV, BS, 2 * D)
    slots = torch.randperm(4 * BS)[:40]
    got = cache.clone()
    move_slots([got], slots[src], slots[dst])
    want = cache.clone()
    k, v = kv_views(want)
    k0, v0 = kv_views(cache)
    for s, n, p in zip(starts.tolist(), count.tolist(), path.tolist()):
        for d in range(1, n + 1):
            a, b = slots[s + 1 + p[d - 1]], slots[s + d]
            k[b // BS, b % BS], v[b // BS, b % BS] = k0[a // BS, a % BS], v0[a // BS, a % BS]
    assert torch.equal(got, want)


def test_a_layers_kv_views_are_made_once_per_cache():
    """The runtime keeps each layer's K, V views (half a layer's launch on the host to make): the same views for the
    same cache tensor, equal to kv_views' and seeing its writes; another tensor (even one reusing a freed one's
    address) gets its own."""
    from vllm_adaspec.runtime.gpu import GPUTreeRuntime

    rt = GPUTreeRuntime("cpu")
    cache = torch.randn(4, HKV, BS, 2 * D)
    k, v = rt._kv_views(cache)
    assert rt._kv_views(cache)[0] is k and rt._kv_views(cache)[1] is v
    want_k, want_v = kv_views(cache)
    assert k.stride() == want_k.stride() and torch.equal(k, want_k) and torch.equal(v, want_v)
    cache.add_(1.0)  # vLLM writes the cache in place: the held views read it
    assert torch.equal(k, kv_views(cache)[0])
    other = cache.clone()
    ok, _ = rt._kv_views(other)
    assert ok is not k and ok.data_ptr() == other.data_ptr()


VLLM_TRITON = r'''
import json, os, sys, types
os.environ["TRITON_INTERPRET"] = "1"
import triton.backends
triton.backends.backends["cpu"] = types.SimpleNamespace(driver=None)  # vLLM uses Triton only with a backend
import torch
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # vLLM's KV write asks; an H100's answer
from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata
from vllm_adaspec.engine import tree_backend
from vllm_adaspec.engine.gpu_tree_backend import (TreeFlashAttentionBackend, TreeTritonAttentionBackend,
                                                  TreeTritonAttentionImpl)
from vllm_adaspec.runtime.gpu import GPUTreeRuntime
from vllm_adaspec.runtime.base import plan_step
from vllm_adaspec.step import DraftPlan
out = {}
tree_backend.register_gpu()
out["registered"] = [AttentionBackendEnum.FLASH_ATTN.get_class().__name__,
                     AttentionBackendEnum.TRITON_ATTN.get_class().__name__]
out["subclasses"] = [issubclass(TreeFlashAttentionBackend, AttentionBackendEnum.FLASH_ATTN.get_class().__mro__[1]),
                     TreeTritonAttentionBackend.__mro__[1].__name__]
support = TreeTritonAttentionBackend.get_builder_cls().get_cudagraph_support(None, None)
out["cg_support"] = support.name
cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
cc.set_splitting_ops_for_v1("naive")  # as a CUDA engine's config sets them: attention between graphed pieces
out["cg_mode"] = cc.resolve_cudagraph_mode_and_sizes(support, "TREE", uniform_decode_query_len=9).name

torch.manual_seed(0)
hq, hkv, d, bs, nb = 4, 2, 32, 16, 24
impl = TreeTritonAttentionImpl(hq, d, d ** -0.5, hkv, None, None, "auto")
layer = types.SimpleNamespace(_k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0), _q_scale=torch.tensor(1.0))
# a chain of 3 drafts (root at 30), a tree of 5 nodes (root at 17), a prefill chunk of 6 tokens (from 0)
plans = {"c": DraftPlan((1, 2, 3), (-1, 0, 1)), "t": DraftPlan((4, 5, 6, 7, 8), (-1, -1, 0, 1, 1))}
rows, roots, ids = [4, 6, 6], [30, 17, 0], ["c", "t", "p"]
qs = [0, 4, 10, 16]
step = plan_step(ids, qs, roots, {k: list(p.tokens) for k, p in plans.items()}, plans, 16)
rt = GPUTreeRuntime("cpu")
rt.heads = (hq, hkv, d)
positions = torch.cat([torch.arange(r, r + n) for r, n in zip(roots, rows)])
seq_lens = torch.tensor([r + n for r, n in zip(roots, rows)], dtype=torch.int32)
rt.begin_step(ids, qs, roots, positions, {k: list(p.tokens) for k, p in plans.items()}, plans, 16, seq_lens,
              set(), set())
impl.tree_runtime = rt
table = torch.randperm(nb)[:9].view(3, 3).to(torch.int32)
kv = torch.zeros(nb, hkv, bs, 2 * d)  # logical [blocks, Hkv, block_size, 2D]
# the prefixes' KV (earlier steps), then this step's rows written by vLLM's own KV write
pre = {"c": 30, "t": 17, "p": 0}
k_all = {i: torch.randn(roots[b] + rows[b], hkv, d) for b, i in enumerate(ids)}
v_all = {i: torch.randn(roots[b] + rows[b], hkv, d) for b, i in enumerate(ids)}
slot = lambda b, p: int(table[b, p // bs]) * bs + p % bs
K, V = kv.transpose(1, 2).split(d, -1)
for b, i in enumerate(ids):
    for p in range(roots[b]):
        K[slot(b, p) // bs, slot(b, p) % bs], V[slot(b, p) // bs, slot(b, p) % bs] = k_all[i][p], v_all[i][p]
key = torch.cat([k_all[i][roots[b]:] for b, i in enumerate(ids)])
value = torch.cat([v_all[i][roots[b]:] for b, i in enumerate(ids)])
slots = torch.tensor([slot(b, roots[b] + j) for b in range(3) for j in range(rows[b])])
impl.do_kv_cache_update(layer, key, value, kv, slots)
q = torch.randn(16, hq, d)
o = torch.full((16, hq, d), float("nan"))
md = TritonAttentionMetadata(num_actual_tokens=16, max_query_len=6, query_start_loc=torch.tensor(qs, dtype=torch.int32),
                             max_seq_len=int(seq_lens.max()), seq_lens=seq_lens, block_table=table, slot_mapping=slots,
                             seq_threshold_3D=0, num_par_softmax_segments=16,
                             softmax_segm_output=torch.empty(16, hq, 16, d), softmax_segm_max=torch.empty(16, hq, 16),
                             softmax_segm_expsum=torch.empty(16, hq, 16), causal=True)
impl.forward(layer, q, key, value, kv, md, o)
# float64 reference: the chain and the prefill chunk causal, the tree rows under their ancestor mask
errs, kv_written = [], True
for b, i in enumerate(ids):
    n, r0 = rows[b], qs[b]
    kk = k_all[i].double().repeat_interleave(hq // hkv, 1)
    vv = v_all[i].double().repeat_interleave(hq // hkv, 1)
    vis = torch.ones(n, roots[b] + n, dtype=torch.bool)
    vis[:, roots[b]:] = torch.ones(n, n, dtype=torch.bool).tril()
    if i == "t":
        vis[:, roots[b]:] = step.requests[0].mask
    s = torch.einsum("ihd,jhd->hij", q[r0:r0 + n].double(), kk) * d ** -0.5
    s = s.masked_fill(~vis[None], float("-inf"))
    want = torch.einsum("hij,jhd->ihd", torch.softmax(s, -1), vv)
    errs.append(float((o[r0:r0 + n].double() - want).abs().max()))
    for j in range(roots[b] + n):
        kv_written &= bool(torch.equal(K[slot(b, j) // bs, slot(b, j) % bs], k_all[i][j]))
out["max_err"] = errs
out["kv_written"] = kv_written
print("@@" + json.dumps(out))
'''


@pytest.fixture(scope="module")
def vllm_triton() -> dict:
    p = subprocess.run([sys.executable, "-c", VLLM_TRITON], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads([line for line in p.stdout.splitlines() if line.startswith("@@")][-1][2:])


def test_the_tree_subclass_of_vllms_triton_backend_runs_vllms_kernels_for_chains(vllm_triton):
    """vLLM's own KV write and attention kernel (interpreted) for every row, then the tree rows rewritten: the chain
    and the prefill chunk equal causal attention, the tree rows tree-masked attention (float64 reference)."""
    assert vllm_triton["kv_written"] is True
    assert max(vllm_triton["max_err"]) < 1e-4, vllm_triton["max_err"]


def test_registration_and_the_graph_mode_vllm_resolves(vllm_triton):
    """FLASH_ATTN and TRITON_ATTN resolve to the tree subclasses; their builders report full graphs for
    single-token decode batches only, and vLLM turns FULL_AND_PIECEWISE into PIECEWISE under speculation (attention,
    tree rows included, runs eagerly each step; a full graph would replay one step's tree rows forever)."""
    assert vllm_triton["registered"] == ["TreeFlashAttentionBackend", "TreeTritonAttentionBackend"]
    assert vllm_triton["subclasses"] == [True, "TritonAttentionBackend"]
    assert vllm_triton["cg_support"] == "UNIFORM_SINGLE_TOKEN_DECODE"
    assert vllm_triton["cg_mode"] == "PIECEWISE"


EMULATION = str(Path(__file__).resolve().parent / "gpu_emulation")
GPU_PROMPTS = [PROMPTS[0], PROMPTS[1], PROMPTS[4], PROMPTS[7], PROMPTS[8], PROMPTS[0]]


def _params(mode: str, tokens: int = 40) -> list:
    """Speculation forced to trees whenever a request drafts (or off: the reference). The first request has a
    min_tokens setting (its trees are verified one by one on the host, each row with its own path's output), three
    are plain greedy (verified in one batch on the device); two sample, not compared: one seeded (one by one), one
    not (sample-and-match in the device batch)."""
    xargs = {"extra_args": {"adaspec_speculation": mode}}
    greedy = {"temperature": 0.0, "max_tokens": tokens, **xargs}
    seeded = {"temperature": 0.8, "seed": 3, "max_tokens": min(tokens, 24), **xargs}
    return [{**greedy, "min_tokens": 4}] + [greedy] * 3 + [seeded, {"temperature": 0.1, "max_tokens": tokens, **xargs}]


@pytest.fixture(scope="module")
def gpu_path_runs(tiny_llama) -> dict:
    """Two engines in one emulating child (harness.EngineHost): MultiBranchProposer's trees and early exit's trees
    (the untrained exit after 2 of 4 layers: draft steps over tree nodes under the draft mask), each with its
    requests' speculation forced to trees, then the same requests with speculation off (the reference)."""
    from vllm_adaspec.harness import EngineHost, default_env

    host = EngineHost(env={**default_env(), "ADASPEC_EMULATE_GPU": "1",
                           "PYTHONPATH": os.pathsep.join([EMULATION, os.environ.get("PYTHONPATH", "")])})
    base = {**ENGINE, "max_model_len": 256, "max_num_batched_tokens": 64, "max_num_seqs": 8}
    # early exit: 16 tokens a request (its draft passes run the interpreted kernel too: ~5x the time a token of
    # MultiBranchProposer's trees; 16 still give ~80 tree rounds)
    tokens = {"multi_branch": 40, "early_exit": 16}
    engines = {"multi_branch": {**base, "speculative_config": {"model": "vllm_adaspec.MultiBranchProposer",
                                                               "num_speculative_tokens": 8},
                                "additional_config": {"adaspec": {"pools": ["context", "recycled"],
                                                                  "cost_model": "off"}}},
               "early_exit": {**base, "speculative_config": {"model": "vllm_adaspec.EarlyExitProposer",
                                                             "num_speculative_tokens": 4},
                              "additional_config": {"adaspec": {"exit_head": "none", "exit_layer": 2,
                                                                "cost_model": "off", "tree": {"budget": 4}}}}}
    try:
        out = {}
        for name, engine in engines.items():
            batches = [{"prompts": GPU_PROMPTS, "params": _params(mode, tokens[name])} for mode in ("tree", "off")]
            out[name] = [b["runs"][0] for b in host.run({"model": tiny_llama, "engine": engine,
                                                         "batches": batches})["batches"]]
        return out
    finally:
        host.close()


@pytest.mark.engine
def test_a_whole_engine_on_the_gpu_tree_path_equals_plain_decoding(gpu_path_runs):
    trees, plain = gpu_path_runs["multi_branch"]
    assert trees["token_ids"][:4] == plain["token_ids"][:4]  # the greedy rows
    st = trees["adaspec"]
    assert st["config"]["tree_mode"] and st["drafter_faults"] == 0, st
    assert st["tree_batched"] > 5 and st["tree_verified"] > st["tree_batched"], st  # both verification paths
    # every kernel launch of the run was a variant compiled at start-up (none compiled while serving), none failed
    assert st["tree_kernel_cold"] == 0 and st["tree_kernel_fallbacks"] == 0, st
    assert st["accepted_drafts"] > 10 and st["tree_kv_moves"] > 0, st
    assert plain["adaspec"]["verified_drafts"] == 0  # the reference drafted nothing


@pytest.mark.engine
def test_early_exit_trees_on_the_gpu_tree_path_equal_plain_decoding(gpu_path_runs):
    trees, plain = gpu_path_runs["early_exit"]
    assert trees["token_ids"][:4] == plain["token_ids"][:4]
    st = trees["adaspec"]
    assert st["drafter_faults"] == 0 and st["tree_rounds"] > 20 and st["draft_passes"] > 20, st
    assert st["tree_batched"] > 10 and st["tree_batched_sampled"] > 5 and st["accepted_drafts"] > 0, st
    assert st["tree_kernel_cold"] == 0 and st["tree_kernel_fallbacks"] == 0, st  # draft steps through the kernel too
    assert plain["adaspec"]["verified_drafts"] == 0


def _steps_of_every_width(rt, ta, k: int, g, widths=None) -> None:
    """Verification steps of a batch of two trees of every width 1..k (or `widths`), over a short prefix (one split:
    the kernel writes the output) and a long one (split keys, reduced as ta.FUSED_MAX_SPLITS says), each through one
    attention layer."""
    cache = torch.randn(80, HKV, BS, 2 * D, generator=g)
    table = torch.randperm(80, generator=g)[:2 * 40].view(2, 40).to(torch.int32)
    for n in widths or range(1, k + 1):
        for root in (9, 530):
            parents = [-1] + [int(torch.randint(i + 1, (), generator=g)) - 1 for i in range(n - 1)]
            plans = {"a": DraftPlan(tuple(range(5, 5 + n)), tuple(parents), tree_path=True),
                     "b": DraftPlan((7,) * min(n, 2), (-1,) * min(n, 2), tree_path=True)}
            rows = [len(plans["a"].tokens) + 1, len(plans["b"].tokens) + 1]
            qs = np.concatenate([[0], np.cumsum(rows)])
            t = int(qs[-1])
            rt.begin_step(["a", "b"], qs, np.array([root, 40]), torch.zeros(t, dtype=torch.long),
                          {r: list(p.tokens) for r, p in plans.items()}, plans, t,
                          torch.zeros(2, dtype=torch.int32), set(), set())
            assert rt.step is not None
            qkv = torch.randn(t, (HQ + 2 * HKV) * D, generator=g)  # vLLM's q: a view of the fused projection
            out = torch.zeros(t, HQ, D)
            rt.attend(None, 0.25, qkv[:, :HQ * D].view(t, HQ, D), None, None, cache,
                      SimpleNamespace(num_actual_tokens=t, slot_mapping=torch.arange(t), block_table=table), out)
            rt.take_step()


def test_no_kernel_variant_compiles_after_start_up(triton_interpret, monkeypatch):
    """Start-up compiles every variant of the tree kernel a step can launch (kernels/tree_attention.warm_up, on the
    engine's own caches and block table too): steps of every tree width, with and without the split reduction,
    launch none other (on a GPU: no compile inside a forward), and the host's plan (numba) is compiled there too.
    Triton specializes on pointer alignment: with the
    staged index arrays at unaligned offsets (as before), steps meet variants start-up never compiled."""
    import vllm_adaspec.runtime.gpu as gtr
    from vllm_adaspec.runtime.gpu import GPUTreeRuntime

    ta = load_interpreted("tree_attention")
    monkeypatch.setattr(gtr, "kernels", ta)
    monkeypatch.setattr(gtr, "tree_verify", load_interpreted("tree_verify"))
    monkeypatch.setattr(gtr, "kv_compaction", load_interpreted("kv_compaction"))
    k = 8
    impls = [SimpleNamespace(num_heads=HQ, num_kv_heads=HKV, head_size=D)] * 2

    def engine():
        ta.VARIANTS = ta.KernelVariants()
        rt = GPUTreeRuntime("cpu", plain=lambda r: None, max_rows=k + 1, block_size=BS, max_blocks=40)
        rt.attached(impls, torch.float32)
        rt.ready([torch.zeros(80, HKV, BS, 2 * D)], torch.zeros(64, 40, dtype=torch.int32))
        return rt

    from vllm_adaspec.trees import step_plan

    plan_warm_ups = []
    warm_up = step_plan.warm_up
    monkeypatch.setattr(step_plan, "warm_up", lambda: plan_warm_ups.append(warm_up()))
    rt = engine()
    assert len(plan_warm_ups) == 1 and step_plan._plan.signatures  # the host's compiled plan too
    warm = len(ta.VARIANTS.warm)
    # split writing the output, reducing its own partials (2 .. FUSED_MAX_SPLITS chunks), writing partials; reduction
    assert warm == 4, ta.VARIANTS.warm
    _steps_of_every_width(rt, ta, k, torch.Generator().manual_seed(0))  # 2 chunks over the long prefix: fused
    with monkeypatch.context() as m:  # where the chunks are more than FUSED_MAX_SPLITS: partials and the reduction
        m.setattr(ta, "FUSED_MAX_SPLITS", 1)
        _steps_of_every_width(rt, ta, k, torch.Generator().manual_seed(1), widths=(1, k))
    assert len(ta.VARIANTS.launched) == warm and ta.VARIANTS.cold == 0, ta.VARIANTS.launched - ta.VARIANTS.warm
    monkeypatch.setattr(gtr, "ALIGN_BYTES", 4)  # the staging buffer as it was: arrays packed end to end
    rt = engine()
    _steps_of_every_width(rt, ta, k, torch.Generator().manual_seed(0))
    assert ta.VARIANTS.cold > 0


def test_a_failed_kernel_launch_is_contained_and_the_layer_computed_in_torch(triton_interpret, monkeypatch):
    """A launch that raises (a resource limit, a driver error) is a contained fault: the layer's tree rows come from
    the torch fallback (the same attention), the fault is counted, the step goes on."""
    import vllm_adaspec.runtime.gpu as gtr

    ta = load_interpreted("tree_attention")
    monkeypatch.setattr(gtr, "kernels", ta)
    monkeypatch.setattr(gtr, "tree_verify", load_interpreted("tree_verify"))
    monkeypatch.setattr(gtr, "kv_compaction", load_interpreted("kv_compaction"))
    g = torch.Generator().manual_seed(0)
    rt, step, qs = planned()
    positions, seq_lens = torch.zeros(int(qs[-1]), dtype=torch.long), torch.zeros(len(REQ_IDS), dtype=torch.int32)
    rt.begin_step(REQ_IDS, qs, ROOTS, positions, {r: list(p.tokens) for r, p in PLANS.items()}, PLANS, int(qs[-1]),
                  seq_lens, set(), set())
    cache, table = paged_cache(g)
    t = int(qs[-1])
    query = torch.randn(t, HQ, D, generator=g)
    md = SimpleNamespace(num_actual_tokens=t, slot_mapping=slots_of(table, qs), block_table=table)
    want = torch.zeros(t, HQ, D)
    rt.attend(None, 0.25, query, None, None, cache, md, want)

    def broken(*a, **kw):
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(ta, "launch", broken)
    got = torch.zeros(t, HQ, D)
    rt.step.kv_caches.clear()
    rt.attend(None, 0.25, query, None, None, cache, md, got)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert rt.faults.count == 1 and rt.kernel_fallbacks == 1


def test_failed_verification_and_compaction_launches_are_contained(triton_interpret, monkeypatch):
    """The step's other two kernels fail alike: a verification launch that raises leaves the batch to the torch ops
    and a compaction launch that raises to the per-layer moves, each a counted fault, and vLLM's sampled tokens and
    every layer's cache end as the kernels leave them (greedy and sampled trees in the batch)."""
    import vllm_adaspec.runtime.gpu as gtr

    tv, kc = load_interpreted("tree_verify"), load_interpreted("kv_compaction")
    monkeypatch.setattr(gtr, "tree_verify", tv)
    monkeypatch.setattr(gtr, "kv_compaction", kc)
    ends = []
    for broken in (False, True):
        if broken:
            def fail(*a, **kw):
                raise RuntimeError("an illegal memory access was encountered")

            monkeypatch.setattr(tv, "verify_trees", fail)
            monkeypatch.setattr(kc, "compact", fail)
        g = torch.Generator().manual_seed(0)
        rt, _, qs = planned(plain={"tree_a": "greedy", "tree_b": "sampled"}.get)
        t = int(qs[-1])
        rt.begin_step(REQ_IDS, qs, ROOTS, torch.zeros(t, dtype=torch.long), {r: list(p.tokens) for r, p in
                      PLANS.items()}, PLANS, t, torch.zeros(len(REQ_IDS), dtype=torch.int32), set(), set())
        step = rt.step
        num = [len(PLANS.get(r, DraftPlan(())).tokens) for r in REQ_IDS]
        logits = torch.randn(sum(num) + len(num), 50, generator=g)
        at = np.concatenate([[0], np.cumsum(np.array(num) + 1)])
        for k, r in enumerate(REQ_IDS):  # each row favours its first child's token: paths get accepted
            if r in PLANS:
                for j, q in reversed(list(enumerate(PLANS[r].parents))):
                    logits[at[k] + 1 + q, PLANS[r].tokens[j]] += 4.0
        tokens = torch.full((len(REQ_IDS), 8), -2, dtype=torch.int32)
        sm = SimpleNamespace(temperature=torch.full((len(REQ_IDS), ), 0.7), top_k=None, top_p=None)
        step.kv_caches = [paged_cache(g)[0] for _ in range(2)]
        step.slot_mapping = torch.randperm(36 * BS, generator=g)[:t]
        torch.manual_seed(5)  # the sampled trees' draws
        verdict = rt.verify_batched(step, logits, tokens, sm)
        rt.finish_step(step, {4: ([0, 1], 3, [])}, verdict)
        assert (rt.faults.count, rt.kernel_fallbacks) == ((2, 2) if broken else (0, 0))
        ends.append((tokens, step.kv_caches, verdict.count))
    (tok_a, caches_a, count_a), (tok_b, caches_b, count_b) = ends
    assert torch.equal(tok_a, tok_b) and torch.equal(count_a, count_b) and int(count_a.sum()) > 0, count_a
    assert all(torch.equal(a, b) for a, b in zip(caches_a, caches_b))


def test_a_failed_row_draw_launch_is_contained(triton_interpret, monkeypatch):
    """The rows' argmax and draws (kernels/row_draws.py, on as on a GPU) from a launch that raises: a counted fault,
    the torch ops instead, vLLM's sampled tokens as the kernel writes them (greedy trees); with top-k set the torch
    ops draw and the kernel is not launched."""
    import vllm_adaspec.runtime.gpu as gtr

    rd = load_interpreted("row_draws")
    monkeypatch.setattr(gtr, "tree_verify", load_interpreted("tree_verify"))
    monkeypatch.setattr(gtr, "row_draws", rd)
    launches = []
    draws = rd.row_draws
    ends = []
    for broken in (False, True):
        def launch(*a, **kw):
            launches.append(broken)
            if broken:
                raise RuntimeError("an illegal memory access was encountered")
            return draws(*a, **kw)

        monkeypatch.setattr(rd, "row_draws", launch)
        rt, _, qs = planned()
        rt.draw_kernel = True
        t = int(qs[-1])
        rt.begin_step(REQ_IDS, qs, ROOTS, torch.zeros(t, dtype=torch.long), {r: list(p.tokens) for r, p in
                      PLANS.items()}, PLANS, t, torch.zeros(len(REQ_IDS), dtype=torch.int32), set(), set())
        logits = torch.randn(t, 50, generator=torch.Generator().manual_seed(3))
        tokens = torch.full((len(REQ_IDS), 8), -2, dtype=torch.int32)
        verdict = rt.verify_batched(rt.step, logits, tokens, SimpleNamespace(temperature=None, top_k=None, top_p=None))
        assert (rt.faults.count, rt.kernel_fallbacks) == ((1, 1) if broken else (0, 0))
        ends.append((tokens, verdict.argmax))
    assert torch.equal(ends[0][0], ends[1][0]) and torch.equal(ends[0][1], ends[1][1]) and launches == [False, True]
    rt, _, qs = planned(plain={"tree_a": "greedy", "tree_b": "sampled"}.get)
    rt.draw_kernel = True
    rt.begin_step(REQ_IDS, qs, ROOTS, torch.zeros(t, dtype=torch.long), {r: list(p.tokens) for r, p in
                  PLANS.items()}, PLANS, t, torch.zeros(len(REQ_IDS), dtype=torch.int32), set(), set())
    sm = SimpleNamespace(temperature=torch.full((len(REQ_IDS),), 0.7), top_k=torch.full((len(REQ_IDS),), 5),
                         top_p=None)
    rt.verify_batched(rt.step, logits, tokens, sm)
    assert launches == [False, True] and rt.faults.count == 0
