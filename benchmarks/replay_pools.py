"""Judge candidate pools and node selection in seconds: replay greedy decoding offline.

Plain greedy decoding runs once per prompt set (vLLM, float32, top-k log-probs kept; cached under
benchmarks/out/). The replay then decodes again without a model: at each step it builds the candidate trie from
the committed context only (pools + calibration, exactly the code MultiBranchProposer runs), verifies it against
the known greedy continuation (the longest accepted root path), commits the accepted tokens + the bonus, feeds the
outcome back (calibration, recycled table: the target's top-k at the root and accepted rows, which the replay
knows), and counts steps and verified nodes. For greedy decoding this is what the engine accepts. Speed is
estimated from a verification cost curve (relative step time by verified rows, `--cost`).

    .venv/bin/python benchmarks/replay_pools.py --datasets humaneval mtbench --num-prompts 16 \
        --pools context suffix recycled corpus --budgets 4 8 16
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np

from vllm_adaspec.pools import Candidates
from vllm_adaspec.pools.context import ContextIndex, propose_context
from vllm_adaspec.pools.recycled import RecycleTable, propose_recycled
from vllm_adaspec.trees.trie import Calibration, best_prefix, feedback, merge, ranked, streak_state

OUT = Path(__file__).parent / "out"
# Relative time of a verification step by rows (1 = plain decoding), batch 1 (chains; trees cost --tree-factor more);
# from benchmarks/verify_cost.py on this CPU. Replaced by --cost.
from vllm_adaspec.policies.cost_model import VERIFY_COST  # noqa: E402
from vllm_adaspec.trees.trie import cost_curve  # noqa: E402

DEFAULT_COST = cost_curve(VERIFY_COST)


def reference(model: str, dataset: str, n: int, max_tokens: int, topk: int, offset: int = 0) -> list[dict]:
    """Plain greedy outputs with the target's top-k at every generated position (cached): prompts offset..offset+n-1."""
    path = OUT / f"replay-{dataset}-{n}-{max_tokens}-{topk}{f'-at{offset}' if offset else ''}.json"
    if path.exists():
        return json.loads(path.read_text())
    from transformers import AutoTokenizer

    from vllm_adaspec.data.prompts import load_prompts
    from vllm_adaspec.harness import run_engine

    tok = AutoTokenizer.from_pretrained(model)
    prompts = load_prompts(dataset, offset + n, tokenizer=tok)[offset:]
    engine = {"dtype": "float32", "max_model_len": 2048, "seed": 0, "enforce_eager": True}
    batch = {"prompts": prompts, "params": [{"temperature": 0.0, "max_tokens": max_tokens, "logprobs": topk}]}
    run = run_engine({"model": model, "engine": engine, "batches": [batch]})["batches"][0]["runs"][0]
    recs = []
    for p, out, lps in zip(prompts, run["token_ids"], run["logprobs"]):
        recs.append({"prompt": tok(p, add_special_tokens=False)["input_ids"], "output": out,
                     "top_ids": [[t for t, _ in pos[:topk]] for pos in lps],
                     "top_probs": [[float(np.exp(lp)) for _, lp in pos[:topk]] for pos in lps]})
    OUT.mkdir(exist_ok=True)
    path.write_text(json.dumps(recs))
    return recs


def medusa_tops(model: str, folder: str, records: list[dict], width: int = 10) -> None:
    """Per record, each generated position g's Medusa top-`width` tokens and probabilities per head, from the
    target's final hidden state two tokens before it (plain torch, float32): rec["medusa"] = (ids, probs),
    [G, K, width] each. What the engine's heads compute at the row that produced each step's root."""
    import torch

    from vllm_adaspec.heads.medusa import head_logits, load_medusa, reads_token
    from vllm_adaspec.training.layers import read_hf_tensors, rms_norm, target_prefix_layers

    cfg = json.load(open(f"{model}/config.json"))
    _, t = load_medusa(folder)
    stack = target_prefix_layers(model, cfg["num_hidden_layers"])
    lm_name = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"
    hf = read_hf_tensors(model, sorted({"model.norm.weight", lm_name, "model.embed_tokens.weight"}))
    vocab = t["draft_vocab"]
    rows = hf[lm_name][vocab].float()
    with torch.inference_mode():
        for rec in records:
            seq = rec["prompt"] + rec["output"]
            ids = torch.tensor([seq])
            h = stack(ids, torch.arange(len(seq))[None], (cfg["num_hidden_layers"],))[cfg["num_hidden_layers"]][0]
            # step g drafts out[g] onward; its root (the last committed token) was sampled from the row before it,
            # whose hidden state the engine hands the heads: position len(prompt) + g - 2
            h = rms_norm(h, hf["model.norm.weight"], cfg["rms_norm_eps"])[len(rec["prompt"]) - 2:len(seq) - 2]
            e = None  # token-conditioned heads also read that row's sampled token (the root)
            if reads_token(t["w"]):
                e = hf["model.embed_tokens.weight"][torch.tensor(seq[len(rec["prompt"]) - 1:len(seq) - 1])].float()
            p, i = head_logits(h, t["w"], t["b"], rows, e).softmax(-1).topk(width, dim=-1)
            rec["medusa"] = (vocab[i].numpy(), p.numpy())


