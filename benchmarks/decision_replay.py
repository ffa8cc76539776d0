"""What MultiBranchProposer's decisions make of the workload mix on this CPU, against vLLM's `suffix` and plain
decoding, in seconds instead of an engine run (to judge an idea here before spending interleaved rounds on it).

Each prompt's greedy continuation is known (transformers, float32, cached per type: `host_replay.continuations`), so
greedy verification of any draft or tree is replayed exactly (feasibility.md's method). The real driver, pools,
calibration and cost model decide every step; vLLM's `suffix` is replayed with the same suffix cache at its
defaults (K 24, depth 24, spec factor 1.0, min token prob 0.1: `SuffixDecodingProposer.propose`). The forward is
simulated by this machine's measured compiled-mode step curve (`MEASURED`: rows, requests, tree requests and rows,
attention by context; `--truth prior`: the cost model's own CPU prior instead), and the driver's cost model learns
from those simulated steps. Counted besides the steps (unless --decode-only): each prompt's prefill and each
method's host work a step (ours: the drafter, Medusa heads included; suffix: its proposer; both from profile_step.py).
Each type's prompts run as one queue of `--batch-size` (vLLM with max_num_seqs), the types one after another in one
driver and one suffix cache (as the interleaved benchmark's engines see them).

Checked against the engine (benchmarks/log/2026-11-27.md): on an interleaved engine run's batch-1 prompts the replay
gives `suffix` the engine's tau on every type (2.78 / 1.44 / 1.96 / 1.67 / 1.63 against 2.78 / 1.44 / 1.96 / 1.68 /
1.63), ours 2.98 / 1.70 / 2.25 / 2.13 / 2.03 (engine 2.98 / 1.62 / 2.25 / 2.10 / 1.91), and ours / `suffix` 1.092 on the
mix (engine 1.09, per type within 0.04).

    .venv/bin/python benchmarks/decision_replay.py --batch-size 8 --num-prompts 8 --offset 7
    .venv/bin/python benchmarks/decision_replay.py --batch-size 1 --settings '{}' '{"pools": ["suffix"]}'
    .venv/bin/python benchmarks/decision_replay.py --settings '{}' '{"env": {"VLLM_ADASPEC_X": "1"}}'  # a switch
    .venv/bin/python benchmarks/decision_replay.py --settings '{}' '{"pools": ["suffix"], "host_ms": [0.3, 0.05]}'
    .venv/bin/python benchmarks/decision_replay.py --warm 4 --settings '{}' '{"warm_calibration": true}'
    .venv/bin/python benchmarks/decision_replay.py --settings '{}' '{"oracle": true}'  # selection's ceiling

`"oracle": true` scores every candidate node by the known continuation (on it: ~1, off it: ~0) instead of its calibrated
chance: the pools' candidates as they are, picked perfectly. What better scoring could still gain over today's on the
same candidates (benchmarks/log/2026-11-28.md: batch 1 1.105 -> 1.269 `suffix`, batch 8 1.026 -> 1.158); a new candidate
source is judged by what it adds to this ceiling as well as to the default.

Prints per type: tau (tokens per target forward, every forward counted), drafted rows per forward, simulated
speed over plain, and each of ours over `suffix`. Runs every replay in this process; ~20 s once the continuations
are cached (the first run of a prompt set computes them: ~8 s a prompt).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import types
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import host_replay as hr  # noqa: E402

SUFFIX = {"k": 24, "depth": 24, "factor": 1.0, "min_prob": 0.1}  # vLLM's suffix decoding at its defaults


# This machine's compiled-mode steps (the AMD EPYC of the measurements from 2026-11-27 on; benchmarks/log/2026-11-27.md,
# `verify_cost.py --batches 1 8 --k 16 --rounds 8 --calls 4`): relative to a one-row step (30.9 ms) by the rows of a
# step in all, rows 1-17 from batch 1 (its matrix library is cheaper at 3-6 rows than at 1), 16-136 from batch 8 (34.0
# ms at 8 rows: the 7 more requests' own share is under the noise); a tree request adds ~0.15 of a one-row step and each
# of its rows ~0.005 (tree / chain 1.12-1.24 at batch 1 from 3 rows, 1.15-1.29 at batch 8 from 4 rows a request).
MEASURED = {1: 1.0, 2: 1.10, 3: 0.94, 4: 0.89, 5: 0.88, 6: 0.92, 7: 1.02, 8: 1.12, 10: 1.11, 12: 1.17, 14: 1.28,
            16: 1.40, 17: 1.41, 24: 1.90, 32: 2.24, 40: 2.61, 48: 3.39, 56: 3.54, 64: 3.76, 80: 4.44, 96: 5.21,
            112: 6.06, 128: 6.74, 136: 7.28}


def cpu_step(unit: float, truth: str = "measured"):
    """(batch, rows, tree requests, tree rows, attention load) -> simulated seconds of a CPU verification step:
    this machine's measured compiled-mode curve, or the cost model's CPU prior (truth="prior")."""
    from vllm_adaspec.policies.cost_model import ATTENTION_PRIOR, Prior, StepCostModel, prior_for

    measured = Prior(MEASURED, per_request=0.003, attention=ATTENTION_PRIOR, tree_request=0.15, tree_row=0.005)
    truth = StepCostModel(prior_for("cpu") if truth == "prior" else measured)
    truth.unit = unit
    return lambda batch, rows, treqs=0, trows=0, att=0.0: truth.predict(batch, rows, treqs, trows, att)


def run_queue(data: list[dict], ks: list[int], batch_size: int, max_tokens: int, draft, verify, step_s,
              other_s=None) -> dict:
    """Continuous batching of requests `ks` (a finished request's place goes to the next): draft(batch, made, got)
    -> drafts per batch entry; verify(k, made, drafts) -> (tokens committed, tree?). Returns the counters: seconds
    (the verification steps: what the cost model sees) and engine_seconds (those, plus other_s(decoding requests,
    prompt tokens prefilled) each step: the method's host work and the prefills)."""
    other_s = other_s or (lambda requests, prompt_tokens: 0.0)
    plen = {k: len(data[k]["prompt"]) for k in ks}
    limit = {k: min(max_tokens, len(data[k]["cont"])) for k in ks}
    made, queue = {k: 0 for k in ks}, list(ks)[::-1]
    batch = [queue.pop() for _ in range(min(batch_size, len(queue)))]
    got = {k: [data[k]["cont"][0]] for k in batch}
    c = {"tokens": 0, "forwards": 0, "seconds": 0.0, "drafted": 0, "accepted": 0, "steps": 0, "tree_steps": 0,
         "output": {k: [] for k in ks}}  # output: the tokens committed per request (= its continuation: lossless)
    c["engine_seconds"] = other_s(0, sum(plen[k] for k in batch))
    while batch:
        for k in batch:
            made[k] += len(got[k])
            c["tokens"] += len(got[k])
            c["output"][k] += got[k]
        drafts = draft(batch, made, got)
        done = [k for k in batch if made[k] >= limit[k]]
        keep = [(k, d) for k, d in zip(batch, drafts) if k not in done]
        batch = [k for k, _ in keep]
        drafts = [d[:max(0, limit[k] - made[k] - 1)] for k, d in keep]  # the scheduler's max_tokens cap
        new = [queue.pop() for _ in range(min(len(done), len(queue)))]
        verify.before(batch, drafts, new, done)
        if not batch and not new:
            break
        rows = len(batch) + sum(map(len, drafts))
        att = sum((1 + len(d)) * (plen[k] + made[k]) for k, d in zip(batch, drafts)) / 1000
        got, tree_reqs, tree_rows = {}, 0, 0
        for k, d in zip(batch, drafts):
            got[k], tree = verify(k, made[k], d)
            c["drafted"] += len(d)
            c["accepted"] += len(got[k]) - 1
            tree_reqs += tree
            tree_rows += len(d) if tree else 0
        for k in new:
            got[k] = [data[k]["cont"][0]]
        c["tree_steps"] += tree_reqs > 0
        c["engine_seconds"] += other_s(len(batch), sum(plen[k] for k in new))
        if batch:
            s = step_s(len(batch), rows, tree_reqs, tree_rows, att)
            c["seconds"] += s
            c["engine_seconds"] += s
            c["forwards"] += len(batch)
            c["steps"] += 1
        verify.after(batch, new, got)
        batch = batch + new
    c["forwards"] += len(ks)  # each request's first token: its prefill's forward
    return c


class Plain:
    def __init__(self, data):
        self.data = data

    def draft(self, batch, made, got):
        return [[] for _ in batch]

    def __call__(self, k, at, d):
        return [self.data[k]["cont"][at]], False

    def before(self, *a):
        pass

    def after(self, *a):
        pass


class VllmSuffix(Plain):
    """SuffixDecodingProposer.propose at vLLM's defaults on one shared cache."""

    def __init__(self, data, names):
        super().__init__(data)
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache, self.names = SuffixDecodingCache(max_tree_depth=SUFFIX["depth"], max_cached_requests=10000), names

    def draft(self, batch, made, got):
        out = []
        for k in batch:
            r, d = self.names[k], self.data[k]
            if r not in self.cache.active_requests:
                self.cache.start_request(r, np.asarray(d["prompt"], dtype=np.int32))
            self.cache.add_active_response(r, got[k])
            seq = d["prompt"] + d["cont"][:made[k]]
            pattern = np.asarray(seq[-SUFFIX["depth"]:], dtype=np.int32)
            out.append(list(self.cache.speculate(r, pattern, max_spec_tokens=SUFFIX["k"],
                                                 max_spec_factor=SUFFIX["factor"],
                                                 min_token_prob=SUFFIX["min_prob"]).token_ids))
        return out

    def __call__(self, k, at, d):
        cont, a = self.data[k]["cont"], 0
        while a < len(d) and at + a < len(cont) and d[a] == cont[at + a]:
            a += 1
        return list(d[:a]) + [cont[min(at + a, len(cont) - 1)]], False

    def before(self, batch, drafts, new, done):
        for k in done:
            self.cache.stop_request(self.names[k])


class VllmNgram(Plain):
    """vLLM's `ngram` proposer as bench_e2e runs it (K 5, n-grams of 2-4 tokens): its own matching function."""
    K, MIN_N, MAX_N = 5, 2, 4

    def draft(self, batch, made, got):
        from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as find

        out = []
        for k in batch:
            d = self.data[k]
            seq = np.asarray(d["prompt"] + d["cont"][:made[k]], dtype=np.int32)
            out.append(find(seq, self.MIN_N, self.MAX_N, 1 << 20, self.K).tolist())
        return out

    __call__ = VllmSuffix.__call__  # a chain's greedy verification


class Ours(Plain):
    """MultiBranchProposer's driver as the engine runs it (host_replay's port; the clock is the simulated one)."""

    def __init__(self, data, names, driver, port, clock, step_s):
        super().__init__(data)
        self.names, self.driver, self.port, self.clock, self.step_s = names, driver, port, clock, step_s
        self.medusa = "medusa" in driver.drafter.pools
        self.plen = [len(d["prompt"]) for d in data]
        self.token_ids = np.zeros((len(data), max(self.plen) + 512), dtype=np.int32)
        for k, d in enumerate(data):
            self.token_ids[k, :self.plen[k]] = d["prompt"]
        self.pending = None  # the last step's batch, for the port's results

    def start(self, batch):
        from vllm_adaspec.step import Taps

        self.port.verified_rows, self.port.results = None, {}
        self.port.taps = Taps(hidden=torch.stack([self.data[k]["hidden"][self.plen[k] - 1] for k in batch])
                              if self.medusa else None)

    def draft(self, batch, made, got):
        port = self.port
        for k in batch:
            s = self.plen[k] + made[k]
            self.token_ids[k, s - len(got[k]):s] = got[k]
        port.req_ids = [self.names[k] for k in batch]
        port.num_prompt = np.array([self.plen[k] for k in batch])
        port.temperature = np.zeros(len(batch), dtype=np.float32)
        num_tokens = np.array([self.plen[k] + made[k] for k in batch])
        self.made = made
        return self.driver.propose([got[k] for k in batch], num_tokens, self.token_ids[batch])

    def before(self, batch, drafts, new, done):
        names = self.names
        scheduled = {names[k]: 1 + len(d) for k, d in zip(batch, drafts)}
        scheduled.update({names[k]: self.plen[k] for k in new})
        self.spec = {names[k]: d for k, d in zip(batch, drafts) if d}
        self.driver.on_schedule(scheduled, self.spec, [names[k] for k in done],
                                {names[k]: self.data[k]["prompt"] for k in new})
        self.driver.while_forward()  # as the worker, once vLLM launched the forward
        self.rows, self.results, self.lens = 0, {}, []
        self.port.req_ids = [names[k] for k in batch + new]

    def __call__(self, k, at, d):
        plan = self.driver.plans.get(self.names[k])
        cont = self.data[k]["cont"]
        path, tree = hr.accepted_path(plan.scheduled(len(d)), cont, at) if d else ([], False)
        got = [plan.tokens[j] for j in path] + [cont[at + len(path)]]
        if tree:
            self.results[len(self.lens)] = (path, got[-1], ())
        self.lens.append(len(d))
        return got, tree

    def after(self, batch, new, got):
        from vllm_adaspec.step import Taps

        self.clock.offset = self.clock_total  # the driver's clock: the simulated forwards so far
        port = self.port
        port.results, port.verified_rows = self.results, self.lens + [0] * len(new)
        port.taps = (hr.hidden_taps(self.data, batch + new, self.plen, self.made, got, port.verified_rows, self.results)
                     if self.medusa else Taps())


def mark_truth(trie, truth: list[int]) -> None:
    """Score a trie's nodes by the continuation `truth` (the tokens after its root): a node on it ~1, off it ~0
    (not 1 / 0: the cost model still weighs rows against a finite gain), path probabilities their products."""
    on: list[bool] = []
    for n, (tok, parent, depth) in enumerate(zip(trie.tokens, trie.parents, trie.depth)):
        on.append((parent < 0 or on[parent]) and depth <= len(truth) and tok == truth[depth - 1])
        trie.cond[n] = 0.999 if on[n] else 0.001
        trie.path[n] = trie.cond[n] * (trie.path[parent] if parent >= 0 else 1.0)


def oracle_scores(score, data, names, ours):
    """The drafter's `score` with every node re-scored by the request's known continuation from its position."""
    index = {name: k for k, name in enumerate(names)}

    def scored(req_id, candidates, state):
        trie = score(req_id, candidates, state)
        k = index[req_id]
        mark_truth(trie, data[k]["cont"][ours.made[k]:])
        return trie

    return scored


def replay_ours(data, by_type, names, settings: dict, model, batch_size, max_tokens, step_s, heads,
                warm: dict | None = None, other_s=None) -> dict:
    """warm: {type: requests} run first by a driver of their own, whose calibration counts the measured driver then
    starts from (settings' "warm_calibration": true)."""
    import copy

    import vllm_adaspec.proposers.driver as driver_mod

    settings = dict(settings)
    use_warm = settings.pop("warm_calibration", False)
    counts = None
    if use_warm and warm:
        first = replay_ours(data, warm, names, settings, model, batch_size, max_tokens, step_s, heads)
        counts = first.pop("calibration")
    env = settings.pop("env", {})
    trees = settings.pop("trees", True)  # false: chains only (an engine without a tree path)
    oracle = settings.pop("oracle", False)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    clock = hr.SimClock(simulated=True)
    real_time = driver_mod.time
    driver_mod.time = types.SimpleNamespace(perf_counter=clock.perf_counter, time=lambda: clock.offset)
    try:
        from vllm_adaspec.observers import CostAudit

        port = hr.ReplayPort(heads)
        audit = CostAudit()
        port.observers.append(audit)
        driver = hr.make_driver(model, settings, port, device="cpu", trees=trees,
                                k=settings.get("tree", {}).get("budget", 16))  # (as bench_e2e sets K)
        if counts is not None:
            driver.drafter.calibration.counts = copy.deepcopy(counts)
        ours = Ours(data, names, driver, port, clock, step_s)
        if oracle:
            driver.drafter.score = oracle_scores(driver.drafter.score, data, names, ours)
        out = {}
        total = [0.0]

        def timed(*a):  # the step's seconds also advance the driver's clock
            s = step_s(*a)
            total[0] += s
            ours.clock_total = total[0]
            return s

        for ds, ks in by_type.items():
            ours.start(ks[:batch_size])
            ours.clock_total = total[0]
            seen = set(audit.rounds)
            out[ds] = run_queue(data, ks, batch_size, max_tokens, ours.draft, ours, timed, other_s)
            rounds = [r for rid in set(audit.rounds) - seen for r in audit.rounds[rid]]
            out[ds]["expected / committed"] = sum(r[0] for r in rounds) / max(1, sum(r[1] for r in rounds))
            out[ds]["proposals"] = len(rounds)
        out["reliability"] = audit.reliability
        out["calibration"] = driver.drafter.calibration.counts
        return out
    finally:
        driver_mod.time = real_time
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--datasets", nargs="+", default=["mix"])
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per type")
    p.add_argument("--offset", type=int, default=7, help="skip each type's first prompts (unseen ones: 7 on)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--settings", nargs="+", default=["{}"], help="MultiBranchProposer settings, JSON each "
                   "(an \"env\" key sets environment variables for that replay; \"oracle\": true scores candidates "
                   "by the known continuation)")
    p.add_argument("--warm", type=int, default=0, help="prompts before --offset of each type a settings' "
                   "\"warm_calibration\": true replays first, in a driver of its own, to start from its calibration")
    p.add_argument("--unit", type=float, default=0.0309, help="seconds of a plain one-request step (this machine's)")
    p.add_argument("--prefill", type=float, default=0.042,
                   help="a prompt token's prefill, in plain one-request steps (this machine, batch 8: ~1.3 ms)")
    p.add_argument("--ours-host-ms", type=float, nargs=2, default=[1.3, 0.18], metavar=("STEP", "REQUEST"),
                   help="our drafter's host work a step: ms per step and per decoding request (profile_step.py)")
    p.add_argument("--suffix-host-ms", type=float, nargs=2, default=[0.11, 0.03], metavar=("STEP", "REQUEST"),
                   help="vLLM suffix's proposer a step (profile_step.py)")
    p.add_argument("--decode-only", action="store_true", help="count the verification steps alone")
    p.add_argument("--ngram", action="store_true", help="also vLLM's ngram (K 5, n 2-4; host work as suffix's)")
    p.add_argument("--truth", choices=("measured", "prior"), default="measured",
                   help="the simulated step: this machine's measured compiled curve, or the cost model's CPU prior")
    p.add_argument("--out", default=None, help="JSON of every cell")
    p.add_argument("--reliability", action="store_true", help="also print each replay's reliability table")
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    from vllm_adaspec.data.prompts import WORKLOAD_MIX, load_prompts
    from vllm_adaspec.models import resolve_model

    model = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(model)
    sets = [d for ds in args.datasets for d in (WORKLOAD_MIX if ds == "mix" else [ds])]
    data, by_type, warm = [], {}, {}
    for ds in sets:  # (cached per type: any choice of types reuses them)
        got = load_prompts(ds, args.offset + args.num_prompts, tokenizer=tok)[args.offset:]
        by_type[ds] = list(range(len(data), len(data) + len(got)))
        data += hr.continuations(model, got, args.max_tokens, ROOT / "benchmarks" / "out")
    for ds in sets if args.warm else ():  # the prompts before --offset: a warm-up set ("warm_calibration")
        got = load_prompts(ds, args.offset, tokenizer=tok)[args.offset - args.warm:]
        warm[ds] = list(range(len(data), len(data) + len(got)))
        data += hr.continuations(model, got, args.max_tokens, ROOT / "benchmarks" / "out")
    names = [f"r{k}" for k in range(len(data))]
    heads_once = hr.replay_heads(model, data)
    step_s = cpu_step(args.unit, args.truth)

    def other(host_ms):  # a method's host work each step (ms: per step, per decoding request) and the prefills
        per_step, per_request = host_ms if not args.decode_only else (0.0, 0.0)
        prefill = 0.0 if args.decode_only else args.prefill * args.unit
        return lambda requests, prompt_tokens: (1e-3 * (per_step + per_request * requests) if requests else 0.0) \
            + prefill * prompt_tokens

    cells = {}
    baselines = [("plain", Plain(data), (0.0, 0.0))] + ([("ngram", VllmNgram(data), args.suffix_host_ms)]
                                                      if args.ngram else []) \
        + [("suffix", VllmSuffix(data, names), args.suffix_host_ms)]
    for name, method, host in baselines:
        cells[name] = {ds: run_queue(data, ks, args.batch_size, args.max_tokens, method.draft, method, step_s,
                                     other(host)) for ds, ks in by_type.items()}
    for s in args.settings:
        settings = json.loads(s)
        host = settings.pop("host_ms", args.ours_host_ms)  # this replay's own host work, where it differs
        cells[f"ours {s}"] = replay_ours(data, by_type, names, settings, model, args.batch_size, args.max_tokens,
                                         step_s, heads_once, warm, other(host))
        print(f"[replay] {s} done", file=sys.stderr, flush=True)

    rel = {m: per.pop("reliability") for m, per in cells.items() if "reliability" in per}
    for per in cells.values():
        per.pop("calibration", None)
    for per in cells.values():
        for ds, c in per.items():
            ok = all(out == data[k]["cont"][:len(out)] and len(out) >= min(args.max_tokens, len(data[k]["cont"]))
                     for k, out in c.pop("output").items())
            assert ok, f"{ds}: a replay committed other tokens than the continuation"
    speed = {m: {ds: c["tokens"] / c["engine_seconds"] for ds, c in per.items()} for m, per in cells.items()}
    head = "| task type | " + " | ".join(f"{m}: tau, drafted / forward, x plain" for m in cells if m != "plain") \
        + " | " + " | ".join(f"{m} / suffix" for m in cells if m.startswith("ours")) + " |"
    lines = [f"batch {args.batch_size}, prompts {args.offset}-{args.offset + args.num_prompts - 1} of each type, "
             + ("simulated CPU steps, decode only" if args.decode_only else
              f"simulated CPU steps, prefills ({args.prefill} of a step a prompt token) and host work (ours "
              f"{args.ours_host_ms[0]} + {args.ours_host_ms[1]} ms a request, suffix {args.suffix_host_ms[0]} + "
              f"{args.suffix_host_ms[1]}) counted"), "", head, "|---|" + "---|" * (head.count("|") - 2)]
    for ds in list(by_type) + ["mix"]:
        row = []
        for m, per in cells.items():
            if m == "plain":
                continue
            if ds == "mix":
                row.append(f"x{geo([speed[m][d] / speed['plain'][d] for d in by_type]):.3f}")
                continue
            c = per[ds]
            row.append(f"{c['tokens'] / c['forwards']:.2f}, {c['drafted'] / c['forwards']:.2f}, "
                       f"x{speed[m][ds] / speed['plain'][ds]:.3f}"
                       + (f", exp/got {c['expected / committed']:.2f}" if "proposals" in c else ""))
        for m in cells:
            if m.startswith("ours"):
                ds_list = list(by_type) if ds == "mix" else [ds]
                row.append(f"{geo([speed[m][d] / speed['suffix'][d] for d in ds_list]):.3f}")
        lines.append(f"| {ds} | " + " | ".join(row) + " |")
    if args.reliability:
        from audit_cost_model import reliability_table

        for m, r in rel.items():
            lines += ["", f"{m}: acceptance of verified nodes by calibrated path probability", "",
                      reliability_table(r)]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "cells": cells}, indent=1))
    return 0


def geo(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


if __name__ == "__main__":
    sys.exit(main())
