"""The host side of a GPU tree step, measured on this CPU without this CPU's forward in between (the host side's target:
at most 10% of the H100 Llama-3-8B step).

In the CPU engine (`profile_step.py --gpu-plan`) two things make the drafter's time unlike a GPU host's: every forward
streams ~540 MB of weights through the caches, so the drafter always starts cache-cold (`host_cache_cold.py`: 2.7-3.2x),
and this CPU's dear rows make the cost model pick chains, so the GPU runtime's planning of a tree step (`plan_cost.py`:
0.2-0.5 ms) almost never runs. This replays decoding instead: the real driver, MultiBranchDrafter, pools, cost model and
the GPU runtime's planning (`GPUTreeRuntime.prepare` on CPU tensors), every step, with the target replaced by an oracle
that knows its greedy continuation of every prompt (computed once with transformers, float32, with the final hidden
states the Medusa pool reads): greedy verification is lossless, so each tree or chain accepts exactly what the target
would. The forward is simulated: the clock the cost model learns from advances by the H100 Llama-3-8B step of the
reference table for the step's rows, so decisions are the ones a GPU engine's cost model would make (more rows, trees).
Requests run as vLLM runs a queue with max_num_seqs = the batch size (a finished request's place goes to the next
prompt). Each replay runs in a process of its own. `--evict-mb` streams that many MB before each propose, as this CPU's
forward does to the caches. The Medusa heads are device work on a GPU: their results at every position are computed
before the replay and handed over when the pool asks (`--heads-on-host` runs them on this CPU between the host's parts,
as the replay first did).

    .venv/bin/python benchmarks/host_replay.py --batch-size 1 8 --evict-mb 0 600
    .venv/bin/python benchmarks/host_replay.py --digest   # decisions unchanged by a host-side change? (~1 min)
    .venv/bin/python benchmarks/host_replay.py --batch-size 8 --evict-mb 0 --repeats 4 --against HEAD~3

Prints ms per step of each part; the host side is propose + on_schedule + the GPU plan, less the Medusa heads' tensor
work (device work on a GPU), against the 8B step of the batch size; what `Driver.while_forward` runs once the forward
is launched (finished and new requests' pool state) is shown apart: on a GPU the host is idle then. Run alone.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import subprocess
import sys
import time
import types
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from vllm_adaspec.trees import DraftTree, verify_greedy  # noqa: E402

from profile_step import STEP_8B_MS  # noqa: E402 (the reference H100 Llama-3-8B step by batch size)

# the same reference table: the same forward's cost with r rows per request over one row
ROWS_8B = {1: {1: 1.0, 4: 1.11, 16: 1.15, 64: 1.18}, 8: {1: 1.0, 4: 1.18, 16: 1.28, 64: 2.25},
           32: {1: 1.0, 4: 1.69, 16: 2.56, 64: 7.71}}


# --fine: (label, where, method) as profile_step.PARTS
FINE = [
    ("fine: pools' extend (observe)", "vllm_adaspec.pools:PoolSet", "extend"),
    ("fine: pools' start (while_forward: a new request's prompt)", "vllm_adaspec.pools:PoolSet", "start"),
    ("fine: calibration feedback (observe)", "vllm_adaspec.proposers.multi_branch:MultiBranchDrafter", "_calibrate"),
    ("fine: outcomes (driver)", "vllm_adaspec.proposers.driver:Driver", "_outcomes"),
    ("fine: tree_rows (draft)", "vllm_adaspec.proposers.driver:Driver", "tree_rows"),
    ("fine: pool taps (draft)", "vllm_adaspec.proposers.multi_branch:MultiBranchDrafter", "_pool_taps"),
    ("fine: the node choice, Python (draft)", "vllm_adaspec.proposers.multi_branch:choose_reference", None),
    ("fine: route (driver)", "vllm_adaspec.proposers.driver:Driver", "_route"),
    ("fine: account (driver)", "vllm_adaspec.proposers.driver:Driver", "_account"),
    ("fine: plan_step (GPU plan)", "vllm_adaspec.runtime.base:plan_step", None),
    # arctic-inference's suffix trees besides the suffix pool's speculation (propose, above)
    ("fine: suffix pool extend (observe)", "vllm_adaspec.pools.suffix:SuffixPool", "extend"),
    ("fine: suffix pool start (while_forward)", "vllm_adaspec.pools.suffix:SuffixPool", "start"),
    ("fine: suffix pool stop (while_forward, a finished request)", "vllm_adaspec.pools.suffix:SuffixPool", "stop"),
]


def forward_ms(batch: int, rows: int) -> float:
    """The simulated 8B step: the table's batch size nearest below (by log), linear in rows per request."""
    b = 1 if batch < 3 else 8 if batch < 16 else 32
    per = max(1.0, rows / max(1, batch))
    xs = sorted(ROWS_8B[b])
    x0 = max(x for x in xs if x <= per) if per < xs[-1] else xs[-2]
    x1 = xs[xs.index(x0) + 1]
    y0, y1 = ROWS_8B[b][x0], ROWS_8B[b][x1]
    return STEP_8B_MS[b] * (y0 + (y1 - y0) * (per - x0) / (x1 - x0))


