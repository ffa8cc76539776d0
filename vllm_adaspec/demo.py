"""`adaspec demo`: our best method next to plain decoding and vLLM's best built-in method, in about three minutes.

Three engines (plain decoding, vLLM's `suffix`, adaspec's MultiBranchProposer at its defaults), each kept alive in
its own process (harness.EngineSession), take turns over rounds of prompts from the workload mix: every round brings
new prompts of several task types (batch 1, greedy), and the engines' order alternates from round to round, so a
drift of the machine's speed falls on every method alike. Reported per method: tokens/s, tau (tokens per target
forward, steps that drafted nothing included), the speedup over plain over all rounds' work (and the range of the
rounds' own ratios: rounds differ in task types), and how many outputs are identical to plain decoding's.
"""

from __future__ import annotations

import statistics
import sys

from vllm_adaspec.harness import FORWARDS, EngineSession, wait_all
from vllm_adaspec.models import resolve_model

# Task types of the workload mix (data/mix.py + HumanEval, MT-Bench) in the order rounds draw them: each round takes
# the next TYPES_PER_ROUND types (wrapping around) and the round's own prompt of each.
DEMO_TYPES = ("code_edit", "rag", "chat", "math", "agent", "summarization", "translation", "humaneval", "mtbench")
TYPES_PER_ROUND = 3
METHODS = ("plain", "vllm-suffix", "adaspec")  # what runs: plain vLLM, vLLM's best built-in method here, ours


def demo_engines(proposer: str, k: int, exit_layer: int | None, exit_head: str) -> dict:
    if proposer == "multibranch":
        ours = {"speculative_config": {"model": "vllm_adaspec.MultiBranchProposer", "num_speculative_tokens": k}}
    else:
        ours = {"speculative_config": {"model": "vllm_adaspec.EarlyExitProposer", "num_speculative_tokens": k},
                "additional_config": {"adaspec": {"exit_head": exit_head,
                                                  **({"exit_layer": exit_layer} if exit_layer is not None else {})}}}
    return {"plain": {}, "vllm-suffix": {"speculative_config": {"method": "suffix"}}, "adaspec": ours}


def demo_rounds(model_path: str, rounds: int) -> list[list[tuple[str, str]]]:
    """[(task type, prompt text)] per round: round r takes types r * TYPES_PER_ROUND ... of DEMO_TYPES and each
    type's prompt number r (prompts never repeat: the suffix caches would replay earlier outputs)."""
    from transformers import AutoTokenizer

    from vllm_adaspec.data.prompts import load_prompts

    tok = AutoTokenizer.from_pretrained(model_path)
    per_type: dict[str, list[str]] = {}
    out = []
    for r in range(rounds):
        types = [DEMO_TYPES[(r * TYPES_PER_ROUND + j) % len(DEMO_TYPES)] for j in range(TYPES_PER_ROUND)]
        for t in types:
            if t not in per_type:
                per_type[t] = load_prompts(t, rounds, tokenizer=tok)
        out.append([(t, per_type[t][r]) for t in types])
    return out


def run_demo(model: str, exit_layer: int | None, k: int, max_tokens: int, dtype: str = "float32",
             exit_head: str = "auto", proposer: str = "multibranch", rounds: int = 6, eager: bool = False) -> dict:
    """Every engine in vLLM's default mode (compiled: what `LLM(...)` and `vllm serve` give a user who passes no
    flag) unless `eager`."""
    path = resolve_model(model)
    engine = {"dtype": dtype, "max_model_len": 2048, "seed": 0, **({"enforce_eager": True} if eager else {})}
    plan = demo_rounds(path, rounds)
    print(f"[demo] starting {len(METHODS)} engines side by side (vLLM's default mode compiles each model: a few "
          "minutes on a CPU) ...", file=sys.stderr, flush=True)
    sessions = {name: EngineSession(path, {**engine, **extra})
                for name, extra in demo_engines(proposer, k, exit_layer, exit_head).items()}
    try:
        wait_all(sessions, lambda line: print(f"[demo] {line}", file=sys.stderr, flush=True))
        warm = {"prompts": ["Hello"], "params": [{"temperature": 0, "max_tokens": 8}]}
        for s in sessions.values():
            s.generate(warm)
        runs: dict[str, list[dict]] = {name: [] for name in sessions}
        for r, prompts in enumerate(plan):
            order = list(sessions) if r % 2 == 0 else list(reversed(sessions))
            print(f"[demo] round {r + 1}/{len(plan)}: {', '.join(t for t, _ in prompts)}", file=sys.stderr,
                  flush=True)
            for name in order:
                calls = [sessions[name].generate({"prompts": [p], "params": [{"temperature": 0,
                                                                               "max_tokens": max_tokens}]})
                         for _, p in prompts]
                runs[name].append(calls)
    finally:
        for s in sessions.values():
            s.close()
    return summarize_demo(runs, plan, proposer)


