"""Tree-mask attention kernel (flash-decoding split over the keys, ancestor bits, GQA) under the Triton interpreter,
against the float64 torch reference and against the CPU tree path's attention for the same trees."""

import dataclasses
import math
import os

import pytest
import torch

from conftest import load_interpreted
from vllm_adaspec.trees import DraftTree, ancestor_mask

ta = load_interpreted("tree_attention")


def random_tree(n: int, g: torch.Generator) -> DraftTree:
    """n draft nodes, breadth-first: each node's parent drawn among the previous depth's nodes (or the root)."""
    parents, prev, cur = [], [-1], []
    for i in range(n):
        if cur and (not prev or torch.rand((), generator=g) < 0.4):  # start the next depth
            prev, cur = cur, []
        q = prev[int(torch.randint(len(prev), (), generator=g))]
        parents.append(q)
        cur.append(i)
    return DraftTree(torch.zeros(n, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


def make_case(prefix_lens, tree_sizes, hq, hkv, d, block_size, dtype, seed=0):
    """(q, k_cache, v_cache, block_table, prefix_lens, cu_rows, tree_mask) with pages scattered over the cache."""
    g = torch.Generator().manual_seed(seed)
    rows = [n + 1 for n in tree_sizes]  # root + nodes
    cu = torch.tensor([0] + list(torch.tensor(rows).cumsum(0)), dtype=torch.int32)
    max_rows = max(rows)
    need = [math.ceil((p + r) / block_size) for p, r in zip(prefix_lens, rows)]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(rows), max(need), dtype=torch.int32)
    at = 0
    for b, k in enumerate(need):
        table[b, :k] = perm[at:at + k].to(torch.int32)
        at += k
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    q = torch.randn(int(cu[-1]), hq, d, generator=g).to(dtype)
    mask = torch.zeros(int(cu[-1]), max_rows, dtype=torch.bool)
    for b, n in enumerate(tree_sizes):
        m = ancestor_mask(random_tree(n, g)) if n else torch.ones(1, 1, dtype=torch.bool)
        mask[int(cu[b]):int(cu[b + 1]), :n + 1] = m
    return q, k_cache, v_cache, table, torch.tensor(prefix_lens, dtype=torch.int32), cu, mask


def with_bits(case):
    *head, mask = case
    return (*head, ta.ancestor_bits(mask))


def test_ancestor_bits_hold_the_mask_past_32_rows():
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(7, 70, generator=g) < 0.5
    bits = ta.ancestor_bits(mask)
    assert bits.dtype == torch.int32 and bits.shape == (7, 3)
    unpacked = ((bits.long().unsqueeze(-1) >> torch.arange(32)) & 1).bool().reshape(7, -1)[:, :70]
    assert torch.equal(unpacked, mask)


@pytest.mark.parametrize("prefix_lens,tree_sizes,hq,hkv,d,block_size,dtype,splits", [
    ([0], [1], 4, 4, 16, 16, torch.float32, None),  # no prefix, one node
    ([5, 17, 0], [3, 8, 0], 9, 3, 64, 16, torch.float32, 1),  # SmolLM2 heads (GQA 3), a request with no drafts
    ([5, 170, 0], [3, 8, 0], 9, 3, 64, 16, torch.float32, 3),  # the same split in three (fused: 2-4 chunks)
    ([33, 300], [16, 33], 14, 2, 64, 32, torch.float16, 4),  # Qwen2.5-0.5B heads (GQA 7), 34 rows: 2 words (fused)
    ([700], [64], 8, 2, 64, 16, torch.bfloat16, 5),  # 64 nodes (65 rows over 3 words), long prefix
    # 20 splits asked (19 chunks of 64 keys): the reduction reads them in two rounds of REDUCE_BLOCK_S (16); the
    # short and the empty request's second round all empty
    ([5, 1200, 0], [3, 8, 0], 9, 3, 64, 16, torch.float32, 20),
])
def test_matches_float64_reference(triton_interpret, prefix_lens, tree_sizes, hq, hkv, d, block_size, dtype, splits):
    case = with_bits(make_case(prefix_lens, tree_sizes, hq, hkv, d, block_size, dtype))
    scale = d ** -0.5
    got = ta.tree_attention_triton(*case, scale, splits=splits, block_n=32)
    want = ta.tree_attention_reference(*case, scale)
    # fp32: exact (IEEE) products, summed in another order; half precision: the P tile is cast for the PV product
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("prefix_lens,tree_sizes,splits,even,prefetch", [
    ([5, 170, 0], [3, 8, 0], 3, True, True),  # short, long and no prefix; chunks ending inside and past the prefix
    ([64, 96, 700], [16, 1, 64], 1, True, True),  # prefixes of whole tiles and not, one split
    ([64, 96, 700], [16, 1, 64], 2, False, True),
    ([64, 96, 700], [16, 1, 64], 1, True, False),  # the pages loaded in each tile's own iteration
    ([5, 170, 0], [3, 8, 0], 3, False, False),
])
def test_loop_variants_match_the_reference(triton_interpret, prefix_lens, tree_sizes, splits, even, prefetch):
    """The prefix loop's variants (candidates for the device's sweep): whole prefix tiles loaded and scored without
    masks (`even`), each tile's pages loaded a tile ahead or in its own iteration (`prefetch`): the same attention."""
    case = with_bits(make_case(prefix_lens, tree_sizes, 9, 3, 64, 16, torch.float32, seed=2))
    got = ta.tree_attention_triton(*case, 0.125, splits=splits, block_n=32, even=even, prefetch=prefetch)
    torch.testing.assert_close(got.double(), ta.tree_attention_reference(*case, 0.125), atol=1e-4, rtol=1e-4)


def test_matches_the_cpu_tree_paths_attention(triton_interpret):
    """The CPU engine's tree attention (runtime/cpu.masked_attention_batch: the prefix visible, among the
    tree rows ancestors-or-self) on the same tree, keys and values: the two paths compute the same rows."""
    from vllm_adaspec.runtime.cpu import masked_attention_batch

    q, k_cache, v_cache, table, plen, cu, mask = make_case([45], [9], 9, 3, 64, 16, torch.float32, seed=2)
    scale = 0.125
    got = ta.tree_attention_triton(q, k_cache, v_cache, table, plen, cu, ta.ancestor_bits(mask), scale, splits=2,
                                   block_n=16)
    p, n = 45, 10
    pos = torch.arange(p + n)
    slots = table[0, pos // 16].long() * 16 + pos % 16
    k = k_cache.reshape(-1, 3, 64)[slots][None]  # [1, p + n, Hkv, D]
    v = v_cache.reshape(-1, 3, 64)[slots][None]
    visible = torch.cat([torch.ones(n, p, dtype=torch.bool), mask[:, :n]], 1)[None]
    want = masked_attention_batch(q[None], k, v, visible, scale)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_mask_matters(triton_interpret):
    """Same inputs with every tree row visible to every other: the output must change (the kernel reads the bits)."""
    case = list(with_bits(make_case([10], [6], 4, 2, 16, 16, torch.float32, seed=1)))
    scale = 0.25
    tree = ta.tree_attention_triton(*case, scale)
    case[6] = ta.ancestor_bits(torch.ones(7, 7, dtype=torch.bool))
    full = ta.tree_attention_triton(*case, scale)
    assert not torch.allclose(tree, full, atol=1e-3)
    torch.testing.assert_close(full.double(), ta.tree_attention_reference(*case, scale), atol=1e-4, rtol=1e-4)


def test_splits_are_chosen_for_the_device():
    assert ta.choose_splits(1, 8, 1, 32768, 64, 132) == 16  # one request, a long prefix: fill the SMs once
    assert ta.choose_splits(8, 8, 1, 8192, 64, 132) == 2  # not 3: no second program on a few SMs
    assert ta.choose_splits(64, 8, 1, 32768, 64, 264) == 1  # a full batch fills the device alone
    assert ta.choose_splits(1, 8, 1, 300, 64, 264) == 2  # a short prefix: no chunk under 2 key tiles
    assert ta.choose_splits(1, 8, 1, 255, 64, 264) == 1
    # more tiles than SMs (128-row tiles, one to an SM): 2 chunks where they fill the last wave better (192 tiles on
    # 132 SMs: 2 waves of whole tiles or 3 of half ones), none where they do not (512 tiles: 4 waves either way), nor
    # into chunks under REFILL_MIN_CHUNK keys, nor for smaller tiles (several to an SM)
    assert ta.choose_splits(8, 8, 3, 8192 + 65, 64, 132) == 2
    assert ta.choose_splits(64, 8, 1, 2048, 64, 132) == 1
    assert ta.choose_splits(8, 8, 3, 2048 + 65, 64, 132) == 1
    assert ta.choose_splits(8, 8, 3, 8192 + 65, 64, 132, refill=False) == 1


def test_the_split_programs_reduce_their_own_partials_where_the_device_measured_it_pays():
    """2-4 chunks of up to FUSED_MAX_CHUNK keys, or any length where the tiles outnumber the SMs: fused; one chunk
    (nothing to reduce), many chunks (one program would read them all) or long chunks over few tiles: the reduce
    launch."""
    assert ta.fuse_reduction(2, 4160, 64, 132) and ta.fuse_reduction(4, 1024, 64, 132)
    assert not ta.fuse_reduction(1, 8192, 8, 132) and not ta.fuse_reduction(5, 1024, 24, 132)
    assert not ta.fuse_reduction(2, 16448, 64, 132) and ta.fuse_reduction(2, 16448, 192, 132)
    # tiles under a quarter of the SMs (batch 1; SmolLM2's 3 kv heads at batch 8): the reduce launch
    assert not ta.fuse_reduction(2, 320, 6, 132) and not ta.fuse_reduction(4, 2048, 24, 132)
    assert ta.fuse_reduction(4, 2048, 33, 132)


def test_smaller_tiles_fill_more_programs_per_sm():
    """Slots for `choose_splits`: one 128 x 128 program per SM, two of 32 x 128 or 64 x 64, four of 16 x 64 (an H200
    sweep, benchmarks/device_runs/2026-11-27-h200); a plan of 5-row trees of Llama-3-8B's heads at batch 8 over 32k keys
    on 132 SMs: 4 chunks, not 2; SmolLM2's 21-row tiles at batch 8 over 8k: 11, not 5."""
    assert [ta.programs_per_sm(m, d) for m, d in ((128, 128), (128, 64), (64, 128), (32, 128), (64, 64), (16, 64),
                                                  (16, 128))] == [1, 1, 1, 2, 2, 4, 4]
    assert ta.choose_splits(8, 8, 1, 32768 + 5, 64, 132 * ta.programs_per_sm(32, 128)) == 4
    assert ta.choose_splits(8, 3, 1, 8192 + 17, 64, 132 * ta.programs_per_sm(64, 64)) == 11


def test_a_tile_packs_the_query_heads_without_padding_the_group():
    """A tile's M side is rows x the kv head's query heads, padded as a whole to a power of two, not the group to
    one: SmolLM2's 17 rows x 3 heads fit one tile of 64 (with the group padded to 4: 128); Qwen2.5-7B's 17 x 7 one
    of 128 (padded to 8: two tiles, every key read twice); Llama-3-8B's 17 x 4 one of 128 as before."""
    assert ta.tile_rows(17, 9, 3) == 21 and ta.tile_m(21, 3) == 64
    assert ta.tile_rows(17, 28, 4) == 18 and ta.tile_m(18, 7) == 128
    assert ta.tile_rows(17, 32, 8) == 32 and ta.tile_m(32, 4) == 128
    assert ta.tile_rows(65, 14, 2) == 18  # 65 rows of GQA 7: 4 tiles of 18 rows
    assert ta.tile_rows(1, 9, 3) == 5 and ta.tile_m(5, 3) == 16  # tl.dot's smallest M


def test_bad_arguments_are_named():
    q, k, v, table, plen, cu, mask = make_case([4], [2], 6, 4, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="not a multiple"):
        ta.tree_attention_triton(q, k, v, table, plen, cu, ta.ancestor_bits(mask), 1.0)
    q, k, v, table, plen, cu, mask = make_case([4], [2], 4, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="ancestor_bits must be"):
        ta.tree_attention_triton(q, k, v, table, plen, cu, mask, 1.0)


def test_tree_rows_are_read_and_written_in_place_among_other_rows(triton_interpret):
    """As a forward runs it: the trees' rows lie among other requests' rows of the layer's q and output (q_rows),
    each tree reads its own row of a larger block table (bt_rows); only the tree rows of the output change, through
    the split reduction and through the one-split path."""
    q, k_cache, v_cache, table, plen, cu, mask = make_case([37, 150], [5, 9], 9, 3, 64, 16, torch.float32, seed=4)
    bits = ta.ancestor_bits(mask)
    want = ta.tree_attention_reference(q, k_cache, v_cache, table, plen, cu, bits, 0.125)
    g = torch.Generator().manual_seed(5)
    big_q = torch.randn(40, 9, 64, generator=g)
    q_rows = torch.cat([torch.arange(3, 9), torch.arange(20, 30)]).to(torch.int32)  # 6 + 10 tree rows, apart
    big_q[q_rows.long()] = q
    big_table = torch.zeros(5, table.shape[1], dtype=torch.int32)
    bt_rows = torch.tensor([4, 1], dtype=torch.int32)
    big_table[bt_rows.long()] = table
    for splits in (3, 1):
        out = torch.full((40, 9, 64), -5.0)
        ta.tree_attention_triton(big_q, k_cache, v_cache, big_table, plen, cu, bits, 0.125, splits=splits, block_n=32,
                                 q_rows=q_rows, bt_rows=bt_rows, out=out)
        torch.testing.assert_close(out[q_rows.long()].double(), want, atol=1e-4, rtol=1e-4)
        others = torch.ones(40, dtype=torch.bool)
        others[q_rows.long()] = False
        assert (out[others] == -5.0).all()


@pytest.mark.parametrize("prefix_lens,tree_sizes,hq,hkv,splits", [
    ([5, 170, 0], [3, 8, 0], 9, 3, 3),  # short, long and no prefix: splits with no keys (their partials empty)
    ([33, 300], [16, 33], 14, 2, 4),  # GQA 7, 34 rows: two row blocks per kv head, each its own counter
])
def test_the_fused_reduction_matches_the_reference_and_leaves_its_counters_at_zero(triton_interpret, prefix_lens,
                                                                                   tree_sizes, hq, hkv, splits):
    """The fused reduction (the default at 2 .. FUSED_MAX_SPLITS chunks): the last split program of each tile
    combines the partials (an atomic count per tile), no reduce launch; the counters are zero again after every
    layer, so the next layer of the step reuses them."""
    case = with_bits(make_case(prefix_lens, tree_sizes, hq, hkv, 64, 16, torch.float32, seed=3))
    q, k, v, table, plen, cu, bits = case
    want = ta.tree_attention_reference(*case, 0.125)
    rows = cu[1:] - cu[:-1]
    plan = ta.plan_launch(plen, cu, bits, torch.arange(q.shape[0], dtype=torch.int32),
                          torch.arange(len(plen), dtype=torch.int32), hq, hkv, 64, int(rows.max()),
                          int((plen + rows).max()), block_n=32, splits=splits, fused=True)
    assert plan.done is not None and plan.splits == splits
    for _ in range(2):  # two layers of one step
        got = ta.launch(plan, q, k, v, table, 0.125, torch.full_like(q, float("nan")))
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
        assert int(plan.done.abs().sum()) == 0


def test_a_plan_on_kept_scratch_computes_the_same_and_allocates_nothing_a_step(triton_interpret):
    """The engine's verification plan takes its partials' buffers (acc, m, l) as views of one kept buffer
    (`scratch`), not three new tensors a step: disjoint, 16-byte aligned (the variant start-up compiled), the same
    output split-reduced or fused as a plan of its own tensors, and the buffer grows only past its size."""
    from vllm_adaspec.kernels import kept

    case = with_bits(make_case([33, 300], [16, 33], 14, 2, 64, 16, torch.float32, seed=4))
    q, k, v, table, plen, cu, bits = case
    want = ta.tree_attention_reference(*case, 0.125)
    rows = cu[1:] - cu[:-1]
    args = (plen, cu, bits, torch.arange(q.shape[0], dtype=torch.int32), torch.arange(len(plen), dtype=torch.int32),
            14, 2, 64, int(rows.max()), int((plen + rows).max()))
    buffers = set()
    for fused in (False, True):
        plan = ta.plan_launch(*args, block_n=32, splits=4, fused=fused, scratch="test plan")
        own = ta.plan_launch(*args, block_n=32, splits=4, fused=fused)
        parts = (plan.acc, plan.m, plan.l)
        assert [p.shape for p in parts] == [p.shape for p in (own.acc, own.m, own.l)]
        assert all(p.is_contiguous() and p.data_ptr() % 16 == 0 for p in parts)
        spans = sorted((p.data_ptr(), p.data_ptr() + 4 * p.numel()) for p in parts)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # disjoint
        buffers.add(parts[0].untyped_storage().data_ptr())
        for p in (plan, own):
            got = ta.launch(p, q, k, v, table, 0.125, torch.full_like(q, float("nan")))
            torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    assert len(buffers) == 1  # (the second plan reused the first one's buffer)
    held = kept.scratch("test plan", 1, "cpu")
    assert kept.scratch("test plan", len(held) + 1, "cpu").data_ptr() != held.data_ptr()  # grown past its size


def test_the_start_up_check_passes_here_and_catches_a_wrong_kernel(triton_interpret, monkeypatch):
    """What the GPU tree runtime runs once on its device when the model is built (runtime/gpu.py): the
    kernel on a small case against the reference, in the model's dtype. A kernel that computes wrong fails it."""
    for dtype in (torch.float32, torch.bfloat16):
        assert ta.check_on_device("cpu", dtype, 9, 3, 64) <= ta.TOLERANCE[dtype]
    monkeypatch.setattr(ta, "tree_attention_triton", lambda q, *a, **k: torch.zeros_like(q))
    assert ta.check_on_device("cpu", torch.float32, 9, 3, 64) > 0.1


@pytest.mark.parametrize("sms", [8, 132])
def test_start_up_compiles_every_variant_a_step_can_launch_whatever_the_devices_sms(triton_interpret, monkeypatch,
                                                                                  sms):
    """The fused reduction is chosen by the step's tiles against the device's SMs (`fuse_reduction`): start-up must
    compile it whatever its own small case would choose. An H200 (132 SMs, benchmarks/device_runs/2026-11-28-h200) found
    the fused variant compiled inside a step, where this machine's 8 interpreter slots had always fused the small
    case."""
    monkeypatch.setattr(ta, "device_programs", lambda device: sms)
    monkeypatch.setattr(ta, "VARIANTS", ta.KernelVariants())
    ta.warm_up("cpu", torch.float32, 9, 3, 64, max_rows=6)
    fused = {value for key in ta.VARIANTS.warm for name, value, *_ in key[1] if name == "FUSED"}
    assert len(ta.VARIANTS.warm) == 4 and fused == {True, False}, ta.VARIANTS.warm


def test_the_device_script_runs_here_on_cpu_tensors(tmp_path):
    """benchmarks/device_check.py and kernel_sweep.py --launch, what a session lent a GPU runs first
    (benchmarks/device_check.sh), run here on CPU tensors under the interpreter with tiny shapes: every check they
    make on a device passes here, so a lent device's minutes are not lost to a script that could not have run."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}

    def bare(script, *args):  # as on the device: a bare copy of the checkout, the package not installed
        code = ("import runpy, sys; sys.meta_path[:] = [f for f in sys.meta_path if 'Editable' not in repr(f)]; "
                f"sys.argv = [{str(root / 'benchmarks' / script)!r}, '--cpu', *{list(args)!r}]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                              cwd=root)
        return proc, proc.stdout[-3000:] + proc.stderr[-3000:]

    proc, tail = bare("device_check.py")
    assert proc.returncode == 0 and "device check: PASS" in proc.stdout, tail
    assert "0 cold launches (ok)" in proc.stdout and "no device wait" in proc.stdout
    assert "row-draw kernel after start-up: on (ok)" in proc.stdout and "argmax equal to torch's" in proc.stdout
    assert "equal to the block-reduction kernel's under one key" in proc.stdout, tail  # today's draws are its draws
    assert "the step's plan: compiled (numba)" in proc.stdout and "plan's arrays, Python" in proc.stdout, tail
    assert "plan part, 8 trees x 4 nodes: the whole plan (begin_step)" in proc.stdout, tail  # where its time goes
    # the pieces as a step runs them, against the same steps without verification and compaction (the 5%)
    assert "step in sequence, 8 trees x 4 nodes, 2 layers: plan + verification + compaction add" in proc.stdout, tail
    proc, tail = bare("kernel_sweep.py", "--launch", "--out", str(tmp_path / "launch.json"))
    assert proc.returncode == 0 and "outputs equal" in proc.stdout and "launch check: PASS" in proc.stdout, tail
    proc, tail = bare("kernel_sweep.py", "--out", str(tmp_path / "sweep.json"))  # every launch option checked
    assert proc.returncode == 0 and "kernel sweep: 1 shapes" in proc.stdout and "failed" not in proc.stdout, tail
    proc, tail = bare("bench_tree_attention.py", "--cascade", "--batch", "2", "--prefix", "40", "--nodes", "4",
                      "--heads", "6,2,16", "--dtype", "float32", "--out", str(tmp_path / "cascade.json"))
    assert proc.returncode == 0 and "cascade / anchor" in proc.stdout and "best / anchor" in proc.stdout, tail
    assert "FAILED" not in proc.stdout, tail  # the cascade's output equals the reference's (checked in the script)


class _Compiled:
    """A stand-in for Triton's CompiledKernel: `[grid](*args)` launches it, positional arguments in the kernel's
    order (what a GPU's launch takes; the interpreter has no compiled kernels)."""

    def __init__(self, calls, fail=False):
        self.calls, self.fail = calls, fail

    def run(self, *a):
        raise AssertionError("launched through __getitem__")

    def __getitem__(self, grid):
        grid = (grid[0], grid[1], grid[2])  # as Triton's runner reads it

        def runner(*args):
            if self.fail:
                raise TypeError("a Triton that launches otherwise")
            self.calls.append(("compiled", grid, args))
        return runner


class _Jit:
    """A stand-in for a JITFunction: `[grid](**kwargs)` dispatches (binds, specializes) and returns the compiled
    kernel, as Triton's JITFunction.run does; its arguments are the real kernel's."""

    def __init__(self, real, fail=False):
        self.arg_names, self.calls, self.fail = real.arg_names, [], fail

    def __getitem__(self, grid):
        def dispatch(**kwargs):
            self.calls.append(("jit", grid, kwargs))
            return _Compiled(self.calls, self.fail)
        return dispatch


def _positional(kernel, kwargs) -> tuple:
    """What a dispatch with kwargs hands the compiled kernel: every argument in order, pointers as ints."""
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in (kwargs[n] for n in kernel.arg_names))


def test_a_plans_later_layers_launch_the_compiled_kernels_with_their_own_pointers(monkeypatch):
    """On a GPU a step's first layer goes through Triton's dispatch (~50 us of Python an H100 host spends per launch:
    binding and specializing ~45 arguments); the layers after it launch the compiled kernels it returned with the
    arguments the dispatch would have given them (their own q, caches, output and block table; the rest the plan's).
    A layer Triton would specialize differently dispatches again; a compiled launch that fails falls back to the
    dispatch, for good."""
    split, reduce = ta._tree_attention_split_kernel, ta._tree_attention_reduce_kernel
    q, k, v, table, plen, cu, mask = make_case([40, 75], [3, 5], 6, 2, 16, 16, torch.float32)
    bits = ta.ancestor_bits(mask)
    t = q.shape[0]
    plan = ta.plan_launch(plen, cu, bits, torch.arange(t, dtype=torch.int32), torch.arange(2, dtype=torch.int32),
                          6, 2, 16, max_rows=6, longest=81, splits=2, block_n=16, fused=False)  # two launches
    layers = [(torch.randn_like(q), torch.randn_like(k), torch.randn_like(v), torch.empty_like(q)) for _ in range(3)]

    def dispatched(i):  # what Triton's dispatch would get for layer i: the positional arguments of each kernel
        fs, fr = _Jit(split), _Jit(reduce)
        monkeypatch.setattr(ta, "_tree_attention_split_kernel", fs)
        monkeypatch.setattr(ta, "_tree_attention_reduce_kernel", fr)
        monkeypatch.setattr(ta, "FAST_LAUNCH", False)
        qi, ki, vi, oi = layers[i]
        ta.launch(dataclasses.replace(plan, compiled={}), qi, ki, vi, table, 0.25, oi)
        return [_positional(split, fs.calls[0][2]), _positional(reduce, fr.calls[0][2])]

    want = [dispatched(i) for i in range(3)]
    js, jr = _Jit(split), _Jit(reduce)
    monkeypatch.setattr(ta, "_tree_attention_split_kernel", js)
    monkeypatch.setattr(ta, "_tree_attention_reduce_kernel", jr)
    monkeypatch.setattr(ta, "FAST_LAUNCH", True)
    for qi, ki, vi, oi in layers:
        ta.launch(plan, qi, ki, vi, table, 0.25, oi)
    assert [c[0] for c in js.calls] == ["jit", "compiled", "compiled"]
    assert [c[0] for c in jr.calls] == ["jit", "compiled", "compiled"]
    assert [c[2] for c in js.calls[1:]] == [want[1][0], want[2][0]]  # each layer's own pointers, the plan's rest
    assert [c[2] for c in jr.calls[1:]] == [want[1][1], want[2][1]]
    assert jr.calls[1][1] == (t, 6, 1)  # the reduction's 2-D grid, padded for the launcher
    wide = torch.randn(t, 6, 32)[:, :, :16]  # another stride: Triton would specialize it apart
    ta.launch(plan, wide, k, v, table, 0.25, torch.empty_like(q))
    assert js.calls[-1][0] == "jit" and len(plan.compiled) == 2
    bs, br = _Jit(split, fail=True), _Jit(reduce, fail=True)
    monkeypatch.setattr(ta, "_tree_attention_split_kernel", bs)
    monkeypatch.setattr(ta, "_tree_attention_reduce_kernel", br)
    fresh = dataclasses.replace(plan, compiled={})
    ta.launch(fresh, q, k, v, table, 0.25, torch.empty_like(q))
    with pytest.warns(RuntimeWarning, match="launching a compiled kernel directly failed"):
        ta.launch(fresh, q, k, v, table, 0.25, torch.empty_like(q))
    assert [c[0] for c in bs.calls] == ["jit", "jit"] and not ta.FAST_LAUNCH and not fresh.compiled
    ta.launch(fresh, q, k, v, table, 0.25, torch.empty_like(q))  # off for good: dispatched, nothing kept
    assert [c[0] for c in bs.calls] == ["jit"] * 3 and not fresh.compiled


def test_launch_options_and_constexprs_are_variants_by_value():
    """VARIANTS counts compiles: two values of a constexpr or of num_warps are two kernels (a multiple-of-16 rule
    would call BLOCK_N 32 and 64 one)."""
    assert ta._arg_key("BLOCK_N", 32, "split") != ta._arg_key("BLOCK_N", 64, "split")
    assert ta._arg_key("num_warps", 4, "split") != ta._arg_key("num_warps", 8, "split")
    assert ta._arg_key("stride_kb", 32, "split") == ta._arg_key("stride_kb", 64, "split")  # specialized alike


def k_registers(verdict: str) -> int:
    import re
    return int(re.search(r"Used (\d+) registers", verdict).group(1))


def test_the_compiled_prefix_loop_keeps_tiles_in_flight():
    """The split kernel compiled for an H100 (sm_90; Triton lowers it without a GPU) with a real launch's
    specialization (benchmarks/kernel_ir.py): with the engine's defaults every prefix loop waits at its top for all
    but the newest num_stages - 1 tiles' copies (async_wait num 2 at 3 stages), its K / V copies asynchronous. With
    the pages loaded in the tile's own iteration (the earlier loop) it waits for every copy: one tile in
    flight, which on the H100 cost 1.25x the GPU time. And the reduction fits in few registers (ptxas). In a fresh
    process: this one's Triton library is interpreted (conftest.py)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); import kernel_ir as k; out = []\n"
            "for heads, prefetch in (((32, 8, 128), True), ((9, 3, 64), True), ((9, 3, 64), False)):\n"
            "    a = k.default_case(heads, batch=2, prefix=1024, nodes=16, splits=2, prefetch=prefetch)\n"
            "    out.append([a['num_stages'], k.loops(k.compile_kernel(a).asm['ttgir'])])\n"
            "out.append(k.registers(k.compile_reduce_kernel(batch=2, prefix=1024).asm['ptx']))\n"
            "a = k.default_case((32, 8, 128), batch=2, prefix=1024, nodes=16, splits=2, fused=True)\n"
            "out.append(k.registers(k.compile_kernel(a).asm['ptx']))\n"
            "print(json.dumps(out))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (stages, llama), (_, smol), (_, smol_old), reduce, fused = json.loads(proc.stdout.strip().splitlines()[-1])
    assert stages == ta.NUM_STAGES == 3 and ta.PREFETCH and ta.EVEN
    for loops in (llama, smol):  # two prefix loops (whole tiles, the rest), then the tree keys' loop
        assert [lp["async_wait_num"] for lp in loops[:2]] == [2, 2], loops
        assert [lp["async_copies"] for lp in loops[:2]] == [2, 2], loops  # K and V
    assert [lp["async_wait_num"] for lp in smol_old[:2]] == [0, 0], smol_old
    # the reduction reads REDUCE_BLOCK_S splits at a time: with all MAX_SPLITS at once it took 255 registers a thread
    # (two programs to an SM, the launch latency-bound: ~440 us over 1088 rows x 32 heads on the H100)
    assert reduce is not None and k_registers(reduce) <= 64, reduce
    # the fused reduction sums FUSED_TAIL_D columns at a time: with the whole row live it spilled (44 bytes, Triton 3.6)
    assert fused is not None and "0 bytes spill stores" in fused, fused