def draft_layer_trees(model: str, folder: str, records: list[dict], widths: tuple[int, ...] = (1, 1, 1)) -> None:
    """Per record, what a draft layer (EarlyExitProposer's, an exit head that reads features) drafts at each step g
    (root out[g - 1], or the prompt's last token): rec["draft"][g] = [(ids [n_j] full vocabulary ids, probs [n_j]
    given the parent) per depth j], a tree from the layer's top-k (`tree_drafts`: widths (1, 1, 1) is its greedy
    chain of 3). Plain torch, float32, teacher-forced: the layer's KV holds the target's true features of every
    committed token, as the engine's feed writes them."""
    import torch

    from vllm_adaspec.training.draft_layer import load_draft_layer, target_features, tree_drafts

    layer, vocab = load_draft_layer(model, folder)
    layer.vocab = torch.as_tensor(vocab, dtype=torch.long)  # (drafts are fed back in full ids)
    with torch.inference_mode():
        for rec in records:
            ids = np.asarray(rec["prompt"] + rec["output"])
            f, _ = target_features(model, layer.feature_layers, ids)
            feats = torch.from_numpy(f.astype(np.float32))
            x = torch.from_numpy(np.concatenate([ids[1:], ids[-1:]]).astype(np.int64))  # [T] x_{t+1}
            levels = [(vocab[i.numpy()], q.numpy()) for i, q in tree_drafts(layer, feats, x, widths)]
            # step g's root is ids[P + g - 1]: its drafts start at the row before it (P: the prompt's length)
            rec["draft"] = [[(i[t], q[t]) for i, q in levels] for t in range(len(rec["prompt"]) - 2, len(ids) - 2)]
    for rec in records:
        rec["draft_widths"] = widths


