"""Corpus pool (Self-Draft's corpus cache): n-gram successors counted offline in general text for one tokenizer.

The table holds, for every context of one and of two tokens seen often enough, its `k` most frequent next tokens
and their relative frequencies. Drafting walks it from the request's last two tokens (falling back to the last
one): each node's most frequent successors, depth by depth. The file (`corpus.npz`) records the tokenizer's
fingerprint: a table built for another tokenizer fails at start-up. Built by `adaspec build corpus` from text the
project can have offline (the model's self-distilled text, Python's own documentation and sources); never from
evaluation sets."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from vllm_adaspec.compiled import AVAILABLE, compiled, warmed
from vllm_adaspec.pools import Candidates, Taps, TailPool

FORMAT = "vllm-adaspec/corpus/1"


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's vocabulary (token -> id), 16 hex digits."""
    vocab = tokenizer.get_vocab()
    return hashlib.sha256(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1])).encode()).hexdigest()[:16]


MEMO_ENTRIES = 1 << 17  # lookups a table remembers (~30 MB at most), then it starts over


class CorpusTable:
    """keys1 [A] sorted one-token contexts, keys2 [B] sorted two-token contexts (t1 * V + t2); ids / probs
    [A or B, k] their successors, most frequent first (-1 padded)."""

    def __init__(self, vocab_size: int, keys1, ids1, probs1, keys2, ids2, probs2, meta: dict | None = None):
        self.vocab_size = vocab_size
        self.keys1, self.ids1, self.probs1 = np.asarray(keys1), np.asarray(ids1), np.asarray(probs1)
        self.keys2, self.ids2, self.probs2 = np.asarray(keys2), np.asarray(ids2), np.asarray(probs2)
        self.meta = meta or {}
        # context key -> its row: a dict lookup, where a binary search in numpy cost ~3 us a call in calls overhead
        # (~20 walks' misses a step at batch 8); ~14 MB for SmolLM2's 140k contexts
        self._rows1 = dict(zip(self.keys1.tolist(), range(len(self.keys1))))
        self._rows2 = dict(zip(self.keys2.tolist(), range(len(self.keys2))))
        self._memo: dict[tuple[int, int, int], tuple[list[int], list[float], int]] = {}

    def best(self, prev2: int, prev1: int, width: int) -> tuple[list[int], list[float], int]:
        """successors() cut to the `width` most frequent, as Python lists; remembered (a step looks up ~20 contexts
        a request, mostly the same ones again: a dict hit costs a fraction of two binary searches in numpy)."""
        key = (prev2, prev1, width)
        hit = self._memo.get(key)
        if hit is None:
            if len(self._memo) >= MEMO_ENTRIES:
                self._memo.clear()
            ids, probs, n = self.successors(prev2, prev1)
            hit = self._memo[key] = (ids[:width].tolist(), probs[:width].tolist(), n)
        return hit

    def successors(self, prev2: int, prev1: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(ids, probs, context length used: 2, 1 or 0) after the tokens prev2 prev1 (prev2 < 0: none)."""
        if prev2 >= 0:
            i = self._rows2.get(prev2 * self.vocab_size + prev1)
            if i is not None:
                return self.ids2[i], self.probs2[i], 2
        i = self._rows1.get(prev1)
        if i is not None:
            return self.ids1[i], self.probs1[i], 1
        return self.ids1[:0], self.probs1[:0], 0

    def save(self, path: str) -> None:
        np.savez_compressed(path, keys1=self.keys1, ids1=self.ids1, probs1=self.probs1.astype(np.float16),
                            keys2=self.keys2, ids2=self.ids2, probs2=self.probs2.astype(np.float16),
                            meta=np.frombuffer(json.dumps({"format": FORMAT, "vocab_size": self.vocab_size,
                                                           **self.meta}).encode(), dtype=np.uint8))

    @classmethod
    def load(cls, path: str) -> "CorpusTable":
        with np.load(path) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path} is not a corpus table ({meta.get('format')!r}, want {FORMAT!r})")
            return cls(meta["vocab_size"], z["keys1"], z["ids1"], z["probs1"].astype(np.float32),
                       z["keys2"], z["ids2"], z["probs2"].astype(np.float32), meta)


def build_table(sequences, vocab_size: int, k: int = 4, min_count: int = 3, meta: dict | None = None) -> CorpusTable:
    """Count successors of every one- and two-token context over `sequences` (iterables of token ids); keep
    contexts seen at least `min_count` times, each with its `k` most frequent successors."""
    firsts, seconds, nexts = [], [], []
    for seq in sequences:
        seq = np.asarray(seq, dtype=np.int64)
        if len(seq) < 2:
            continue
        firsts.append(np.concatenate([[-1], seq[:-2]]))  # -1: the pair (first, second) does not exist at i = 1
        seconds.append(seq[:-1])
        nexts.append(seq[1:])
    if not nexts:
        empty = np.zeros(0, np.int64), np.zeros((0, k), np.int32), np.zeros((0, k), np.float32)
        return CorpusTable(vocab_size, *empty, *empty, meta=meta)
    first, second, nxt = np.concatenate(firsts), np.concatenate(seconds), np.concatenate(nexts)
    has2 = first >= 0
    return CorpusTable(vocab_size, *_top_successors(second, nxt, vocab_size, k, min_count),
                       *_top_successors(first[has2] * vocab_size + second[has2], nxt[has2], vocab_size, k, min_count),
                       meta=meta)


def _top_successors(ctx: np.ndarray, nxt: np.ndarray, vocab_size: int, k: int, min_count: int):
    """ctx, nxt [N] (context key, next token) pairs -> keys [C] sorted, ids [C, k] (-1 padded), probs [C, k]:
    each context's k most frequent successors and their shares of its count, for contexts seen >= min_count."""
    pairs, counts = np.unique(ctx * vocab_size + nxt, return_counts=True)  # sorted by context, then token
    pctx, ptok = pairs // vocab_size, pairs % vocab_size
    keys, start, per_ctx = np.unique(pctx, return_index=True, return_counts=True)
    totals = np.add.reduceat(counts, start)
    # Within each context, most frequent first (ties: smaller token id first, for determinism).
    order = np.lexsort((ptok, -counts, pctx))
    rank = np.arange(len(pairs)) - np.repeat(start, per_ctx)
    row = np.repeat(np.arange(len(keys)), per_ctx)
    keep = rank < k
    ids = np.full((len(keys), k), -1, np.int32)
    probs = np.zeros((len(keys), k), np.float32)
    o = order[keep]
    ids[row[keep], rank[keep]] = ptok[o]
    probs[row[keep], rank[keep]] = counts[o] / totals[row[keep]]
    seen = totals >= min_count
    return keys[seen], ids[seen], probs[seen]


def propose_corpus(table: CorpusTable, context: list[int], depth: int, width: int = 2, max_nodes: int = 8,
                   min_prob: float = 0.1) -> Candidates:
    """Depth by depth from the last two tokens: each node's `width` most frequent successors of at least
    `min_prob`, until `max_nodes` (8: 32 cost the drafter time and added no tokens per step: benchmarks/log/2026-11-26.md)."""
    tokens, parents, node_probs, evidence = [], [], [], []
    prev2 = context[-2] if len(context) >= 2 else -1
    frontier = [(-1, prev2, context[-1])]
    for _ in range(depth):
        nxt = []
        for parent, a, b in frontier:
            ids, probs, n = table.best(a, b, width)
            for t, p in zip(ids, probs):
                if t < 0 or p < min_prob or len(tokens) >= max_nodes:
                    break
                nxt.append((len(tokens), b, t))
                tokens.append(t)
                parents.append(parent)
                node_probs.append(p)
                evidence.append(n)
        if not nxt:
            break
        frontier = nxt
    return Candidates(tokens, parents, node_probs, evidence, "corpus")



def _walk(keys1, ids1, probs1, keys2, ids2, probs2, vocab_size, prev2, prev1, depth, width, max_nodes, min_prob,
          out_tok, out_par, out_prob, out_ev, counts):
    """propose_corpus for a step's requests in one pass (numba): request e's nodes at out_*[e * max_nodes:],
    counts[e] of them. prev2 / prev1 / depth [R]. The same nodes, probabilities (float32 read as double) and
    evidence as the Python walk."""
    k = ids1.shape[1]
    f_par = np.empty(max_nodes + 1, np.int64)  # the frontier: (parent node, its context's two tokens)
    f_a = np.empty(max_nodes + 1, np.int64)
    f_b = np.empty(max_nodes + 1, np.int64)
    g_par = np.empty(max_nodes + 1, np.int64)
    g_a = np.empty(max_nodes + 1, np.int64)
    g_b = np.empty(max_nodes + 1, np.int64)
    for e in range(prev1.shape[0]):
        at, n, m = e * max_nodes, 0, 1
        f_par[0], f_a[0], f_b[0] = -1, prev2[e], prev1[e]
        for _ in range(depth[e]):
            g = 0
            for f in range(m):
                a, b = f_a[f], f_b[f]
                row, level = -1, 0
                if a >= 0:  # successors(): the two-token context, else the one-token one
                    key = a * vocab_size + b
                    i = np.searchsorted(keys2, key)
                    if i < keys2.shape[0] and keys2[i] == key:
                        row, level = i, 2
                if level == 0:
                    i = np.searchsorted(keys1, b)
                    if i < keys1.shape[0] and keys1[i] == b:
                        row, level = i, 1
                if level == 0:
                    continue
                for j in range(min(width, k)):
                    t = ids2[row, j] if level == 2 else ids1[row, j]
                    p = np.float64(probs2[row, j] if level == 2 else probs1[row, j])
                    if t < 0 or p < min_prob or n >= max_nodes:
                        break
                    g_par[g], g_a[g], g_b[g] = n, b, t
                    g += 1
                    out_tok[at + n], out_par[at + n], out_prob[at + n], out_ev[at + n] = t, f_par[f], p, level
                    n += 1
            if g == 0:
                break
            m = g
            f_par[:g], f_a[:g], f_b[:g] = g_par[:g], g_a[:g], g_b[:g]
        counts[e] = n


if AVAILABLE:  # (else the Python walk: the same nodes)
    _walk = compiled(_walk)


def propose_corpus_batch(table: CorpusTable, contexts: list[list[int]], depths: list[int], width: int = 2,
                         max_nodes: int = 8, min_prob: float = 0.1) -> list[Candidates]:
    """propose_corpus for every request of a step, in one compiled pass (contexts: each one's last tokens)."""
    r = len(contexts)
    prev2 = np.array([c[-2] if len(c) >= 2 else -1 for c in contexts], np.int64)
    prev1 = np.array([c[-1] for c in contexts], np.int64)
    tok, par, ev = (np.empty(r * max_nodes, np.int64) for _ in range(3))
    prob, counts = np.empty(r * max_nodes, np.float64), np.zeros(r, np.int64)
    _walk(table.keys1, table.ids1, table.probs1, table.keys2, table.ids2, table.probs2, table.vocab_size, prev2,
          prev1, np.asarray(depths, np.int64), width, max_nodes, min_prob, tok, par, prob, ev, counts)
    t, q, w, v = tok.tolist(), par.tolist(), prob.tolist(), ev.tolist()
    out = []
    for e, n in enumerate(counts.tolist()):
        a, b = e * max_nodes, e * max_nodes + n
        out.append(Candidates(t[a:b], q[a:b], w[a:b], v[a:b], "corpus"))
    return out


class CorpusPool(TailPool):
    """The static table (loaded once, shared); per request: its last two tokens (the walk's context)."""
    name = "corpus"
    keep = 2

    def __init__(self, table: CorpusTable | str):
        super().__init__()
        self.table = CorpusTable.load(table) if isinstance(table, (str, os.PathLike)) else table
        self.compiled = warmed(lambda: propose_corpus_batch(self.table, [[0, 0]], [1]),  # the walk compiled
                               "the corpus pool's compiled walk did not compile; it walks in Python")

    @classmethod
    def from_build(cls, build):
        if build.corpus_table is None:
            raise ValueError("the corpus pool needs its file loaded: pass corpus_table")
        return cls(build.corpus_table)

    def propose(self, requests: list[str], budgets: list[int], taps: Taps) -> list[Candidates]:
        if self.compiled:
            return propose_corpus_batch(self.table, [self.tails[r] for r in requests], budgets)
        return [propose_corpus(self.table, self.tails[r], depth=b) for r, b in zip(requests, budgets)]


SHIPPED_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "corpus")


