"""Train Medusa-1 heads on the frozen target by self-distillation (paper 002, 3.2.1 / 3.3.2).

    h_t   = the target's final (normed) hidden state at position t (computed once per data set, cached on disk)
    e_t+1 = the target's embedding of token t + 1 (token-conditioned heads, the default; plain Medusa reads h_t only)
    q_k   = softmax(W[V'] . (h_t + SiLU(A_k [h_t; e_t+1] + b_k)))      W = the target's LM head (shared, frozen)
    loss  = sum_k 0.8^(k-1) CE(q_k, y_{t+k+1})                 on every t whose next token x_{t+1} was generated

y_j is the target's own argmax at position j given the text before it (`adaspec distill` records it, on greedy
and sampled continuations alike): on sampled text it is the token greedy decoding would accept there, not the
sampled one, so head k learns what the target would write k tokens after its next one without sampling noise. A seeded 1/20 of the sequences is held out; the report gives each
head's top-1 / top-5 there and its accuracy by rank, which the sparse tree is built from (pools/medusa.py).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from vllm_adaspec.heads.medusa import head_logits, init_heads, save_medusa
from vllm_adaspec.training.distill import Sequences, load_shards
from vllm_adaspec.training.exit_trainer import _read_config, hidden_cache, most_frequent
from vllm_adaspec.training.layers import read_hf_tensors, rms_norm

__all__ = ["MedusaTrainSettings", "train_medusa", "medusa_positions"]

RANKS = 10  # accuracy by rank is recorded for each head's top RANKS tokens


@dataclass(frozen=True)
class MedusaTrainSettings:
    model: str  # Hugging Face folder of the target
    data: str  # folder written by `adaspec distill`
    out: str  # checkpoint folder
    num_heads: int = 4  # K
    draft_vocab: int = 4096  # V': the most frequent generated tokens
    token_input: bool = True  # blocks also read the last committed token's embedding (no vLLM export then)
    epochs: float = 3.0
    lr: float = 1e-3
    batch: int = 512  # positions per optimizer step
    decay: float = 0.8  # head k's loss weight is decay^(k-1) (paper 3.2.1)
    holdout_every: int = 20
    seed: int = 0
    name: str | None = None  # base model name recorded in the checkpoint


def medusa_positions(seqs: Sequences, idx: np.ndarray, num_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions t (indices into seqs.tokens) of the sequences `idx` whose next token was generated, and labels
    [P, K]: for head k, the target's argmax at position t + k + 1 (a generated position), -1 past the end."""
    go = seqs.gen_offsets()
    argmax = seqs.topk_ids[:, 0]  # [G] the target's top token at every generated position
    pos, labels = [], []
    for s in idx:
        a, b = int(seqs.offsets[s]), int(seqs.offsets[s + 1])
        first_gen = a + int(seqs.prompt_lens[s])
        t = np.arange(first_gen - 1, b - 1)
        if not len(t):
            continue
        at = t[:, None] + np.arange(2, num_heads + 2)[None]  # [P, K] positions predicted
        lab = np.where(at < b, argmax[go[s] + np.minimum(at, b - 1) - first_gen], -1)
        pos.append(t)
        labels.append(lab)
    return np.concatenate(pos), np.concatenate(labels).astype(np.int64)


@torch.no_grad()
def evaluate(w, b, lm_rows, vocab_ids, inputs_of, pos, labels, batch: int = 2048) -> dict:
    """Held-out: per head top-1 / top-5 (a label outside V' counts as a miss) and accuracy by rank."""
    k = w.shape[0]
    by_rank = torch.zeros(k, RANKS, dtype=torch.float64)
    counted = torch.zeros(k, dtype=torch.float64)
    vocab = torch.as_tensor(vocab_ids)
    for lo in range(0, len(pos), batch):
        lab = torch.as_tensor(labels[lo:lo + batch])  # [B, K]
        h, *e = inputs_of(pos[lo:lo + batch])
        top = vocab[head_logits(h, w, b, lm_rows, *e).topk(RANKS, dim=-1).indices]  # [B, K, RANKS] full ids
        valid = lab >= 0
        hit = (top == lab[..., None]) & valid[..., None]
        by_rank += hit.sum(0).double()
        counted += valid.sum(0).double()
    acc = (by_rank / counted.clamp(min=1)[:, None])
    return {"top1": [round(float(x), 4) for x in acc[:, 0]], "top5": [round(float(x), 4) for x in acc[:, :5].sum(1)],
            "accuracy_by_rank": [[round(float(x), 5) for x in row] for row in acc], "positions": int(len(pos))}


