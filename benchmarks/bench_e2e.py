"""End-to-end speed of every method in one run: plain decoding, vLLM ngram, vLLM suffix, adaspec early exit.

Each method runs in its own engine (a child process, same settings otherwise) over the same prompt sets, batch
sizes and repeats. Reported per (dataset, batch size, method): median tokens/s over repeats, speedup over plain,
tau (tokens committed per target forward = generated / (generated - accepted drafts)), drafts accepted, and
whether the greedy outputs equal plain decoding's.

    .venv/bin/python benchmarks/bench_e2e.py --num-prompts 8 --repeats 3 --ks 1 2 3 5 8

adaspec rows use `--exit-head` (default "auto": the shipped head and its N; "none": the untrained exit; a folder,
or a pattern with {n} for one trained head per N). Also reported: top-1 agreement inside vLLM (acceptance of the
first draft), acceptance rate, and EESD's HM = 2 v r / (v + r) with v = accepted / drafted and r = accepted /
generated. With several K a plot of speedup against K is written next to the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

from vllm_adaspec.data.prompts import WORKLOAD_MIX, load_prompts
from vllm_adaspec.harness import run_engine
from vllm_adaspec.models import resolve_model


def methods(args) -> dict[str, dict]:
    out = {"plain": {}}
    if "plain-sync" in args.methods:
        # vLLM turns async scheduling on for plain decoding and off for custom, ngram and suffix drafters; this
        # row separates that difference from drafting.
        out["plain-sync"] = {"async_scheduling": False}
    if "spec-idle" in args.methods:
        # A speculative engine that drafts nothing (vLLM's ngram looking for a 64-token repeat): what vLLM's
        # speculative path costs by itself, apart from any drafter's work.
        out["spec-idle"] = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 1,
                                                   "prompt_lookup_max": 64, "prompt_lookup_min": 64}}
    if "ngram" in args.methods:
        out["ngram"] = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 5,
                                               "prompt_lookup_max": 4, "prompt_lookup_min": 2}}
    if "suffix" in args.methods:
        # vLLM's suffix decoding at its defaults (K = 24, 10000 cached responses): what its users run. Its cache of
        # past responses (and our suffix pool's) would replay a prompt seen before: each engine sees each prompt
        # once (one engine per batch size; --repeats > 1 warns).
        out["suffix"] = {"speculative_config": {"method": "suffix",
                                                "suffix_decoding_max_cached_requests": args.suffix_cached_requests}}
    if "medusa" in args.methods:
        # vLLM's own Medusa (a top-1 chain of the heads) on our heads exported to its layout
        # (`adaspec train medusa --export-vllm DIR`).
        if not args.vllm_medusa:
            raise SystemExit("method 'medusa' needs --vllm-medusa DIR (heads in vLLM's medusa layout)")
        k = json.load(open(f"{args.vllm_medusa}/config.json"))["num_heads"]
        out["vllm medusa"] = {"speculative_config": {"method": "medusa", "model": args.vllm_medusa,
                                                     "num_speculative_tokens": k}}
    if "multibranch" in args.methods:
        for spec in args.mb:
            # MultiBranchProposer: K = the node budget; cost model as given (default online). "requests": per-request
            # controls every request of the row carries (controls.py), e.g. {"adaspec_speculation": "chain"}.
            settings = json.loads(spec)
            requests = settings.pop("requests", None)
            env = settings.pop("env", None)  # variables for this row's engine (e.g. a VLLM_ADASPEC_* switch)
            budget = settings.get("tree", {}).get("budget", 16)
            n, length = settings.get("branches", 0), settings.get("branch_length", 4)
            label = "multibranch " + "+".join(settings.get("pools", ["default"])) + f" B={budget}" + (
                " guard off" if settings.get("speed_guard") is False else "") + (
                f" cost {settings['cost_model']}" if "cost_model" in settings else "") + (
                f" branches N={n} L={length}" + (" random" if settings.get("branch_init") == "random" else "")
                if n else "") + ("".join(f" {k.removeprefix('adaspec_')}={v}" for k, v in requests.items())
                                 if requests else "") + ("".join(f" {k.removeprefix('VLLM_ADASPEC_')}={v}"
                                                                 for k, v in env.items()) if env else "")
            # Self-Draft branch rows are drafts to vLLM's scheduler: K = node budget + N * L
            out[label] = {"speculative_config": {"model": "vllm_adaspec.MultiBranchProposer",
                                                 "num_speculative_tokens": budget + n * length},
                          "additional_config": {"adaspec": settings},
                          **({"requests": requests} if requests else {}), **({"env": env} if env else {})}
            if args.unpruned:  # the same, structured-output requests' candidates not checked against the grammar
                out[label + " unpruned"] = {**out[label], "env": {"VLLM_ADASPEC_GRAMMAR_PRUNING": "0"}}
    if "adaspec" in args.methods:
        for n in args.exit_layers or [None]:
            head = args.exit_head.format(n=n) if "{n}" in args.exit_head else args.exit_head
            for k in args.ks:
                # Fixed K: no cost model, so the row measures drafting K every step.
                settings = {"exit_head": head, "cost_model": "off", **({"exit_layer": n} if n is not None else {})}
                label = "adaspec-ee" + (f" N={n}" if n is not None else "") + f" K={k}"
                out[label] = {
                    "speculative_config": {"model": "vllm_adaspec.EarlyExitProposer", "num_speculative_tokens": k},
                    "additional_config": {"adaspec": settings},
                }
        for pol in args.policies:
            # A policy with K = --policy-k as its ceiling, no cost model: the row measures the policy's own choices.
            spec = json.loads(pol) if pol.startswith("{") else pol
            name = spec if isinstance(spec, str) else spec["name"]
            out[f"adaspec policy {name} (K={args.policy_k})"] = {
                "speculative_config": {"model": "vllm_adaspec.EarlyExitProposer",
                                       "num_speculative_tokens": args.policy_k},
                "additional_config": {"adaspec": {"exit_head": args.exit_head, "cost_model": "off",
                                                  "policy": spec}},
            }
        for spec in args.trees:
            # Tree mode at a node budget B (K = B drafts verified), no cost model; compare with the chain row K = B.
            tree = json.loads(spec)
            label = f"adaspec tree B={tree['budget']} top-k={tree.get('top_k', 2)}" + "".join(
                f" {key}={tree[key]}" for key in ("depth", "max_depth", "second_top_k") if key in tree)
            if tree.get("builder") == "c2t":
                label = label.replace("adaspec tree", "adaspec c2t") + f" beta={tree.get('beta', 0.5)}"
            out[label] = {
                "speculative_config": {"model": "vllm_adaspec.EarlyExitProposer",
                                       "num_speculative_tokens": tree["budget"]},
                "additional_config": {"adaspec": {"exit_head": args.exit_head, "cost_model": "off", "tree": tree}},
            }
        for spec in args.ee:
            # EarlyExitProposer with these settings (cost model on unless they turn it off); "k": its K (default 3)
            settings = json.loads(spec)
            k = settings.pop("k", 3)
            label = f"early-exit K={k} " + " ".join(
                f"{key}={os.path.basename(str(v).rstrip('/'))}" for key, v in settings.items())
            out[label.strip()] = {
                "speculative_config": {"model": "vllm_adaspec.EarlyExitProposer", "num_speculative_tokens": k},
                "additional_config": {"adaspec": settings},
            }
        if args.default_k:
            out[f"adaspec default (cost model, K={args.default_k})"] = {
                "speculative_config": {"model": "vllm_adaspec.EarlyExitProposer",
                                       "num_speculative_tokens": args.default_k},
                "additional_config": {"adaspec": {"exit_head": args.exit_head}},
            }
    return out


def flop_share(cfg: dict, n: int, exit_layers: int, draft_vocab: int) -> float:
    """FLOPs of one draft step / one target step per token (weights only: layers run + LM-head rows)."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or h // heads
    layer = h * d * (2 * heads + 2 * kv) + 3 * h * i
    return ((n + exit_layers) * layer + draft_vocab * h) / (cfg["num_hidden_layers"] * layer + cfg["vocab_size"] * h)