def propose_draft_layer(levels: list, widths: tuple[int, ...]) -> Candidates:
    """The draft layer's tree (draft_layer_trees) as one pool's candidates, each node's probability given its parent
    the layer's (the online calibration corrects it per depth), evidence = depth."""
    c = Candidates(pool="draft")
    prev: list[int] = []
    for j, (ids, probs) in enumerate(levels):
        prev = [c.add(prev[b // widths[j]] if j else -1, tok, float(q), j + 1)
                for b, (tok, q) in enumerate(zip(ids.tolist(), probs.tolist()))]
    return c


NODE_POOLS = ("context", "suffix", "recycled", "corpus", "medusa")


def node_features(trie, i: int, calib) -> list[float]:
    """What a pool-node classifier reads (C2T for candidate trees): the calibrated conditional
    and path probabilities, depth, the raw score's bucket, competing siblings, match length / rank evidence,
    the request's streak state, which pools proposed it and how many."""
    pools, bucket, siblings, evidence, *state = calib.key(trie.codes[i])
    return [trie.cond[i], trie.path[i], trie.depth[i], bucket / 10, siblings, evidence, state[0] if state else 0,
            *[float(p in pools) for p in NODE_POOLS], len(pools)]


def classifier_order(trie, params, calib) -> list[int]:
    """Nodes ranked by the classifier's confidence, a child capped at its parent's (closed under parents)."""
    import torch

    from vllm_adaspec.trees.c2t import confidence

    if not len(trie):
        return []
    conf = confidence(params, torch.tensor([node_features(trie, i, calib) for i in range(len(trie))])).tolist()
    score = []
    for i, parent in enumerate(trie.parents):  # parents come first
        score.append(min(conf[i], score[parent]) if parent >= 0 else conf[i])
    return sorted(range(len(trie)), key=lambda i: (-score[i], trie.depth[i], i))


def replay(records: list[dict], pools: set[str], budget: int, cost: list[float] | None, vocab_size: int,
           corpus=None, strength: float = 4.0, streak: bool = True, tree_factor: float = 1.0,
           vllm_suffix: bool = False, medusa_acc: list | None = None, record: list | None = None,
           classifier: dict | None = None, draft_cost: float = 0.0, draft_gate: float | None = None,
           draft_upkeep: float = 0.0) -> dict:
    """cost None: verify the `budget` most probable nodes every step; else choose the count on the cost curve.
    record: append (features [n, F], accepted [n]) of every trie node (labels for all of them: the replay knows
    the continuation). classifier: rank the trie's nodes by a pool-node classifier instead of path probability.
    draft_cost: what the draft layer's passes and KV upkeep add to every step, relative to a plain step ("draft"
    pool: the records' rec["draft"], draft_layer_trees). draft_gate: run the draft layer only on steps whose copied
    candidates promise fewer than this many accepted tokens (their cost-aware choice's summed path probabilities);
    draft_upkeep: what the layer's KV upkeep adds to every step, drafting or not."""
    from vllm_adaspec.pools.corpus import propose_corpus
    from vllm_adaspec.pools.medusa import MAX_NODES, propose_medusa, sparse_tree
    from vllm_adaspec.pools.suffix import SuffixPool

    trees: dict = {}
    calib = Calibration(strength)
    table = RecycleTable(vocab_size)
    suffix = SuffixPool() if "suffix" in pools else None
    steps = tokens = nodes = accepted = only_draft = drafting = 0
    time = predicted = 0.0
    for rid, rec in enumerate(records):
        prompt, out = rec["prompt"], rec["output"]
        ctx = ContextIndex()
        ctx.extend(prompt)
        if suffix:
            suffix.start(rid, np.asarray(prompt))
        g, last_acc = 0, 0
        while g < len(out):
            context = prompt + out[:g]
            cands: list[Candidates] = []
            if "context" in pools:
                cands.append(propose_context(ctx, depth=budget))
            if suffix:
                cands.append(suffix.speculate(rid, np.asarray(context), max_nodes=budget))
            if "recycled" in pools:
                cands.append(propose_recycled(table, context[-1], depth=budget))
            if corpus is not None and "corpus" in pools:
                cands.append(propose_corpus(corpus, context, depth=budget))
            if medusa_acc is not None and "medusa" in pools:
                tree = trees.get(budget) or trees.setdefault(budget, sparse_tree(medusa_acc, min(budget, MAX_NODES)))
                cands.append(propose_medusa(tree, rec["medusa"][0][g], rec["medusa"][1][g]))
            drafted = "draft" in pools
            if drafted and draft_gate is not None and cands:  # what the copies promise without the layer
                copy = merge(cands, calib, streak_state(last_acc) if streak else ())
                top = ranked(copy)[:budget]
                k = best_prefix([copy.path[i] for i in top], 1.0, cost or DEFAULT_COST, 1)
                drafted = sum(copy.path[i] for i in top[:k]) < draft_gate
            if drafted:
                cands.append(propose_draft_layer(rec["draft"][g], rec["draft_widths"]))
            if vllm_suffix:  # vLLM's `suffix` method: the path mode of the same cache at its defaults
                d = suffix.cache.speculate(rid, np.asarray(context[-24:], dtype=np.int32), max_spec_tokens=budget,
                                           max_spec_factor=1.0, min_token_prob=0.1, use_tree_spec=False)
                cands = [Candidates(list(d.token_ids), list(range(-1, len(d.token_ids) - 1)),
                                    [1.0] * len(d.token_ids), [0] * len(d.token_ids), "v")]
            trie = merge(cands, calib, streak_state(last_acc) if streak else ())
            order = (ranked(trie) if classifier is None else classifier_order(trie, classifier, calib))[:budget]
            if vllm_suffix:
                k = len(order)
            elif cost is None:
                k = len(order)
            else:
                k = best_prefix([trie.path[i] for i in order], 1.0, cost, 1)
            chosen = order[:k]
            if cost is not None and tree_factor > 1 and not vllm_suffix:
                if _is_tree(trie, chosen):  # a real tree: worth its extra cost against its best chain?
                    path_nodes = _best_chain(trie, chosen)
                    t_gain = 1 + sum(trie.path[i] for i in chosen)
                    c_gain = 1 + sum(trie.path[i] for i in path_nodes)
                    if c_gain / _c(cost, 1 + len(path_nodes)) >= t_gain / (tree_factor * _c(cost, 1 + len(chosen))):
                        chosen = path_nodes
            path = accepted_path(trie, chosen, out, g)  # greedy verification against the known continuation
            feedback(trie, chosen, path, calib)
            if record is not None and len(trie):
                on = [False] * len(trie)  # every node on the continuation, chosen or not
                for i in range(len(trie)):
                    q, d = trie.parents[i], trie.depth[i]
                    on[i] = (q < 0 or on[q]) and g + d - 1 < len(out) - 1 and trie.tokens[i] == out[g + d - 1]
                record.append((np.array([node_features(trie, i, calib) for i in range(len(trie))], dtype=np.float32),
                               np.array(on)))
            last_acc = len(path)
            predicted += sum(trie.path[i] for i in chosen)
            accepted += len(path)
            commit = out[g:g + len(path) + 1]
            # the target's top-k at the rows it just verified on the accepted path: root and accepted nodes
            rows = [context[-1]] + commit[:-1]
            table.update(np.asarray(rows), np.asarray(rec["top_ids"][g:g + len(rows)]),
                         np.asarray(rec["top_probs"][g:g + len(rows)]))
            ctx.extend(commit)
            if suffix:
                suffix.extend(rid, np.asarray(commit))
            g += len(commit)
            steps += 1
            tokens += len(commit)
            nodes += len(chosen)
            rows_cost = (cost or DEFAULT_COST)(1 + len(chosen))
            time += rows_cost * (tree_factor if _is_tree(trie, chosen) else 1.0) + drafted * draft_cost
            time += ("draft" in pools) * draft_upkeep
            drafting += drafted
            if "draft" in pools:  # where the draft layer's chain alone was accepted: what it adds to the copies
                only_draft += bool(path) and set(calib.key(trie.codes[path[0]])[0]) == {"draft"}
        if suffix:
            suffix.stop(rid)
    return {"tau": tokens / steps, "nodes_per_step": nodes / steps, "speedup_est": tokens / time,
            "predicted_accepted": predicted / steps, "accepted": accepted / steps,
            "draft_only_first": only_draft / steps, "drafting_steps": drafting / steps}


def accepted_path(trie, chosen, out: list[int], g: int) -> list[int]:
    """Greedy verification of the chosen trie nodes against the known continuation out[g:]: the longest root path
    along it (trie nodes, root to deepest; the continuation's last token is never a draft)."""
    kids: dict[int, dict[int, int]] = {}
    for i in chosen:
        kids.setdefault(trie.parents[i], {})[trie.tokens[i]] = i
    path, node = [], -1
    while g + len(path) < len(out) - 1:
        nxt = kids.get(node, {}).get(out[g + len(path)])
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return path


def _c(cost, rows):
    return cost(rows)


def _is_tree(trie, chosen) -> bool:
    kids: dict[int, int] = {}
    for i in chosen:
        kids[trie.parents[i]] = kids.get(trie.parents[i], 0) + 1
    return any(n > 1 for n in kids.values())


def _best_chain(trie, chosen) -> list[int]:
    """The chosen nodes' best root path (by path probability), as a chain."""
    kids: dict[int, list[int]] = {}
    for i in chosen:
        kids.setdefault(trie.parents[i], []).append(i)
    out, node = [], -1
    while kids.get(node):
        node = max(kids[node], key=lambda c: trie.path[c])
        out.append(node)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--pools", nargs="+", default=["context", "suffix", "recycled", "corpus"])
    ap.add_argument("--budgets", nargs="+", type=int, default=[4, 8, 16])
    ap.add_argument("--corpus", default=None, help="corpus table (.npz); default: the shipped one if any")
    ap.add_argument("--medusa", default=None, help="Medusa heads folder (default: the shipped ones)")
    ap.add_argument("--offset", type=int, default=0, help="first prompt of each dataset (unseen ones: 7)")
    ap.add_argument("--draft-layer", default=None, help="the \"draft\" pool's draft layer (an exit head folder "
                    "that reads features; default: the shipped one for the model)")
    ap.add_argument("--draft-widths", default="1,1,1",
                    help="the draft pool's tree: children per node at each depth from the layer's top-k (1,1,1: its "
                         "greedy chain of 3; 3,2,1: 3 + 6 + 6 nodes)")
    ap.add_argument("--draft-cost", type=float, default=0.25,
                    help="what the draft pool adds to every step over a plain step's time (passes + KV upkeep)")
    ap.add_argument("--draft-gate", type=float, nargs="+", default=None,
                    help="run the draft layer only on steps whose copied candidates promise fewer accepted tokens "
                         "than this (one replay per value; default: every step)")
    ap.add_argument("--draft-upkeep", type=float, default=0.0,
                    help="what the draft layer's KV upkeep adds to every step, drafting or not (with --draft-gate)")
    ap.add_argument("--cost", default=None, help='JSON {rows: relative step time}, e.g. \'{"1": 1.0, "9": 1.5}\'')
    ap.add_argument("--combos", action="store_true", help="every pool alone, all, and leave-one-out")
    ap.add_argument("--sets", nargs="+", default=None, help="pool sets to replay, e.g. context+suffix medusa")
    ap.add_argument("--tree-factor", type=float, default=1.15, help="tree verification cost over a chain's")
    ap.add_argument("--no-streak", action="store_true", help="calibrate without the request's last acceptance")
    ap.add_argument("--node-classifier", action="store_true",
                    help="C2T for candidate trees: per dataset, train a pool-node classifier on the other datasets' "
                         "replayed tries and compare its ranking with path probability")
    ap.add_argument("--out", default=str(OUT / "replay_pools.json"), help="results (JSON); a plot goes next to it")
    args = ap.parse_args()
    from vllm_adaspec.models import resolve_model

    model = resolve_model(args.model)
    cost = cost_curve({int(k): v for k, v in json.loads(args.cost).items()}) if args.cost else DEFAULT_COST
    sets = [set(args.pools)]
    if args.sets:
        sets = [set(x.split("+")) for x in args.sets]
    elif args.combos:
        sets = [{p} for p in args.pools] + [set(args.pools)] + [set(args.pools) - {p} for p in args.pools]
    used = set().union(*sets)
    corpus = None
    if "corpus" in used:
        from vllm_adaspec.pools.corpus import CorpusTable, find_corpus

        corpus = CorpusTable.load(args.corpus or find_corpus(model))
    medusa_acc = None
    if "medusa" in used:
        from vllm_adaspec.heads.medusa import find_medusa, load_medusa

        folder = find_medusa(json.load(open(f"{model}/config.json")), args.medusa or "auto")
        medusa_acc = load_medusa(folder, tensors=False)[0]["accuracy_by_rank"]
    vocab = json.load(open(f"{model}/config.json"))["vocab_size"]
    print("| dataset | pools | budget | tau (fixed B) | nodes/step | est. speedup | tau (cost-aware) | nodes/step "
          "| est. speedup | steps whose first accepted token only the draft layer proposed |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for ds in args.datasets:
        recs = reference(model, ds, args.num_prompts, args.max_tokens, 8, args.offset)
        v = replay(recs, {"suffix"}, 24, cost, vocab, vllm_suffix=True)
        print(f"| {ds} | vLLM suffix (chain, factor 1, min prob 0.1) | - | - | - | - | {v['tau']:.2f} | "
              f"{v['nodes_per_step']:.1f} | {v['speedup_est']:.2f} | - |", flush=True)
    rows = []
    refs = {}
    for ds in args.datasets:
        refs[ds] = reference(model, ds, args.num_prompts, args.max_tokens, 8, args.offset)
        if medusa_acc is not None:
            medusa_tops(model, folder, refs[ds])
        if "draft" in used:
            from vllm_adaspec.heads import SHIPPED_DIR

            draft_layer_trees(model, args.draft_layer or f"{SHIPPED_DIR}/{Path(model).name.lower()}-draft-layer",
                              refs[ds], tuple(int(w) for w in args.draft_widths.split(",")))
    if args.node_classifier:
        return compare_node_classifier(args, refs, sets[0], cost, vocab, corpus, medusa_acc)
    gates = [None] + (args.draft_gate or [])
    for ds, pools, b, gate in itertools.product(args.datasets, sets, args.budgets, gates):
        if gate is not None and "draft" not in pools:
            continue
        recs = refs[ds]
        kw = dict(streak=not args.no_streak, tree_factor=args.tree_factor, medusa_acc=medusa_acc,
                  draft_cost=args.draft_cost, draft_gate=gate, draft_upkeep=args.draft_upkeep)
        fixed = replay(recs, pools, b, None, vocab, corpus, **kw)
        aware = replay(recs, pools, b, cost, vocab, corpus, **kw)
        name = "+".join(sorted(pools)) + (f" (draft when copies < {gate}: {aware['drafting_steps']:.0%} of steps)"
                                          if gate is not None else "")
        print(f"| {ds} | {name} | {b} | {fixed['tau']:.2f} | {fixed['nodes_per_step']:.1f} | "
              f"{fixed['speedup_est']:.2f} | {aware['tau']:.2f} | {aware['nodes_per_step']:.1f} | "
              f"{aware['speedup_est']:.2f} | {aware['draft_only_first']:.2f} |", flush=True)
        rows.append({"dataset": ds, "pools": name, "budget": b, "fixed": fixed, "cost_aware": aware})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    plot(rows, Path(args.out).with_suffix(".png"))


def compare_node_classifier(args, refs, pools, cost, vocab, corpus, medusa_acc) -> None:
    """Train on every other dataset's replayed tries (held-out transfer, as C2T's paper does across benchmarks),
    replay this one ranked by the classifier and by path probability, fixed budget and cost-aware."""
    from vllm_adaspec.training.c2t_trainer import fit_classifier

    kw = dict(streak=not args.no_streak, tree_factor=args.tree_factor, medusa_acc=medusa_acc)
    data = {}
    for ds, recs in refs.items():
        rec: list = []
        replay(recs, pools, max(args.budgets), None, vocab, corpus, record=rec, **kw)
        data[ds] = (np.concatenate([r[0] for r in rec]), np.concatenate([r[1] for r in rec]))
    print("| dataset (held out) | budget | ranking | tau (fixed B) | nodes/step | est. speedup | tau (cost-aware) | "
          "nodes/step | est. speedup |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for ds, recs in refs.items():
        x = np.concatenate([data[o][0] for o in refs if o != ds])
        y = np.concatenate([data[o][1] for o in refs if o != ds])
        params = fit_classifier(x, y, epochs=20, neg_per_pos=None, seed=0)  # all negatives: calibrated
        for b in args.budgets:
            for name, clf in (("path probability", None), ("classifier", params)):
                fixed = replay(recs, pools, b, None, vocab, corpus, classifier=clf, **kw)
                aware = replay(recs, pools, b, cost, vocab, corpus, classifier=clf, **kw)
                print(f"| {ds} | {b} | {name} | {fixed['tau']:.2f} | {fixed['nodes_per_step']:.1f} | "
                      f"{fixed['speedup_est']:.2f} | {aware['tau']:.2f} | {aware['nodes_per_step']:.1f} | "
                      f"{aware['speedup_est']:.2f} |", flush=True)
                rows.append({"dataset": ds, "budget": b, "ranking": name, "fixed": fixed, "cost_aware": aware})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


def plot(rows: list[dict], path: Path) -> None:
    """Estimated speedup against budget, one line per pool set, per dataset (cost-aware choice solid, fixed dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({r["dataset"] for r in rows})
    fig, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4.5), squeeze=False)
    for ax, ds in zip(axes[0], datasets):
        for pools in sorted({r["pools"] for r in rows if r["dataset"] == ds}):
            pts = sorted((r["budget"], r["cost_aware"]["speedup_est"], r["fixed"]["speedup_est"]) for r in rows
                         if r["dataset"] == ds and r["pools"] == pools)
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=pools)
            ax.plot([p[0] for p in pts], [p[2] for p in pts], ls="--", color=line.get_color(), alpha=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("node budget B")
        ax.set_ylabel("estimated speedup over plain (replay)")
        ax.set_title(f"{ds}: cost-aware (solid) vs all B nodes (dashed)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
