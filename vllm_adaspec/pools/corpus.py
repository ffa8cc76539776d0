"""Corpus pool (Self-Draft's corpus cache): n-gram successors counted offline in general text for one tokenizer.

The table holds, for every context of one and of two tokens seen often enough, its `k` most frequent next tokens
and their relative frequencies. Drafting walks it from the request's last two tokens (falling back to the last
one): each node's most frequent successors, depth by depth. The file (`corpus.npz`) records the tokenizer's
fingerprint: a table built for another tokenizer fails at start-up. Built by `adaspec build corpus` from text the
project can have offline (the model's self-distilled text, Python's own documentation and sources); never from
evaluation sets."""

from __future__ import annotations

import hashlib
import os
import json
from collections import Counter, defaultdict

import numpy as np

from vllm_adaspec.pools import Candidates, prob_bucket

FORMAT = "vllm-adaspec/corpus/1"


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's vocabulary (token -> id), 16 hex digits."""
    vocab = tokenizer.get_vocab()
    return hashlib.sha256(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1])).encode()).hexdigest()[:16]


class CorpusTable:
    """keys1 [A] sorted one-token contexts, keys2 [B] sorted two-token contexts (t1 * V + t2); ids / probs
    [A or B, k] their successors, most frequent first (-1 padded)."""

    def __init__(self, vocab_size: int, keys1, ids1, probs1, keys2, ids2, probs2, meta: dict | None = None):
        self.vocab_size = vocab_size
        self.keys1, self.ids1, self.probs1 = np.asarray(keys1), np.asarray(ids1), np.asarray(probs1)
        self.keys2, self.ids2, self.probs2 = np.asarray(keys2), np.asarray(ids2), np.asarray(probs2)
        self.meta = meta or {}

    def successors(self, prev2: int, prev1: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(ids, probs, context length used: 2, 1 or 0) after the tokens prev2 prev1 (prev2 < 0: none)."""
        if prev2 >= 0:
            key = prev2 * self.vocab_size + prev1
            i = int(np.searchsorted(self.keys2, key))
            if i < len(self.keys2) and self.keys2[i] == key:
                return self.ids2[i], self.probs2[i], 2
        i = int(np.searchsorted(self.keys1, prev1))
        if i < len(self.keys1) and self.keys1[i] == prev1:
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
    """Count successors of every one- and two-token context over `sequences` (iterables of token ids)."""
    c1: dict[int, Counter] = defaultdict(Counter)
    c2: dict[int, Counter] = defaultdict(Counter)
    for seq in sequences:
        seq = [int(t) for t in seq]
        for i in range(1, len(seq)):
            c1[seq[i - 1]][seq[i]] += 1
            if i >= 2:
                c2[seq[i - 2] * vocab_size + seq[i - 1]][seq[i]] += 1

    def pack(counts):
        keys, ids, probs = [], [], []
        for key in sorted(counts):
            total = sum(counts[key].values())
            if total < min_count:
                continue
            top = counts[key].most_common(k)
            keys.append(key)
            ids.append([t for t, _ in top] + [-1] * (k - len(top)))
            probs.append([n / total for _, n in top] + [0.0] * (k - len(top)))
        return (np.asarray(keys, dtype=np.int64), np.asarray(ids, dtype=np.int32).reshape(-1, k),
                np.asarray(probs, dtype=np.float32).reshape(-1, k))

    return CorpusTable(vocab_size, *pack(c1), *pack(c2), meta=meta)


def propose_corpus(table: CorpusTable, context: list[int], depth: int, width: int = 2, max_nodes: int = 32,
                   min_prob: float = 0.1) -> Candidates:
    """Depth by depth from the last two tokens: each node's `width` most frequent successors of at least
    `min_prob`, until `max_nodes`."""
    out = Candidates()
    prev2 = context[-2] if len(context) >= 2 else -1
    frontier = [(-1, prev2, context[-1])]
    for _ in range(depth):
        nxt = []
        for parent, a, b in frontier:
            ids, probs, n = table.successors(a, b)
            for t, p in zip(ids[:width].tolist(), probs[:width].tolist()):
                if t < 0 or p < min_prob or len(out) >= max_nodes:
                    break
                nxt.append((out.add(parent, t, p, ("corpus", n, prob_bucket(p))), b, t))
        if not nxt:
            break
        frontier = nxt
    return out


SHIPPED_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "corpus")


def find_corpus(tokenizer_path: str, required: bool = False) -> str | None:
    """The shipped corpus table built for this tokenizer (matched by its vocabulary's fingerprint), or None;
    `required`: raise AdaspecConfigError naming what is missing instead."""
    import os

    from transformers import AutoTokenizer

    from vllm_adaspec.config import SECTION, AdaspecConfigError

    want = tokenizer_fingerprint(AutoTokenizer.from_pretrained(tokenizer_path))
    found = []
    if os.path.isdir(SHIPPED_DIR):
        for name in sorted(os.listdir(SHIPPED_DIR)):
            path = os.path.join(SHIPPED_DIR, name, "corpus.npz")
            if os.path.isfile(path):
                meta = CorpusTable.load(path).meta
                if meta.get("tokenizer") == want:
                    return path
                found.append(f"{name} (tokenizer {meta.get('tokenizer')})")
    if required:
        raise AdaspecConfigError(
            f"additional_config['{SECTION}']['pools']: 'corpus' has no table for this tokenizer ({want}); shipped: "
            f"{', '.join(found) or 'none'}. Build one with `adaspec build corpus --model MODEL`, or drop 'corpus'")
    return None