def calls(prompts: dict[str, list[str]], batch_sizes: list[int], repeats: int, max_tokens: int,
          temperature: float = 0.0, extra: dict[str, list[dict]] | None = None) -> list[dict]:
    """One entry per generate() call, tagged with (repeat, dataset, batch size). Sampled runs seed each prompt
    (seed = its index), the same in every method. extra: per dataset, per prompt, more sampling settings."""
    out = []
    for r in range(repeats):
        for ds, ps in prompts.items():
            more = (extra or {}).get(ds) or [{}] * len(ps)
            for bs in batch_sizes:
                for i in range(0, len(ps), bs):
                    params = [{"temperature": temperature, "max_tokens": max_tokens, **more[i + j],
                               **({"seed": i + j} if temperature > 0 else {})} for j in range(len(ps[i:i + bs]))]
                    out.append({"prompts": ps[i:i + bs], "params": params, "tag": [r, ds, bs, i]})
    return out


def summarize(runs: list[dict], tags: list[list], plain_ids: dict | None) -> dict:
    """Aggregate the per-call runs of one method into per-(dataset, batch size) rows."""
    cells: dict[tuple, dict] = {}
    for run, (r, ds, bs, i) in zip(runs, tags):
        c = cells.setdefault((ds, bs), {"reps": {}, "ids": {}})
        rep = c["reps"].setdefault(r, {"tokens": 0, "seconds": 0.0, "drafts": 0, "draft_tokens": 0, "accepted": 0,
                                       "draft_seconds": 0.0, "draft_passes": 0, "accepted_first": 0,
                                       "policy_seconds": 0.0, "c2t_seconds": 0.0, "branch_rows": 0,
                                       "decode_rows": 0})
        rep["tokens"] += sum(len(t) for t in run["token_ids"])
        rep["seconds"] += run["seconds"]
        m = run["metrics"]
        rep["drafts"] += m.get("vllm:spec_decode_num_drafts", 0)
        rep["draft_tokens"] += m.get("vllm:spec_decode_num_draft_tokens", 0)
        rep["accepted"] += m.get("vllm:spec_decode_num_accepted_tokens", 0)
        rep["accepted_first"] += (m.get("vllm:spec_decode_num_accepted_tokens_per_pos") or [0])[0]
        rep["draft_seconds"] += run.get("adaspec", {}).get("draft_seconds", 0.0)
        rep["draft_passes"] += run.get("adaspec", {}).get("draft_passes", 0)
        rep["policy_seconds"] += run.get("adaspec", {}).get("policy_seconds", 0.0)
        rep["c2t_seconds"] += run.get("adaspec", {}).get("c2t_seconds", 0.0)
        rep["branch_rows"] += run.get("adaspec", {}).get("branch_rows", 0)  # Self-Draft rows: drafts to vLLM
        rep["grammar_pruned"] = rep.get("grammar_pruned", 0) + run.get("adaspec", {}).get("grammar_pruned", 0)
        rep["decode_rows"] += run.get("adaspec", {}).get("decode_rows", 0)  # target forwards over requests
        rep["forwards"] = rep.get("forwards", 0) + m.get("adaspec:forwards", 0)  # the same, counted by the scheduler
        lengths = run.get("adaspec", {}).get("round_lengths")
        if lengths:
            rep["round_lengths"] = [a + b for a, b in zip(rep.get("round_lengths", [0] * len(lengths)), lengths)]
        if r == 0:
            for j, t in enumerate(run["token_ids"]):
                c["ids"][i + j] = t
    rows = {}
    for (ds, bs), c in cells.items():
        reps = list(c["reps"].values())
        rep = reps[0]
        # Draft cost c = one draft pass / one target step. At batch 1 each committed round is one target forward.
        # tokens per target forward (forwards that drafted nothing included), counted by the scheduler for every
        # method; vLLM's accepted-draft counter would overstate it (it counts drafts accepted past a stop)
        forwards = rep.get("forwards") or rep["decode_rows"] or max(1, rep["tokens"] - rep["accepted"])
        target_step = (rep["seconds"] - rep["draft_seconds"]) / forwards
        c_cost = (rep["draft_seconds"] / rep["draft_passes"]) / target_step if rep["draft_passes"] and bs == 1 else None
        verified = rep["draft_tokens"] - rep["branch_rows"]  # drafts vLLM counted, less the unverified branch rows
        v = rep["accepted"] / verified if verified else 0.0
        r_d = rep["accepted"] / max(1, rep["tokens"])
        rows[f"{ds}|{bs}"] = {
            "seconds_total": rep["seconds"], "draft_seconds_total": rep["draft_seconds"],
            "draft_passes_total": rep["draft_passes"],
            "agree1": rep["accepted_first"] / rep["drafts"] if rep["drafts"] else None,
            "accept_rate": v,
            "hm": 2 * v * r_d / (v + r_d) if v + r_d else 0.0,
            "draft_share": rep["draft_seconds"] / rep["seconds"],
            "policy_share": rep["policy_seconds"] / rep["seconds"],
            "classifier_share": rep["c2t_seconds"] / rep["seconds"],
            # verified drafts (tree nodes) per drafting step: C2T's gamma
            "gamma": verified / rep["drafts"] if rep["drafts"] else 0.0,
            # candidate nodes a structured-output request's grammar forbade before choosing, per drafting step
            "grammar_pruned": rep.get("grammar_pruned", 0) / rep["drafts"] if rep["drafts"] else 0.0,
            # Self-Draft: branch rows per target forward (rows the forward runs besides the root and the nodes)
            "extra_rows": rep["branch_rows"] / forwards,
            "draft_cost_c": c_cost,
            "round_lengths": rep.get("round_lengths"),
            "tok_s": statistics.median(x["tokens"] / x["seconds"] for x in reps),
            "tok_s_all": [x["tokens"] / x["seconds"] for x in reps],
            "tokens": rep["tokens"],
            "tau": rep["tokens"] / forwards,
            "drafts": rep["drafts"],
            "draft_tokens": rep["draft_tokens"],
            "accepted": rep["accepted"],
            "identical": None if plain_ids is None else sum(
                c["ids"][k] == plain_ids[f"{ds}|{bs}"][k] for k in c["ids"]),
            "n": len(c["ids"]),
            "ids": c["ids"],
        }
    return rows