def ref_tree(ref: str) -> Path:
    """A temporary worktree of git `ref` holding this script and profile_step.py (the measurement stays this one) and
    the cached continuations and heads' results. (vllm_adaspec.kernels still comes from the installed package: the
    kernels' host code, plan_launch, is this tree's.)"""
    import shutil
    import tempfile

    tree = Path(tempfile.mkdtemp(prefix="host_replay_ref_"))
    tree.rmdir()
    done = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), ref], capture_output=True,
                          text=True)
    if done.returncode:
        sys.exit(f"--against {ref}: {done.stderr.strip()}")
    for name in ("host_replay.py", "profile_step.py"):
        shutil.copy(ROOT / "benchmarks" / name, tree / "benchmarks" / name)
    (tree / "benchmarks" / "out").mkdir(exist_ok=True)
    for cached in (ROOT / "benchmarks" / "out").glob("host_replay_*.pt"):
        (tree / "benchmarks" / "out" / cached.name).symlink_to(cached)
    return tree


# --- the oracle: each prompt's greedy continuation and the final hidden states along it ---

def continuations(model_path: str, prompts: list[str], max_tokens: int, cache_dir: Path) -> list[dict]:
    key = hashlib.sha256(json.dumps([model_path, prompts, max_tokens]).encode()).hexdigest()[:16]
    path = cache_dir / f"host_replay_{key}.pt"
    if path.exists():
        return torch.load(path)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for n, p in enumerate(prompts):
            ids = tok(p, return_tensors="pt", add_special_tokens=False).input_ids
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=tok.eos_token_id)
            full = gen[0]
            hidden = model(full[None], output_hidden_states=True).hidden_states[-1][0]  # [P + T, H] (after the norm)
            out.append({"prompt": ids[0].tolist(), "cont": full[ids.shape[1]:].tolist(), "hidden": hidden.clone()})
            print(f"[replay] continuation {n + 1}/{len(prompts)}: {ids.shape[1]} + {len(out[-1]['cont'])} tokens",
                  file=sys.stderr, flush=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    torch.save(out, path)
    return out


# --- the Medusa heads, as a GPU engine's host sees them ---

DEVICE: dict[int, dict] = {}  # id(heads) -> {(hidden row bytes, last token): (ids [K, W], probs [K, W])}


def device_results(heads, data: list[dict], cache_dir: Path | None) -> dict:
    """The heads' ranked tokens at every position a replay can hand them (the final hidden state of position j, the
    token at j + 1), at the widest any step asks for: computed here in batches, not between the host's parts."""
    from vllm_adaspec.pools.medusa import MAX_NODES, sparse_tree

    width = sparse_tree(heads.accuracy, MAX_NODES).max_rank
    weights = [list(heads.w.shape), float(heads.w.double().sum()), float(heads.lm_rows.double().sum())]  # (not the path:
    # an --against worktree loads the same heads from another folder)
    key = hashlib.sha256(json.dumps([weights, width, [d["cont"] for d in data]]).encode()).hexdigest()[:16]
    path = cache_dir / f"host_replay_heads_{key}.pt" if cache_dir is not None else None
    rows = [(k, j) for k, d in enumerate(data) for j in range(len(d["prompt"]) - 1, len(d["prompt"]) + len(d["cont"]) - 1)]
    seq = [d["prompt"] + d["cont"] for d in data]
    if path is not None and path.exists():
        ids, probs = torch.load(path)
    else:
        ids, probs = [], []
        with torch.inference_mode():
            for at in range(0, len(rows), 256):
                chunk = rows[at:at + 256]
                h = torch.stack([data[k]["hidden"][j] for k, j in chunk])
                i, p = RANKED(heads, h, [seq[k][j + 1] for k, j in chunk], width)
                ids.append(i.cpu())
                probs.append(p.cpu())
        ids, probs = torch.cat(ids), torch.cat(probs)
        if path is not None:
            torch.save((ids, probs), path)
    return {(data[k]["hidden"][j].numpy().tobytes(), seq[k][j + 1]): (ids[n], probs[n]) for n, (k, j) in enumerate(rows)}


def ranked_on_device(heads, h, last_tokens: list[int], width: int):
    """pools.medusa.ranked_tokens as a GPU engine's host gets it: the heads ran on the device (here: before the
    replay, `device_results`), the host reads their top tokens. Running them on this CPU between the host's parts
    (`--heads-on-host`) also streams their weights (~110 MB a step) through the host's caches and wakes torch's
    threads: the host parts after them ran up to 1.5x slower."""
    table = DEVICE[id(heads)]
    got = [table[(h[r].numpy().tobytes(), t)] for r, t in enumerate(last_tokens)]
    return torch.stack([g[0] for g in got])[..., :width], torch.stack([g[1] for g in got])[..., :width]


RANKED = None  # pools.medusa.ranked_tokens itself (device_results computes with it)


# --- the engine, as the driver sees it ---

class ReplayPort:
    """What the driver asks of the engine (engine/port.EnginePort's methods it calls), answered by the replay."""

    def __init__(self, heads_of):
        from vllm_adaspec.step import RequestTraits, Taps

        self.observers, self.taps, self._heads_of = [], Taps(), heads_of
        self.results, self.verified_rows = {}, None
        self.traits_one = RequestTraits(tree=True, plain="greedy")
        self.device = torch.device("cpu")

    def view(self, sampled, num_tokens, token_ids):
        from vllm_adaspec.step import BatchView

        return BatchView(self.req_ids, sampled, num_tokens, token_ids, self.num_prompt, self.temperature)

    def traits(self, req_id):
        return self.traits_one

    def forget(self, req_ids):
        pass

    def feedback(self):
        from vllm_adaspec.step import Taps

        out = (self.results, 0, self.taps, self.verified_rows)
        self.results, self.taps, self.verified_rows = {}, Taps(), None
        return out

    def drop_trees(self, req_ids):
        pass

    def held_copy_tokens(self):
        return 0

    def tree_copies(self):
        return False  # the GPU runtime reads the paged cache in place

    def kv_positions(self):
        return 1 << 20

    def medusa_heads(self, target_model, folder):
        return self._heads_of(folder)

    def live(self):
        return {}

    def tree_counts(self):
        return {}

    def observer_stats(self):
        return {}

    def observer_live(self):
        return {}


def medusa_from(model_path: str, data: list[dict] | None = None, cache_dir: Path | None = None):
    """MedusaHeads on the transformers model's LM head and embeddings (what engine/medusa_heads builds on vLLM's).
    With `data` (the oracle's continuations), the heads' results at every position of every continuation are
    computed once here (cached under cache_dir) for `ranked_on_device` to hand over during the replay."""
    def build(folder):
        heads = _build(folder)
        if data is not None:
            DEVICE[id(heads)] = device_results(heads, data, cache_dir)
        return heads

    def _build(folder):
        from transformers import AutoModelForCausalLM

        from vllm_adaspec.engine.medusa_heads import MedusaHeads
        from vllm_adaspec.heads.medusa import load_medusa, reads_token

        model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
        meta, t = load_medusa(folder)
        vocab = t["draft_vocab"]
        rows = model.lm_head.weight[: model.config.vocab_size][vocab].detach().clone()
        emb = model.get_input_embeddings()
        embed = (lambda ids: emb(ids).detach()) if reads_token(t["w"]) else None
        return MedusaHeads(t["w"].float(), t["b"].float(), vocab, rows, meta["accuracy_by_rank"], folder, embed)
    return build


def make_driver(model_path: str, settings_json: dict, port: ReplayPort, device: str = "cuda", k: int = 16,
                trees: bool = True):
    """A MultiBranchProposer's driver with the settings start-up would resolve for this model, and the cost model's
    prior of a CUDA engine for an 8B model (device "cpu": of this model on the CPU engine); k: vLLM's
    num_speculative_tokens (the tree budget's cap); trees=False: as an engine without a tree path (chains only)."""
    from transformers import AutoConfig

    from vllm_adaspec.config import parse_adaspec_config, resolve_config
    from vllm_adaspec.engine.startup import _with_pool_files  # the pools' files, as start-up resolves them
    from vllm_adaspec.proposers.driver import Driver
    from vllm_adaspec.proposers.multi_branch import MultiBranchDrafter

    hf = AutoConfig.from_pretrained(model_path)
    resolved = resolve_config(parse_adaspec_config({"adaspec": settings_json}, proposer="multi_branch"),
                              architectures=hf.architectures, num_layers=hf.num_hidden_layers,
                              num_speculative_tokens=k, proposer="multi_branch")
    vllm_config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(seed=0, hf_text_config=hf, tokenizer=model_path),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1),
        device_config=types.SimpleNamespace(device_type="cuda"))
    resolved = replace(_with_pool_files(resolved, vllm_config), checked=True,
                       tree_unsupported=None if trees else "the replay: chains only")
    big = types.SimpleNamespace(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False)

    class ReplayDriver(Driver):
        proposer, drafter_cls = "multi_branch", MultiBranchDrafter

    import vllm_adaspec.proposers.driver as driver_mod
    from vllm_adaspec.policies.cost_model import model_parameters, prior_for

    prior = driver_mod.engine_prior
    driver_mod.engine_prior = lambda cfg: (prior_for("cuda", model_parameters(big)) if device == "cuda"
                                           else prior_for("cpu"))  # the 8B's curve, or this CPU's
    try:
        driver = ReplayDriver(vllm_config, resolved)
    finally:
        driver_mod.engine_prior = prior
    driver.attach(port)
    driver.load_model(None)
    return driver


