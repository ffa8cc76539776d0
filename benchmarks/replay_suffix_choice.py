"""Which drafts, or how many? Our suffix pool's choice against vLLM's `suffix` at the same number of drafted rows,
replayed offline (greedy decoding known, no model: benchmarks/replay_pools.py's method).

At every step of vLLM `suffix`'s own decoding (its chain: arctic's cache in path mode, max_spec_factor 1.0,
min_token_prob 0.1, up to 16 tokens; the step commits what it accepts plus the bonus), the same cache is asked for our
pool's tree (pools/suffix.py: tree mode, factor 2.0, min prob 0.05), calibrated and ranked as MultiBranchProposer does
(trees/trie.py), and verified at the chain's length L: its top-L nodes, and its best path of L nodes. Prints the
accepted drafts per step of each, by L, and the calibration's reliability over every ranked node (predicted path
probability against acceptance when the top 16 are verified).

    .venv/bin/python benchmarks/replay_suffix_choice.py --datasets math chat --num-prompts 24
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_pools import accepted_path, reference  # noqa: E402

from vllm_adaspec.pools.suffix import SuffixPool  # noqa: E402
from vllm_adaspec.proposers.multi_branch import best_path  # noqa: E402
from vllm_adaspec.trees.trie import Calibration, feedback, merge, ranked, streak_state  # noqa: E402


def chain_accepted(tokens, out, g) -> int:
    a = 0
    while a < len(tokens) and g + a < len(out) - 1 and tokens[a] == out[g + a]:
        a += 1
    return a


def replay(records: list[dict], budget: int = 16) -> dict:
    pool, calib = SuffixPool(), Calibration(4.0)
    by_len: dict[int, list[float]] = {}  # min(L, 8) -> [steps, vLLM accepted, ours top-L, ours best path, predicted]
    reliability: dict[int, list[float]] = {}  # decile -> [nodes, accepted, predicted]
    for rid, rec in enumerate(records):
        prompt, out = rec["prompt"], rec["output"]
        pool.start(rid, np.asarray(prompt))
        g, last = 0, 0
        while g < len(out):
            context = prompt + out[:g]
            chain = pool.cache.speculate(rid, np.asarray(context[-24:], dtype=np.int32), max_spec_tokens=budget,
                                         max_spec_factor=1.0, min_token_prob=0.1, use_tree_spec=False)
            tokens = list(chain.token_ids)
            n = len(tokens)
            v_acc = chain_accepted(tokens, out, g)
            trie = merge([pool.speculate(rid, np.asarray(context), max_nodes=budget)], calib, streak_state(last))
            order = ranked(trie)
            top = order[:n]
            top_path = accepted_path(trie, top, out, g)
            row = by_len.setdefault(min(n, 8), [0, 0, 0, 0, 0.0])
            row[0] += 1
            row[1] += v_acc
            row[2] += len(top_path)
            row[3] += len(accepted_path(trie, best_path(trie, n), out, g)) if n else 0
            row[4] += sum(trie.path[i] for i in top)
            on = set(accepted_path(trie, order[:budget], out, g))
            for i in order[:budget]:
                r = reliability.setdefault(min(9, int(trie.path[i] * 10)), [0, 0, 0.0])
                r[0] += 1
                r[1] += i in on
                r[2] += trie.path[i]
            feedback(trie, top, top_path, calib)  # the calibration learns from the nodes verified (the top L)
            commit = out[g:g + v_acc + 1]  # vLLM's step: its accepted drafts and the bonus
            pool.extend(rid, np.asarray(commit))
            g += len(commit)
            last = v_acc
        pool.stop(rid)
    return {"by_len": by_len, "reliability": reliability}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--datasets", nargs="+", default=["math", "chat"])
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args(argv)
    from vllm_adaspec.models import resolve_model

    model = resolve_model(args.model)
    for ds in args.datasets:
        res = replay(reference(model, ds, args.num_prompts, args.max_tokens, 8))
        rows = res["by_len"]
        steps = sum(r[0] for r in rows.values())
        total = [sum(r[k] for r in rows.values()) / steps for k in range(1, 5)]
        drafted = sum(n * r[0] for n, r in rows.items()) / steps
        print(f"\n{ds}: {steps} steps, vLLM suffix drafts {drafted:.2f} a step (8+ counted as 8)\n")
        print("| chain length L | steps | accepted: vLLM suffix | ours, top L | ours, best path of L | ours predicted |")
        print("|---|---|---|---|---|---|")
        for n in sorted(rows):
            r = rows[n]
            print(f"| {n}{'+' if n == 8 else ''} | {r[0]} | {r[1] / r[0]:.2f} | {r[2] / r[0]:.2f} | {r[3] / r[0]:.2f} | "
                  f"{r[4] / r[0]:.2f} |")
        print(f"| all | {steps} | {total[0]:.3f} | {total[1]:.3f} | {total[2]:.3f} | {total[3]:.3f} |")
        print("\n| predicted path probability | nodes | mean predicted | accepted |\n|---|---|---|---|")
        for d, r in sorted(res["reliability"].items()):
            print(f"| {d / 10:.1f}-{(d + 1) / 10:.1f} | {r[0]} | {r[2] / r[0]:.3f} | {r[1] / r[0]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