def train_medusa(st: MedusaTrainSettings, progress: bool = True, log=print) -> dict:
    """Train, evaluate on the held-out split, write the checkpoint to `st.out`. Returns the report."""
    from tqdm import tqdm

    from vllm_adaspec.heads import config_hash, fingerprint_names, weights_fingerprint

    if st.num_heads < 1 or st.draft_vocab < 16 or st.epochs <= 0 or st.batch < 1:
        raise ValueError("--heads must be >= 1, --draft-vocab >= 16, --epochs > 0, --batch >= 1")
    t_start = time.perf_counter()
    torch.manual_seed(st.seed)
    cfg = _read_config(st.model)
    num_layers, vocab_size = cfg["num_hidden_layers"], cfg["vocab_size"]
    seqs = load_shards(st.data)
    is_held = np.random.default_rng(12345).permutation(len(seqs)) % st.holdout_every == 0
    all_idx = np.arange(len(seqs))
    train_pos, train_lab = medusa_positions(seqs, all_idx[~is_held], st.num_heads)
    held_pos, held_lab = medusa_positions(seqs, all_idx[is_held], st.num_heads)
    eos = cfg.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    head1 = train_lab[:, 0]
    vocab_ids, coverage = most_frequent(head1[head1 >= 0], st.draft_vocab, vocab_size, eos)  # head 1's labels

    hidden = hidden_cache(st.model, st.data, seqs, num_layers, progress=progress)  # [T, H] before the final norm
    lm_name = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"
    emb_name = "model.embed_tokens.weight"
    t = read_hf_tensors(st.model, sorted({"model.norm.weight", lm_name, emb_name}))
    norm_w, eps = t["model.norm.weight"].float(), float(cfg["rms_norm_eps"])
    lm_rows = t[lm_name][torch.as_tensor(vocab_ids)].float()  # [V', H]
    embed, tokens = t[emb_name], torch.from_numpy(seqs.tokens.astype(np.int64))

    def inputs_of(p: np.ndarray) -> tuple:  # (final normed hidden states [B, H], embeddings of token t + 1 [B, H])
        h = rms_norm(torch.from_numpy(np.asarray(hidden[p])).float(), norm_w, eps)
        return (h, embed[tokens[torch.from_numpy(p + 1)]].float()) if st.token_input else (h,)

    to_sub = torch.full((vocab_size,), -1, dtype=torch.long)
    to_sub[torch.as_tensor(vocab_ids)] = torch.arange(len(vocab_ids))
    heads = init_heads(st.num_heads, lm_rows.shape[1], token_input=st.token_input)
    w, b = (torch.nn.Parameter(heads["w"]), torch.nn.Parameter(heads["b"]))
    weight = torch.tensor([st.decay ** k for k in range(st.num_heads)])
    before = evaluate(w.detach(), b.detach(), lm_rows, vocab_ids, inputs_of, held_pos, held_lab)
    log(f"held-out top-1 per head before training: {before['top1']}")

    rng = np.random.default_rng(st.seed)
    steps_per_epoch = max(1, len(train_pos) // st.batch)
    total = max(1, math.ceil(steps_per_epoch * st.epochs))
    opt = torch.optim.AdamW([w, b], lr=st.lr, weight_decay=0.0, betas=(0.9, 0.98))
    warm = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
    bar = tqdm(total=total, desc=f"Medusa heads (K={st.num_heads})", unit="step", disable=not progress)
    step, ema, first, order = 0, None, None, np.zeros(0, np.int64)
    while step < total:
        if len(order) < st.batch:
            order = np.concatenate([order, rng.permutation(len(train_pos))])
        pick, order = order[:st.batch], order[st.batch:]
        lab = to_sub[torch.as_tensor(np.maximum(train_lab[pick], 0))]  # [B, K] index in V' (-1: outside)
        lab[torch.as_tensor(train_lab[pick]) < 0] = -1
        h, *e = inputs_of(train_pos[pick])
        logits = head_logits(h, w, b, lm_rows, *e)  # [B, K, V']
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab.reshape(-1), ignore_index=-1,
                             reduction="none").view(lab.shape)
        valid = (lab >= 0).float()
        loss = ((ce * valid).sum(0) / valid.sum(0).clamp(min=1) * weight).sum() / weight.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        x = float(loss)
        first = x if first is None else first
        ema = x if ema is None else 0.98 * ema + 0.02 * x
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}")
    bar.close()
    after = evaluate(w.detach(), b.detach(), lm_rows, vocab_ids, inputs_of, held_pos, held_lab)
    log(f"held-out top-1 per head after training: {after['top1']} (top-5 {after['top5']})")

    hf_t = read_hf_tensors(st.model, fingerprint_names(num_layers))
    report = {"before": before, "after": after, "draft_vocab_coverage": round(coverage, 4),
              "train_positions": int(len(train_pos)), "heldout_positions": int(len(held_pos)), "steps": step,
              "loss_first": first, "loss_last": ema, "seconds": round(time.perf_counter() - t_start, 1)}
    meta = {"base_model": {"name": st.name or os.path.basename(os.path.normpath(st.model)),
                           "architectures": cfg.get("architectures", []), "config_hash": config_hash(cfg),
                           "weights_fingerprint": weights_fingerprint(hf_t.__getitem__, num_layers, vocab_size)},
            "num_heads": st.num_heads, "draft_vocab_size": int(len(vocab_ids)), "token_input": st.token_input,
            "accuracy_by_rank": after["accuracy_by_rank"],
            "training": {**{k: v for k, v in asdict(st).items() if k not in ("model", "data", "out")}, **report}}
    save_medusa(st.out, w.detach(), b.detach(), torch.as_tensor(vocab_ids), meta)
    return {**report, "out": st.out}


