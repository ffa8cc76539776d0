"""The device checks a session lent a GPU runs first, in one script (benchmarks/device_check.sh: this, then
bench_tree_attention.py; under 6 minutes on an H100). What it prints goes into benchmarks/RESULTS.md.

1. kernel: the tree-attention kernel on the device (no interpreter) against the float64 reference, on the shapes of
   tests/test_kernel_tree_attention.py and a draft step's (more tree keys than rows), in fp32 / fp16 / bf16.
2. compiles: the GPU tree runtime's start-up warm-up, then verification steps of every tree width 1..K over short
   and long prefixes and draft steps: Triton's own caches of the two kernels must gain no entry after start-up
   (and the plugin's own count, tree_kernel_cold, must stay 0).
3. the step's other pieces at Llama-3-8B shapes (32 layers, 8 kv heads of 128, vocabulary 128256; 8 trees of 16
   and of 64 nodes over 8k prefixes): planning (host + staged copies), batched greedy verification, batched
   sample-and-match (one launch of kernels/tree_verify.py for both), compaction of every layer (one launch of
   kernels/kv_compaction.py), an early-exit draft step's plan; each run under
   torch.cuda.set_sync_debug_mode("error") (a wait for the device raises) and timed (CUDA events, median); then
   the same pieces as a step runs them (one wait, at the end: the verification and compaction launched behind the
   forward's stand-in, every layer's attention), against the same steps without them: what the plan, the
   verification and the compaction add to a step (the target: at most 5% of it; `sequence_cost`).

    python benchmarks/device_check.py            # on a GPU
    python benchmarks/device_check.py --cpu      # the same code on CPU tensors, tiny shapes, Triton interpreted
                                                 # (the suite runs this: the script cannot fail on a device for a
                                                 # reason this machine could have shown)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from checkout import use_checkout  # noqa: E402

use_checkout()  # the device runs a bare copy of the checkout


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="CPU tensors, tiny shapes, Triton's interpreter")
    p.add_argument("--draws-only", action="store_true", help="only the row-draw kernel's checks and timings")
    p.add_argument("--step-only", action="store_true", help="only the step's compiles, waits and pieces (3.)")
    p.add_argument("--profile", type=int, default=12, metavar="N",
                   help="after the timings, each piece's N costliest functions of host time (cProfile; 0: none)")
    return p.parse_args(argv)


ARGS = parse(sys.argv[1:] if __name__ == "__main__" else [])
if ARGS.cpu:
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton decorates the kernels

import numpy as np  # noqa: E402
import torch  # noqa: E402

from vllm_adaspec.runtime import gpu as gtr  # noqa: E402
from vllm_adaspec.runtime.gpu import GPUTreeRuntime  # noqa: E402
from vllm_adaspec.kernels import kv_compaction as kc  # noqa: E402
from vllm_adaspec.kernels import row_draws as rd  # noqa: E402
from vllm_adaspec.kernels import tree_attention as ta  # noqa: E402
from vllm_adaspec.kernels import tree_verify as tv  # noqa: E402
from vllm_adaspec.step import DraftPlan  # noqa: E402
from vllm_adaspec.trees import step_plan  # noqa: E402

DEVICE = "cpu" if ARGS.cpu else "cuda"


def say(*parts) -> None:
    print(*parts, flush=True)


def compiled_entries() -> int | None:
    """Entries in Triton's compile caches of the step's kernels (None under the interpreter)."""
    total = 0
    for fn in (ta._tree_attention_split_kernel, ta._tree_attention_reduce_kernel, tv._tree_verify_kernel,
               kc._kv_compaction_kernel, rd._row_draws_kernel):
        caches = getattr(fn, "device_caches", None)
        if caches is None:
            return None
        for entry in caches.values():
            total += len(entry[0] if isinstance(entry, tuple) else entry)
    return total


def check_kernel() -> bool:
    from test_kernel_tree_attention import make_case

    shapes = [([0], [1], 4, 4, 16, 16), ([5, 17, 0], [3, 8, 0], 9, 3, 64, 16), ([5, 170, 0], [3, 8, 0], 9, 3, 64, 16),
              ([33, 300], [16, 33], 14, 2, 64, 32), ([700], [64], 8, 2, 64, 16), ([4000, 90], [16, 5], 32, 8, 128, 16)]
    if ARGS.cpu:
        shapes = shapes[:3]
    ok = True
    for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)):
        worst = 0.0
        for plens, sizes, hq, hkv, d, bs in shapes:
            *head, mask = make_case(plens, sizes, hq, hkv, d, bs, dtype)
            case = [x.to(DEVICE) for x in head] + [ta.ancestor_bits(mask).to(DEVICE)]
            # one chunk (the output written directly), 3 (the split programs reduce their own partials), and on
            # the longest prefix 32 (partials and the reduce launch, which reads them in two rounds of 16)
            for splits in (1, 3) + ((40,) if plens[0] >= 4000 else ()):
                got = ta.tree_attention_triton(*case, d ** -0.5, splits=splits)
                want = ta.tree_attention_reference(*case, d ** -0.5)
                worst = max(worst, float((got.double() - want).abs().max()))
        long = " and a long prefix split 32 ways" if any(p[0] >= 4000 for p, *_ in shapes) else ""
        say(f"kernel {dtype}: max error {worst:.2e} over {len(shapes)} shapes x 2 splits{long} "
            f"({'ok' if worst <= tol else 'FAILED'}, tolerance {tol})")
        ok &= worst <= tol
    return ok


def check_draws() -> bool:
    """The row-draw kernel (kernels/row_draws.py) on the device: every row's argmax torch's over Llama-3's vocabulary
    in fp32 and bf16 logits (ties to the first), greedy trees' draws their argmax, and sampled draws' law (chi-square of
    4000 rows over 6 tokens at temperature 0.7), and its argmax and draws equal to the block-reduction kernel's under
    one key (benchmarks/baselines/row_draws_block_reductions.py, the kernel before each lane kept its own first maximum:
    the same numbers, the same first maxima). Its GPU time at 8 trees x 17 and x 65 rows against that kernel's and
    torch's ops."""
    from baselines import row_draws_block_reductions as block_reductions  # the baseline: reductions in its loop
    from stats import chi2_pvalue

    vocab = 1000 if ARGS.cpu else 128256
    g = torch.Generator().manual_seed(0)
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(136, vocab, generator=g).to(dtype).to(DEVICE)
        logits[5, 7] = logits[5, vocab - 3] = 60.0
        rows = torch.randperm(136, generator=g).view(8, 17).to(DEVICE)
        temperature = torch.full((8,), 0.8, device=DEVICE)
        argmax, draws = rd.row_draws(logits, rows, torch.arange(8, device=DEVICE), temperature, 4)
        same = torch.equal(argmax, logits.argmax(-1)[rows]) and torch.equal(draws[:4], argmax[:4])
        say(f"row draws {dtype}: argmax {'equal to' if same else 'DIFFERENT from'} torch's over {vocab} tokens")
        ok &= same
    per = 5 if ARGS.cpu else 17  # (interpreted: fewer rows, the same code)
    logits = torch.randn(8 * per, vocab, generator=g).to(DEVICE)
    rows = torch.randperm(8 * per, generator=g).view(8, per).to(DEVICE)
    call = (rows, torch.arange(8, device=DEVICE), torch.full((8,), 0.8, device=DEVICE), 4)
    key = torch.tensor([(1 << 35) + 7], device=DEVICE)
    now, then = rd.row_draws(logits, *call, seed=key), block_reductions.row_draws(logits, *call, seed=key)
    same = torch.equal(now[0], then[0]) and torch.equal(now[1], then[1])
    say(f"row draws: argmax and draws (half the trees sampled) {'equal to' if same else 'DIFFERENT from'} the "
        "block-reduction kernel's under one key")
    ok &= same
    n = 100 if ARGS.cpu else 4000  # (interpreted: a smoke check; the law's own test is test_kernel_row_draws.py)
    x = torch.tensor([[1.0, 0.2, -0.5, 0.9, 2.0, -1.0]], device=DEVICE)
    draws = rd.row_draws(x, torch.zeros(1, n, dtype=torch.long, device=DEVICE), torch.zeros(1, dtype=torch.long,
                         device=DEVICE), torch.full((1,), 0.7, device=DEVICE), 0)[1]
    p = chi2_pvalue(torch.bincount(draws[0].cpu(), minlength=6), torch.softmax(x[0].cpu() / 0.7, -1))
    say(f"row draws' law: chi-square p {p:.3f} over {n} rows ({'ok' if p > 1e-4 else 'FAILED'})")
    ok &= p > 1e-4
    if DEVICE == "cuda":
        from bench_tree_attention import graphed_time

        temperature = torch.full((8,), 0.8, device=DEVICE)
        tree_rows = torch.arange(8, device=DEVICE)
        key = torch.tensor([1 << 33], device=DEVICE)  # (made before the capture: no copy inside a CUDA graph)
        chunk_tiles = rd.CHUNK_TILES
        for per in (17, 65):  # 8 trees of 16 and of 64 nodes
            logits = torch.randn(8 * per, vocab, device=DEVICE)
            rows = torch.arange(8 * per, device=DEVICE).view(8, per)
            out = torch.empty(2, 8, per, dtype=torch.long, device=DEVICE)
            for first, what in ((8, "greedy"), (4, "half sampled")):
                torch_ops = graphed_time(lambda: rd.row_draws_reference(logits, rows, tree_rows, temperature, first))
                before = graphed_time(lambda: block_reductions.row_draws(logits, rows, tree_rows, temperature, first,
                                                                         seed=key, out=out))
                say(f"row draws, 8 trees x {per} rows, {what}: the block-reduction kernel "
                    f"({block_reductions.num_chunks(vocab)} chunks a row) GPU {before * 1e3:.1f} us; torch's ops "
                    f"{torch_ops * 1e3:.1f} us")
                for tiles in sorted({chunk_tiles, 1000, 4, 2, 1} if per == 17 else {chunk_tiles}, reverse=True):
                    rd.CHUNK_TILES = tiles  # 1 chunk .. 16 a row
                    kern = graphed_time(lambda: rd.row_draws(logits, rows, tree_rows, temperature, first, seed=key,
                                                             out=out))
                    say(f"row draws, 8 trees x {per} rows, {what}, {rd.num_chunks(vocab)} chunks a row"
                        f"{' (the default)' if tiles == chunk_tiles else ''}: GPU {kern * 1e3:.1f} us "
                        f"({before / kern:.2f}x faster than the block-reduction kernel)")
                rd.CHUNK_TILES = chunk_tiles
    return ok