def markdown(results: dict, args) -> str:
    lines = [
        "| dataset | batch | method | tok/s (median) | speedup (median, range over rounds) | tau | gamma (verified / step) |"
        " top-1 agreement | accepted / drafted | HM |"
        " drafts / round | drafting share of time | policy share of time | draft cost c | identical to plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    plain = results["plain"]
    for key in plain:
        ds, bs = key.split("|")
        for name, rows in results.items():
            row = rows[key]
            speed = f"{row['speedup']:.2f}x"
            if len(row["speedup_rounds"]) > 1:
                speed += f" ({min(row['speedup_rounds']):.2f}-{max(row['speedup_rounds']):.2f})"
            acc = f"{row['accepted']} / {row['draft_tokens']}" if row["draft_tokens"] else "-"
            share = f"{row['draft_share']:.0%}" if row["draft_share"] else "-"
            pshare = f"{row['policy_share']:.1%}" if row.get("policy_share") else "-"
            if row.get("classifier_share"):
                pshare += f" (classifier {row['classifier_share']:.1%})"
            gamma = f"{row['gamma']:.2f}" if row.get("gamma") else "-"
            if row.get("grammar_pruned"):
                gamma += f" ({row['grammar_pruned']:.1f} pruned)"
            c_cost = f"{row['draft_cost_c']:.2f}" if row["draft_cost_c"] else "-"
            if row.get("flop_share") and row["draft_cost_c"]:
                c_cost += f" ({row['draft_cost_c'] / row['flop_share']:.1f}x FLOP share {row['flop_share']:.2f})"
            agree = f"{row['agree1']:.1%}" if row.get("agree1") is not None else "-"
            hm = f"{row['hm']:.1%}" if row["draft_tokens"] else "-"
            rl = row.get("round_lengths")
            per_round = f"{sum(i * c for i, c in enumerate(rl)) / sum(rl):.2f}" if rl and sum(rl) else "-"
            same = f"{row['identical']}/{row['n']}" if args.temperature == 0 else "n/a (sampled)"
            lines.append(f"| {ds} | {bs} | {name} | {row['tok_s']:.1f} | {speed} | {row['tau']:.2f} | {gamma} | {agree} | "
                         f"{acc} | {hm} | {per_round} | {share} | {pshare} | {c_cost} | {same} |")
    return "\n".join(lines)


def annotate_exit(rows: dict, runs: list[dict], model: str) -> None:
    """Add the exit settings the drafter reported and the FLOP share of its draft step to each row."""
    cfg_used = next((r.get("adaspec", {}).get("config") for r in runs if r.get("adaspec", {}).get("config")), None)
    if not cfg_used or "exit_layer" not in cfg_used:  # (model-free proposers have no draft model)
        return
    with open(Path(model) / "config.json") as f:
        hf = json.load(f)
    n_exit, vocab = 0, hf["vocab_size"]
    if cfg_used.get("exit_head"):
        with open(Path(cfg_used["exit_head"]) / "exit_head.json") as f:
            meta = json.load(f)
        n_exit, vocab = meta["num_exit_layers"], meta["draft_vocab_size"]
    share = flop_share(hf, cfg_used["exit_layer"], n_exit, vocab)
    for v in rows.values():
        v["flop_share"] = share
        v["exit"] = cfg_used


def merge_rounds(per_round: list[dict], todo: dict) -> dict:
    """Round 1's rows (acceptance, tau, costs), with tok/s and speedup as medians over the rounds and identity
    as the worst round's."""
    # every round's rates read before any row is overwritten: round 1's rows are the merged rows, and plain's
    # (merged first) must not divide the others' round-1 rates by its median
    rates = {(name, key): [r[name][key]["tok_s"] for r in per_round] for name in todo for key in per_round[0][name]}
    identical = {(name, key): min(r[name][key]["identical"] for r in per_round) for name, key in rates}
    results = {name: per_round[0][name] for name in todo}
    for name, rows in results.items():
        for key, row in rows.items():
            ratios = [a / b for a, b in zip(rates[name, key], rates["plain", key])]
            row["tok_s_rounds"], row["speedup_rounds"] = rates[name, key], ratios
            row["tok_s"], row["speedup"] = statistics.median(rates[name, key]), statistics.median(ratios)
            row["identical"] = identical[name, key]
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--datasets", nargs="+", default=["mix"],
                   help="prompt sets (vllm_adaspec.data.PROMPT_SETS); 'mix' = the workload mix: " + ", ".join(WORKLOAD_MIX))
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="generate() passes per engine (median)")
    p.add_argument("--rounds", type=int, default=1,
                   help="fresh engines per method, in alternating order; speedup = median of per-round ratios")
    p.add_argument("--methods", nargs="+", default=["plain", "ngram", "suffix", "adaspec"])
    p.add_argument("--exit-layers", type=int, nargs="+", default=None,
                   help="N values (default: the exit head's own N)")
    p.add_argument("--default-k", type=int, default=3,
                   help="also run the default settings (shipped head, cost model on) with this K; 0 = skip")
    p.add_argument("--exit-head", default="auto", help="'auto', 'none', a checkpoint folder, or a pattern with {n}")
    p.add_argument("--ks", type=int, nargs="*", default=[3], help="fixed-K rows (no cost model); none: only the default row")
    p.add_argument("--suffix-cached-requests", type=int, default=10000,
                   help="vLLM suffix decoding's cross-request response cache (its default: 10000)")
    p.add_argument("--policies", nargs="*", default=[],
                   help="adaptive policy rows (names or JSON objects), each with K = --policy-k and no cost model")
    p.add_argument("--policy-k", type=int, default=10)
    p.add_argument("--trees", nargs="*", default=[],
                   help='tree-mode rows, JSON each: \'{"budget": 8, "top_k": 2}\' (K = budget, no cost model)')
    p.add_argument("--ee", nargs="*", default=[],
                   help='EarlyExitProposer rows (method "adaspec"), JSON each: \'{"exit_head": "DIR", "k": 1, '
                        '"cost_model": "off"}\' (k: its K, default 3; the other keys: its settings)')
    p.add_argument("--vllm-medusa", default=None, help="folder of heads in vLLM's medusa layout (method 'medusa')")
    p.add_argument("--mb", nargs="*", default=['{}'],
                   help='MultiBranchProposer rows (method "multibranch"), JSON each: \'{"pools": ["context", "suffix"], '
                        '"tree": {"budget": 8}}\' (K = budget; default settings: {})')
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: seeded sampling (seed = prompt index)")
    p.add_argument("--structured", action="store_true",
                   help="the agent loop's replies under their tool-call JSON schema (structured output)")
    p.add_argument("--unpruned", action="store_true",
                   help="with --structured: each multibranch row again with grammar pruning off")
    p.add_argument("--dtype", default="float32", help="float32: this CPU has no native bf16 (AVX2), where bf16 is several times slower")
    p.add_argument("--eager", action="store_true", help="enforce_eager (default: vLLM's compiled mode, as users run)")
    p.add_argument("--offset", type=int, default=0,
                   help="--interleave: skip each set's first prompts (earlier benchmarks ran the first 8)")
    p.add_argument("--interleave", action="store_true",
                   help="every method's engine kept alive side by side; each call (a batch of prompts) runs through "
                        "every engine in turn, the order alternating from call to call; every round new prompts "
                        "(--num-prompts per type and round); per type the median over rounds of each round's "
                        "ratio to plain, and its range")
    p.add_argument("--out", default="benchmarks/out/bench_e2e.json")
    args = p.parse_args(argv)

    model = resolve_model(args.model)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    datasets = [d for ds in args.datasets for d in (WORKLOAD_MIX if ds == "mix" else [ds])]
    if args.interleave:
        return interleaved(args, model, tok, datasets)
    prompts = {ds: load_prompts(ds, args.num_prompts, tokenizer=tok) for ds in datasets}
    if args.repeats > 1:
        print("warning: --repeats > 1 runs every prompt again in the same engine, where vLLM's suffix cache and "
              "adaspec's suffix pool replay their earlier outputs: use --rounds (fresh engines)", file=sys.stderr)
    # one engine per (method, batch size): a batch size never meets prompts another one already ran
    extra = {}
    if args.structured and "agent" in prompts:
        from vllm_adaspec.data.mix import agent_call_schemas

        extra["agent"] = [{"structured_outputs": {"json": schema}} for schema in agent_call_schemas(args.num_prompts)]
    plans = {bs: calls(prompts, [bs], args.repeats, args.max_tokens, args.temperature, extra)
             for bs in args.batch_sizes}
    tags = {bs: [c.pop("tag") for c in plan] for bs, plan in plans.items()}
    engine = engine_settings(args)
    warmup = {"prompts": ["Hello"], "params": [{"temperature": 0.0, "max_tokens": 8}]}

    # Rounds: every method once per round, in alternating order, each in a fresh engine. This machine's speed
    # drifts by 10-20% over minutes (shared host), so speedups are per-round ratios against the same round's plain
    # run, and the table reports their median; tok/s is the median over rounds of each round's median.
    todo = methods(args)
    plain_ids = None
    per_round: list[dict[str, dict]] = []
    bar = tqdm(total=args.rounds * len(todo) * len(plans), desc="engines", file=sys.stderr)
    for rnd in range(args.rounds):
        order = list(todo) if rnd % 2 == 0 else list(reversed(todo))  # round 1 runs plain first: reference ids
        results: dict[str, dict] = {}
        for name in order:
            rows = {}
            for bs, plan in plans.items():
                t0 = time.perf_counter()
                spec = dict(todo[name])
                env = spec.pop("env", {})
                requests = spec.pop("requests", None)
                batches = plan if not requests else [{**c, "params": [{**p_, "extra_args": requests}
                                                                      for p_ in c["params"]]} for c in plan]
                res = run_engine({"model": model, "engine": {**engine, **spec}, "batches": [warmup] + batches,
                                  "env": env})
                runs = [b["runs"][0] for b in res["batches"][1:]]
                rows.update(summarize(runs, tags[bs], plain_ids))
                annotate_exit(rows, runs, model)
                bar.update()
                tqdm.write(f"round {rnd + 1}: {name} batch {bs}: {time.perf_counter() - t0:.0f}s", file=sys.stderr)
            if name == "plain" and plain_ids is None:  # later rounds' plain runs are checked against round 1
                plain_ids = {k: v["ids"] for k, v in rows.items()}
                for v in rows.values():
                    v["identical"] = v["n"]
            results[name] = rows
        per_round.append(results)
    bar.close()
    results = merge_rounds(per_round, todo)

    table = markdown(results, args)
    if len({key.split("|")[0] for key in results["plain"]}) > 1:
        table = mix_table(results) + "\n\nEvery cell:\n\n" + table
    if any(k.startswith("adaspec-ee") for k in results):
        table += "\n\nBreak-even at batch 1 (first repeat):\n\n" + break_even(results)
    if any(" branches N=" in name for name in results):
        table += "\n\nSelf-Draft branches (tau: tokens per target forward; extra rows: branch rows per forward):\n\n"
        table += branch_table(results)
    write(args, results, table)
    if len(args.ks) > 1 or args.policies:
        plot_k_sweep(results, Path(args.out).with_suffix(".png"))
    if any(name.startswith(("adaspec tree", "adaspec c2t")) for name in results):
        plot_tau_gamma(results, Path(args.out).with_name(Path(args.out).stem + "_tau_gamma.png"))
    if any(" branches N=" in name for name in results):
        plot_branch_heatmap(results, Path(args.out).with_name(Path(args.out).stem + "_branches.png"))
    print(table)
    return 0