def summarize_demo(runs: dict[str, list[list[dict]]], plan, proposer: str) -> dict:
    """Per method: tok/s, tau, per-round speedups over plain (median, range), identical outputs."""
    def totals(calls):
        tokens = sum(len(c["token_ids"][0]) for c in calls)
        seconds = sum(c["seconds"] for c in calls)
        forwards = sum(c["metrics"].get(FORWARDS, 0) for c in calls)  # target forwards that committed tokens
        return tokens, seconds, max(1, forwards)

    out = {"proposer": proposer, "rounds": len(plan), "types": [[t for t, _ in p] for p in plan]}
    plain_rates = [totals(c)[0] / totals(c)[1] for c in runs["plain"]]
    plain_all = totals([c for calls in runs["plain"] for c in calls])
    plain_ids = [c["token_ids"][0] for calls in runs["plain"] for c in calls]
    for name, per_round in runs.items():
        flat = [c for calls in per_round for c in calls]
        tokens, seconds, forwards = totals(flat)
        ratios = [totals(c)[0] / totals(c)[1] / p for c, p in zip(per_round, plain_rates)]
        ids = [c["token_ids"][0] for c in flat]
        # the speedup over all rounds' work (rounds differ in task types; their ratios show the spread)
        out[name] = {"tok_s": tokens / seconds, "tau": tokens / forwards, "speedup_median": statistics.median(ratios),
                     "speedup_range": [min(ratios), max(ratios)], "identical": sum(a == b for a, b in zip(ids, plain_ids)),
                     "n": len(ids), "text": flat[0]["texts"][0],
                     "config": next((c["adaspec"]["config"] for c in flat if c.get("adaspec", {}).get("config")), {})}
        out[name]["speedup"] = out[name]["tok_s"] / (plain_all[0] / plain_all[1])
    return out


def print_demo(res: dict, k: int) -> None:
    ada = res["adaspec"]
    cfg = ada.get("config", {})
    if res.get("proposer") == "multibranch":
        label = f"adaspec MultiBranchProposer (K={k})"
    else:
        print(f"exit head: {cfg.get('exit_head') or 'untrained (final norm + LM head on h_N)'}")
        label = f"adaspec early exit N={cfg.get('exit_layer')} K={k}"
    types = sorted({t for p in res["types"] for t in p})
    print(f"{res['rounds']} rounds of {len(res['types'][0])} prompts (batch 1, greedy; task types: {', '.join(types)})")
    print(f"{'method':38s} {'tok/s':>7s} {'tau':>5s}  speedup over plain (all rounds; rounds' range)  identical")
    for name, title in (("plain", "plain decoding"), ("vllm-suffix", "vLLM suffix decoding (built in)"),
                        ("adaspec", label)):
        r = res[name]
        speed = "1.00x" if name == "plain" else (f"{r['speedup']:.2f}x ({r['speedup_range'][0]:.2f}-"
                                                f"{r['speedup_range'][1]:.2f})")
        print(f"{title:38s} {r['tok_s']:7.1f} {r['tau']:5.2f}  {speed:44s} {r['identical']}/{r['n']}")
    print(f"adaspec vs vLLM suffix: {ada['speedup'] / res['vllm-suffix']['speedup']:.2f}x over all rounds")