class SimClock:
    """perf_counter for the driver: real time plus the simulated forwards so far. simulated=True (--digest): the
    simulated forwards only (and 1 us a read), so that the drafter's decisions do not depend on this run's timings."""

    def __init__(self, simulated: bool = False):
        self.offset, self.simulated, self.reads = 0.0, simulated, 0

    def perf_counter(self) -> float:
        if self.simulated:
            self.reads += 1
            return self.offset + self.reads * 1e-6
        return time.perf_counter() + self.offset


def accepted_path(plan, cont: list[int], at: int) -> tuple[list[int], bool]:
    """Greedy verification against the known continuation (cont[at] is the next token): the accepted nodes (a
    tree's node indices root to deepest, a chain's 0..a-1), and whether it is a tree. A row's argmax is the
    continuation's token at its depth: right on the accepted path, the only rows verification reads."""
    n = plan.num_verified
    parents = plan.parents[:n] if plan.parents is not None else tuple(range(-1, n - 1))
    tree = DraftTree.of(plan.tokens[:n], parents)
    argmax = torch.tensor([cont[min(at + d, len(cont) - 1)] for d in [0] + tree.depth_list])
    return verify_greedy(tree, argmax)[0], plan.is_tree


def hidden_taps(data: list[dict], batch: list[int], plen, made, got: dict, verified_rows: list[int], results: dict):
    """What the Medusa pool reads after a step of requests `batch` (decoding, then prefills): the forward's output
    rows (1 + drafts per decoding request, 1 per prefill) [rows, H], each bonus row the final hidden state of the
    position that produced the request's new last token (made[k]: tokens before this step's got[k])."""
    from vllm_adaspec.requests import bonus_rows
    from vllm_adaspec.step import Taps

    at_rows = bonus_rows([len(got[k]) for k in batch], verified_rows, {r: p for r, (p, *_) in results.items()})
    h = torch.zeros(len(batch) + sum(verified_rows), data[0]["hidden"].shape[1])  # [rows, H]
    for row, k in enumerate(batch):
        h[at_rows[row]] = data[k]["hidden"][plen[k] + made[k] + len(got[k]) - 2]
    return Taps(hidden=h)