def built_dir(model: str) -> str:
    """Where `adaspec build corpus` writes a table by default: <cache>/corpus/<model folder name>."""
    from vllm_adaspec._pkgcache import cache_root

    return str(cache_root() / "corpus" / os.path.basename(os.path.normpath(model)))


def find_corpus(tokenizer_path: str, setting: str = "auto") -> str:
    """The corpus table to load for this tokenizer: `setting` "auto" = the shipped one or one that
    `adaspec build corpus` wrote to the cache (matched by the vocabulary's fingerprint); else a corpus.npz or a
    folder holding one, which must have been built for this tokenizer. Raises AdaspecConfigError naming what is
    missing or mismatched."""
    from transformers import AutoTokenizer

    from vllm_adaspec.errors import SECTION, AdaspecConfigError

    want = tokenizer_fingerprint(AutoTokenizer.from_pretrained(tokenizer_path))
    key = f"additional_config['{SECTION}']"
    if setting != "auto":
        path = os.path.join(setting, "corpus.npz") if os.path.isdir(setting) else setting
        try:
            meta = CorpusTable.load(path).meta
        except (OSError, ValueError, KeyError) as e:
            raise AdaspecConfigError(f"{key}['corpus']: cannot read a corpus table at {path!r} ({e})") from None
        if meta.get("tokenizer") != want:
            raise AdaspecConfigError(
                f"{key}['corpus']: {path} was built for another tokenizer ({meta.get('model', '?')}, fingerprint "
                f"{meta.get('tokenizer')}; this model's is {want}). Build one with `adaspec build corpus --model "
                f"MODEL`")
        return path
    found = []
    roots = [SHIPPED_DIR, os.path.dirname(built_dir("x"))]
    for root in roots:
        if not os.path.isdir(root):
            continue
        for name in sorted(os.listdir(root)):
            path = os.path.join(root, name, "corpus.npz")
            if os.path.isfile(path):
                meta = CorpusTable.load(path).meta
                if meta.get("tokenizer") == want:
                    return path
                found.append(f"{name} (tokenizer {meta.get('tokenizer')})")
    raise AdaspecConfigError(
        f"{key}['pools']: 'corpus' has no table for this tokenizer ({want}); shipped or built: "
        f"{', '.join(found) or 'none'}. Build one with `adaspec build corpus --model MODEL`, or drop 'corpus'")
