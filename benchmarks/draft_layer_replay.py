"""Choose the learned draft's family and depth by an offline replay before any engine run: each candidate (the EAGLE-
style draft layer, the attention-free MLP speculator; the features of the target's last layer or of an earlier one)
is trained on the same self-distillation corpus for the same number of steps, then replayed on unseen prompts of the
workload mix (their greedy continuations from plain vLLM): acceptance by draft depth, tokens per target forward when
decoding drafts a chain of k, the draft's cost per token against a target step (torch, batch 1), and the implied
speed over plain decoding, tau / (v(k) + k c), with v(k) the engine's measured cost of verifying k drafts on this
CPU. training/draft_layer.py holds the families, the trainer and the replay.

    .venv/bin/python benchmarks/draft_layer_replay.py --data DISTILL_FOLDER --max-tokens 200000 \\
        --candidates layer:30:3 mlp:30:3 layer:24:3 --out benchmarks/out/draft_layer_replay.json
    # trained layers (exit-head folders that read features), replayed as they are:
    .venv/bin/python benchmarks/draft_layer_replay.py --checkpoints vllm_adaspec/heads/smollm2-135m-instruct-draft-layer
    # ... and again with the numerics of the engine's int8 draft weights (kernels/int8_linear.py):
    .venv/bin/python benchmarks/draft_layer_replay.py --checkpoints DIR --int8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# the engine's step with k verified drafts against a plain step, SmolLM2 on this CPU (../shared/notes/cpu-setup.md:
# K = 1 / 4 / 8: 1.10 / 1.16 / 1.37; linear between)
VERIFY_COST = {0: 1.0, 1: 1.10, 2: 1.12, 3: 1.14, 4: 1.16, 5: 1.21, 6: 1.26, 7: 1.32, 8: 1.37}
TYPES = ("translation", "summarization", "rag", "math", "chat", "code_edit")


def unseen_sequences(model: str, per_type: int, offset: int, max_tokens: int) -> dict:
    """{type: [(prompt length, prompt + greedy continuation ids)]} from plain vLLM (eager), prompts `offset`..."""
    from transformers import AutoTokenizer

    from vllm_adaspec.data.prompts import load_prompts
    from vllm_adaspec.harness import run_engine

    tok = AutoTokenizer.from_pretrained(model)
    prompts = {t: load_prompts(t, offset + per_type, tokenizer=tok)[offset:] for t in TYPES}
    # token ids in, so that the prompt's ids are exactly what the target read
    flat = [(t, tok(p, add_special_tokens=False)["input_ids"]) for t, ps in prompts.items() for p in ps]
    res = run_engine({"model": model, "engine": {"dtype": "float32", "max_model_len": 2048, "enforce_eager": True,
                                                 "seed": 0},
                      "batches": [{"prompts": [{"prompt_token_ids": ids} for _, ids in flat],
                                   "params": [{"temperature": 0.0, "max_tokens": max_tokens}]}]})
    run = res["batches"][0]["runs"][0]
    out: dict = {t: [] for t in TYPES}
    for (t, pid), ids in zip(flat, run["token_ids"]):
        out[t].append((len(pid), pid + list(ids)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--data", default=None, help="an `adaspec distill` folder, or several joined by commas")
    p.add_argument("--checkpoints", nargs="*", default=[], help="trained draft layers to replay (no training)")
    p.add_argument("--labels", default="auto", help="the candidates' training labels (draft_layer.LABELS, or auto)")
    p.add_argument("--max-tokens", type=int, default=200_000, help="corpus tokens each candidate trains on")
    p.add_argument("--candidates", nargs="+", default=["layer:0:3", "mlp:0:3"],
                   help="FAMILY:FEATURE_LAYER:DEPTH (feature layer 0: the last; 2+15+27+30: those four fused)")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--per-type", type=int, default=3, help="unseen prompts per task type")
    p.add_argument("--offset", type=int, default=7, help="first prompt index of each type (0-6: tuning prompts)")
    p.add_argument("--k", type=int, default=5, help="the longest draft chain replayed")
    p.add_argument("--int8", action="store_true",
                   help="replay with the engine's int8 draft weights (bfloat16 activations) instead of float32")
    p.add_argument("--out", default="benchmarks/out/draft_layer_replay.json")
    p.add_argument("--sequences", default=None,
                   help="a JSON file keeping the unseen continuations (written on the first run, read after: runs side "
                        "by side then share one vLLM run)")
    args = p.parse_args(argv)
    if args.candidates and not args.checkpoints and not args.data:
        p.error("--data is needed to train --candidates")

    from vllm_adaspec.models import resolve_model
    from vllm_adaspec.training.draft_layer import (DraftTrainSettings, draft_cost_ratio, load_trained,
                                                   parse_feature_layers, replay, train_draft_layer,
                                                   with_int8_weights)

    model = resolve_model(args.model)
    t0 = time.perf_counter()
    cache = Path(args.sequences) if args.sequences else None
    if cache and cache.exists():
        seqs = json.loads(cache.read_text())
    else:
        seqs = unseen_sequences(model, args.per_type, args.offset, 128)
        if cache:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(seqs))
    print(f"unseen continuations: {sum(map(len, seqs.values()))} prompts in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    rows = []
    todo = [(c, None) for c in args.checkpoints] + [(None, c) for c in (args.candidates if args.data else [])]
    for folder, cand in todo:
        if folder:
            (m, vocab, family, layers), trained, cand = load_trained(model, folder), {"curve": []}, folder
        else:
            family, n, depth = cand.split(":")
            layers = parse_feature_layers(n)
            st = DraftTrainSettings(model=model, data=args.data, out=str(Path(args.out).parent / f"draft_{cand}"),
                                    family=family, feature_layer=layers, depth=int(depth), max_tokens=args.max_tokens,
                                    epochs=args.epochs, labels=args.labels)
            trained = train_draft_layer(st)
            m, vocab = trained.pop("model"), trained.pop("vocab_ids")
        if args.int8 and family == "layer":
            m = with_int8_weights(m)
        c = draft_cost_ratio(m, family, model)
        per_type = {t: replay(m, family, vocab, model, s, args.k, layers) for t, s in seqs.items()}
        everything = replay(m, family, vocab, model, [x for s in seqs.values() for x in s], args.k, layers)
        implied = {k: round(tau / (VERIFY_COST[k] + k * c), 3) for k, tau in everything["tau_by_k"].items()}
        rows.append({"candidate": cand, "train": {k: v for k, v in trained.items() if k != "curve"},
                     "curve": trained["curve"], "draft_cost": round(c, 4), "replay": everything,
                     "per_type": per_type, "implied_speedup_by_k": implied})
        print(json.dumps({"candidate": cand, "heldout_agreement": trained.get("agreement_after"), "draft_cost": c,
                          "accept_depth1_by_type": {t: r["accept_at_depth"][0] for t, r in per_type.items()},
                          "accept_at_depth": everything["accept_at_depth"], "tau_by_k": everything["tau_by_k"],
                          "implied_speedup_by_k": implied}), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
