"""Audit of the step cost model and the calibration, per step, on the workload mix: what MultiBranchProposer's
decisions assumed against what happened (observers.CostAudit, VLLM_ADASPEC_AUDIT=1).

    .venv/bin/python benchmarks/audit_cost_model.py --datasets translation summarization rag math chat \
        --num-prompts 4 --offset 8 --batch-sizes 1 8 --out benchmarks/out/audit.json

One engine per batch size (vLLM's default compiled mode unless --eager; MultiBranchProposer at its defaults or
--settings), each task type's prompts in turn. Reported per task type:

- step seconds: the cost model's prediction for every pure decode step (made before it learned from that step)
  against the measured step, for chain steps and tree steps apart (median ratio, mean absolute error, steps);
- committed tokens: per verified proposal, the expected tokens its choice assumed (1 + the chosen nodes'
  calibrated path probabilities) against the tokens it committed (sum over proposals, ratio), trees and chains;
- reliability: per pool, verified nodes by calibrated path probability (tenths) against their acceptance rate, in
  a table and a plot (`.png` next to --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from vllm_adaspec.data.prompts import WORKLOAD_MIX, load_prompts
from vllm_adaspec.harness import EngineSession, default_env
from vllm_adaspec.models import resolve_model
from vllm_adaspec.observers import RELIABILITY_BINS


def step_rows(steps: list) -> dict:
    """Chain and tree steps apart: [batch, rows, tree requests, tree rows, attention, predicted, measured]."""
    out = {}
    for kind, sel in (("chain steps", lambda s: s[2] == 0), ("tree steps", lambda s: s[2] > 0),
                      ("all steps", lambda s: True)):
        xs = [s for s in steps if sel(s) and s[6] > 0]
        if not xs:
            continue
        ratios = [s[5] / s[6] for s in xs]
        out[kind] = {"steps": len(xs), "median predicted / measured": statistics.median(ratios),
                     "mean abs error %": 100 * statistics.mean(abs(r - 1) for r in ratios),
                     "measured ms (median)": 1e3 * statistics.median(s[6] for s in xs),
                     "rows (median)": statistics.median(s[1] for s in xs)}
    return out


def token_rows(rounds: list) -> dict:
    """[expected, committed, nodes, tree] per proposal -> sums and ratio, trees and chains apart."""
    out = {}
    for kind, sel in (("chain proposals", lambda r: not r[3]), ("tree proposals", lambda r: r[3]),
                      ("all proposals", lambda r: True)):
        xs = [r for r in rounds if sel(r)]
        if not xs:
            continue
        exp, got = sum(r[0] for r in xs), sum(r[1] for r in xs)
        out[kind] = {"proposals": len(xs), "expected tokens": exp, "committed tokens": got,
                     "expected / committed": exp / got if got else float("nan"),
                     "nodes per proposal": sum(r[2] for r in xs) / len(xs)}
    return out


def diff_reliability(after: dict, before: dict) -> dict:
    out = {}
    for pool, cells in after.items():
        prev = before.get(pool, [[0, 0]] * RELIABILITY_BINS)
        out[pool] = [[a[0] - b[0], a[1] - b[1]] for a, b in zip(cells, prev)]
    return out


def add_reliability(total: dict, part: dict) -> None:
    for pool, cells in part.items():
        acc = total.setdefault(pool, [[0, 0] for _ in range(RELIABILITY_BINS)])
        for a, c in zip(acc, cells):
            a[0] += c[0]
            a[1] += c[1]


def reliability_table(rel: dict) -> str:
    bins = [f"{b / RELIABILITY_BINS:.1f}-{(b + 1) / RELIABILITY_BINS:.1f}" for b in range(RELIABILITY_BINS)]
    lines = ["| pool | " + " | ".join(bins) + " |", "|---|" + "---|" * RELIABILITY_BINS]
    for pool, cells in sorted(rel.items()):
        lines.append(f"| {pool} | " + " | ".join(f"{c[1] / c[0]:.2f} ({c[0]})" if c[0] else "-" for c in cells) + " |")
    return "\n".join(lines)


def plot_reliability(rel: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--", label="calibrated")
    for pool, cells in sorted(rel.items()):
        xs = [(b + 0.5) / RELIABILITY_BINS for b, c in enumerate(cells) if c[0] >= 20]
        ys = [c[1] / c[0] for c in cells if c[0] >= 20]
        if xs:
            ax.plot(xs, ys, marker="o", lw=2.2 if pool == "all" else 1.2, label=pool)
    ax.set_xlabel("calibrated path probability of a verified node")
    ax.set_ylabel("accepted")
    ax.set_title("Reliability of MultiBranchProposer's node probabilities\n(bins with >= 20 nodes)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--datasets", nargs="+", default=["mix"])
    p.add_argument("--num-prompts", type=int, default=4, help="prompts per type and batch size")
    p.add_argument("--offset", type=int, default=0, help="skip each set's first prompts")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("-k", type=int, default=16)
    p.add_argument("--settings", default="{}", help="MultiBranchProposer settings (JSON)")
    p.add_argument("--eager", action="store_true")
    p.add_argument("--out", default="benchmarks/out/audit.json")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    model = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(model)
    datasets = [d for ds in args.datasets for d in (WORKLOAD_MIX if ds == "mix" else [ds])]
    need = args.num_prompts * len(args.batch_sizes)
    prompts = {ds: load_prompts(ds, args.offset + need, tokenizer=tok)[args.offset:] for ds in datasets}
    engine = {"dtype": "float32", "max_model_len": 2048, "seed": 0, "kv_cache_memory_bytes": 2**29,
              "speculative_config": {"model": "vllm_adaspec.MultiBranchProposer", "num_speculative_tokens": args.k},
              "additional_config": {"adaspec": json.loads(args.settings)},
              **({"enforce_eager": True} if args.eager else {})}
    report, total_rel = {}, {}
    for b_i, bs in enumerate(args.batch_sizes):
        session = EngineSession(model, engine, env={**default_env(), "VLLM_ADASPEC_AUDIT": "1"})
        try:
            session.generate({"prompts": ["Hello"], "params": [{"temperature": 0.0, "max_tokens": 8}]})
            before, seen = {}, set()
            for ds in datasets:
                ps = prompts[ds][b_i * args.num_prompts:(b_i + 1) * args.num_prompts]
                steps, rounds, seconds, tokens = [], [], 0.0, 0
                for i in range(0, len(ps), bs):
                    run = session.generate({"prompts": ps[i:i + bs],
                                            "params": [{"temperature": 0.0, "max_tokens": args.max_tokens}]})
                    st = run["adaspec"]
                    steps += st["audit_steps"]  # (appended meanwhile: harness.diff_metrics)
                    # this call's requests: the ids the drafter saw first now (vLLM's engine ids, not the outputs')
                    for rid in set(st["audit_rounds"]) - seen:
                        rounds += st["audit_rounds"][rid]
                    seen |= set(st["audit_rounds"])
                    rel = diff_reliability(st["audit_reliability"], before)
                    before = st["audit_reliability"]
                    add_reliability(total_rel, rel)
                    seconds += run["seconds"]
                    tokens += sum(map(len, run["token_ids"]))
                report[f"{ds}|{bs}"] = {"tok_s": tokens / seconds, "steps": step_rows(steps),
                                        "tokens": token_rows(rounds)}
                print(f"{ds} batch {bs}: {tokens / seconds:.1f} tok/s; " + "; ".join(
                    f"{k}: {v['median predicted / measured']:.2f}x ({v['steps']})"
                    for k, v in report[f'{ds}|{bs}']['steps'].items()) + "; " + "; ".join(
                    f"{k}: expected/committed {v['expected / committed']:.2f} ({v['proposals']})"
                    for k, v in report[f'{ds}|{bs}']['tokens'].items()), file=sys.stderr, flush=True)
        finally:
            session.close()
    lines = ["| task type | batch | tok/s | step: predicted / measured (median; mean abs error; steps) chain | tree |"
             " tokens: expected / committed (proposals) chain | tree | nodes per tree proposal |",
             "|---|---|---|---|---|---|---|---|"]
    for key, r in report.items():
        ds, bs = key.split("|")
        s, t = r["steps"], r["tokens"]

        def sc(kind):
            v = s.get(kind)
            return f"{v['median predicted / measured']:.2f} ({v['mean abs error %']:.0f}%; {v['steps']})" if v else "-"

        def tc(kind):
            v = t.get(kind)
            return f"{v['expected / committed']:.2f} ({v['proposals']})" if v else "-"

        nodes = t.get("tree proposals", {}).get("nodes per proposal")
        lines.append(f"| {ds} | {bs} | {r['tok_s']:.1f} | {sc('chain steps')} | {sc('tree steps')} | "
                     f"{tc('chain proposals')} | {tc('tree proposals')} | {f'{nodes:.1f}' if nodes else '-'} |")
    table = "\n".join(lines) + "\n\nReliability (acceptance rate (verified nodes) by calibrated path probability):\n\n" \
        + reliability_table(total_rel)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "report": report, "reliability": total_rel}, indent=1))
    out.with_suffix(".md").write_text(table + "\n")
    plot_reliability(total_rel, out.with_suffix(".png"))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
