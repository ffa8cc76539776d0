"""Train C2T's node classifier (paper 004, appendix B) from labelled tree nodes.

    data   = (features [N, 3] = joint probability, top-1000 entropy, depth; accepted [N] bool) from fully verified
             draft trees
    train  = BCE, Adam (lr 1e-3), batches of 1024, negatives subsampled to `neg_per_pos` per positive (accepted
             nodes are rare: a few per tree of hundreds)
    judge  = recall of accepted nodes and positive rate (the share of nodes kept) at a threshold beta, on a held-out
             split: recall first, then the smaller positive rate

`train_c2t` collects the data inside vLLM: greedy generation on the self-distillation prompts with wide
joint-probability trees (every node verified; the proposer records each tree's node features and, after
verification, which nodes were on the accepted path), then fits, judges on held-out prompts and writes the
classifier next to the exit head.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from vllm_adaspec.trees.c2t import classifier_logits, confidence, init_classifier
from vllm_adaspec.engine.vllm_surface import vllm_object

__all__ = ["fit_classifier", "recall_and_positive_rate", "replay_trees", "joint_top", "c2t_keep", "C2TSettings",
           "collect_trees", "train_c2t"]


def fit_classifier(feats: np.ndarray, accepted: np.ndarray, epochs: int = 10, lr: float = 1e-3, batch: int = 1024,
                   neg_per_pos: float | None = 4.0, seed: int = 0) -> dict[str, torch.Tensor]:
    """feats [N, F] (C2T: F = 3), accepted [N] -> classifier parameters (trees/c2t.py layout).

    The features live on different scales (probability in [0, 1], entropy in nats, depth 1..10): training sees
    them standardized, and the standardization is folded into the first layer afterwards, so the saved classifier
    reads raw features. neg_per_pos None: every negative (confidences stay calibrated probabilities)."""
    if feats.ndim != 2 or len(feats) != len(accepted):
        raise ValueError(f"feats must be [N, F] with one label per row, got {feats.shape} and {len(accepted)} labels")
    pos = np.flatnonzero(accepted)
    neg = np.flatnonzero(~accepted.astype(bool))
    if not len(pos) or not len(neg):
        raise ValueError(f"need accepted and rejected nodes, got {len(pos)} and {len(neg)}")
    rng = np.random.default_rng(seed)
    neg_per_pos = len(neg) / len(pos) if neg_per_pos is None else neg_per_pos
    params = {k: v.clone().requires_grad_(True)
              for k, v in init_classifier(seed=seed, features=feats.shape[1]).items()}
    opt = torch.optim.Adam(params.values(), lr=lr)
    x_raw = torch.as_tensor(feats, dtype=torch.float32)
    mu, sd = x_raw.mean(0), x_raw.std(0).clamp_min(1e-6)
    x_all = (x_raw - mu) / sd
    y_all = torch.as_tensor(accepted, dtype=torch.float32)
    for _ in range(epochs):  # a fresh negative sample each epoch
        keep = np.concatenate([pos, rng.choice(neg, size=min(len(neg), int(neg_per_pos * len(pos))), replace=False)])
        rng.shuffle(keep)
        for lo in range(0, len(keep), batch):
            idx = torch.as_tensor(keep[lo:lo + batch])
            loss = torch.nn.functional.binary_cross_entropy_with_logits(classifier_logits(params, x_all[idx]),
                                                                        y_all[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    out = {k: v.detach().clone() for k, v in params.items()}
    # ((x - mu) / sd) @ w1 + b1 = x @ (w1 / sd[:, None]) + (b1 - (mu / sd) @ w1)
    out["b1"] = out["b1"] - (mu / sd) @ out["w1"]
    out["w1"] = out["w1"] / sd[:, None]
    return out


@torch.no_grad()
def recall_and_positive_rate(params: dict[str, torch.Tensor], feats: np.ndarray, accepted: np.ndarray,
                             beta: float) -> tuple[float, float]:
    """(share of accepted nodes with confidence > beta, share of all nodes with confidence > beta)."""
    kept = (confidence(params, torch.as_tensor(feats, dtype=torch.float32)) > beta).numpy()
    acc = accepted.astype(bool)
    return float(kept[acc].mean()) if acc.any() else 0.0, float(kept.mean())


# --- trees replayed offline: what C2T at beta and the joint-probability top-B would have verified and accepted ---

def _depth_reached(parents: np.ndarray, accepted: np.ndarray, kept: np.ndarray) -> int:
    """Accepted depth if only `kept` nodes were verified: the accepted path's nodes (root to deepest) while kept."""
    path = np.flatnonzero(accepted)  # breadth-first order: shallow first
    d = 0
    for node in path:
        if not kept[node]:
            break
        d += 1
    return d