def engine_shape():
    """(heads, layers, vocab, prefix, block_size, K)."""
    if ARGS.cpu:
        return (4, 2, 16), 2, 64, 70, 16, 8
    return (32, 8, 128), 32, 128256, 8192, 16, 64


def make_runtime(heads, k, block_size, max_blocks, dtype, caches, table):
    rt = GPUTreeRuntime(DEVICE, plain=lambda r: "greedy" if r.startswith("g") else "sampled", max_rows=k + 1,
                        block_size=block_size, max_blocks=max_blocks)
    rt.draw_kernel = True  # as on a GPU (on CPU tensors too: the interpreter runs it, tiny vocabulary)
    rt.attached([SimpleNamespace(num_heads=heads[0], num_kv_heads=heads[1], head_size=heads[2])], dtype)
    rt.ready(caches, table)
    return rt


def random_plan(n: int, g) -> DraftPlan:
    parents = [-1] + [int(torch.randint(i + 1, (), generator=g)) - 1 for i in range(n - 1)]
    return DraftPlan(tuple(int(t) for t in torch.randint(1000, (n,), generator=g)), tuple(parents), tree_path=True)


def step_batch(rt, trees: int, nodes: int, prefix: int, g, layers_kv, table, heads, vocab, dtype, run=None,
               torch_draws: bool = False):
    """One verification step of `trees` trees of `nodes` nodes: plan, attention in every layer, batched
    verification (half greedy, half sampled), compaction, each piece through `run(name, fn)` (timed(), no_wait(),
    or called as is). The batched verdict's read-back (take_results: after vLLM's own wait for the sampled tokens)
    runs outside."""
    req_ids = [("g" if i % 2 == 0 else "s") + str(i) for i in range(trees)]
    plans = {r: random_plan(nodes, g) for r in req_ids}
    rows = [nodes + 1] * trees
    qs = np.concatenate([[0], np.cumsum(rows)])
    t = int(qs[-1])
    roots = np.full(trees, prefix)
    positions = torch.zeros(t, dtype=torch.long, device=DEVICE)
    seq_lens = torch.zeros(trees, dtype=torch.int32, device=DEVICE)
    spec = {r: list(p.tokens) for r, p in plans.items()}
    hq, hkv, d = heads
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEVICE, dtype=dtype)
    q = qkv[:, :hq * d].view(t, hq, d)
    out = torch.empty(t, hq, d, device=DEVICE, dtype=dtype)
    logits = torch.randn(t, vocab, device=DEVICE, dtype=torch.float32)
    tokens = torch.full((trees, nodes + 2), -1, dtype=torch.int32, device=DEVICE)
    sm = SimpleNamespace(temperature=torch.full((trees,), 0.8, device=DEVICE), top_k=None, top_p=None)
    slot_mapping = torch.arange(t, device=DEVICE)
    run = run or (lambda name, fn: fn())
    run("plan", lambda: rt.begin_step(req_ids, qs, roots, positions, spec, plans, t, seq_lens, set(), set()))
    step = rt.step
    assert step is not None and len(step.requests) == trees
    if step_plan.compiled():  # the Python the compiled plan replaced, on the same trees (its arrays only)
        run("plan's arrays, Python", lambda: rt.prepare_reference(replace(step)))
    md = SimpleNamespace(num_actual_tokens=t, slot_mapping=slot_mapping, block_table=table)
    run("attention, every layer", lambda: [rt.attend(None, d ** -0.5, q, None, None, kv, md, out)
                                            for kv in layers_kv])
    if torch_draws:  # the same verification with the draws as torch ops first (what ran before the kernel)
        rt.draw_kernel = False
        run("verification, torch draws", lambda: rt.verify_batched(step, logits, tokens, sm))
        rt.draw_kernel = True
    verdict = run("verification", lambda: rt.verify_batched(step, logits, tokens, sm))
    run("compaction, every layer", lambda: rt.finish_step(step, {}, verdict))
    rt.take_step()
    rt.take_results()