def engine_settings(args) -> dict:
    # 512 MiB of KV cache: eight requests of 2048 tokens of SmolLM2 fit, and eight engines side by side fit 24 GiB
    return {"dtype": args.dtype, "max_model_len": 2048, "seed": 0, "kv_cache_memory_bytes": 2**29,
            **({"enforce_eager": True} if args.eager else {})}


def write(args, results: dict, table: str) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for rows in results.values():
        for row in rows.values():
            row.pop("ids", None)
    out.write_text(json.dumps({"args": vars(args), "command": " ".join(sys.argv), "results": results}, indent=1))
    out.with_suffix(".md").write_text(table + "\n")


def interleaved(args, model: str, tok, datasets: list[str]) -> int:
    """--interleave: one engine per method kept alive (harness.EngineSession), each call through every engine in
    turn (the order alternating call by call), new prompts every round (suffix caches never replay a prompt), per
    (type, batch size) each round's ratio to the same round's plain run; the table reports medians over rounds and
    their range (merge_rounds)."""
    from vllm_adaspec.harness import EngineSession, default_env

    todo = methods(args)
    need = args.num_prompts * args.rounds
    prompts = {ds: load_prompts(ds, args.offset + need * len(args.batch_sizes), tokenizer=tok)[args.offset:]
               for ds in datasets}
    for ds, ps in prompts.items():
        if len(ps) < need * len(args.batch_sizes):
            raise SystemExit(f"prompt set {ds!r} has {len(ps)} prompts past --offset {args.offset}; --interleave "
                             f"needs {need * len(args.batch_sizes)} (num-prompts x rounds x batch sizes)")
    engine = engine_settings(args)
    sessions = {}
    t0 = time.perf_counter()
    extras = {}
    for name, spec in todo.items():  # built one after another: compiles of several at once would thrash 2 cores
        spec = dict(spec)
        env = spec.pop("env", {})
        extras[name] = spec.pop("requests", None)
        sessions[name] = EngineSession(model, {**engine, **spec}, env={**default_env(), **env} if env else None)
        sessions[name].wait()
        tqdm.write(f"engine {name}: ready after {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    warm = {"prompts": ["Hello"], "params": [{"temperature": 0.0, "max_tokens": 8}]}
    try:
        for s in sessions.values():
            s.generate(warm)
        per_round = []
        total = args.rounds * sum(len(calls({ds: ps[:args.num_prompts]}, [bs], 1, 1)) for ds, ps in prompts.items()
                                  for bs in args.batch_sizes)
        bar = tqdm(total=total * len(sessions), desc="calls", file=sys.stderr)
        turn = 0
        for rnd in range(args.rounds):
            runs = {name: [] for name in sessions}
            tags = []
            for b_i, bs in enumerate(args.batch_sizes):
                at = (b_i * args.rounds + rnd) * args.num_prompts
                this = {ds: ps[at:at + args.num_prompts] for ds, ps in prompts.items()}
                for call in calls(this, [bs], 1, args.max_tokens, args.temperature):
                    tags.append(call.pop("tag"))
                    order = list(sessions) if turn % 2 == 0 else list(reversed(sessions))
                    turn += 1
                    for name in order:
                        this_call = call if not extras[name] else {**call, "params": [
                            {**p_, "extra_args": extras[name]} for p_ in call["params"]]}
                        runs[name].append(sessions[name].generate(this_call))
                        bar.update()
            plain = summarize(runs["plain"], tags, None)
            plain_ids = {k: v["ids"] for k, v in plain.items()}
            per_round.append({name: summarize(r, tags, plain_ids) for name, r in runs.items()})
            tqdm.write(f"round {rnd + 1}: " + ", ".join(
                f"{name} {statistics.median(v['tok_s'] / per_round[-1]['plain'][k]['tok_s'] for k, v in rows.items()):.2f}x"
                for name, rows in per_round[-1].items() if name != "plain"), file=sys.stderr)
        bar.close()
    finally:
        for s in sessions.values():
            s.close()
    results = merge_rounds(per_round, todo)
    table = mix_table(results) if len(datasets) > 1 else ""
    table += "\n\nEvery cell:\n\n" + markdown(results, args)
    write(args, results, table)
    if args.out and len(datasets) > 1:
        plot_mix(results, Path(args.out).with_suffix(".png"))
    print(table)
    return 0


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def paired_ratios(results: dict, name: str, ref: str, keys: list[str]) -> list[float]:
    """Per round, `name`'s speed over `ref`'s on the same prompts (each round's ratio to its own plain run, so the
    same prompts at the same moment), as the geometric mean over `keys`: what differs between two methods with the
    prompts' own difficulty and the machine's drift of that round divided out. [] without per-round data."""
    rounds = [(results[name][k].get("speedup_rounds"), results[ref][k].get("speedup_rounds")) for k in keys]
    if not rounds or any(not a or not b or len(a) != len(b) for a, b in rounds):
        return []
    return [geomean(a[i] / b[i] for a, b in rounds) for i in range(len(rounds[0][0]))]


def _paired_cell(r: list[float], per_key: dict[str, list[float]]) -> str:
    """The mix's paired ratios `r`: median (range); and the type with the lowest median of `per_key`'s."""
    if not r:
        return "-"
    worst = min(per_key, key=lambda k: statistics.median(per_key[k]))
    return (f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f}); "
            f"{statistics.median(per_key[worst]):.2f}x ({worst.split('|')[0]})")