def replay_trees(trees, select) -> tuple[float, float]:
    """trees [(feats [n, 3], accepted [n], parents [n])], select(feats, parents) -> kept [n] bool (closed under
    parents) -> (tau = 1 + mean accepted depth, gamma = mean kept nodes) over the trees."""
    depth = nodes = 0
    for feats, accepted, parents in trees:
        kept = select(feats, parents)
        depth += _depth_reached(parents, accepted, kept)
        nodes += int(kept.sum())
    return 1 + depth / len(trees), nodes / len(trees)


def joint_top(budget: int):
    """The `budget` nodes of highest joint probability (a child is never above its parent: closed)."""
    def select(feats, parents):
        kept = np.zeros(len(feats), dtype=bool)
        kept[np.argsort(-feats[:, 0], kind="stable")[:budget]] = True
        return kept
    return select


def c2t_keep(params: dict[str, torch.Tensor], beta: float):
    """Pre-pruning as in the engine: a node is kept when its confidence passes beta and its parent was kept."""
    def select(feats, parents):
        with torch.no_grad():
            passed = (confidence(params, torch.as_tensor(feats)) > beta).numpy()
        kept = np.zeros(len(feats), dtype=bool)
        for i in range(len(feats)):  # breadth-first: parents come first
            kept[i] = passed[i] and (parents[i] < 0 or kept[parents[i]])
        return kept
    return select


# --- collecting labelled trees inside vLLM and training the shipped classifier ---

@dataclass(frozen=True)
class C2TSettings:
    model: str  # Hugging Face folder of the target
    data: str  # `adaspec distill` folder: its prompts (never evaluation sets) seed the trees
    exit_head: str  # the trained exit head whose trees are judged; c2t.{json,safetensors} are written there
    prompts: int = 64
    max_tokens: int = 96
    budget: int = 24  # nodes verified per tree while collecting: wide, so that rejected alternatives are seen
    top_k: int = 4
    max_depth: int = 6
    epochs: int = 60
    holdout_every: int = 4  # every 4th chunk of 16 prompts is held out
    seed: int = 0
    trees: str | None = None  # .npz of labelled trees: read when it exists, else collected and written there


def save_trees(path: str, chunks) -> None:
    """Chunks of trees -> one .npz (flat arrays + offsets)."""
    trees = [t for c in chunks for t in c]
    sizes = np.array([len(t[0]) for t in trees], dtype=np.int64)
    np.savez_compressed(path, feats=np.concatenate([t[0] for t in trees]), accepted=np.concatenate([t[1] for t in trees]),
                        parents=np.concatenate([t[2] for t in trees]), sizes=sizes,
                        chunk_sizes=np.array([len(c) for c in chunks], dtype=np.int64))


def load_trees(path: str):
    z = np.load(path)
    off = np.concatenate([[0], np.cumsum(z["sizes"])])
    trees = [(z["feats"][a:b], z["accepted"][a:b], z["parents"][a:b]) for a, b in zip(off[:-1], off[1:])]
    cs = np.concatenate([[0], np.cumsum(z["chunk_sizes"])])
    return [trees[a:b] for a, b in zip(cs[:-1], cs[1:])]


def collect_trees(st: C2TSettings, progress: bool = True) -> list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """Greedy generation through vLLM with wide joint-probability trees, every node verified. Returns per chunk
    of prompts its trees [(features [n, 3], accepted [n], parents [n])]."""
    os.environ["VLLM_ADASPEC_RECORD_TREES"] = "1"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # records come back through get_stats in-process
    from tqdm import tqdm
    LLM, SamplingParams = vllm_object("LLM"), vllm_object("SamplingParams")

    from vllm_adaspec.training.distill import load_shards

    seqs = load_shards(st.data)
    order = np.random.default_rng(st.seed).permutation(len(seqs))[:st.prompts]
    prompts = [seqs.tokens[seqs.offsets[i]:seqs.offsets[i] + seqs.prompt_lens[i]].tolist() for i in order]
    llm = LLM(model=st.model, dtype="float32", seed=st.seed, max_model_len=2048, enforce_eager=True,
              kv_cache_memory_bytes=2**31,
              speculative_config={"model": "vllm_adaspec.EarlyExitProposer", "num_speculative_tokens": st.budget},
              additional_config={"adaspec": {"exit_head": st.exit_head, "cost_model": "off", "policy": "fixed",
                                             "tree": {"budget": st.budget, "top_k": st.top_k,
                                                      "max_depth": st.max_depth}}})
    params = SamplingParams(temperature=0.0, max_tokens=st.max_tokens, detokenize=False)
    chunks, size = [], 16
    bar = tqdm(total=len(prompts), unit="prompt", desc="labelled trees", disable=not progress)
    for lo in range(0, len(prompts), size):
        before = len(llm.collective_rpc("adaspec_stats")[0].get("tree_records", []))
        llm.generate([{"prompt_token_ids": p[-1500:]} for p in prompts[lo:lo + size]], params, use_tqdm=False)
        recs = llm.collective_rpc("adaspec_stats")[0].get("tree_records", [])[before:]
        chunks.append([(np.asarray(f, dtype=np.float32), np.asarray(a, dtype=bool), np.asarray(q, dtype=np.int64))
                       for f, a, q in recs])
        bar.update(len(prompts[lo:lo + size]))
        bar.set_postfix(trees=sum(map(len, chunks)))
    bar.close()
    del llm
    return chunks


