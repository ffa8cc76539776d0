"""Train the acceptance predictor of `thompson-cali` (EESD Eq. 5) for one trained exit head.

Data: the `adaspec distill` set the head was trained on. For a subset of sequences one pass through the whole
target gives h_N (for the exit head) and the last layer (normed: what vLLM samples from). Teacher-forced, the
exit head's draft at position p is correct iff its argmax equals the target's argmax recorded there.

Samples mirror a drafting round. The round starts after the target produced token a+1 from its row at position a
(H^T = normed last layer at a). Draft i comes from the exit's normed hidden at position a+i (H^D_i) and is
accepted iff the exit agrees with the target there. The policy only asks about draft i after drafts 1..i-1 were
proposed, and they matter only if accepted, so a pair (a, i) is a sample only where the exit agrees at a+1..a+i-1:
the situations the predictor is consulted in, with inputs equal to the true text.

Loss: binary cross-entropy (EESD trains W_p as a 2-way classifier with cross-entropy; the same thing). Reported on
held-out sequences against a per-depth constant (the best input-free predictor): log loss, Brier score, AUC.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from vllm_adaspec.heads import exit_head_hash
from vllm_adaspec.policies.calibration import MAX_DEPTH, CalibrationPredictor, predictor_logits
from vllm_adaspec.training.distill import Sequences, load_shards
from vllm_adaspec.training.exit_trainer import _batches, _pad
from vllm_adaspec.training.layers import ExitHead, LayerShape, read_hf_tensors, rms_norm, target_prefix_layers

__all__ = ["CalibrationSettings", "train_calibration", "round_samples"]


@dataclass(frozen=True)
class CalibrationSettings:
    model: str  # Hugging Face folder of the target
    data: str  # `adaspec distill` folder
    exit_head: str  # trained exit head folder (the predictor is tied to it)
    out: str  # where calibration.{json,safetensors} go (default in the CLI: the exit head folder)
    max_tokens: int = 60_000  # generated tokens to use (the full-model pass over them is the slow part)
    epochs: int = 6
    lr: float = 3e-3
    batch: int = 4096
    holdout_every: int = 20
    seed: int = 0


def round_samples(agree: np.ndarray, max_depth: int = MAX_DEPTH) -> tuple[np.ndarray, np.ndarray]:
    """agree [P] (exit correct at label position p, teacher-forced) -> (anchor a, depth i) pairs.

    (a, i) is kept when a + i < P and the exit agrees at a+1 .. a+i-1 (a round reaches draft i only then)."""
    anchors, depths = [], []
    n = len(agree)
    for i in range(1, max_depth + 1):
        a = np.arange(max(0, n - i))
        ok = np.ones(len(a), dtype=bool)
        for j in range(1, i):
            ok &= agree[a + j]
        anchors.append(a[ok])
        depths.append(np.full(int(ok.sum()), i))
    return np.concatenate(anchors), np.concatenate(depths)


def _load_exit(folder: str, s: LayerShape):
    from vllm_adaspec.heads import load_exit_head

    meta, t = load_exit_head(folder)
    head = ExitHead(s, meta["num_exit_layers"])
    head.layers.load_state_dict({k[len("layers."):]: v.float() for k, v in t.items() if k.startswith("layers.")})
    head.norm.weight.data.copy_(t["norm.weight"].float())
    return meta, head.eval(), t["draft_vocab"].long(), t.get("lm_head.weight")


def _load_models(st: CalibrationSettings):
    """(exit meta, target stack with every layer, exit head, draft vocab, its LM-head rows, final norm, shape)."""
    with open(os.path.join(st.model, "config.json")) as f:
        cfg = json.load(f)
    s = LayerShape.from_hf_config(cfg)
    meta, head, vocab, lm_rows = _load_exit(st.exit_head, s)
    tied = cfg.get("tie_word_embeddings", False)
    lm_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    t = read_hf_tensors(st.model, ["model.norm.weight", lm_name])
    lm_rows = (t[lm_name][vocab] if lm_rows is None else lm_rows).float()
    stack = target_prefix_layers(st.model, cfg["num_hidden_layers"])
    return meta, stack, head, vocab, lm_rows, t["model.norm.weight"], s


def _features(models, seqs: Sequences, idx: np.ndarray, progress: bool, batch_tokens: int = 4096):
    """For sequences idx: per sequence (H^T [P, d] fp16, H^D [P, d] fp16, agree [P] bool) over label positions."""
    from tqdm import tqdm

    meta, stack, head, vocab, lm_rows, final_norm, s = models
    n, L = meta["exit_layer"], len(stack.layers)
    go = seqs.gen_offsets()
    lengths = np.diff(seqs.offsets)
    order = idx[np.argsort(lengths[idx], kind="stable")]
    out = {}
    bar = tqdm(total=int(sum(go[i + 1] - go[i] for i in idx)), unit="tok", desc="target + exit passes",
               disable=not progress)
    with torch.inference_mode():
        for batch in _batches(lengths, order, batch_tokens):
            ids = torch.from_numpy(_pad([seqs.tokens[seqs.offsets[i]:seqs.offsets[i + 1]] for i in batch]).astype(np.int64))
            pos = torch.arange(ids.shape[1])[None].expand_as(ids)
            hs = stack(ids, pos, capture=(n, L))  # right padding: causal attention keeps real rows exact
            h_t_all = rms_norm(hs[L], final_norm, s.eps)
            h_d_all = head(hs[n], pos)
            for j, i in enumerate(batch):
                p0, g = int(seqs.prompt_lens[i]) - 1, int(go[i + 1] - go[i])
                rows = slice(p0, p0 + g)  # label positions: row p predicts token p+1 (a generated token)
                h_d = h_d_all[j, rows]
                pred = vocab[(h_d @ lm_rows.T).argmax(-1)].numpy()
                agree = pred == seqs.topk_ids[go[i]:go[i + 1], 0]
                out[int(i)] = (h_t_all[j, rows].half().numpy(), h_d.half().numpy(), agree)
                bar.update(g)
    bar.close()
    return [out[int(i)] for i in idx]


def _stack(feats) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """All round samples: (H^T rows, H^D rows as global indices into the concatenated arrays), depth, label."""
    ht = torch.from_numpy(np.concatenate([f[0] for f in feats]))
    hd = torch.from_numpy(np.concatenate([f[1] for f in feats]))
    ti, di, dep, lab = [], [], [], []
    base = 0
    for _, _, agree in feats:
        a, i = round_samples(agree)
        ti.append(base + a)
        di.append(base + a + i)
        dep.append(i)
        lab.append(agree[a + i])
        base += len(agree)
    cat = lambda xs, dt: torch.from_numpy(np.concatenate(xs).astype(dt))  # noqa: E731
    return ht, hd, cat(ti, np.int64), cat(di, np.int64), cat(dep, np.int64), cat(lab, np.float32)


def _auc(score: np.ndarray, label: np.ndarray) -> float:
    order = np.argsort(score, kind="stable")
    ranks = np.empty(len(score))
    ranks[order] = np.arange(1, len(score) + 1)
    pos = label > 0.5
    npos, nneg = int(pos.sum()), int((~pos).sum())
    if npos == 0 or nneg == 0:
        return float("nan")
    return float((ranks[pos].sum() - npos * (npos + 1) / 2) / (npos * nneg))


def _metrics(p: np.ndarray, y: np.ndarray) -> dict:
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return {"log_loss": float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean()),
            "brier": float(((p - y) ** 2).mean()), "auc": _auc(p, y)}


def train_calibration(st: CalibrationSettings, progress: bool = True, log=print) -> dict:
    from tqdm import tqdm

    t_start = time.perf_counter()
    torch.manual_seed(st.seed)
    rng = np.random.default_rng(st.seed)
    seqs = load_shards(st.data)
    go = seqs.gen_offsets()
    # Same held-out split as the exit-layer trainer: the predictor is judged on text the head never saw.
    is_held = np.random.default_rng(12345).permutation(len(seqs)) % st.holdout_every == 0
    gen = np.diff(go)
    pick = rng.permutation(np.flatnonzero(~is_held & (gen > 0)))
    pick = pick[: max(1, int(np.searchsorted(np.cumsum(gen[pick]), st.max_tokens)) + 1)]
    held = np.flatnonzero(is_held & (gen > 0))
    held = held[: max(1, int(np.searchsorted(np.cumsum(gen[held]), max(2000, st.max_tokens // 5))) + 1)]
    models = _load_models(st)
    meta = models[0]
    train_f = _features(models, seqs, pick, progress)
    held_f = _features(models, seqs, held, progress)
    ht, hd, ti, di, dep, lab = _stack(train_f)
    ht_h, hd_h, ti_h, di_h, dep_h, lab_h = _stack(held_f)
    d = ht.shape[1]
    log(f"{len(lab)} training samples from {len(pick)} sequences, {len(lab_h)} held-out; "
        f"acceptance {lab.mean():.3f} (held-out {lab_h.mean():.3f})")

    u = torch.zeros(MAX_DEPTH, d, requires_grad=True)
    w = torch.zeros(d, requires_grad=True)
    base = torch.tensor([float(lab[dep == i].mean()) if (dep == i).any() else 0.3 for i in range(1, MAX_DEPTH + 1)])
    b = torch.logit(base.clamp(0.01, 0.99)).clone().requires_grad_(True)  # start at the per-depth constant
    opt = torch.optim.Adam([u, w, b], lr=st.lr)

    def logits(ht_, hd_, ti_, di_, dep_, sel):
        proj = ht_[ti_[sel]].float() @ u.T  # [M, 10]
        x = proj.gather(1, (dep_[sel].clamp(max=MAX_DEPTH) - 1)[:, None]).squeeze(1)
        return x + hd_[di_[sel]].float() @ w + b[dep_[sel].clamp(max=MAX_DEPTH) - 1]

    steps = st.epochs * max(1, len(lab) // st.batch)
    bar = tqdm(total=steps, desc="calibration predictor", unit="step", disable=not progress)
    for _ in range(st.epochs):
        perm = torch.from_numpy(rng.permutation(len(lab)))
        for k in range(max(1, len(lab) // st.batch)):
            sel = perm[k * st.batch:(k + 1) * st.batch]
            loss = F.binary_cross_entropy_with_logits(logits(ht, hd, ti, di, dep, sel), lab[sel])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            bar.set_postfix(loss=f"{loss.item():.4f}")
            bar.update(1)
    bar.close()

    with torch.no_grad():
        all_h = torch.arange(len(lab_h))
        p_h = torch.sigmoid(logits(ht_h, hd_h, ti_h, di_h, dep_h, all_h)).numpy()
        const = base[(dep_h.clamp(max=MAX_DEPTH) - 1)].numpy()
        # Consistency check of the runtime path (predictor_logits) against the training expression.
        pred = CalibrationPredictor(u.detach().clone(), w.detach().clone(), b.detach().clone())
        sel = all_h[:256]
        rt = torch.stack([predictor_logits(pred.project_target(ht_h[ti_h[j:j + 1]].float()), hd_h[di_h[j:j + 1]].float(),
                                           pred.w, pred.b, int(dep_h[j]))[0] for j in sel])
        assert torch.allclose(rt, logits(ht_h, hd_h, ti_h, di_h, dep_h, sel), atol=1e-4)
    y = lab_h.numpy()
    report = {"held_out": _metrics(p_h, y), "held_out_constant_per_depth": _metrics(const, y),
              "held_out_acceptance": float(y.mean()), "held_out_samples": int(len(y)), "train_samples": int(len(lab)),
              "train_sequences": int(len(pick)), "seconds": round(time.perf_counter() - t_start, 1),
              "calibration_deciles": _deciles(p_h, y)}
    log(f"held-out log loss {report['held_out']['log_loss']:.4f} vs {report['held_out_constant_per_depth']['log_loss']:.4f} "
        f"(constant per depth), AUC {report['held_out']['auc']:.3f}")
    pred.save(st.out, {"exit_head_hash": exit_head_hash(st.exit_head), "exit_layer": meta["exit_layer"],
                       "base_model": meta["base_model"], "hidden_size": d,
                       "training": {**{k: v for k, v in asdict(st).items() if k not in ("model", "data", "exit_head", "out")},
                                    **report}})
    return {**report, "out": st.out}


def _deciles(p: np.ndarray, y: np.ndarray) -> list[list[float]]:
    """[mean predicted, observed, count] per predicted-probability decile (reliability table)."""
    edges = np.quantile(p, np.linspace(0, 1, 11))
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (p >= lo) & (p <= hi)
        if m.any():
            out.append([round(float(p[m].mean()), 4), round(float(y[m].mean()), 4), int(m.sum())])
    return out