def timed(timings: dict):
    """run(name, fn) that times each piece into timings[name] = (device or host seconds, whichever is longer;
    host seconds): CUDA events around it, waiting for the device before and after (so never under no_wait)."""
    def run(name, fn):
        if DEVICE != "cuda":
            t0 = time.perf_counter()
            r = fn()
            timings[name] = (time.perf_counter() - t0,) * 2
            return r
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        r = fn()
        b.record()
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        timings[name] = (max(a.elapsed_time(b) / 1e3, host), host)
        return r
    return run


def profiled(profiles: dict):
    """run(name, fn) under one cProfile per piece (the host's side: where its milliseconds go on this host)."""
    import cProfile

    def run(name, fn):
        prof = profiles.setdefault(name, cProfile.Profile())
        prof.enable()
        try:
            return fn()
        finally:
            prof.disable()
    return run


def top_functions(prof, n: int, steps: int) -> list[str]:
    """The n functions of most own time: 'tottime cumtime calls  file:line(function)', per step."""
    import pstats

    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:n]  # (cc, nc, tottime, cumtime, callers)
    out = []
    for (file, line, func), (_, calls, tot, cum, _) in rows:
        where = f"{Path(file).name}:{line}({func})" if line else func
        out.append(f"{tot / steps * 1e3:7.3f} {cum / steps * 1e3:7.3f} {calls / steps:6.0f}  {where}")
    return out