@torch.inference_mode()
def replay(data: list[dict], batch_size: int, settings_json: dict, model_path: str, evict_mb: int, acc,
           max_tokens: int, heads, digest=None) -> dict:
    """One replay; digest (a hashlib object, --digest): every propose call's drafts and plans go into it, and the
    driver's clock is the simulated one only (the same inputs then make the same decisions, run after run). In
    torch's inference mode, as vLLM's GPU worker runs execute_model and sample_tokens (the drafter's propose and the
    tree plan inside them): tensors made there skip autograd's bookkeeping (a view ~0.8 us, not ~1.3)."""
    import vllm_adaspec.proposers.driver as driver_mod
    from vllm_adaspec.runtime.gpu import GPUTreeRuntime
    from vllm_adaspec.runtime.base import plan_step
    from vllm_adaspec.kernels import tree_attention
    from vllm_adaspec.kernels.tree_attention import tile_rows
    try:
        from vllm_adaspec.trees.step_plan import warm_up as warm_up_plan
    except ImportError:  # --against a tree from before the compiled plan
        warm_up_plan = lambda: None  # noqa: E731
    from vllm_adaspec.step import Taps

    from profile_step import HEADS, SHADOW
    from vllm_adaspec.policies.cost_model import UNIT_STEPS

    clock = SimClock(simulated=digest is not None)
    real_time = driver_mod.time
    driver_mod.time = types.SimpleNamespace(perf_counter=clock.perf_counter, time=time.time)
    port = ReplayPort(heads)
    driver = make_driver(model_path, settings_json, port)
    gpu = GPUTreeRuntime("cpu", plain=lambda r: "greedy", max_rows=65)
    gpu.heads, gpu.block_q = (32, 8, 128), tile_rows(65, 32, 8)  # Llama-3-8B's heads
    device_programs = tree_attention.device_programs
    tree_attention.device_programs = lambda device: 132  # an H100's SMs (on CPU tensors the plan would assume 8)
    warm_up_plan()  # as an engine's start-up does (GPUTreeRuntime.attached): no compile inside the replay
    sink = np.zeros(max(1, evict_mb) << 18, dtype=np.float32) if evict_mb else None  # evict_mb MB
    steps = tokens = forwards = tree_steps = nodes = 0
    host_ms, ref_ms = [], []
    steady = []  # host ms less the heads' of each step once the cost model's scale is set (its first UNIT_STEPS
    # observed steps re-solve every fit each step, once in an engine's life) and the first batch has started
    overlapped_ms = []  # Driver.while_forward per step: off the critical path on a GPU
    overlap = hasattr(driver, "while_forward")  # (an older tree, --against, runs that work inside the host side)
    names = [f"r{k}" for k in range(len(data))]
    plen = [len(d["prompt"]) for d in data]
    limit = [min(max_tokens, len(d["cont"])) for d in data]
    token_ids = np.zeros((len(data), max(plen) + max_tokens + 64), dtype=np.int32)
    for k, d in enumerate(data):
        token_ids[k, :plen[k]] = d["prompt"]
    made = [0] * len(data)  # tokens generated per request
    queue = list(range(len(data)))[::-1]
    medusa = "medusa" in driver.drafter.pools
    gc.collect()  # as vLLM's engine core after start-up (freeze_gc_heap): collections skip what start-up made
    gc.freeze()
    try:
        # continuous batching, as vLLM runs a queue of requests with max_num_seqs = batch_size: a finished
        # request's place goes to the next prompt, whose prefill samples its first token in the same step
        batch = [queue.pop() for _ in range(min(batch_size, len(queue)))]
        if overlap:  # the first batch's prefill step, as the engine schedules it (its pools start behind it)
            driver.on_schedule({names[k]: plen[k] for k in batch}, {}, [], {names[k]: data[k]["prompt"] for k in batch})
            driver.while_forward()
        got = {k: [data[k]["cont"][0]] for k in batch}
        port.verified_rows, port.results = None, {}
        hid = [data[k]["hidden"][plen[k] - 1] for k in batch]
        port.taps = Taps(hidden=torch.stack(hid) if medusa else None)
        while batch:
            for k in batch:  # commit what the step sampled
                s = plen[k] + made[k]
                token_ids[k, s:s + len(got[k])] = got[k]
                made[k] += len(got[k])
                tokens += len(got[k])
            port.req_ids = [names[k] for k in batch]
            port.num_prompt = np.array([plen[k] for k in batch])
            port.temperature = np.zeros(len(batch), dtype=np.float32)
            num_tokens = np.array([plen[k] + made[k] for k in batch])
            rows_now, sampled = token_ids[batch], [got[k] for k in batch]
            if sink is not None:
                sink.sum()  # what a CPU forward does to the caches
            # vLLM proposes right after sampling, for the step's whole batch (requests that just finished too)
            heads0 = acc[HEADS][0]
            t0 = time.perf_counter()
            drafts = driver.propose(sampled, num_tokens, rows_now)
            if digest is not None:
                digest.update(repr((drafts, sorted((r, p.tokens, p.parents) for r, p in driver.plans.items())))
                              .encode())
            t_propose = time.perf_counter() - t0
            done = [k for k in batch if made[k] >= limit[k]]
            keep = [(k, d) for k, d in zip(batch, drafts) if k not in done]
            batch = [k for k, _ in keep]
            drafts = [d[:max(0, limit[k] - made[k] - 1)] for k, d in keep]  # the scheduler's max_tokens cap
            new = [queue.pop() for _ in range(min(len(done), len(queue)))]  # prefills join the step
            scheduled = {names[k]: 1 + len(d) for k, d in zip(batch, drafts)}
            scheduled.update({names[k]: plen[k] for k in new})
            spec = {names[k]: d for k, d in zip(batch, drafts) if d}
            t0 = time.perf_counter()
            if overlap:  # vLLM's worker hands the new requests' prompts over at scheduling
                driver.on_schedule(scheduled, spec, [names[k] for k in done], {names[k]: data[k]["prompt"] for k in new})
            else:  # (an older tree: --against)
                driver.on_schedule(scheduled, spec, [names[k] for k in done])
            t_sched = time.perf_counter() - t0
            if not batch and not new:
                break
            port.req_ids = [names[k] for k in batch + new]
            query_start = np.concatenate([[0], np.cumsum([1 + len(d) for d in drafts] + [plen[k] for k in new])])
            rows = int(query_start[-1]) - sum(plen[k] for k in new)  # decode rows (prefills: not simulated)
            roots = np.array([plen[k] + made[k] - 1 for k in batch] + [0] * len(new))
            t0 = time.perf_counter()
            step = plan_step(port.req_ids, query_start, roots, spec, driver.plans, int(query_start[-1]))
            if step is not None:
                gpu.prepare(step)
            t_plan = time.perf_counter() - t0
            acc[SHADOW][0] += t_plan
            acc[SHADOW][1] += 1
            if overlap:  # the forward is launched: on a GPU this runs while it computes (not on the critical path)
                t0 = time.perf_counter()
                driver.while_forward()
                overlapped_ms.append(1e3 * (time.perf_counter() - t0))
            clock.offset += forward_ms(max(1, len(batch)), max(1, rows)) / 1e3
            ref_ms.append(STEP_8B_MS[1 if len(batch) + len(new) < 3 else 8])
            host_ms.append(1e3 * (t_propose + t_sched + t_plan))
            if driver.costs is not None and driver.costs.observations >= UNIT_STEPS:
                steady.append(host_ms[-1] - 1e3 * (acc[HEADS][0] - heads0))
            steps += 1
            forwards += len(batch) + len(new)
            tree_steps += step is not None
            nodes += rows - len(batch)
            # verification by the oracle: what greedy verification of each plan accepts
            results, got = {}, {}
            for row, (k, d) in enumerate(zip(batch, drafts)):
                cont, at = data[k]["cont"], made[k]
                plan = driver.plans.get(names[k])
                path, tree = accepted_path(plan.scheduled(len(d)), cont, at) if d else ([], False)
                got[k] = [plan.tokens[j] for j in path] + [cont[at + len(path)]]
                if tree:
                    results[row] = (path, got[k][-1], ())
            for k in new:
                got[k] = [data[k]["cont"][0]]
            batch = batch + new
            port.results, port.verified_rows = results, [len(d) for d in drafts] + [0] * len(new)
            if medusa:
                port.taps = hidden_taps(data, batch, plen, made, got, port.verified_rows, results)
    finally:
        driver_mod.time = real_time
        tree_attention.device_programs = device_programs
    return {"steps": steps, "tokens": tokens, "forwards": forwards, "tree_steps": tree_steps, "nodes": nodes,
            "host_ms": host_ms, "ref_ms": ref_ms, "steady": [sum(steady) / max(1, len(steady)), len(steady)],
            "overlapped": sum(overlapped_ms) / max(1, steps)}