BETAS = tuple(round(0.05 * i, 2) for i in range(1, 20))  # 0.05 .. 0.95
JOINT_BUDGETS = (4, 8, 16)


def train_c2t(st: C2TSettings, progress: bool = True, log=print) -> dict:
    """Collect labelled trees, fit, judge on held-out chunks (recall / positive rate per beta, and the replayed
    tau and verified nodes of C2T against joint-probability top-B on the same trees), save next to the head."""
    from vllm_adaspec.heads.c2t import save_c2t

    t0 = time.perf_counter()
    if st.trees is not None and os.path.exists(st.trees):
        chunks = load_trees(st.trees)
    else:
        chunks = collect_trees(st, progress)
        if st.trees is not None:
            save_trees(st.trees, chunks)
    held = [t for c, trees in enumerate(chunks) if c % st.holdout_every == st.holdout_every - 1 for t in trees]
    train = [t for c, trees in enumerate(chunks) if c % st.holdout_every != st.holdout_every - 1 for t in trees]
    if not train or not held:
        raise ValueError(f"too few trees to train and judge ({len(train)} / {len(held)}); raise --prompts")
    cat = lambda ts, j: np.concatenate([t[j] for t in ts])  # noqa: E731
    x, y = cat(train, 0), cat(train, 1)
    xh, yh = cat(held, 0), cat(held, 1)
    log(f"{len(train)} training trees ({len(y)} nodes, {y.mean():.3f} accepted), {len(held)} held out")
    params = fit_classifier(x, y, epochs=st.epochs, seed=st.seed)
    judged = {f"{b:.2f}": dict(zip(("recall", "positive_rate"), recall_and_positive_rate(params, xh, yh, b)))
              for b in BETAS}
    replay = {f"joint_B{b}": dict(zip(("tau", "gamma"), replay_trees(held, joint_top(b)))) for b in JOINT_BUDGETS}
    replay.update({f"c2t_beta{b:.2f}": dict(zip(("tau", "gamma"), replay_trees(held, c2t_keep(params, b))))
                   for b in BETAS})
    replay[f"joint_B{st.budget}_full"] = dict(zip(("tau", "gamma"), replay_trees(held, joint_top(st.budget))))
    # At equal tau (within 3%) how many fewer nodes C2T verifies than each joint budget, on the held-out trees.
    matched = {}
    for b in JOINT_BUDGETS:
        j = replay[f"joint_B{b}"]
        ok = [(r["gamma"], name) for name, r in replay.items() if name.startswith("c2t") and r["tau"] >= 0.97 * j["tau"]]
        if ok:
            g, name = min(ok)
            matched[f"joint_B{b}"] = {"c2t": name, "gamma_saved": round(1 - g / j["gamma"], 3)}
    report = {"train_trees": len(train), "held_out_trees": len(held), "train_nodes": int(len(y)),
              "accepted_share": float(y.mean()), "held_out": judged, "replay": replay, "matched": matched,
              "seconds": round(time.perf_counter() - t0, 1)}
    for name, r in replay.items():
        log(f"replay {name:14s} tau {r['tau']:.3f}  gamma {r['gamma']:.2f}")
    settings = {k: v for k, v in asdict(st).items() if k not in ("model", "data", "exit_head", "trees")}
    save_c2t(st.exit_head, params, {"features": ["joint_probability", "top1000_entropy", "depth"],
                              "training": {**settings, **report}})
    return {**report, "out": st.exit_head}