def plan_parts(rt, steps: int, make_step) -> dict:
    """Where the plan's host time goes, part by part (perf_counter around each, not cProfile, which charges a
    caller with what C code it calls does): ms a step, median over `steps` steps of make_step() (one plan each)."""
    from vllm_adaspec.runtime import base as tree_runtime

    parts = [(tree_runtime, "plan_step", "plan_step (drafts matched to trees)"),
             (gtr.GPUTreeRuntime, "prepare", "prepare (the device step)"),
             (step_plan, "plan_arrays", ". plan_arrays (compiled)"),
             (gtr.GPUTreeRuntime, "_plan_views", ". staging copy and views"),
             (gtr.GPUTreeRuntime, "_device_step", ". the device step's fields"),
             (ta, "plan_launch", ". . plan_launch (the kernel's plan)"),
             (gtr.GPUTreeRuntime, "write_step", "write_step (positions, seq_lens)"),
             (gtr.GPUTreeRuntime, "begin_step", "the whole plan (begin_step)")]
    spent = {label: 0.0 for *_, label in parts}
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in parts]

    def timed_part(fn, label):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t0
        return wrapper

    for (owner, name, label), (_, _, fn) in zip(parts, saved):
        setattr(owner, name, timed_part(fn, label))
    per_step = {label: [] for label in spent}
    try:
        for _ in range(steps):
            for label in spent:
                spent[label] = 0.0
            make_step()
            for label, t in spent.items():
                per_step[label].append(t * 1e3)
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    return {label: statistics.median(ts) for label, ts in per_step.items()}