def replay_inputs(model_name: str, datasets: list[str], num_prompts: int, max_tokens: int, heads_on_host: bool):
    """(the model's folder, each prompt's continuation, the Medusa heads by folder) for `replay`; without
    heads_on_host the pool's ranked_tokens becomes the lookup of the heads' precomputed results (call this before
    any timer wraps it: the lookup is then timed as the heads' part)."""
    from transformers import AutoTokenizer

    from vllm_adaspec.data.prompts import WORKLOAD_MIX, load_prompts
    from vllm_adaspec.models import resolve_model

    model = resolve_model(model_name)
    tok = AutoTokenizer.from_pretrained(model)
    sets = [d for ds in datasets for d in (WORKLOAD_MIX if ds == "mix" else [ds])]
    prompts = [q for ds in sets for q in load_prompts(ds, num_prompts, tokenizer=tok)]
    data = continuations(model, prompts, max_tokens, ROOT / "benchmarks" / "out")
    return model, data, replay_heads(model, data, on_device=not heads_on_host)


def replay_heads(model: str, data: list[dict], on_device: bool = True):
    """The Medusa heads by folder, built once each, for `replay`. on_device: the pool's ranked_tokens becomes the
    lookup of the heads' results precomputed at every position of `data` (a GPU's device work), else they run here."""
    global RANKED
    import vllm_adaspec.pools.medusa as medusa_pool

    RANKED = medusa_pool.ranked_tokens
    if on_device:
        medusa_pool.ranked_tokens = ranked_on_device
    heads = medusa_from(model, data if on_device else None, ROOT / "benchmarks" / "out")
    built = {}
    return lambda folder: built.setdefault(folder, heads(folder))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--settings", default="{}", help="MultiBranchProposer settings (JSON; default: its defaults)")
    p.add_argument("--datasets", nargs="+", default=["mix"])
    p.add_argument("--num-prompts", type=int, default=4, help="prompts per dataset (4: batch 8 stays full most steps)")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8])
    p.add_argument("--evict-mb", type=int, nargs="+", default=[0, 600],
                   help="MB streamed before each propose (0: a GPU host's warm caches; 600: this CPU's forward)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="replays per column (the median step's parts)")
    p.add_argument("--out", default=None, help="JSON of every column")
    p.add_argument("--fine", action="store_true", help="also time the drafter's smaller parts")
    p.add_argument("--heads-on-host", action="store_true",
                   help="run the Medusa heads on this CPU inside each step (default: their results computed before "
                        "the replay and handed over as a GPU's device work would be)")
    p.add_argument("--against", default=None, metavar="REF",
                   help="also replay the drafter of git REF (a worktree of it, with this script), alternating with "
                        "this tree's, one column each: host-side changes compared within one run")
    p.add_argument("--digest", action="store_true",
                   help="one replay per batch size on the simulated clock alone; print a digest of every drafted "
                        "token and plan (a host-side change that must not change decisions leaves it the same)")
    p.add_argument("--cprofile", default=None, metavar="FILE",
                   help="with --one: a cProfile of the replay loop alone (not start-up) to FILE")
    p.add_argument("--one", type=int, nargs=2, default=None, help=argparse.SUPPRESS)  # child: batch size, MB
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from profile_step import HEADS, PARTS, SHADOW, install

    model, data, heads_once = replay_inputs(args.model, args.datasets, args.num_prompts, args.max_tokens,
                                            args.heads_on_host)
    settings = json.loads(args.settings)
    acc = defaultdict(lambda: [0.0, 0])
    parts = [(label, where, name) for label, where, name in PARTS  # the drafter's and the plan's (no forward here)
             if where and where.startswith("vllm_adaspec") and ":TreeRuntime" not in where
             and ":TreeRejectionSampler" not in where]  # (the CPU engine's verification: not in a replay)
    if args.fine:  # the drafter's smaller parts too (nested timers cost ~1 us a call: compare parts, not totals)
        parts += FINE
    install(acc, parts)
    if args.digest:
        for b in args.batch_size:
            h = hashlib.sha256()
            r = replay(data, b, settings, model, 0, acc, args.max_tokens, heads_once, digest=h)
            print(f"batch {b}: {r['steps']} steps, {r['tokens']} tokens, tau {r['tokens'] / r['forwards']:.3f}, "
                  f"digest {h.hexdigest()[:16]}", flush=True)
        return
    if args.one is not None:  # one replay, in a process of its own (a second replay in the same process runs
        # slower: the first one's objects stay and the garbage collector walks them)
        b, mb = args.one
        if args.cprofile:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        r = replay(data, b, settings, model, mb, acc, args.max_tokens, heads_once)
        if args.cprofile:
            prof.disable()
            prof.dump_stats(args.cprofile)
        r["parts"] = {label: 1e3 * acc[label][0] / r["steps"] for label, _, _ in parts}
        r["parts"][SHADOW] = 1e3 * acc[SHADOW][0] / r["steps"]
        r["host"] = [sum(r["host_ms"]) / r["steps"], sum(r["host_ms"]) / r["steps"] - r["parts"][HEADS]]
        r["ref"] = sum(r["ref_ms"]) / r["steps"]
        print("@@" + json.dumps({k: v for k, v in r.items() if k not in ("host_ms", "ref_ms")}), flush=True)
        return
    trees = [("", ROOT)]
    if args.against:
        trees.append((args.against, ref_tree(args.against)))
    columns = []
    try:
        for b in args.batch_size:
            for mb in args.evict_mb:
                runs = {name: [] for name, _ in trees}
                for k in range(args.repeats):
                    for name, tree in trees[::1 if k % 2 == 0 else -1]:  # alternating: the machine's drift hits both
                        cmd = [sys.executable, str(tree / "benchmarks" / "host_replay.py"), "--one", str(b), str(mb),
                               "--model", args.model, "--settings", args.settings, "--datasets", *args.datasets,
                               "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens)] \
                            + (["--fine"] if args.fine else []) + (["--heads-on-host"] if args.heads_on_host else [])
                        out = subprocess.run(cmd, capture_output=True, text=True, cwd=tree)
                        line = next((x for x in out.stdout.splitlines() if x.startswith("@@")), None)
                        if line is None:
                            sys.exit(f"replay failed ({name or 'this tree'}):\n{out.stderr[-3000:]}")
                        runs[name].append(json.loads(line[2:]))
                for name, _ in trees:
                    got = sorted(runs[name], key=lambda r: r["host"][1])
                    med = got[len(got) // 2]
                    med.update(batch=b, evict_mb=mb, tree=name, spread=[got[0]["host"][1], got[-1]["host"][1]])
                    if all("steady" in r for r in got):  # (its own median: an older tree's replay has none)
                        med["steady"] = sorted((r["steady"] for r in got), key=lambda v: v[0])[len(got) // 2]
                    columns.append(med)
                    print(f"[replay] batch {b}, evict {mb} MB{', ' + name if name else ''}: host less heads "
                          f"{med['host'][1]:.2f} ms ({[round(r['host'][1], 2) for r in got]})", file=sys.stderr,
                          flush=True)
    finally:
        if args.against:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(trees[1][1])],
                           capture_output=True)
    head = "| ms per step | " + " | ".join(f"b{c['batch']}, {c['evict_mb']} MB{', ' + c['tree'] if c['tree'] else ''}"
                                          for c in columns) + " |"
    print(head + "\n|---|" + "---|" * len(columns))
    for label, _, _ in parts:
        indent = len(label) - len(label.lstrip()) - 6
        print(f"| {'. ' * max(0, indent // 2)}{label.strip()} | "
              + " | ".join(f"{c['parts'][label]:.3f}" for c in columns) + " |")
    rows = [("GPU tree plan (plan_step + GPUTreeRuntime.prepare)", lambda c: f"{c['parts'][SHADOW]:.3f}"),
            ("host side: propose + on_schedule + GPU plan", lambda c: f"{c['host'][0]:.3f}"),
            ("while the forward runs (Driver.while_forward: finished requests' pools freed, new ones' prompts "
             "indexed; not in the host side: on a GPU the host waits for the forward then)",
             lambda c: f"{c['overlapped']:.3f}" if "overlapped" in c else "-"),
            ("host side less the Medusa heads' tensor work", lambda c: f"**{c['host'][1]:.3f}**"),
            ("... spread over repeats", lambda c: f"{c['spread'][0]:.2f}-{c['spread'][1]:.2f}"),
            ("... of the H100 Llama-3-8B step (reference)", lambda c: f"{100 * c['host'][1] / c['ref']:.1f}%"),
            ("the same, steady state: steps after the cost model's first 31 (ms)",
             lambda c: f"{c['steady'][0]:.3f} ({c['steady'][1]} steps)" if "steady" in c else "-"),
            ("... of the H100 Llama-3-8B step",
             lambda c: f"{100 * c['steady'][0] / c['ref']:.1f}%" if "steady" in c else "-"),
            ("tokens per target forward (tau)", lambda c: f"{c['tokens'] / c['forwards']:.2f}"),
            ("tokens per step", lambda c: f"{c['tokens'] / c['steps']:.2f}"),
            ("requests per step", lambda c: f"{c['forwards'] / c['steps']:.2f}"),
            ("drafted rows per step", lambda c: f"{c['nodes'] / c['steps']:.1f}"),
            ("steps with a tree", lambda c: f"{100 * c['tree_steps'] / c['steps']:.0f}%"),
            ("steps", lambda c: str(c["steps"]))]
    for label, f in rows:
        print(f"| {label} | " + " | ".join(f(c) for c in columns) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump([{k: v for k, v in c.items() if k not in ("host_ms", "ref_ms")} for c in columns], f, indent=1)


if __name__ == "__main__":
    main()