@torch.inference_mode()
def medusa_top1(model_dir: str, folder: str, token_ids: list[int]) -> list[int]:
    """Plain-torch reference of Medusa head 1: for every position t < n - 1 of `token_ids` (n of them), its top
    token (a full id) for position t + 2, from the target's final hidden state at t (and the embedding of token
    t + 1). The engine drafts from the row that sampled the last committed token (position n - 1 of n committed),
    i.e. from t = n - 2: what its medusa pool must reproduce."""
    from vllm_adaspec.heads.medusa import load_medusa, reads_token
    from vllm_adaspec.training.layers import target_prefix_layers

    cfg = _read_config(model_dir)
    n = cfg["num_hidden_layers"]
    _, t = load_medusa(folder)
    lm_name = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"
    hf = read_hf_tensors(model_dir, sorted({"model.norm.weight", lm_name, "model.embed_tokens.weight"}))
    h = target_prefix_layers(model_dir, n)(torch.tensor([token_ids]), torch.arange(len(token_ids))[None], (n,))[n][0]
    h = rms_norm(h, hf["model.norm.weight"], cfg["rms_norm_eps"])[:-1]  # [n - 1, H]
    e = hf["model.embed_tokens.weight"][torch.tensor(token_ids[1:])].float() if reads_token(t["w"]) else None
    vocab = t["draft_vocab"]
    return vocab[head_logits(h, t["w"][:1], t["b"][:1], hf[lm_name][vocab].float(), e)[:, 0].argmax(-1)].tolist()