def mix_table(results: dict) -> str:
    """Per batch size: each task type's speedup over plain (median over rounds, and its range) and tau for every
    method, then the geometric mean over the types (speedup; tau); when vLLM's `suffix` ran, each method against it
    paired by round (`paired_ratios`: the ranges over plain mostly measure how the prompts of each round differ, the
    paired ratio divides that out), over the mix and per type."""
    names = [n for n in results if n != "plain"]
    out = []
    for bs in sorted({int(k.split("|")[1]) for k in results["plain"]}):
        keys = [k for k in results["plain"] if int(k.split("|")[1]) == bs]
        lines = [f"batch {bs}: speedup over plain / tau (tokens per target forward); plain in tok/s", "",
                 "| task type | plain | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        def spread(row) -> str:
            r = row.get("speedup_rounds") or []
            return f" ({min(r):.2f}-{max(r):.2f})" if len(r) > 1 else ""

        for key in keys:
            cells = [f"{results[n][key]['speedup']:.2f}x{spread(results[n][key])} / {results[n][key]['tau']:.2f}"
                     + ("" if results[n][key]["identical"] in (None, results[n][key]["n"]) else
                        f" ({results[n][key]['identical']}/{results[n][key]['n']} identical)") for n in names]
            lines.append(f"| {key.split('|')[0]} | {results['plain'][key]['tok_s']:.1f} | " + " | ".join(cells) + " |")
        lines.append("| **geometric mean** | | " + " | ".join(
            f"**{geomean(results[n][k]['speedup'] for k in keys):.2f}x** / {geomean(results[n][k]['tau'] for k in keys):.2f}"
            for n in names) + " |")
        if "suffix" in results:
            per_key = {n: {k: paired_ratios(results, n, "suffix", [k]) for k in keys} for n in names}
            lines.append("| vs vLLM suffix, paired by round: geo. mean over types, median (range); worst type | | "
                         + " | ".join(_paired_cell(paired_ratios(results, n, "suffix", keys), per_key[n])
                                      for n in names) + " |")
            lines += ["", f"batch {bs}: each method / vLLM suffix on the same prompts in the same round (per type: "
                          "median over rounds, range)", ""]
            lines += _paired_table(results, [n for n in names if n != "suffix"], "suffix", keys)
        ours = min((n for n in names if n.startswith("multibranch default")), key=len, default=None)
        parts = [n for n in names if n.startswith("multibranch") and n != ours]
        if ours and parts:  # the promise: the default never below one of its own parts beyond the spread
            lines += ["", f"batch {bs}: each of ours' other rows / ours' default ({ours}), paired by round (per type "
                          "and over the mix: median over rounds, range)", ""]
            lines += _paired_table(results, parts, ours, keys, mix=True)
        out.append("\n".join(lines))
    return "\n\n".join(out)


def _paired_table(results: dict, names: list[str], ref: str, keys: list[str], mix: bool = False) -> list[str]:
    """Markdown rows: per task type (and with `mix` the geometric mean over them) each of `names` / `ref` paired by
    round (`paired_ratios`), median over rounds (range)."""
    def cell(r: list[float]) -> str:
        return f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})" if r else "-"

    lines = ["| task type | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for key in keys:
        lines.append(f"| {key.split('|')[0]} | " + " | ".join(cell(paired_ratios(results, n, ref, [key]))
                                                             for n in names) + " |")
    if mix:
        lines.append("| **mix** | " + " | ".join(cell(paired_ratios(results, n, ref, keys)) for n in names) + " |")
    return lines


def plot_mix(results: dict, path: Path) -> None:
    """mix_table as a figure: per batch size a panel, per task type a group of bars (every method's speedup over
    plain, the median over rounds) with the rounds' range as a whisker; vLLM's `suffix` dashed per type."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in results if n != "plain"]
    sizes = sorted({int(k.split("|")[1]) for k in results["plain"]})
    fig, axes = plt.subplots(1, len(sizes), figsize=(1.6 + 2.2 * len(results["plain"]), 4.2), squeeze=False)
    width = 0.8 / len(names)
    for ax, bs in zip(axes[0], sizes):
        keys = [k for k in results["plain"] if int(k.split("|")[1]) == bs]
        for j, n in enumerate(names):
            xs = [i - 0.4 + width * (j + 0.5) for i in range(len(keys))]
            mid = [results[n][k]["speedup"] for k in keys]
            rng = [results[n][k].get("speedup_rounds") or [m] for k, m in zip(keys, mid)]
            err = [[m - min(r) for m, r in zip(mid, rng)], [max(r) - m for m, r in zip(mid, rng)]]
            ax.bar(xs, mid, width, yerr=err, capsize=2, label=n, error_kw={"lw": 0.8})
        if "suffix" in results:
            for i, k in enumerate(keys):
                ax.hlines(results["suffix"][k]["speedup"], i - 0.45, i + 0.45, colors="k", linestyles="dashed", lw=0.8)
        ax.axhline(1.0, color="grey", lw=0.8)
        low = min(min(results[n][k].get("speedup_rounds") or [results[n][k]["speedup"]]) for n in names for k in keys)
        ax.set_ylim(bottom=max(0.0, min(0.9, low) - 0.1))  # the bars differ by percents: start near the lowest
        ax.set_xticks(range(len(keys)), [k.split("|")[0] for k in keys])
        ax.set_title(f"batch {bs}")
        ax.set_ylabel("speedup over plain (median of rounds; whiskers: range)", fontsize=8)
    fig.legend(*axes[0][0].get_legend_handles_labels(), fontsize=8, loc="lower center", ncol=min(4, len(names)))
    fig.suptitle("Interleaved rounds: every method per task type (dashed: vLLM suffix)")
    fig.tight_layout(rect=(0, 0.06 * (1 + (len(names) - 1) // 4), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def branch_grid(results: dict) -> dict:
    """{(N, L, init): row name} of the multibranch rows with branches, and (0, 0, "") for the one without."""
    grid = {}
    for name in results:
        m = re.match(r"multibranch .* branches N=(\d+) L=(\d+)( random)?$", name)
        if m:
            grid[(int(m.group(1)), int(m.group(2)), (m.group(3) or "").strip())] = name
        elif name.startswith("multibranch ") and " branches " not in name and (0, 0, "") not in grid:
            grid[(0, 0, "")] = name
    return grid


def branch_table(results: dict) -> str:
    """Per (dataset, batch): each (N, L) against the proposer without branches: tau ratio, speed ratio."""
    grid = branch_grid(results)
    base = grid.get((0, 0, ""))
    lines = ["| dataset | batch | N | L | init | extra rows / forward | tau | tau / tau without branches |"
             " speedup vs plain | speed / without branches |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key in results["plain"]:
        ds, bs = key.split("|")
        for (n, length, init), name in sorted(grid.items()):
            row = results[name][key]
            ref = results[base][key] if base else None
            tau_r = f"{row['tau'] / ref['tau']:.2f}" if ref else "-"
            sp_r = f"{row['speedup'] / ref['speedup']:.2f}" if ref else "-"
            lines.append(f"| {ds} | {bs} | {n} | {length} | {init or 'prompt'} | {row.get('extra_rows', 0):.1f} | "
                         f"{row['tau']:.2f} | {tau_r} | {row['speedup']:.2f}x | {sp_r} |")
    return "\n".join(lines)


def plot_branch_heatmap(results: dict, path: Path) -> None:
    """Speedup over plain by (N, L), one panel per (dataset, batch); N = 0 is the proposer without branches."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = {k: v for k, v in branch_grid(results).items() if k[2] in ("", "prompt")}
    ns = sorted({n for n, _, _ in grid if n})
    ls = sorted({length for _, length, _ in grid if length})
    keys = list(results["plain"])
    fig, axes = plt.subplots(1, len(keys), figsize=(3.6 * len(keys), 3.4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        base = results[grid[(0, 0, "")]][key]["speedup"] if (0, 0, "") in grid else float("nan")
        m = [[base] * len(ls)] + [[results[grid[(n, length, "")]][key]["speedup"] if (n, length, "") in grid
                                   else float("nan") for length in ls] for n in ns]
        im = ax.imshow(m, cmap="RdYlGn", vmin=0.5, vmax=1.5, origin="lower", aspect="auto")
        for i, r in enumerate(m):
            for j, v in enumerate(r):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(ls)), [str(x) for x in ls])
        ax.set_yticks(range(len(ns) + 1), ["0"] + [str(n) for n in ns])
        ax.set_xlabel("branch length L")
        ax.set_ylabel("branches N")
        ds, bs = key.split("|")
        ax.set_title(f"{ds}, batch {bs}", fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), label="speedup over plain")
    fig.suptitle("MultiBranchProposer + Self-Draft branches: speedup by (N, L)", fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def break_even(results: dict) -> str:
    """Batch-1 cost model from the measured times: a step costs v(K) plain steps to verify plus K draft passes of
    c plain steps each; with a per-draft acceptance a it commits (1 - a^(K+1)) / (1 - a) tokens. Break-even a*
    solves tokens = v + K c."""
    lines = ["| dataset | method | v(K) verify cost | c draft pass | break-even acceptance a* | measured acceptance |"
             " measured first-draft agreement |", "|---|---|---|---|---|---|---|"]
    for key, plain in results["plain"].items():
        ds, bs = key.split("|")
        if bs != "1":
            continue
        t_plain = 1.0 / plain["tok_s"]
        for name, rows in results.items():
            row = rows[key]
            m = re.match(r"adaspec-ee.* K=(\d+)$", name)
            if not m or not row.get("draft_passes_total"):
                continue
            k = int(m.group(1))
            forwards = max(1, row["tokens"] - row["accepted"])
            v = (row["seconds_total"] - row["draft_seconds_total"]) / forwards / t_plain
            c = row["draft_seconds_total"] / row["draft_passes_total"] / t_plain
            need = v + k * c
            lo, hi = 0.0, 1.0
            for _ in range(60):  # tokens(a) is increasing in a
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if sum(mid ** j for j in range(k + 1)) < need else (lo, mid)
            star = f"{lo:.1%}" if need <= k + 1 else "never (> K+1 tokens needed)"
            agree = f"{row['agree1']:.1%}" if row.get("agree1") is not None else "-"
            lines.append(f"| {ds} | {name} | {v:.2f} | {c:.2f} | {star} | {row['accept_rate']:.1%} | {agree} |")
    return "\n".join(lines)


def plot_k_sweep(results: dict, path: Path) -> None:
    """Speedup over plain against K, one line per (dataset, batch), baselines as dashed lines."""
    import re

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plain = results["plain"]
    keys = list(plain)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        series: dict[str, list] = {}
        for name, rows in results.items():
            m = re.match(r"(adaspec-ee(?: N=\d+)?) K=(\d+)", name)
            if m:
                series.setdefault(m.group(1), []).append((int(m.group(2)), rows[key]["speedup"]))
        for label, pts in series.items():
            pts.sort()
            ax.plot([k for k, _ in pts], [v for _, v in pts], marker="o", label=label)
        for base in ("ngram", "suffix"):
            if base in results:
                ax.axhline(results[base][key]["speedup"], ls="--", lw=1, label=base,
                           color="gray" if base == "ngram" else "black")
        for name, rows in results.items():  # adaptive policies: horizontal lines (EESD figure 3)
            if name.startswith("adaspec policy"):
                ax.axhline(rows[key]["speedup"], ls=":", lw=1.5, label=name.replace("adaspec policy ", ""),
                           color=f"C{3 + list(results).index(name) % 6}")
        ax.axhline(1.0, color="red", lw=0.8)
        ds, bs = key.split("|")
        ax.set_title(f"{ds}, batch {bs}")
        ax.set_xlabel("K (max drafts per step)")
        ax.set_ylabel("speedup over plain")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_tau_gamma(results: dict, path: Path) -> None:
    """C2T's figure 4: tokens per target forward (tau) against verified nodes per step (gamma), per (dataset, batch);
    joint-probability trees as a line over their budgets, C2T as points labelled by beta. Lower right is better."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results["plain"])
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys):
        joint = sorted((rows[key]["tau"], rows[key]["gamma"]) for name, rows in results.items()
                       if name.startswith("adaspec tree"))
        if joint:
            ax.plot([t for t, _ in joint], [g for _, g in joint], "o-", label="joint probability (budget B)")
        for name, rows in results.items():
            if name.startswith("adaspec c2t"):
                t, g = rows[key]["tau"], rows[key]["gamma"]
                ax.plot([t], [g], "s", color="C1", label="C2T" if "C2T" not in ax.get_legend_handles_labels()[1] else None)
                ax.annotate(name.split("beta=")[-1], (t, g), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ds, bs = key.split("|")
        ax.set_title(f"{ds}, batch {bs}")
        ax.set_xlabel("tau (tokens per target forward)")
        ax.set_ylabel("gamma (verified nodes per step)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
