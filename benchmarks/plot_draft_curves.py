"""Training curves of draft layers (`adaspec train draft-layer` writes draft_layer.json beside each checkpoint):
smoothed loss and the training batches' top-1 agreement at each draft depth, against training tokens, one line per
checkpoint, with its held-out agreement at depth 1 in the legend.

    .venv/bin/python benchmarks/plot_draft_curves.py A/draft_layer.json B/draft_layer.json \\
        --out benchmarks/plots/draft_layer_curves.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+")
    p.add_argument("--labels", nargs="*", default=None)
    p.add_argument("--out", default="benchmarks/plots/draft_layer_curves.png")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_top1) = plt.subplots(1, 2, figsize=(11, 4))
    for i, path in enumerate(args.reports):
        with open(path) as f:
            r = json.load(f)
        st = r["settings"]
        label = (args.labels[i] if args.labels else os.path.basename(os.path.dirname(path))) + (
            f" (held-out {r['agreement_after'][0]:.2f})")
        tokens = [c[0] * st["batch_tokens"] / 1e6 for c in r["curve"]]
        line, = ax_loss.plot(tokens, [c[1] for c in r["curve"]], label=label)
        for d in range(len(r["curve"][0][2])):
            ax_top1.plot(tokens, [c[2][d] for c in r["curve"]], color=line.get_color(), alpha=1.0 - 0.3 * d,
                         linestyle=("-", "--", ":")[min(d, 2)])
    ax_loss.set(xlabel="training tokens (millions)", ylabel="loss (EMA)", title="loss")
    ax_top1.set(xlabel="training tokens (millions)", ylabel="top-1 agreement (batch)",
                title="top-1 by draft depth (solid 1, dashed 2, dotted 3)")
    ax_loss.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
