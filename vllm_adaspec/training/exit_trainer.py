"""Train EESD's exit layer by self-distillation (paper sections 3.1-3.2).

    h_N = first N target layers (frozen, computed once per data set and cached on disk)
    q   = softmax(W'[V'] . norm(exit_layers(h_N)))      W' = the target's LM head (shared, frozen) or a trained copy
    loss on every generated position: CE(q, argmax p)  ("argmax")  or  CE(q, p restricted to its top-k) ("distribution")

p is the target's next-token distribution, recorded by `adaspec distill` as its top-k log-probs. The exit layers
start as copies of the target's last layers and the norm as its final norm: at step 0 the head is "the last layer
applied early". V' is the draft vocabulary, the most frequent next tokens of the training split; the drafter maps
its argmax back to full ids, so a smaller V' costs agreement only on tokens outside it.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from vllm_adaspec.training.distill import Sequences, load_shards
from vllm_adaspec.training.layers import ExitHead, LayerShape, load_layer, read_hf_tensors, target_prefix_layers

__all__ = ["ExitTrainSettings", "train_exit_layer", "hidden_cache", "choose_draft_vocab", "evaluate"]


@dataclass(frozen=True)
class ExitTrainSettings:
    model: str  # Hugging Face folder of the target
    data: str  # folder written by `adaspec distill`
    exit_layer: int  # N
    out: str  # checkpoint folder
    num_exit_layers: int = 1
    loss: str = "distribution"  # or "argmax"
    draft_vocab: int = 8192  # V'; 0 = the full vocabulary
    train_head: bool = False
    epochs: float = 1.0
    lr: float = 1e-3
    batch_tokens: int = 2048
    holdout_every: int = 20  # every 20th sequence is held out for evaluation
    seed: int = 0
    name: str | None = None  # base model name recorded in the checkpoint
    # How the exit layers start: "last" = copies of the target's last layers (EESD); "next" = copies of layers
    # N, N+1, ... (the exit starts as the untrained exit one layer deeper); "identity" = last layers with o_proj
    # and down_proj zeroed, so the exit starts as exactly the untrained exit (final norm + LM head on h_N).
    init: str = "identity"


def _read_config(model: str) -> dict:
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)


def _batches(lengths: np.ndarray, order: np.ndarray, budget: int) -> list[np.ndarray]:
    """Group sequence indices (already ordered) into batches of at most `budget` padded tokens."""
    out, cur, longest = [], [], 0
    for i in order:
        n = int(lengths[i])
        if cur and max(longest, n) * (len(cur) + 1) > budget:
            out.append(np.asarray(cur))
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(np.asarray(cur))
    return out


def _pad(seqs: list[np.ndarray], fill=0) -> np.ndarray:
    t = max(len(s) for s in seqs)
    out = np.full((len(seqs), t) + seqs[0].shape[1:], fill, dtype=seqs[0].dtype)
    for j, s in enumerate(seqs):
        out[j, : len(s)] = s
    return out


def hidden_cache(model: str, data: str, seqs: Sequences, n: int, batch_tokens: int = 4096,
                 progress: bool = True) -> np.ndarray:
    """h_N for every token of `data` as float16 [T, H], computed once and kept at DATA/hidden-N{n}.npy."""
    from tqdm import tqdm

    path = os.path.join(data, f"hidden-N{n}.npy")
    if os.path.exists(path):
        arr = np.load(path, mmap_mode="r")
        if arr.shape[0] == len(seqs.tokens):
            return arr
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    stack = target_prefix_layers(model, n).to(device)
    hdim = stack.embed.weight.shape[1]
    tmp = path + ".tmp.npy"
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=(len(seqs.tokens), hdim))
    lengths = np.diff(seqs.offsets)
    order = np.argsort(lengths, kind="stable")
    bar = tqdm(total=int(lengths.sum()), unit="tok", desc=f"h_{n} (first {n} layers, once)", disable=not progress)
    with torch.inference_mode():
        for batch in _batches(lengths, order, batch_tokens):
            ids = torch.from_numpy(_pad([seqs.tokens[seqs.offsets[i]:seqs.offsets[i + 1]] for i in batch]).astype(np.int64))
            ids = ids.to(device)
            pos = torch.arange(ids.shape[1], device=device)[None].expand_as(ids)
            h = stack(ids, pos, capture=(n,))[n].to(torch.float16).cpu().numpy()
            for j, i in enumerate(batch):
                out[seqs.offsets[i]:seqs.offsets[i + 1]] = h[j, : lengths[i]]
            bar.update(int(lengths[batch].sum()))
    bar.close()
    out.flush()
    del out
    os.replace(tmp, path)
    return np.load(path, mmap_mode="r")


def choose_draft_vocab(seqs: Sequences, train_idx: np.ndarray, size: int, vocab_size: int,
                       always: tuple[int, ...] = ()) -> tuple[np.ndarray, float]:
    """The `size` most frequent next tokens (target argmax) of the training split, plus `always` (e.g. EOS).
    Returns (sorted ids, share of training labels covered)."""
    go = seqs.gen_offsets()
    labels = np.concatenate([seqs.topk_ids[go[i]:go[i + 1], 0] for i in train_idx])
    if size <= 0 or size >= vocab_size:
        return np.arange(vocab_size), 1.0
    return most_frequent(labels, size, vocab_size, always)


def most_frequent(labels: np.ndarray, size: int, vocab_size: int, always: tuple[int, ...] = ()) -> tuple[np.ndarray, float]:
    """The `size` most frequent ids of `labels` plus `always`, sorted, and the share of labels they cover."""
    counts = np.bincount(labels, minlength=vocab_size)
    keep = set(int(t) for t in always if 0 <= t < vocab_size)
    for t in np.argsort(-counts, kind="stable"):
        if len(keep) >= size:
            break
        keep.add(int(t))
    ids = np.asarray(sorted(keep))
    return ids, float(counts[ids].sum() / max(1, counts.sum()))


def _label_rows(seqs: Sequences, go: np.ndarray, batch: np.ndarray) -> tuple[list, np.ndarray]:
    """For each sequence: (batch row, positions predicting generated tokens) and the matching topk rows."""
    where, rows = [], []
    for j, i in enumerate(batch):
        p = int(seqs.prompt_lens[i])
        g = int(go[i + 1] - go[i])
        if g == 0:
            continue
        where.append((j, np.arange(p - 1, p - 1 + g)))
        rows.append(np.arange(go[i], go[i + 1]))
    return where, (np.concatenate(rows) if rows else np.zeros(0, np.int64))


def _forward(head, hidden, seqs, batch, device):
    lengths = np.diff(seqs.offsets)
    h = torch.from_numpy(_pad([np.asarray(hidden[seqs.offsets[i]:seqs.offsets[i] + lengths[i]]) for i in batch]))
    h = h.to(device, torch.float32)
    pos = torch.arange(h.shape[1], device=device)[None].expand(h.shape[0], -1)
    return head(h, pos)  # [B, T, H]


def evaluate(head, lm_rows, vocab_ids, seqs, hidden, idx, device, batch_tokens=8192) -> dict:
    """Top-1 agreement of the exit head with the target's argmax on sequences `idx` (all / greedy / sampled)."""
    go = seqs.gen_offsets()
    vocab_t = torch.as_tensor(vocab_ids, device=device)
    hit = {True: [0, 0], False: [0, 0]}
    lengths = np.diff(seqs.offsets)
    with torch.no_grad():
        for batch in _batches(lengths, idx, batch_tokens):
            out = _forward(head, hidden, seqs, batch, device)
            where, rows = _label_rows(seqs, go, batch)
            for (j, pos), i in zip(where, [b for b in batch if go[b + 1] > go[b]]):
                pred = vocab_t[(out[j, torch.as_tensor(pos, device=device)] @ lm_rows.T).argmax(-1)].cpu().numpy()
                tgt = seqs.topk_ids[go[i]:go[i + 1], 0]
                hit[bool(seqs.sampled[i])][0] += int((pred == tgt).sum())
                hit[bool(seqs.sampled[i])][1] += len(tgt)
    tot = hit[True][1] + hit[False][1]
    return {"agreement": (hit[True][0] + hit[False][0]) / max(1, tot), "tokens": tot,
            "agreement_greedy": hit[False][0] / max(1, hit[False][1]),
            "agreement_sampled": hit[True][0] / max(1, hit[True][1])}