def in_sequence(times: dict, last: str, skip: tuple = ()):
    """run(name, fn) for the pieces of one step run as vLLM runs a step: the device idle at its start (the step before
    ended with vLLM's read of its sampled tokens), no wait between pieces, one at the end (after `last`). The
    verification and compaction are launched while the device still runs the forward queued before them, so what
    they add to a step is their device time, not their host time (a piece timed alone, `timed`, is the larger of the
    two). times[name]: the piece's host seconds; times["wall"]: from the plan's start to the device's end after
    `last`; times["device", name]: the device seconds between the end of the piece before and its own (CUDA events).
    Pieces in `skip` (and the reference plan's) are not run."""
    marks: list = []

    def run(name, fn):
        if name in skip or name == "plan's arrays, Python":
            return None
        cuda = DEVICE == "cuda"
        if not marks:
            if cuda:
                torch.cuda.synchronize()
            marks.append((None, torch.cuda.Event(enable_timing=True) if cuda else None))
            if cuda:
                marks[0][1].record()
            times["start"] = time.perf_counter()
        t0 = time.perf_counter()
        r = fn()
        times[name] = time.perf_counter() - t0
        if cuda:
            marks.append((name, torch.cuda.Event(enable_timing=True)))
            marks[-1][1].record()
        if name == last:
            if cuda:
                torch.cuda.synchronize()
                for (_, a), (piece, b) in zip(marks, marks[1:]):
                    times["device", piece] = a.elapsed_time(b) / 1e3
            times["wall"] = time.perf_counter() - times.pop("start")
        return r
    return run


def sequence_cost(rt, trees: int, nodes: int, prefix: int, g, layers_kv, table, heads, vocab, dtype,
                  repeats: int) -> dict:
    """What the plan, the verification and the compaction add to a step run as vLLM runs it (`in_sequence`): steps
    with every piece, alternating with the same steps less the verification and compaction; ms, medians over
    `repeats` pairs: the plan's host time (the device idle: on the step's critical path), the forward's stand-in
    (the attention of every layer) alone, and what the verification and compaction add behind it (paired)."""
    full, base = [], []
    for _ in range(repeats):
        for out, last, skip in ((full, "compaction, every layer", ()),
                                (base, "attention, every layer", ("verification", "compaction, every layer"))):
            out.append({})
            step_batch(rt, trees, nodes, prefix, g, layers_kv, table, heads, vocab, dtype,
                       run=in_sequence(out[-1], last, skip))
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    got = {"plan (host)": med([t["plan"] for t in full]),
           "wall, forward stand-in only": med([t["wall"] for t in base]),
           "wall, with verification and compaction": med([t["wall"] for t in full]),
           "verification + compaction add": med([a["wall"] - b["wall"] for a, b in zip(full, base)])}
    for piece in ("verification", "compaction, every layer"):
        got[f"{piece}: host"] = med([t[piece] for t in full])
        if DEVICE == "cuda":
            got[f"{piece}: device"] = med([t["device", piece] for t in full])
    got["plan + verification + compaction add"] = got["plan (host)"] + max(0.0, got["verification + compaction add"])
    return got


