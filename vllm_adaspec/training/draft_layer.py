"""A draft layer on the target's own features, by self-distillation (EAGLE's feature-level drafting, trained several
draft steps deep on its own outputs as EAGLE-3's training-time test and HASS do), and an attention-free variant
(Hydra's / Arctic's MLP speculator), with the offline replay that chooses between them.

Features: f_t, the target's hidden state at position t, the state that predicted token x_{t+1}: for N = the last
layer, after the final norm (what the LM head reads and vLLM's runner returns, so the engine takes them from
verification); for N < L, the residual stream after N layers. Labels: the target's own top-1 after f_{t+1} (what it
would emit after x_{t+1}): the corpus' (vLLM's) on generated tokens, the prefill's on prompt tokens. Features are
computed once per corpus shard by a bfloat16 prefill (`feature_cache`), never stored by the corpus. Several layers
(EAGLE-3's low / middle / high, the last one L) are concatenated and fused by the layer family's first step into one
feature (`DraftLayer.inputs`); later draft steps read the layer's own output as before.

    layer  (EAGLE):  u_t = W [norm(f_t) ; e(x_{t+1})],  g_t = decoder_layer(u)_t (causal),  q_t = head(norm(g_t))
                     g_t stands for f_{t+1}; a draft step feeds (g_t, its own token) as the next step's input
    mlp    (no attention): s_1 = f_t,  s_{d+1} = s_d + mlp_d([norm(s_d) ; e(x_{t+d})]),  q = head(norm(s_{d+1}))

Training (`train_draft_layer`): q against the target (`LABELS`: its whole next distribution, softmax(head(f_{t+1})),
as a KL loss; its argmax; its corpus top-k), plus (layer) a regression of g_t on
f_{t+1} (`reg_weight`); `depth` > 1 unrolls the layer on its own features: at step j the query of position t reads
g^{(j-1)}_{t-1} (its own prediction of f_t) and attends to the true rows up to t - j + 1 and to the rows of steps
2..j along its own draft chain (the attention a draft of depth j sees in decoding). The head is the target's LM
head restricted to a draft vocabulary (frozen), e is the target's embedding (frozen).

Replay (`replay`): on unseen prompts' greedy continuations, from every position, a chain of `k` drafts; acceptance
per depth (every earlier draft right too), tokens per target forward when decoding drafts k a step, and the draft
cost per token as a share of a target step (both timed here, torch, batch 1).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vllm_adaspec.kernels.int8_linear import int8_linear_emulated, quantize_rows
from vllm_adaspec.training.layers import DecoderLayer, LayerShape, load_layer, read_hf_tensors, rms_norm, rope

__all__ = ["DraftTrainSettings", "DraftLayer", "DraftMLP", "feature_cache", "train_draft_layer", "replay"]

FAMILIES = ("layer", "mlp")
# What a draft is trained to match at each position: the target's argmax; its top-k where the corpus keeps them
# (generated tokens; the argmax elsewhere); or its whole distribution over the draft vocabulary, read off the next
# position's feature (the layer reading the last layer's features: f_{t+1} is what the LM head reads), EAGLE's label.
LABELS = ("argmax", "topk", "distribution")


@dataclass(frozen=True)
class DraftTrainSettings:
    model: str  # Hugging Face folder of the target
    data: str  # `adaspec distill` folder
    out: str  # checkpoint folder
    family: str = "layer"  # FAMILIES
    feature_layer: int | tuple = 0  # N: the target layers the features come from (0: all of them, the last hidden
    # state); a tuple of layers, the last one L, fuses several depths (EAGLE-3's low / middle / high features)
    depth: int = 3  # draft steps trained (the training-time test's depth)
    draft_vocab: int = 8192
    reg_weight: float = 0.1  # the feature regression's weight (layer)
    epochs: float = 1.0
    lr: float = 1e-3  # beat 3e-4 on a million tokens (held-out 0.39 vs 0.35)
    batch_tokens: int = 4096
    holdout_every: int = 20
    max_tokens: int = 0  # train on at most this many tokens of the corpus (0: all)
    cached_only: bool = False  # train on each folder's leading shards whose features are cached, prefill nothing
    seed: int = 0
    labels: str = "auto"  # LABELS, or auto: "distribution" where the layer family reads the last layer, else "argmax"
    save_minutes: float = 10.0  # a run saves its progress (OUT/train-state.pt) this often and resumes from it
    amp: bool = True  # bfloat16 autocast (weights and optimizer in float32): ~5x float32 GEMMs on AMX CPUs
    prompt_context: int = 64  # prompt tokens trained on before each response (-1: whole sequences): a draft runs
    # on what the target writes, and EAGLE / HASS mask their losses to responses; half a corpus' tokens are prompts
    init: str = ""  # a folder this trainer wrote: start from its weights and draft vocabulary (training goes on
    # over a grown corpus or for more epochs instead of starting over; the learning rate warms up again)


def _autocast(on: bool):
    import contextlib

    return torch.autocast("cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext()


def _config(model: str) -> dict:
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)


def _lm_name(cfg: dict) -> str:
    return "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"


# --- features ---------------------------------------------------------------------------------------------------

def _target_parts(model: str, dtype: torch.dtype):
    """(the target's layers, (final norm, LM head, eps)) in `dtype`, frozen."""
    from vllm_adaspec.training.layers import target_prefix_layers

    cfg = _config(model)
    stack = target_prefix_layers(model, cfg["num_hidden_layers"]).to(dtype)
    t = read_hf_tensors(model, ["model.norm.weight", _lm_name(cfg)])
    return stack, (t["model.norm.weight"].to(dtype), t[_lm_name(cfg)].to(dtype), cfg["rms_norm_eps"])


def feature_layers(n, L: int) -> tuple[int, ...]:
    """The target layers a draft reads, as a tuple: 0 -> (L,) (the last), N -> (N,), a tuple as it is (several
    depths fused, EAGLE-3's low / middle / high features)."""
    layers = tuple(n) if isinstance(n, (tuple, list)) else ((n or L),)
    if not layers or any(not 1 <= k <= L for k in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"feature layers must be distinct, in 1..{L}: got {n!r}")
    return layers


def fused_layers(L: int) -> tuple[int, ...]:
    """EAGLE-3's low / middle / high depths and the last, (2, L // 2, L - 3, L): what the shipped layer reads
    ((2, 15, 27, 30) on SmolLM2; fused, they beat the last layer alone by 0.045 at depth 1 on unseen prompts)."""
    return tuple(sorted({k for k in (2, L // 2, L - 3) if 1 <= k < L})) + (L,)


def parse_feature_layers(text: str):
    """'0' -> 0, '12' -> 12, '2,15,30' or '2+15+30' -> (2, 15, 30): what `feature_layers` takes; 'auto' as it is
    (`fused_layers` of the model)."""
    if str(text) == "auto":
        return "auto"
    parts = [int(x) for x in str(text).replace("+", ",").split(",")]
    return parts[0] if len(parts) == 1 else tuple(parts)


def _layers_name(layers: tuple[int, ...]) -> str:
    return "+".join(map(str, layers))


@torch.inference_mode()
def target_features(model: str, n, ids: np.ndarray, stack=None, head=None,
                    labelled: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One sequence's token ids [T] -> (features [T, H * len(layers)] float16, labels [T] int32: the target's argmax
    at each position, or at the first `labelled` only and -1 after them: a corpus has the rest, and the full-vocabulary
    logits are a fifth of a prefill), n an int or a tuple of layers (`feature_layers`). The features of the last layer L are its
    final-normed hidden state (what the LM head reads and what vLLM's runner returns from a forward, so the engine
    reads them off verification); of a layer N < L, the residual stream after N layers; several are concatenated in
    order. Computed in the dtype of `stack` (bfloat16: ~3x float32 here, AMX)."""
    cfg = _config(model)
    L = cfg["num_hidden_layers"]
    layers = feature_layers(n, L)
    if stack is None:
        stack, head = _target_parts(model, torch.float32)
    norm_w, lm, eps = head
    x = torch.from_numpy(ids.astype(np.int64))[None]
    pos = torch.arange(x.shape[1])[None]
    hs = stack(x, pos, capture=tuple(sorted(set(layers) | {L})))
    top = rms_norm(hs[L][0], norm_w, eps)  # [T, H]
    labels = torch.full((top.shape[0],), -1, dtype=torch.long)
    m = top.shape[0] if labelled is None else max(0, min(labelled, top.shape[0]))
    labels[:m] = (top[:m] @ lm.T).max(-1).indices  # (argmax is ~4x slower than max on CPU)
    feats = torch.cat([top if k == L else hs[k][0] for k in layers], -1)
    return feats.to(torch.float16).numpy(), labels.to(torch.int32).numpy()


class ColumnView:
    """Rows of a cached feature matrix restricted to some of its layers' columns (a cache of layers (2, 15, 30)
    serves a draft reading (30,)): arr[rows] -> [rows, len(cols)]."""

    def __init__(self, arr: np.ndarray, cols: np.ndarray):
        self.arr, self.cols = arr, cols
        self.shape = (arr.shape[0], len(cols))

    def __getitem__(self, rows):
        return np.asarray(self.arr[rows])[..., self.cols]

    def __len__(self):
        return self.shape[0]


class RowChunks:
    """Feature matrices (one per corpus shard, of one or several folders) read as their row-wise concatenation, the
    first `total` rows, without loading them: rows[a:b] inside one part is that part's (memory-mapped) slice, across
    parts a copy. A corpus at scale has more features than memory (3M tokens of 4 depths: 14 GB)."""

    def __init__(self, parts: list, total: int | None = None):
        self.parts = parts
        self.starts = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
        rows = int(self.starts[-1]) if total is None else int(total)
        self.shape = (rows, parts[0].shape[1])

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, rows):
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError("RowChunks reads contiguous row slices")
        a, b, _ = rows.indices(self.shape[0])
        if b <= a:
            return np.zeros((0, self.shape[1]), np.float16)
        i = int(np.searchsorted(self.starts, a, side="right")) - 1
        if b <= self.starts[i + 1]:
            return self.parts[i][a - self.starts[i]:b - self.starts[i]]
        out, j = [], i
        while j < len(self.parts) and self.starts[j] < b:
            s0 = int(self.starts[j])
            out.append(np.asarray(self.parts[j][max(a, s0) - s0:min(b, int(self.starts[j + 1])) - s0]))
            j += 1
        return np.concatenate(out)

    def __array__(self, dtype=None, copy=None):
        out = self[0:self.shape[0]]
        return np.asarray(out, dtype=dtype)


def _feature_dir(data: str, layers: tuple[int, ...]) -> str:
    return os.path.join(data, f"features-N{_layers_name(layers)}")


def _shard_files(folder: str, i: int) -> tuple[str, str]:
    return os.path.join(folder, f"shard-{i:05d}.npy"), os.path.join(folder, f"shard-{i:05d}.labels.npy")


def _cached_shard(data: str, layers: tuple[int, ...], i: int, hidden: int):
    """(features, labels) of shard i from a cache in `data` holding every layer of `layers` (its own, or one of more
    layers: their columns), else None."""
    import glob

    for d in sorted(glob.glob(os.path.join(data, "features-N*"))):
        have = tuple(int(k) for k in os.path.basename(d)[len("features-N"):].split("+"))
        fpath, lpath = _shard_files(d, i)
        if set(layers) <= set(have) and os.path.exists(fpath):  # labels are written first
            arr = np.load(fpath, mmap_mode="r")
            if have == layers:
                return arr, np.load(lpath)
            cols = np.concatenate([np.arange(hidden) + hidden * have.index(k) for k in layers])
            return ColumnView(arr, cols), np.load(lpath)
    return None


def _shard_features(model: str, seqs, first: int, last: int, layers, parts, out: tuple[str, str], bar) -> None:
    """Prefill sequences first..last-1 of `seqs` (one shard) into out = (shard-i.npy, its labels), atomically: labels
    first, the features' rename last, so a shard whose features exist is complete."""
    a0, b0 = int(seqs.offsets[first]), int(seqs.offsets[last])
    fpath, lpath = out
    tmp = f"{fpath}.{os.getpid()}.tmp.npy"
    stack, head = parts
    feats = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=(b0 - a0, head[1].shape[1] * len(layers)))
    labels = np.zeros(b0 - a0, np.int32)
    gen = seqs.gen_offsets()
    for i in range(first, last):
        a, b = int(seqs.offsets[i]) - a0, int(seqs.offsets[i + 1]) - a0
        # position t's label is the token after it: generated rows g0.. cover positions a + plen - 1 ..
        plen, g0, g1 = int(seqs.prompt_lens[i]), int(gen[i]), int(gen[i + 1])
        feats[a:b], labels[a:b] = target_features(model, layers, seqs.tokens[a0 + a:a0 + b], stack, head, plen - 1)
        labels[a + plen - 1:a + plen - 1 + g1 - g0] = seqs.topk_ids[g0:g1, 0]
        bar.update(b - a)
    feats.flush()
    del feats
    np.save(lpath + f".{os.getpid()}.tmp.npy", labels)
    os.replace(lpath + f".{os.getpid()}.tmp.npy", lpath)
    os.replace(tmp, fpath)


def _remove_dead_partials(folder: str) -> list[str]:
    """Delete the half-written shard files (NAME.PID.tmp.npy) of prefills no longer running: a killed prefill's
    memory map can be gigabytes. A live process' files stay (folders are prefilled side by side). Returns them."""
    import glob

    gone = []
    for path in glob.glob(os.path.join(folder, "*.tmp.npy")):
        pid = path[:-len(".tmp.npy")].rsplit(".", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # someone else's live process
        os.remove(path)
        gone.append(path)
    return gone


def feature_cache(model: str, data: str, seqs, n, max_tokens: int = 0, progress: bool = True,
                  dtype: torch.dtype = torch.bfloat16, cached_only: bool = False) -> tuple:
    """(features [T, H * layers] float16 (`RowChunks` of memory maps), labels [T] int32, sequences) for every token of
    the first sequences of `seqs` (the folder's `load_shards`) holding at most max_tokens tokens (0: all), computed
    once per shard of the corpus and kept in DATA/features-N{layers}/shard-i.npy and shard-i.labels.npy (a cache of
    more layers serves fewer): an interrupted prefill resumes at its first missing shard, a grown corpus prefills its
    new shards only. A generated position's label is the corpus' own top-1 (vLLM's, in the dtype it generated with);
    a prompt position's, the prefill's argmax. cached_only: the leading shards already cached only (a prefill still
    running), nothing prefilled."""
    from tqdm import tqdm

    from vllm_adaspec.training.distill import shard_sizes

    cfg = _config(model)
    layers = feature_layers(n, cfg["num_hidden_layers"])
    lengths = np.diff(seqs.offsets)
    count = len(seqs) if not max_tokens else max(1, int(np.searchsorted(np.cumsum(lengths), max_tokens)))
    total = int(seqs.offsets[count])
    bounds = np.concatenate([[0], np.cumsum(shard_sizes(data))])
    bounds = bounds[bounds <= len(seqs)]  # shards a running `distill` wrote after `seqs` was read are not in it
    if bounds[-1] < count:
        raise ValueError(f"{data}: its shards hold {bounds[-1]} sequences, {count} asked")
    shards = int(np.searchsorted(bounds, count, side="left"))  # shards 0..shards-1 cover the first `count`
    cached = [_cached_shard(data, layers, i, cfg["hidden_size"]) for i in range(shards)]
    if cached_only:
        shards = next((i for i, c in enumerate(cached) if c is None), shards)
        if shards == 0:
            raise ValueError(f"{data}: no features of layers {_layers_name(layers)} cached for its first shard")
        cached, count = cached[:shards], min(count, int(bounds[shards]))
        total = int(seqs.offsets[count])
    todo = [i for i, c in enumerate(cached) if c is None]
    if todo:
        out = _feature_dir(data, layers)
        os.makedirs(out, exist_ok=True)
        _remove_dead_partials(out)
        parts = _target_parts(model, dtype)
        work = sum(int(seqs.offsets[bounds[i + 1]] - seqs.offsets[bounds[i]]) for i in todo)
        with tqdm(total=work, unit="tok", desc=f"target features (N={_layers_name(layers)}, prefill, "
                  f"{len(todo)} of {shards} shards)", disable=not progress) as bar:
            for i in todo:
                _shard_features(model, seqs, int(bounds[i]), int(bounds[i + 1]), layers, parts,
                                _shard_files(out, i), bar)
                cached[i] = _cached_shard(data, layers, i, cfg["hidden_size"])
    feats = RowChunks([f for f, _ in cached], total)
    labels = np.concatenate([lab for _, lab in cached])[:total]
    return feats, labels, count


def corpus_features(model: str, data: str, n: int, max_tokens: int = 0, progress: bool = True,
                    cached_only: bool = False) -> tuple:
    """(sequences, features [T, H] (`RowChunks`), labels [T], sequences used) of one `adaspec distill` folder or
    several joined by commas (each folder's features cached in it), taking folders in order up to max_tokens tokens
    (0: all)."""
    from vllm_adaspec.training.distill import concat_sequences, load_shards

    folders = [d for d in data.split(",") if d]
    if len(folders) == 1:
        seqs = load_shards(folders[0])
        return (seqs, *feature_cache(model, folders[0], seqs, n, max_tokens, progress, cached_only=cached_only))
    parts, feats, labels, left = [], [], [], max_tokens
    for d in folders:
        seqs = load_shards(d)
        f, lab, count = feature_cache(model, d, seqs, n, left, progress, cached_only=cached_only)
        total = int(seqs.offsets[count])
        parts.append(_first_sequences(seqs, count))
        feats += _rows(f, total)
        labels.append(lab[:total])
        if max_tokens:
            left -= total
            if left <= 0:
                break
    seqs = concat_sequences(parts)
    return seqs, RowChunks(feats), np.concatenate(labels), len(seqs)


def _rows(f: RowChunks, total: int) -> list:
    """f's parts cut to its first `total` rows (views)."""
    cut = lambda p, k: ColumnView(p.arr[:k], p.cols) if isinstance(p, ColumnView) else p[:k]  # noqa: E731
    return [cut(p, total - int(s)) for p, s in zip(f.parts, f.starts) if s < total]


def _first_sequences(seqs, count: int):
    """The first `count` sequences of `seqs`."""
    from vllm_adaspec.training.distill import Sequences

    t, g = int(seqs.offsets[count]), int(seqs.gen_offsets()[count])
    return Sequences(tokens=seqs.tokens[:t], offsets=seqs.offsets[:count + 1], prompt_lens=seqs.prompt_lens[:count],
                     sampled=seqs.sampled[:count], topk_ids=seqs.topk_ids[:g], topk_logp=seqs.topk_logp[:g])


# --- the two families ----------------------------------------------------------------------------------------------

class DraftLayer(nn.Module):
    """EAGLE-style: one decoder layer over [norm(feature) ; embedding] rows (module docstring)."""

    def __init__(self, s: LayerShape, embed: torch.Tensor, head_rows: torch.Tensor, n_layers: int = 1):
        super().__init__()
        self.s, self.n_layers = s, n_layers
        self.embed = nn.Embedding.from_pretrained(embed, freeze=True)
        self.head = nn.Parameter(head_rows, requires_grad=False)  # [V', H]
        if n_layers > 1:  # several depths' features, each normed, fused into one (starting as the last one alone)
            self.part_norm = nn.Parameter(torch.ones(n_layers, s.hidden))
            self.fuse = nn.Linear(n_layers * s.hidden, s.hidden, bias=False)
            self.fuse.weight.data.zero_()
            self.fuse.weight.data[:, -s.hidden:] = torch.eye(s.hidden)
        self.fc = nn.Linear(2 * s.hidden, s.hidden, bias=False)
        self.feat_norm = nn.Parameter(torch.ones(s.hidden))
        self.layer = DecoderLayer(s)
        self.norm = nn.Parameter(torch.ones(s.hidden))

    def inputs(self, feats: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """feats [B, T, H] (a feature, or the layer's own output) or [B, T, H * n_layers] (the target's features at
        several depths, fused first), next_tokens [B, T] -> the layer's input rows [B, T, H]."""
        h = self.s.hidden
        if feats.shape[-1] != h:
            parts = rms_norm(feats.unflatten(-1, (self.n_layers, h)), self.part_norm, self.s.eps)
            feats = self.fuse(parts.flatten(-2))
        return self.fc(torch.cat([rms_norm(feats, self.feat_norm, self.s.eps), self.embed(next_tokens)], -1))

    def attend(self, u: torch.Tensor, positions: torch.Tensor, keys: list, mask: torch.Tensor | None):
        """The decoder layer on rows u [B, T, H] at `positions`, their queries attending to the keys and values of
        earlier steps `keys` [(k, v)] and their own (mask [T, keys] bool, True = visible; None: causal over u).
        Returns (out [B, T, H], this step's (k, v))."""
        s, a, layer = self.s, self.layer.self_attn, self.layer
        b, t, _ = u.shape
        x = rms_norm(u, layer.input_layernorm.weight, s.eps)
        q = rope(a.q_proj(x).view(b, t, s.heads, s.head_dim), positions, s.rope_theta).transpose(1, 2)
        k = rope(a.k_proj(x).view(b, t, s.kv_heads, s.head_dim), positions, s.rope_theta).transpose(1, 2)
        v = a.v_proj(x).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        if mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=s.kv_heads != s.heads)
        else:
            kk = torch.cat([k_ for k_, _ in keys] + [k], 2)
            vv = torch.cat([v_ for _, v_ in keys] + [v], 2)
            o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=s.kv_heads != s.heads)
        h = u + a.o_proj(o.transpose(1, 2).reshape(b, t, s.heads * s.head_dim))
        y = rms_norm(h, layer.post_attention_layernorm.weight, s.eps)
        m = layer.mlp
        return h + m.down_proj(F.silu(m.gate_proj(y)) * m.up_proj(y)), (k, v)

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        return rms_norm(g, self.norm, self.s.eps) @ self.head.T

    def unroll(self, feats: torch.Tensor, tokens: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """feats [B, T, H] (f_t), tokens [B, T] (x_{t+1}, the token after position t) -> [g^(1) .. g^(depth)], each
        [B, T, H]: step j's prediction of f_{t+1} at position t, its input at t being step j-1's prediction of f_t
        (module docstring); position t of step j is meaningful for t >= j - 1."""
        b, t, _ = feats.shape
        pos = torch.arange(t, device=feats.device)[None].expand(b, -1)
        g, kv = self.attend(self.inputs(feats, tokens), pos, [], None)
        outs, keys = [g], [kv]
        for j in range(2, depth + 1):
            prev = torch.cat([g[:, :1], g[:, :-1]], 1)  # step j-1's prediction of f_t sits at t - 1
            g, kv = self.attend(self.inputs(prev, tokens), pos, keys, ttt_mask(t, j, feats.device))
            outs.append(g)
            keys.append(kv)
        return outs


class _Int8Emulated(nn.Module):
    """A linear as the engine runs it with int8 draft weights (kernels/int8_linear.py), emulated."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        q, scale = quantize_rows(weight)
        self.w, self.bias = q.float() * scale[:, None], bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear_emulated(x, self.w, self.bias)


def with_int8_weights(model: "DraftLayer") -> "DraftLayer":
    """`model` with its linears and head computing as the engine's int8 draft weights do (`draft_weights: "int8"`,
    the default on CPU), for replays and tests of what the engine drafts. Changes `model` in place."""
    for m in list(model.modules()):
        for name, lin in list(m.named_children()):
            if isinstance(lin, nn.Linear):
                setattr(m, name, _Int8Emulated(lin.weight.detach(), lin.bias))
    head = _Int8Emulated(model.head.detach())
    model.logits = lambda g: head(rms_norm(g, model.norm, model.s.eps))
    return model


def ttt_mask(t: int, j: int, device) -> torch.Tensor:
    """[T, j * T] bool: the query of position p at step j sees the true rows s <= p - j + 1 (step 1's keys) and,
    of steps i = 2..j, the row p - j + i (its own draft chain, itself last)."""
    p = torch.arange(t, device=device)[:, None]
    s = torch.arange(t, device=device)[None, :]
    parts = [s <= p - j + 1] + [s == p - j + i for i in range(2, j + 1)]
    mask = torch.cat(parts, 1)
    mask[:, 0] |= ~mask.any(1)  # the first rows of a deep step see nothing yet: give them position 0 (unused)
    return mask


class DraftMLP(nn.Module):
    """Attention-free: a residual MLP per draft depth over [norm(state) ; embedding] (module docstring)."""

    def __init__(self, s: LayerShape, embed: torch.Tensor, head_rows: torch.Tensor, depth: int, inner: int = 0):
        super().__init__()
        self.s = s
        self.embed = nn.Embedding.from_pretrained(embed, freeze=True)
        self.head = nn.Parameter(head_rows, requires_grad=False)
        inner = inner or 2 * s.hidden
        self.state_norm = nn.ParameterList([nn.Parameter(torch.ones(s.hidden)) for _ in range(depth)])
        self.up = nn.ModuleList(nn.Linear(2 * s.hidden, inner, bias=False) for _ in range(depth))
        self.down = nn.ModuleList(nn.Linear(inner, s.hidden, bias=False) for _ in range(depth))
        for d in self.down:
            nn.init.zeros_(d.weight)
        self.norm = nn.Parameter(torch.ones(s.hidden))

    def step(self, d: int, state: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """Draft depth d + 1 (past the trained depths: the deepest one's weights again)."""
        d = min(d, len(self.up) - 1)
        x = torch.cat([rms_norm(state, self.state_norm[d], self.s.eps), self.embed(token)], -1)
        return state + self.down[d](F.gelu(self.up[d](x)))

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        return rms_norm(g, self.norm, self.s.eps) @ self.head.T


# --- training --------------------------------------------------------------------------------------------------

def _model_parts(model: str, vocab_ids: np.ndarray):
    cfg = _config(model)
    s = LayerShape.from_hf_config(cfg)
    t = read_hf_tensors(model, ["model.embed_tokens.weight", "model.norm.weight", _lm_name(cfg)])
    return cfg, s, t["model.embed_tokens.weight"], t[_lm_name(cfg)][torch.as_tensor(vocab_ids)], t["model.norm.weight"]


def build(family: str, model: str, vocab_ids: np.ndarray, depth: int, feature_layer=0) -> nn.Module:
    cfg, s, embed, rows, norm = _model_parts(model, vocab_ids)
    L = cfg["num_hidden_layers"]
    layers = feature_layers(feature_layer, L)
    if len(layers) > 1 and (family != "layer" or layers[-1] != L):
        raise ValueError(f"features of several layers {layers} are fused by the layer family and end with the last "
                         f"layer ({L}): the draft predicts that one")
    if layers[-1] == L:
        norm = torch.ones_like(norm)  # the last layer's features are normed already: its weight is in them
    if family == "layer":
        m = DraftLayer(s, embed, rows, len(layers))
        m.feature_layers = layers  # what `target_features` computes for it
        load_layer(m.layer, model, cfg["num_hidden_layers"] - 1)  # starts as the target's last layer
        m.layer.self_attn.o_proj.weight.data.zero_()  # ... adding nothing: g = u at first
        m.layer.mlp.down_proj.weight.data.zero_()
        h = s.hidden
        m.fc.weight.data.zero_()
        m.fc.weight.data[:, :h] = torch.eye(h)  # u = norm(f): g starts as the (normed) feature itself
    else:
        m = DraftMLP(s, embed, rows, depth)
    with torch.no_grad():
        m.norm.copy_(norm)  # the target's final norm
    return m


def _windows(offsets: np.ndarray, count: int, length: int, prompt_lens: np.ndarray | None = None,
             prompt_context: int = -1) -> list[tuple[int, int]]:
    """[a, b) token windows of at most `length` inside each of the first `count` sequences, from `prompt_context`
    tokens before the response's first label (-1: from the sequence's start)."""
    out = []
    for i in range(count):
        a, b = int(offsets[i]), int(offsets[i + 1])
        if prompt_context >= 0 and prompt_lens is not None:
            a = max(a, a + int(prompt_lens[i]) - 1 - prompt_context)
        for w in range(a, b - 2, length):
            out.append((w, min(b, w + length)))
    return out


def _soft_ce(logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of logits [N, V'] against the target's top-k [N, k] (draft-vocabulary ids, -1 outside it; their
    probabilities, renormalized over those inside): the target's distribution as the label."""
    w = probs.masked_fill(ids < 0, 0)
    w = w / w.sum(-1, keepdim=True).clamp(min=1e-6)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids.clamp(min=0))
    return -(w * logp).sum(-1).mean()


def _losses(model: nn.Module, family: str, feats, tokens, labels, to_sub, depth: int, reg: float, soft=None):
    """feats [B, T, H] (f_t), tokens [B, T] (x_{t+1}), labels [B, T] (target argmax after f_{t+1}, full ids; -1 none)
    -> (loss, per-depth top-1 agreement). soft: the layer family's cross-entropy label where given (else the argmax):
    (ids, probs) [B, T, k] the target's top-k after f_{t+1} (full ids, -1 none), or "distribution": the target's
    distribution over the draft vocabulary, softmax(head(f_{t+1}))."""
    sub = to_sub[labels.clamp(min=0)].masked_fill(labels < 0, -1)
    loss, agree = 0.0, []
    if family == "layer":
        outs = model.unroll(feats, tokens, depth)
        top = feats[..., -model.s.hidden:]  # the last layer's (fused features end with it)
        nxt = torch.cat([top[:, 1:], top[:, -1:]], 1)  # f_{t+1}
        if isinstance(soft, str):  # the label's log-probabilities and entropy, once for every depth
            with torch.autocast("cpu", enabled=False):
                logp = torch.log_softmax(nxt.float() @ model.head.T.float(), -1)  # [B, T, V']
            p = logp.exp()
            neg_entropy = (p * logp).sum(-1)  # [B, T]
        elif soft is not None:
            sid = to_sub[soft[0].clamp(min=0)].masked_fill(soft[0] < 0, -1)
            sp = soft[1]
        for j, g in enumerate(outs, start=1):
            lg = model.logits(g)[:, j - 1:]
            y = sub[:, j - 1:]
            ok = y >= 0
            if soft is None:
                ce = F.cross_entropy(lg[ok], y[ok])
            elif isinstance(soft, str):  # KL(target || draft): the cross-entropy less the label's entropy (0 at a match)
                # (masked by weights, not by indexing: a [B, T, V'] gather and its backward cost more than the few
                # positions without a label)
                logq = torch.log_softmax(lg.float(), -1)
                kl = neg_entropy[:, j - 1:] - (p[:, j - 1:] * logq).sum(-1)  # [B, T - j + 1]
                ce = (kl * ok).sum() / ok.sum().clamp(min=1)
            else:
                ce = _soft_ce(lg[ok], sid[:, j - 1:][ok], sp[:, j - 1:][ok])
            loss = loss + ce + reg * F.smooth_l1_loss(g[:, j - 1:-1], nxt[:, j - 1:-1])
            agree.append(_agreement(lg.detach(), y))
        return loss / depth, agree
    state = feats
    for d in range(depth):  # depth d+1 drafts x_{t+d+2} from x_{t+d+1}: shift tokens and labels by d
        tok = torch.cat([tokens[:, d:], tokens[:, -1:].expand(-1, d)], 1)
        y = torch.cat([sub[:, d:], torch.full_like(sub[:, :d], -1)], 1)
        state = model.step(d, state, tok)
        lg = model.logits(state)
        ok = y >= 0
        loss = loss + F.cross_entropy(lg[ok], y[ok])
        agree.append(_agreement(lg.detach(), y))
    return loss / depth, agree


def _agreement(logits: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 agreement of logits [..., V'] with labels y [...] (draft-vocabulary ids, -1 none) where there is one
    (max, not argmax: ~4x faster on CPU)."""
    ok = y >= 0
    if not ok.any():
        return 0.0
    return float(((logits.max(-1).indices == y) & ok).sum() / ok.sum())


def _soft_labels(seqs, labels: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [T, k] int32, probs [T, k] float32) per position of the first `count` sequences: a generated token's
    position before it holds the corpus' top-k (vLLM's log-probabilities); a prompt position its argmax label."""
    total, k = int(seqs.offsets[count]), seqs.topk_ids.shape[1]
    ids = np.full((total, k), -1, np.int32)
    probs = np.zeros((total, k), np.float32)
    ids[:, 0], probs[:, 0] = labels[:total], 1.0
    gen = seqs.gen_offsets()
    for i in range(count):
        a, plen, g0, g1 = int(seqs.offsets[i]), int(seqs.prompt_lens[i]), int(gen[i]), int(gen[i + 1])
        ids[a + plen - 1:a + plen - 1 + g1 - g0] = seqs.topk_ids[g0:g1]
        probs[a + plen - 1:a + plen - 1 + g1 - g0] = np.exp(seqs.topk_logp[g0:g1].astype(np.float32))
    return ids, probs


def train_draft_layer(st: DraftTrainSettings, progress: bool = True, log=print) -> dict:
    """Train on the corpus' training split, report held-out top-1 agreement per depth, write `st.out`."""
    from tqdm import tqdm

    from vllm_adaspec.training.exit_trainer import most_frequent

    if st.family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {st.family!r}")
    if st.labels not in LABELS + ("auto",):
        raise ValueError(f"labels must be one of {', '.join(LABELS)}, got {st.labels!r}")
    t0 = time.perf_counter()
    torch.manual_seed(st.seed)
    rng = np.random.default_rng(st.seed)
    cfg = _config(st.model)
    n = feature_layers(st.feature_layer, cfg["num_hidden_layers"])
    if st.labels == "distribution" and (st.family != "layer" or n[-1] != cfg["num_hidden_layers"]):
        raise ValueError("labels 'distribution' reads the target's distribution off the last layer's features: it "
                         "needs the layer family and feature_layer 0 (all layers)")
    if st.labels == "auto":
        st = replace(st, labels="distribution" if st.family == "layer" and n[-1] == cfg["num_hidden_layers"]
                     else "argmax")
    seqs, feats, labels, count = corpus_features(st.model, st.data, n, st.max_tokens, progress, st.cached_only)
    held = np.random.default_rng(12345).permutation(count) % st.holdout_every == 0
    eos = cfg.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    train_tok = np.concatenate([labels[seqs.offsets[i]:seqs.offsets[i + 1]] for i in range(count) if not held[i]])
    train_tok = train_tok[train_tok >= 0]  # (a sequence's last position has no next token to learn)
    if st.init:
        model, vocab_ids = _warm_start(st, n)
        coverage = float(np.isin(train_tok, vocab_ids).mean())
    else:
        vocab_ids, coverage = most_frequent(train_tok, st.draft_vocab, cfg["vocab_size"], eos)
        model = build(st.family, st.model, vocab_ids, st.depth, n)
    to_sub = torch.full((cfg["vocab_size"],), -1, dtype=torch.long)
    to_sub[torch.as_tensor(vocab_ids)] = torch.arange(len(vocab_ids))
    win = 256
    windows = _windows(seqs.offsets, count, win, seqs.prompt_lens, st.prompt_context)
    seq_of = np.searchsorted(seqs.offsets[1:count + 1], [a for a, _ in windows], side="right")
    train_w = [w for w, i in zip(windows, seq_of) if not held[i]]
    held_w = [w for w, i in zip(windows, seq_of) if held[i]]

    topk = st.labels == "topk"
    soft_ids, soft_p = _soft_labels(seqs, labels, count) if topk else (None, None)

    def batch(ws):
        t = max(b - a for a, b in ws)
        f = torch.zeros(len(ws), t, feats.shape[1])
        x = torch.zeros(len(ws), t, dtype=torch.long)
        y = torch.full((len(ws), t), -1, dtype=torch.long)
        k = soft_ids.shape[1] if topk else 1
        sid, sp = torch.full((len(ws), t, k), -1, dtype=torch.long), torch.zeros(len(ws), t, k)
        for j, (a, b) in enumerate(ws):
            f[j, :b - a] = torch.from_numpy(np.asarray(feats[a:b], dtype=np.float32))
            x[j, :b - a - 1] = torch.from_numpy(seqs.tokens[a + 1:b].astype(np.int64))  # x_{t+1}
            y[j, :b - a - 1] = torch.from_numpy(labels[a + 1:b].astype(np.int64))  # argmax after f_{t+1}
            if topk:
                sid[j, :b - a - 1] = torch.from_numpy(soft_ids[a + 1:b].astype(np.int64))
                sp[j, :b - a - 1] = torch.from_numpy(soft_p[a + 1:b])
        return f, x, y, ((sid, sp) if topk else ("distribution" if st.labels == "distribution" else None))

    per_batch = max(1, st.batch_tokens // win)
    steps = max(1, int(math.ceil(len(train_w) / per_batch * st.epochs)))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=st.lr, weight_decay=0.0, betas=(0.9, 0.95))
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min(1.0, (k + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, k / steps))))

    def evaluate() -> list[float]:
        model.eval()
        tot, hits = 0, np.zeros(st.depth)
        with torch.no_grad():
            for k in range(0, len(held_w), per_batch):
                f, x, y, sl = batch(held_w[k:k + per_batch])
                with _autocast(st.amp):
                    _, agree = _losses(model, st.family, f, x, y, to_sub, st.depth, st.reg_weight, sl)
                m = int((y >= 0).sum())
                hits += np.asarray(agree) * m
                tot += m
        model.train()
        return (hits / max(1, tot)).round(4).tolist()

    state_path = os.path.join(st.out, TRAIN_STATE)
    resumed = _load_state(state_path, st, model, opt, sched)
    if resumed:
        first, before, curve, ema = resumed["step"], resumed["before"], resumed["curve"], resumed["ema"]
        log(f"resuming {state_path} at step {first} of {steps}")
    else:
        first, curve, ema = 0, [], None
        before = evaluate()
    log(f"held-out top-1 agreement by depth before training: {before}")
    order = rng.permutation(len(train_w))
    saved = time.perf_counter()
    with tqdm(total=steps, initial=first, desc=f"draft {st.family} (N={n}, depth {st.depth})", unit="step",
              disable=not progress) as bar:
        for step in range(first, steps):
            idx = order[(step * per_batch) % len(order):][:per_batch]
            if len(idx) < per_batch:
                idx = np.concatenate([idx, order[:per_batch - len(idx)]])
            f, x, y, sl = batch([train_w[i] for i in idx])
            with _autocast(st.amp):
                loss, agree = _losses(model, st.family, f, x, y, to_sub, st.depth, st.reg_weight, sl)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
            if step % max(1, steps // 50) == 0 or step == steps - 1:
                curve.append((step, round(ema, 4), [round(a, 4) for a in agree]))
            bar.set_postfix(loss=f"{ema:.3f}", top1=f"{agree[0]:.2f}")
            bar.update(1)
            if time.perf_counter() - saved > st.save_minutes * 60 and step + 1 < steps:
                _save_state(state_path, st, model, opt, sched,
                            {"step": step + 1, "before": before, "curve": curve, "ema": ema})
                saved = time.perf_counter()
    after = evaluate()
    log(f"held-out top-1 agreement by depth after training: {after}")
    os.makedirs(st.out, exist_ok=True)
    if st.family == "layer" and n[-1] == cfg["num_hidden_layers"]:
        _save_as_exit_head(st, cfg, model, vocab_ids, n)  # what EarlyExitProposer loads
    else:  # the replay's other candidates: no engine path reads them
        from safetensors.torch import save_file

        tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()
                   if not k.startswith(("embed", "head"))}
        tensors["draft_vocab"] = torch.as_tensor(vocab_ids, dtype=torch.int64)
        save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()},
                  os.path.join(st.out, "draft_layer.safetensors"))
    report = {"settings": asdict(st), "feature_layer": n, "tokens": int(seqs.offsets[count]), "sequences": count,
              "train_windows": len(train_w), "heldout_windows": len(held_w), "draft_vocab_coverage": coverage,
              "steps": steps, "agreement_before": before, "agreement_after": after, "curve": curve,
              "seconds": round(time.perf_counter() - t0, 1)}
    with open(os.path.join(st.out, "draft_layer.json"), "w") as f:
        json.dump(report, f, indent=1)
    if os.path.exists(state_path):
        os.remove(state_path)  # the checkpoint is written: a run with these settings starts over
    return {**report, "model": model, "vocab_ids": vocab_ids}


TRAIN_STATE = "train-state.pt"


def _trainable(model: nn.Module) -> dict:
    """The module's state without the target's frozen embedding and head rows."""
    return {k: v for k, v in model.state_dict().items() if not k.startswith(("embed", "head"))}


def _save_state(path: str, st: DraftTrainSettings, model: nn.Module, opt, sched, progress: dict) -> None:
    """What resumes a run cut short (a session's end): weights, optimizer, schedule, the step reached."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"settings": asdict(st), "model": _trainable(model), "opt": opt.state_dict(),
                "sched": sched.state_dict(), **progress}, path + ".tmp")
    os.replace(path + ".tmp", path)


def _load_state(path: str, st: DraftTrainSettings, model: nn.Module, opt, sched) -> dict | None:
    """The saved progress of a run with these very settings (loaded into model, opt, sched), None without one;
    refused where the folder holds another run's."""
    if not os.path.exists(path):
        return None
    state = torch.load(path, weights_only=False)
    mine, theirs = asdict(st), state["settings"]
    diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k) and k != "save_minutes")
    if diff:
        raise ValueError(f"{path} resumes a run with other settings ({', '.join(diff)} differ): pass those settings, "
                         "or delete it to start over")
    model.load_state_dict(state["model"], strict=False)
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    return state


def _warm_start(st: DraftTrainSettings, n: tuple) -> tuple[nn.Module, np.ndarray]:
    """(the module of `st.init` in training mode, its draft vocabulary), refused where it is not what `st` trains."""
    m, vocab, family, layers = load_trained(st.model, st.init)
    layers = feature_layers(layers, _config(st.model)["num_hidden_layers"])
    if family != st.family or tuple(layers) != tuple(n):
        raise ValueError(f"init {st.init} is a {family} draft on features of layers {list(layers)}, not the "
                         f"{st.family} on layers {list(n)} being trained")
    if family == "mlp" and len(m.up) != st.depth:
        raise ValueError(f"init {st.init} drafts {len(m.up)} steps, not depth {st.depth}")
    return m.train(), vocab


def _save_as_exit_head(st: DraftTrainSettings, cfg: dict, model: "DraftLayer", vocab_ids: np.ndarray,
                       layers: tuple) -> None:
    """An exit-head checkpoint (heads/) that sits on all L layers and reads features: `input.*` maps
    [final-normed feature ; embedding] to the layer's input (fused features of several depths `layers`, the last L:
    `input.part_norm.weight` [n, H] and `input.fuse.weight` [H, n * H] first), `layers.0.*` is the decoder layer,
    `norm.weight` its norm before the shared LM head's draft-vocabulary rows."""
    from vllm_adaspec.heads import config_hash, fingerprint_names, save_exit_head, weights_fingerprint

    L = cfg["num_hidden_layers"]
    tensors = {f"layers.0.{k}": v for k, v in model.layer.state_dict().items()}
    tensors["norm.weight"] = model.norm.detach()
    tensors["input.fc.weight"] = model.fc.weight.detach()
    tensors["input.feat_norm.weight"] = model.feat_norm.detach()
    if len(layers) > 1:
        tensors["input.part_norm.weight"] = model.part_norm.detach()
        tensors["input.fuse.weight"] = model.fuse.weight.detach()
    tensors["draft_vocab"] = torch.as_tensor(vocab_ids, dtype=torch.int64)
    hf_t = read_hf_tensors(st.model, fingerprint_names(L))
    meta = {"base_model": {"name": os.path.basename(os.path.normpath(st.model)),
                           "architectures": cfg.get("architectures", []), "config_hash": config_hash(cfg),
                           "weights_fingerprint": weights_fingerprint(hf_t.__getitem__, L, cfg["vocab_size"])},
            "exit_layer": L, "num_exit_layers": 1, "input": "features", "feature_layers": [int(k) for k in layers],
            "lm_head": "shared", "draft_vocab_size": len(vocab_ids),
            "training": {k: v for k, v in asdict(st).items() if k not in ("model", "data", "out")}}
    save_exit_head(st.out, tensors, meta)


def export_exit_head(model: str, folder: str, out: str) -> None:
    """A replay-only layer-family candidate (draft_layer.safetensors) whose features end with the last layer, written
    as the exit head EarlyExitProposer loads."""
    m, vocab, family, layers = load_trained(model, folder)
    with open(os.path.join(folder, "draft_layer.json")) as f:
        st = DraftTrainSettings(**{k: tuple(v) if isinstance(v, list) else v
                                   for k, v in json.load(f)["settings"].items()})
    cfg = _config(model)
    layers = feature_layers(layers, cfg["num_hidden_layers"])
    if family != "layer" or layers[-1] != cfg["num_hidden_layers"]:
        raise ValueError(f"{folder}: only the layer family on features ending with the last layer loads as an exit head")
    _save_as_exit_head(replace(st, model=model, out=out), cfg, m, vocab, layers)


def load_draft_layer(model: str, folder: str) -> tuple["DraftLayer", np.ndarray]:
    """(the DraftLayer of an exit-head folder that reads features, float32, eval mode; its draft vocabulary): the
    torch reference of what EarlyExitProposer drafts with it."""
    from vllm_adaspec.heads import load_exit_head

    meta, t = load_exit_head(folder)
    if meta.get("input") != "features":
        raise ValueError(f"{folder} is an exit head on h_N, not a draft layer reading features")
    vocab = t["draft_vocab"].numpy()
    layers = tuple(meta.get("feature_layers", [meta["exit_layer"]]))
    m = build("layer", model, vocab, 1, layers if len(layers) > 1 else 0)
    state = {f"layer.{k[len('layers.0.'):]}": v for k, v in t.items() if k.startswith("layers.0.")}
    state.update({"norm": t["norm.weight"], "fc.weight": t["input.fc.weight"],
                  "feat_norm": t["input.feat_norm.weight"]})
    if len(layers) > 1:
        state.update({"part_norm": t["input.part_norm.weight"], "fuse.weight": t["input.fuse.weight"]})
    missing, unexpected = m.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if unexpected or set(missing) - {"embed.weight", "head"}:  # (the embedding and head rows are the target's)
        raise ValueError(f"{folder}: tensors {unexpected} unknown, {missing} missing")
    return m.eval(), vocab


def load_trained(model: str, folder: str) -> tuple[nn.Module, np.ndarray, str, object]:
    """(module, draft vocabulary, family, feature layers) of a folder `train_draft_layer` wrote: an exit head the
    engine loads, or a replay-only candidate (draft_layer.safetensors and its draft_layer.json)."""
    from safetensors.torch import load_file

    if os.path.exists(os.path.join(folder, "exit_head.json")):
        m, vocab = load_draft_layer(model, folder)
        return m, vocab, "layer", m.feature_layers if len(m.feature_layers) > 1 else 0
    with open(os.path.join(folder, "draft_layer.json")) as f:
        st = json.load(f)["settings"]
    t = load_file(os.path.join(folder, "draft_layer.safetensors"))
    vocab = t.pop("draft_vocab").numpy()
    layers = tuple(st["feature_layer"]) if isinstance(st["feature_layer"], list) else st["feature_layer"]
    m = build(st["family"], model, vocab, st["depth"], layers)
    missing, unexpected = m.load_state_dict({k: v.float() for k, v in t.items()}, strict=False)
    if unexpected or {k for k in missing if not k.startswith(("embed", "head"))}:
        raise ValueError(f"{folder}: tensors {unexpected} unknown, {missing} missing")
    return m.eval(), vocab, st["family"], layers


# --- the offline replay --------------------------------------------------------------------------------------------

@torch.no_grad()
def chain_drafts(model: nn.Module, family: str, feats: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """From every position t of one sequence (feats [T, H] = f_t, tokens [T] = x_{t+1}), a chain of k drafts, each
    fed back (token and, for the layer, its own feature): [T, k] draft-vocabulary indices (draft d at t guesses
    x_{t+d+1})."""
    t = feats.shape[0]
    f, x = feats[None], tokens[None]
    out = torch.zeros(t, k, dtype=torch.long)
    if family == "layer":
        pos = torch.arange(t)[None]
        g, kv = model.attend(model.inputs(f, x), pos, [], None)
        keys = [kv]
        cur = model.logits(g)[0].argmax(-1)
        out[:, 0] = cur
        vocab = model.vocab
        for j in range(2, k + 1):
            # step j at position p: the chain started at p - j + 1; its input is step j-1's output at p - 1 and
            # the token it drafted there
            prev_g = torch.cat([g[:, :1], g[:, :-1]], 1)
            prev_tok = torch.cat([cur[:1], cur[:-1]])
            g, kv = model.attend(model.inputs(prev_g, vocab[prev_tok][None]), pos, keys, ttt_mask(t, j, f.device))
            keys.append(kv)
            cur = model.logits(g)[0].argmax(-1)
            # out[start, j-1] where start = p - j + 1
            out[:t - j + 1, j - 1] = cur[j - 1:]
        return out
    state = f
    for d in range(k):
        state = model.step(d, state, x if d == 0 else model.vocab[out[:, d - 1]][None])
        out[:, d] = model.logits(state)[0].argmax(-1)
    return out


@torch.no_grad()
def tree_drafts(model: "DraftLayer", feats: torch.Tensor, tokens: torch.Tensor, widths: tuple[int, ...]) -> list:
    """From every position t of one sequence (as chain_drafts), a tree of drafts from the layer's top-k: each node at
    depth j has the top widths[j] tokens of the layer (fed its parent's own output and token) as children, as EarlyExit
    would draft it with trees. Returns per depth j (ids [T, n_j], probs [T, n_j]) in draft-vocabulary indices,
    n_j = widths[0] * ... * widths[j-1]: node b's parent at depth j - 1 is b // widths[j-1]; probs are each node's
    probability given its parent under the layer. widths (1, 1, ...) is chain_drafts."""
    t = feats.shape[0]
    pos = torch.arange(t)[None]
    g, kv = model.attend(model.inputs(feats[None], tokens[None]), pos, [], None)
    p, ids = model.logits(g)[0].float().softmax(-1).topk(widths[0], -1)  # [T, w], position-indexed
    # each branch: (its output g [1, T, H] and token [T] by position, its chain's keys, conditional probs by position)
    branches = [(g, ids[:, i], [kv]) for i in range(widths[0])]
    out = [(ids, p)]
    for j, w in enumerate(widths[1:], start=2):
        level_ids, level_p, grown = [], [], []
        for g, cur, keys in branches:  # step j at position p reads step j-1's output at p - 1 and its token there
            prev_g = torch.cat([g[:, :1], g[:, :-1]], 1)
            prev_tok = torch.cat([cur[:1], cur[:-1]])
            g2, kv = model.attend(model.inputs(prev_g, model.vocab[prev_tok][None]), pos, keys,
                                  ttt_mask(t, j, feats.device))
            p2, ids2 = model.logits(g2)[0].float().softmax(-1).topk(w, -1)  # [T, w] by position p
            for i in range(w):
                grown.append((g2, ids2[:, i], keys + [kv]))
            # by chain start s = p - j + 1 (rows past the sequence's end: zeros)
            a, b = torch.zeros(t, w, dtype=torch.long), torch.zeros(t, w)
            a[:t - j + 1], b[:t - j + 1] = ids2[j - 1:], p2[j - 1:]
            level_ids.append(a)
            level_p.append(b)
        branches = grown
        out.append((torch.cat(level_ids, 1), torch.cat(level_p, 1)))
    return out


def replay(model: nn.Module, family: str, vocab_ids: np.ndarray, model_dir: str, sequences: list[tuple[int, list]],
           k: int = 5, feature_layer: int = 0) -> dict:
    """sequences: [(prompt length, prompt + greedy continuation ids)] of unseen prompts. From every position of each
    continuation, a chain of k drafts against the continuation: acceptance by depth (the share of positions whose
    first d drafts are all right), and decoding simulated with a chain of j drafts a step (j = 1..k): tokens per
    target forward (tau)."""
    n = feature_layers(feature_layer, _config(model_dir)["num_hidden_layers"])
    stack, head = _target_parts(model_dir, torch.float32)
    model.vocab = torch.as_tensor(vocab_ids, dtype=torch.long)
    model.eval()
    runs, steps = np.zeros(k + 1), {j: [0, 0] for j in range(1, k + 1)}  # tokens, forwards
    for plen, ids in sequences:
        ids = np.asarray(ids)
        feats, _ = target_features(model_dir, n, ids, stack, head)
        f = torch.from_numpy(feats.astype(np.float32))
        x = torch.from_numpy(np.concatenate([ids[1:], ids[-1:]]).astype(np.int64))
        drafts = model.vocab[chain_drafts(model, family, f, x, k)].numpy()  # [T, k] full ids
        # position t (after x_{t+1} committed) drafts x_{t+2..}: the continuation starts at index plen
        for t_ in range(plen - 1, len(ids) - 2):
            truth = ids[t_ + 2:t_ + 2 + k]
            ok = np.cumprod(drafts[t_, :len(truth)] == truth)
            runs[int(ok.sum())] += 1
        for j in range(1, k + 1):  # decode the continuation: each forward commits accepted + 1
            pos = plen - 1
            while pos < len(ids) - 1:
                truth = ids[pos + 2:pos + 2 + j]
                acc = int(np.cumprod(drafts[pos, :len(truth)] == truth).sum()) if len(truth) else 0
                steps[j][0] += acc + 1
                steps[j][1] += 1
                pos += acc + 1
    total = runs.sum()
    at_least = [float(runs[d:].sum() / max(1, total)) for d in range(1, k + 1)]
    return {"positions": int(total), "accept_at_depth": [round(a, 4) for a in at_least],
            "tau_by_k": {j: round(steps[j][0] / max(1, steps[j][1]), 3) for j in steps}}


def draft_cost_ratio(model: nn.Module, family: str, model_dir: str, context: int = 300, iters: int = 30) -> float:
    """One draft token's time over one target decode step's, torch, batch 1, a `context`-token prefix (the layer
    attends over it; the target's step: every layer over it and the full LM head). A rough price: the engine's own
    kernels differ from torch's."""
    from vllm_adaspec.training.layers import target_prefix_layers

    cfg = _config(model_dir)
    stack = target_prefix_layers(model_dir, cfg["num_hidden_layers"])
    lm = read_hf_tensors(model_dir, [_lm_name(cfg)])[_lm_name(cfg)]
    h = cfg["hidden_size"]
    with torch.no_grad():
        x = torch.randn(1, 1, h)
        xf = torch.randn(1, 1, h * getattr(model, "n_layers", 1))  # the draft's first step reads fused features
        pos = torch.tensor([[context]])
        s = model.s
        kv = [(torch.randn(1, s.kv_heads, context, s.head_dim), torch.randn(1, s.kv_heads, context, s.head_dim))]
        mask = torch.ones(1, context + 1, dtype=torch.bool)

        def draft():
            if family == "layer":
                g, _ = model.attend(model.inputs(xf, torch.tensor([[1]])), pos, kv, mask)
            else:
                g = model.step(0, x, torch.tensor([[1]]))
            return model.logits(g).argmax(-1)

        def target_step():  # every layer's projections and MLP on one token + the LM head (attention left out)
            y = x
            for layer in stack.layers:
                a = layer.self_attn
                z = rms_norm(y, layer.input_layernorm.weight, s.eps)
                q = a.q_proj(z)
                a.k_proj(z), a.v_proj(z)  # (their cost, not their values)
                y = y + a.o_proj(q)
                z = rms_norm(y, layer.post_attention_layernorm.weight, s.eps)
                y = y + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(z)) * layer.mlp.up_proj(z))
            return (y @ lm.T).argmax(-1)

        def timed(fn):
            fn()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - t0) / iters

        return timed(draft) / timed(target_step)