def train_exit_layer(st: ExitTrainSettings, progress: bool = True, log=print) -> dict:
    """Train, evaluate on the held-out split, write the checkpoint to `st.out`. Returns the report."""
    from tqdm import tqdm

    from vllm_adaspec.heads import config_hash, fingerprint_names, save_exit_head, weights_fingerprint

    t_start = time.perf_counter()
    torch.manual_seed(st.seed)
    rng = np.random.default_rng(st.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = _read_config(st.model)
    L = cfg["num_hidden_layers"]
    if not 1 <= st.exit_layer < L:
        raise ValueError(f"exit_layer must satisfy 1 <= N < {L}, got {st.exit_layer}")
    if not 1 <= st.num_exit_layers <= L:
        raise ValueError(f"num_exit_layers must be in 1..{L}, got {st.num_exit_layers}")
    if st.init not in ("last", "next", "identity"):
        raise ValueError(f"init must be 'last', 'next' or 'identity', got {st.init!r}")
    if st.loss not in ("argmax", "distribution"):
        raise ValueError(f"loss must be 'argmax' or 'distribution', got {st.loss!r}")
    s = LayerShape.from_hf_config(cfg)

    seqs = load_shards(st.data)
    all_idx = np.arange(len(seqs))
    # A seeded random 1/holdout_every of the sequences (greedy and sampled alike) is held out.
    is_held = np.random.default_rng(12345).permutation(len(seqs)) % st.holdout_every == 0
    held, train = all_idx[is_held], all_idx[~is_held]
    eos = cfg.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    vocab_ids, coverage = choose_draft_vocab(seqs, train, st.draft_vocab, cfg["vocab_size"], always=eos)
    hidden = hidden_cache(st.model, st.data, seqs, st.exit_layer, progress=progress)

    # Exit layers = copies of the last layers; norm = final norm; head rows = LM head restricted to V'.
    head = ExitHead(s, st.num_exit_layers)
    for j, layer in enumerate(head.layers):
        load_layer(layer, st.model, (st.exit_layer + j) if st.init == "next" else (L - st.num_exit_layers + j))
        if st.init == "identity":
            layer.self_attn.o_proj.weight.data.zero_()
            layer.mlp.down_proj.weight.data.zero_()
    tied = cfg.get("tie_word_embeddings", False)
    lm_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    t = read_hf_tensors(st.model, ["model.norm.weight", lm_name])
    head.norm.weight.data.copy_(t["model.norm.weight"])
    head = head.to(device)
    lm_rows = t[lm_name][torch.as_tensor(vocab_ids)].to(device)  # [V', H]
    params = list(head.parameters())
    if st.train_head:
        lm_rows = torch.nn.Parameter(lm_rows)
        params.append(lm_rows)
    # Map full ids -> V' index (-1 outside V').
    to_sub = torch.full((cfg["vocab_size"],), -1, dtype=torch.long)
    to_sub[torch.as_tensor(vocab_ids)] = torch.arange(len(vocab_ids))
    to_sub = to_sub.to(device)

    lengths = np.diff(seqs.offsets)
    go = seqs.gen_offsets()
    steps_per_epoch = len(_batches(lengths, train, st.batch_tokens))
    total = max(1, math.ceil(steps_per_epoch * st.epochs))
    opt = torch.optim.AdamW(params, lr=st.lr, weight_decay=0.0, betas=(0.9, 0.98))
    warm = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min(1.0, (k + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, k / total))))
    before = evaluate(head, lm_rows.detach(), vocab_ids, seqs, hidden, held, device)
    log(f"held-out agreement before training: {before['agreement']:.3f}")
    bar = tqdm(total=total, desc=f"exit layer N={st.exit_layer}", unit="step", disable=not progress)
    step, ema, first = 0, None, None
    head.train()
    while step < total:
        order = train[rng.permutation(len(train))]
        # Bucket by length inside random chunks: little padding, still shuffled.
        chunks = [order[i:i + 256] for i in range(0, len(order), 256)]
        order = np.concatenate([c[np.argsort(lengths[c], kind="stable")] for c in chunks])
        batches = _batches(lengths, order, st.batch_tokens)
        rng.shuffle(batches)
        for batch in batches:
            if step >= total:
                break
            out = _forward(head, hidden, seqs, batch, device)  # [B, T, H]
            where, rows = _label_rows(seqs, go, batch)
            if not where:
                continue
            b_idx = torch.cat([torch.full((len(p),), j) for j, p in where]).to(device)
            t_idx = torch.from_numpy(np.concatenate([p for _, p in where])).to(device)
            logits = out[b_idx, t_idx] @ lm_rows.T  # [M, V']
            ids = torch.from_numpy(seqs.topk_ids[rows].astype(np.int64)).to(device)  # [M, k]
            sub = to_sub[ids]  # [M, k], -1 outside V'
            if st.loss == "argmax":
                tgt = sub[:, 0]
                ok = tgt >= 0
                loss = F.cross_entropy(logits[ok], tgt[ok])
            else:
                lp = torch.from_numpy(seqs.topk_logp[rows].astype(np.float32)).to(device)
                lp = lp.masked_fill(sub < 0, -math.inf)
                ok = torch.isfinite(lp).any(-1)
                p = torch.softmax(lp[ok], -1).nan_to_num(0.0)  # target top-k, renormalised on V'
                logq = torch.log_softmax(logits[ok], -1).gather(1, sub[ok].clamp(min=0))
                loss = -(p * logq).sum(-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            step += 1
            ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
            first = ema if first is None else first
            bar.set_postfix(loss=f"{ema:.3f}")
            bar.update(1)
    bar.close()
    head.eval()
    # Evaluate what ships: weights rounded to the checkpoint dtype.
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        if st.train_head:
            lm_rows.data.copy_(lm_rows.data.to(torch.bfloat16).float())
    after = evaluate(head, lm_rows.detach(), vocab_ids, seqs, hidden, held, device)
    log(f"held-out agreement after training: {after['agreement']:.3f} "
        f"(greedy text {after['agreement_greedy']:.3f}, sampled text {after['agreement_sampled']:.3f})")

    hf_t = read_hf_tensors(st.model, fingerprint_names(L))
    fp = weights_fingerprint(hf_t.__getitem__, L, cfg["vocab_size"])
    tensors = {f"layers.{k}": v for k, v in head.layers.state_dict().items()}
    tensors["norm.weight"] = head.norm.weight
    tensors["draft_vocab"] = torch.as_tensor(vocab_ids, dtype=torch.int64)
    if st.train_head:
        tensors["lm_head.weight"] = lm_rows.detach()
    report = {
        "before": before, "after": after, "draft_vocab_coverage": coverage, "train_sequences": len(train),
        "heldout_sequences": len(held), "generated_tokens": int(go[-1]), "steps": step,
        "loss_first": first, "loss_last": ema,
        "seconds": round(time.perf_counter() - t_start, 1), "device": str(device),
    }
    meta = {
        "base_model": {"name": st.name or os.path.basename(os.path.normpath(st.model)),
                       "architectures": cfg.get("architectures", []), "config_hash": config_hash(cfg),
                       "weights_fingerprint": fp},
        "exit_layer": st.exit_layer, "num_exit_layers": st.num_exit_layers,
        "lm_head": "trained" if st.train_head else "shared", "draft_vocab_size": len(vocab_ids),
        "training": {**{k: v for k, v in asdict(st).items() if k not in ("model", "data", "out")}, **report},
    }
    save_exit_head(st.out, tensors, meta)
    return {**report, "out": st.out}