def where(e: BaseException) -> str:
    """The innermost frames of this checkout in e's traceback (the harness itself left out): what waited."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if f.filename.startswith(str(ROOT)) and not f.filename.endswith("device_check.py")]
    return " <- ".join(f"{Path(f.filename).relative_to(ROOT)}:{f.lineno} {f.name}: {f.line}" for f in frames[::-1][:3])


def no_wait(found: dict):
    """run(name, fn) under torch.cuda.set_sync_debug_mode("error"): a piece that waits for the device is recorded in
    found[name] (where it waited) and run again, allowed to wait, so the next piece has its inputs."""
    def run(name, fn):
        if DEVICE != "cuda":
            return fn()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn()
        except RuntimeError as e:
            if "synchroniz" not in str(e):
                raise
            found.setdefault(name, where(e) or str(e))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return fn()
    return run


def draft_step(rt, g, prefix: int, table_cpu) -> None:
    """An early-exit draft step's plan (two trees, a few nodes run): staged as a kernel plan."""
    from vllm_adaspec.proposers.early_exit import EarlyExitDrafter
    from vllm_adaspec.trees import GrowingTree, add_children

    t1, t2 = GrowingTree(), GrowingTree()
    add_children(t1, -1, [5, 6], [0.6, 0.3])
    add_children(t1, 0, [7, 8], [0.5, 0.4])
    add_children(t2, -1, [3, 4], [0.7, 0.2])
    roots = np.array([prefix, prefix // 2])
    pre = EarlyExitDrafter._draft_prefix(roots, table_cpu[:2])
    mask = EarlyExitDrafter._draft_mask([(0, 2), (1, 0), (0, 3)], [t1, t2], [{0: 1, 1: 2, 2: 3, 3: 4}, {0: 1}],
                                        roots, pre)
    rt.on_device(mask)


def check_step() -> bool:
    heads, layers, vocab, prefix, bs, k = engine_shape()
    dtype = torch.float32 if ARGS.cpu else torch.bfloat16
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(0)
    trees = 8
    per_req = -(-(prefix + k + 2) // bs)
    blocks = trees * per_req + 4
    table = torch.randperm(blocks, generator=g)[:trees * per_req].view(trees, per_req).to(torch.int32).to(DEVICE)
    table_cpu = table.cpu()  # the host copy vLLM keeps (an early-exit draft step plans from it)
    layers_kv = [torch.randn(blocks, hkv, bs, 2 * d, device=DEVICE, dtype=dtype) for _ in range(layers)]
    ta.VARIANTS = ta.KernelVariants()  # the engine's count starts at its start-up (the kernel check ran others)
    before = compiled_entries()
    rt = make_runtime(heads, k, bs, per_req, dtype, layers_kv, table)
    after_start = compiled_entries()
    say(f"compiles at start-up: {after_start if after_start is None else after_start - (before or 0)} kernel "
        f"entries; plugin's warm variants: {len(ta.VARIANTS.warm)}")
    # the row-draw kernel passed its start-up check (else the runtime turned it off with a warning: torch's ops draw)
    say(f"row-draw kernel after start-up: {'on (ok)' if rt.draw_kernel else 'OFF: its start-up check failed (FAILED)'}")
    drawing = rt.draw_kernel
    # every tree width, short and long prefixes (one split and the reduction), and draft steps (interpreted: the
    # smallest, a middle and the largest width, for the suite's minutes; the variants do not depend on the width)
    widths = sorted({1, k // 2, k}) if ARGS.cpu else range(1, k + 1)
    for n in widths:
        for p in (9, prefix):
            step_batch(rt, 2, n, p, g, layers_kv, table, heads, min(vocab, 1024), dtype)
    draft_step(rt, g, prefix, table_cpu)
    after = compiled_entries()
    cold = ta.VARIANTS.cold
    ok = cold == 0 and (after is None or after == after_start)
    say(f"compiles after start-up over {2 * len(widths)} verification steps (widths 1..{k}) and a draft step: "
        f"{'n/a (interpreter)' if after is None else after - after_start} Triton cache entries, {cold} cold "
        f"launches ({'ok' if ok else 'FAILED'})")
    for key in list(ta.VARIANTS.launched - ta.VARIANTS.warm)[:3]:  # what differs from the nearest warm variant
        near = min((w for w in ta.VARIANTS.warm if w[0] == key[0]),
                   key=lambda w: sum(a != b for a, b in zip(w[1], key[1])))
        say(f"  cold {key[0]} variant: " + ", ".join(f"{a} (warm: {b})" for a, b in zip(key[1], near[1]) if a != b))
    # the step's pieces at the engine's shapes: first each under the sync debug mode (a wait for the device is found
    # and where it happened said), then timed (the timing itself waits)
    found: dict = {}
    for nodes in ((4,) if ARGS.cpu else (16, 64)):
        if not ARGS.cpu:  # (on CPU tensors nothing can wait for a device: the timed pass below runs the same code)
            step_batch(rt, trees, nodes, prefix, g, layers_kv, table, heads, vocab, dtype, run=no_wait(found),
                       torch_draws=True)
        runs = []
        for _ in range(1 if ARGS.cpu else 7):
            runs.append({})
            step_batch(rt, trees, nodes, prefix, g, layers_kv, table, heads, vocab, dtype, run=timed(runs[-1]),
                       torch_draws=True)
        for piece in runs[0]:
            dev = statistics.median(r[piece][0] for r in runs) * 1e3
            host = statistics.median(r[piece][1] for r in runs) * 1e3
            say(f"step piece, {trees} trees x {nodes} nodes, {layers} layers: {piece:24s} {dev:7.3f} ms "
                f"(host {host:6.3f} ms), {'WAITS for the device' if piece in found else 'no device wait'}")
        if ARGS.profile and nodes == 16 or ARGS.cpu and ARGS.profile:
            profiles: dict = {}
            for _ in range(1 if ARGS.cpu else 5):
                step_batch(rt, trees, nodes, prefix, g, layers_kv, table, heads, vocab, dtype, run=profiled(profiles),
                           torch_draws=True)
            for piece, prof in profiles.items():
                say(f"host profile, {trees} trees x {nodes} nodes, {piece} (cProfile, {1 if ARGS.cpu else 5} steps; "
                    f"tottime / cumtime ms a step, calls a step):")
                for line in top_functions(prof, ARGS.profile, 1 if ARGS.cpu else 5):
                    say("    " + line)
    # the pieces as a step runs them (one wait, at its end): what they add to the step, the target's 5%
    for nodes in ((4,) if ARGS.cpu else (16, 64)):
        got = sequence_cost(rt, trees, nodes, prefix, g, layers_kv, table, heads, vocab, dtype, 1 if ARGS.cpu else 9)
        for label, ms in got.items():
            say(f"step in sequence, {trees} trees x {nodes} nodes, {layers} layers: {label:42s} {ms:7.3f} ms")
    # the plan's host time part by part, 8 trees x 16 nodes (4 here): where the plan's share of the 5% goes
    nodes = 4 if ARGS.cpu else 16
    got = plan_parts(rt, 3 if ARGS.cpu else 30,
                     lambda: step_batch(rt, trees, nodes, prefix, g, layers_kv, table, heads, vocab, dtype,
                                        run=lambda name, fn: fn() if name == "plan" else None))
    for label, ms in got.items():
        say(f"plan part, {trees} trees x {nodes} nodes: {label:40s} {ms:7.3f} ms")
    no_wait(found)("draft step's plan", lambda: draft_step(rt, g, prefix, table_cpu))
    for piece, at in found.items():
        say(f"  {piece} waits for the device at {at}")
    say(f"device waits in the step's pieces: {len(found)} ({'ok' if not found else 'FAILED'})")
    ok &= not found
    contained = (rt.faults.count, rt.kernel_fallbacks)
    say(f"faults, kernel fallbacks over every step: {contained} ({'ok' if contained == (0, 0) else 'FAILED'})"
        + (f": {dict(rt.faults.by_place)}" if rt.faults.count else ""))
    return ok and contained == (0, 0) and drawing


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        say("needs a CUDA GPU (or --cpu)")
        return 2
    say(f"device: {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu (interpreter)'}, torch "
        f"{torch.__version__}, triton {__import__('triton').__version__}; the step's plan: "
        + ("compiled (numba)" if step_plan.compiled() else "Python (numba not installed here)"))
    if ARGS.draws_only:
        ok = check_draws()
    elif ARGS.step_only:
        ok = check_step()
    else:
        ok = check_kernel()
        ok &= check_draws()
        ok &= check_step()
    say(f"device check: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
