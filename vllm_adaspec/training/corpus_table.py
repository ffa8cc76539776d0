"""`adaspec build corpus`: the corpus pool's n-gram table for one tokenizer, from text this machine has offline.

Sources (never an evaluation set): the model's self-distilled text (`adaspec distill`: prompts built from the
standard library and hand-written chat topics, and the target's own answers) and the Python standard library's
own sources. The table records the tokenizer's fingerprint and what it was built from.
"""

from __future__ import annotations

import os
import sysconfig

import numpy as np

from vllm_adaspec.pools.corpus import CorpusTable, build_table, tokenizer_fingerprint

__all__ = ["stdlib_sources", "build_corpus"]

# Folders of the standard library left out: third-party code, test suites, GUI demos.
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3", "turtledemo",
             "tkinter"}


def stdlib_sources() -> list[str]:
    """Paths of the standard library's .py files, sorted (the same list on any machine with this Python)."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        paths += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".py")]
    return sorted(paths)


def build_corpus(model: str, out: str, distill_dir: str | None = None, stdlib: bool = True, k: int = 4,
                 min_count: int = 3, progress: bool = True) -> dict:
    """Tokenize the sources with `model`'s tokenizer, count successors, write OUT/corpus.npz. Returns a summary."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    tok.model_max_length = 1 << 30  # whole source files are counted, never fed to a model
    sequences, sources = [], []
    if distill_dir is not None:
        from vllm_adaspec.training.distill import load_shards

        data = load_shards(distill_dir)
        sequences += [data.tokens[a:b] for a, b in zip(data.offsets[:-1], data.offsets[1:])]
        sources.append(f"self-distilled text ({os.path.basename(os.path.normpath(distill_dir))}, "
                       f"{len(data)} sequences)")
    if stdlib:
        files = stdlib_sources()
        for path in tqdm(files, desc="tokenizing the standard library", unit="file", disable=not progress):
            with open(path, encoding="utf-8", errors="replace") as f:
                sequences.append(np.asarray(tok(f.read(), add_special_tokens=False)["input_ids"], np.int64))
        sources.append(f"Python {sysconfig.get_python_version()} standard library ({len(files)} files)")
    if not sequences:
        raise ValueError("no sources: give a self-distillation folder or keep the standard library")
    tokens = int(sum(len(s) for s in sequences))
    meta = {"tokenizer": tokenizer_fingerprint(tok), "model": os.path.basename(os.path.normpath(model)),
            "sources": sources, "tokens": tokens, "k": k, "min_count": min_count}
    vocab = max(len(tok), 1 + max(int(s.max()) for s in sequences if len(s)))
    table = build_table(sequences, vocab_size=vocab, k=k, min_count=min_count, meta=meta)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "corpus.npz")
    table.save(path)
    return {"path": path, "tokens": tokens, "contexts": [len(table.keys1), len(table.keys2)],
            "bytes": os.path.getsize(path), "sources": sources}
