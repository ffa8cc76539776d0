"""Exit-head checkpoints: the trained EESD exit layer(s) + norm (+ LM head when trained) + draft vocabulary.

A checkpoint is a folder with `exit_head.safetensors` and `exit_head.json`. The JSON names the base model it was
trained on (architecture, a hash of the config fields that shape the network, and a fingerprint of its weights),
N (the target layers the exit sits on), how many exit layers, whether the LM head is shared, the draft vocabulary
size, and how it was trained. `check_against_model` refuses a checkpoint for another model or another N.

Folders next to this file are checkpoints shipped with the package; `find_shipped` picks one for a model.
Pure Python + torch: usable by the trainer (no vLLM) and by the drafter (inside vLLM).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Callable, Mapping

import torch

from vllm_adaspec.errors import AdaspecConfigError, one_line

__all__ = ["FORMAT", "config_hash", "weights_fingerprint", "fingerprint_mismatch", "fingerprint_names", "save_exit_head", "load_exit_head",
           "check_against_model", "find_shipped", "SHIPPED_DIR", "exit_head_hash", "check_calibration"]

FORMAT = "vllm-adaspec/exit-head/1"
SHIPPED_DIR = os.path.dirname(os.path.abspath(__file__))
_CONFIG_KEYS = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "tie_word_embeddings")


def _cfg_get(cfg, key):
    return cfg.get(key) if isinstance(cfg, Mapping) else getattr(cfg, key, None)


def config_hash(cfg) -> str:
    """sha256 over the config fields that shape the network (dict or HF config object)."""
    picked = {k: _cfg_get(cfg, k) for k in _CONFIG_KEYS}
    if picked["rope_theta"] is None:  # transformers 5 configs keep it under rope_parameters
        rp = _cfg_get(cfg, "rope_parameters") or {}
        picked["rope_theta"] = rp.get("rope_theta") if isinstance(rp, Mapping) else None
    if picked["head_dim"] is None and picked["hidden_size"] and picked["num_attention_heads"]:
        picked["head_dim"] = picked["hidden_size"] // picked["num_attention_heads"]
    picked = {k: (float(v) if isinstance(v, float) else v) for k, v in picked.items()}
    return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint_names(num_layers: int) -> list[str]:
    """Tensors fingerprinted: embedding, final norm and every layer's two norms. They have the same name and
    layout in Hugging Face checkpoints and in vLLM's loaded model on every platform (linear weights do not:
    vLLM fuses q/k/v and, on CPU, repacks them), so both sides can compute the same value."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(num_layers):
        names += [f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.post_attention_layernorm.weight"]
    return names


FINGERPRINT_CHUNKS = 32
FINGERPRINT_RTOL = 1e-3


def weights_fingerprint(get: Callable[[str], torch.Tensor], num_layers: int, vocab_size: int) -> list[float]:
    """What identifies a checkpoint's weights in any dtype: for the embedding and for all norms together (each
    flattened, in FINGERPRINT_CHUNKS equal chunks), every chunk's mean and mean absolute value, summed in float64.
    A float32, bfloat16 or float16 load of the same checkpoint gives the same numbers up to rounding averaged over
    thousands of values (far below FINGERPRINT_RTOL); another checkpoint or a fine-tune moves them.

    (Heads before this format stored a sha256 of bfloat16-rounded values, which float16 loads cannot reproduce:
    rounding float16 to bfloat16 is not rounding float32 to bfloat16.)"""
    names = fingerprint_names(num_layers)
    emb = get(names[0]).detach()[:vocab_size].reshape(-1)  # vLLM pads the vocabulary
    norms = torch.cat([get(n).detach().reshape(-1).to("cpu", torch.float32) for n in names[1:]])
    out = []
    for t in (emb.to("cpu", torch.float32), norms):
        for chunk in torch.tensor_split(t, FINGERPRINT_CHUNKS):
            out += [chunk.sum(dtype=torch.float64).item() / chunk.numel(),
                    chunk.abs().sum(dtype=torch.float64).item() / chunk.numel()]
    return [float(f"{x:.9g}") for x in out]


def fingerprint_mismatch(stored, loaded: list[float]) -> float | None:
    """None when `loaded` (weights_fingerprint of the model) is the checkpoint `stored` describes, else how far off
    it is (largest deviation over the tolerance; > 1). `stored` may be a legacy sha256 string (exact match on
    bfloat16-rounded values, computed here again for the comparison's sake by the caller: see _legacy)."""
    if len(stored) != len(loaded):
        return float("inf")
    worst, half = 0.0, len(stored) // 2
    for part in (slice(0, half), slice(half, None)):
        a, b = stored[part], loaded[part]
        scale = sum(abs(x) for x in a[1::2]) / max(1, len(a) // 2)  # mean |w| of this tensor group
        tol = FINGERPRINT_RTOL * scale + 1e-12
        worst = max(worst, max(abs(x - y) for x, y in zip(a, b)) / tol)
    return None if worst <= 1 else worst


def legacy_fingerprint(get: Callable[[str], torch.Tensor], num_layers: int, vocab_size: int) -> str:
    """The format of heads trained before weights_fingerprint: sha256 over bfloat16-rounded tensors."""
    h = hashlib.sha256()
    for name in fingerprint_names(num_layers):
        t = get(name).detach()
        if name == "model.embed_tokens.weight":
            t = t[:vocab_size]
        h.update(name.encode())
        h.update(t.to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


def save_exit_head(folder: str, tensors: dict[str, torch.Tensor], meta: dict, dtype=torch.bfloat16) -> None:
    """tensors: `layers.{j}.<hf layer param>`, `norm.weight`, `draft_vocab` (int64), optionally `lm_head.weight`."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    out = {k: (v.detach().to("cpu").contiguous() if v.dtype == torch.int64 else v.detach().to("cpu", dtype).contiguous())
           for k, v in tensors.items()}
    save_file(out, os.path.join(folder, "exit_head.safetensors"))
    with open(os.path.join(folder, "exit_head.json"), "w") as f:
        json.dump({"format": FORMAT, **meta}, f, indent=1, sort_keys=True)


EXIT_HEAD_KEY = "additional_config['adaspec']['exit_head']"


def load_exit_head(folder: str, tensors: bool = True) -> tuple[dict, dict[str, torch.Tensor] | None]:
    return load_checkpoint(folder, "exit_head", FORMAT, tensors,
                           f"{EXIT_HEAD_KEY}: {folder!r} is not an exit-head checkpoint folder (no exit_head.json); "
                           "train one with `adaspec train exit-layer`", key=EXIT_HEAD_KEY)


# What each checkpoint's JSON must hold for start-up and the worker to read it (name -> JSON type), and the tensors
# its .safetensors must hold: a hand-edited or truncated file is refused at start-up, naming the file.
REQUIRED_META = {"exit_head": {"base_model": dict, "exit_layer": int, "num_exit_layers": int},
                 "medusa": {"base_model": dict, "accuracy_by_rank": list}}
REQUIRED_TENSORS = {"exit_head": ("norm.weight", "draft_vocab"), "medusa": ("w", "b", "draft_vocab"),
                    "c2t": ("w1", "b1", "w2", "b2")}


def load_checkpoint(folder: str, stem: str, fmt: str, tensors: bool, missing: str,
                    key: str = "additional_config['adaspec']") -> tuple[dict, dict[str, torch.Tensor] | None]:
    """FOLDER/<stem>.json (its "format" must be `fmt`) and, with `tensors`, FOLDER/<stem>.safetensors;
    AdaspecConfigError(`missing`) when there is no <stem>.json, and AdaspecConfigError naming `key` (the setting
    that named the folder) and the file when either file cannot be read or lacks what this package reads."""
    folder = os.path.expanduser(folder)
    path = os.path.join(folder, f"{stem}.json")
    if not os.path.isfile(path):
        raise AdaspecConfigError(missing)
    meta = _read_meta(path, key)
    if meta.get("format") != fmt:
        raise AdaspecConfigError(f"{key}: {path}: format {meta.get('format')!r}, this vllm_adaspec reads {fmt!r}")
    _check_meta(meta, path, key, REQUIRED_META.get(stem, {}))
    weights = os.path.join(folder, f"{stem}.safetensors")
    if not os.path.isfile(weights):
        raise AdaspecConfigError(f"{key}: {folder} has {stem}.json but no {stem}.safetensors (an incomplete copy?)")
    try:
        names = _tensor_names(weights)
        loaded = _load_tensors(weights) if tensors else None
    except Exception as e:  # safetensors raises its own error types for a truncated or foreign file
        raise AdaspecConfigError(f"{key}: cannot read {weights} ({one_line(e)})") from None
    lacking = [n for n in REQUIRED_TENSORS.get(stem, ()) if n not in names]
    if lacking:
        raise AdaspecConfigError(f"{key}: {weights} lacks the tensor(s) {', '.join(lacking)}")
    return meta, loaded


def _read_meta(path: str, key: str) -> dict:
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise AdaspecConfigError(f"{key}: cannot read {path} ({one_line(e)})") from None
    if not isinstance(meta, dict):
        raise AdaspecConfigError(f"{key}: {path} must hold a JSON object, got {type(meta).__name__}")
    return meta


def _check_meta(meta: dict, path: str, key: str, required: dict) -> None:
    for name, kind in required.items():
        value = meta.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise AdaspecConfigError(f"{key}: {path} has no {name!r} ({kind.__name__}); it was not written by this "
                                     f"package's trainer, or was edited")
    base = meta.get("base_model")
    if "base_model" in required and not isinstance(base.get("config_hash"), str):
        raise AdaspecConfigError(f"{key}: {path}: 'base_model' has no 'config_hash' (string)")


def _tensor_names(path: str) -> set[str]:
    """The tensors in a .safetensors file, from its header only (cheap at start-up)."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return set(f.keys())


def _load_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def hf_num_layers(hf_config) -> int:
    return int(_cfg_get(hf_config, "num_hidden_layers"))


def check_against_model(meta: dict, folder: str, hf_config, exit_layer: int | None,
                        get_weights: Callable[[str], torch.Tensor] | None = None) -> None:
    """Raise AdaspecConfigError when the checkpoint was not trained for this model / N (and, with `get_weights`:
    name -> the loaded model's tensor, for these weights)."""
    base = meta["base_model"]
    where = f"exit head {folder}"
    archs = list(_cfg_get(hf_config, "architectures") or [])
    if base["config_hash"] != config_hash(hf_config):
        raise AdaspecConfigError(
            f"{EXIT_HEAD_KEY}: {where} was trained for {base.get('name')} "
            f"({', '.join(base.get('architectures', []))}, config hash "
            f"{base['config_hash']}), not for this model ({', '.join(archs)}, config hash {config_hash(hf_config)})")
    if exit_layer is not None and exit_layer != meta["exit_layer"]:
        raise AdaspecConfigError(
            f"additional_config['adaspec']['exit_layer'] = {exit_layer}, but {where} was trained on the first "
            f"{meta['exit_layer']} layers; omit exit_layer or set it to {meta['exit_layer']}")
    if get_weights is not None:
        stored = base["weights_fingerprint"]
        if isinstance(stored, str):  # a head from before the tolerant format
            loaded = legacy_fingerprint(get_weights, hf_num_layers(hf_config), _cfg_get(hf_config, "vocab_size"))
            off = None if loaded == stored else float("inf")
        else:
            off = fingerprint_mismatch(
                stored, weights_fingerprint(get_weights, hf_num_layers(hf_config), _cfg_get(hf_config, "vocab_size")))
        if off is not None:
            raise AdaspecConfigError(
                f"{EXIT_HEAD_KEY}: {where} was trained for {base.get('name')} with other weights (same architecture, "
                f"different weights: another checkpoint or a fine-tune; its weights fingerprint is {off:.3g}x the "
                "tolerance away). Train a head for these weights with `adaspec train exit-layer`")


def find_shipped(hf_config, exit_layer: int | None = None) -> str | None:
    """A shipped checkpoint folder whose config hash (and N, when given) match; None when there is none."""
    want = config_hash(hf_config)
    for name in sorted(os.listdir(SHIPPED_DIR)):
        folder = os.path.join(SHIPPED_DIR, name)
        if not os.path.isfile(os.path.join(folder, "exit_head.json")):
            continue
        meta, _ = load_exit_head(folder, tensors=False)
        if meta["base_model"]["config_hash"] == want and exit_layer in (None, meta["exit_layer"]):
            return folder
    return None


def exit_head_hash(folder: str) -> str:
    """sha256 of the exit head's weights file: ties a calibration predictor to the head it was trained with."""
    path = os.path.join(os.path.expanduser(folder), "exit_head.safetensors")
    st = os.stat(path)
    return _file_hash(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=16)
def _file_hash(path: str, mtime_ns: int, size: int) -> str:
    """Start-up reads the hash several times (predictor, classifier): a 7 MB file is hashed once per version."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


POLICY_KEY = "additional_config['adaspec']['policy']"


def check_calibration(folder: str | None, policy: str) -> None:
    """Raise AdaspecConfigError unless `folder` (the exit head in use) holds a predictor trained for it."""
    from vllm_adaspec.policies.calibration import META, WEIGHTS, read_meta

    fix = "train one with `adaspec train calibration --exit-head <folder>` or pick another policy"
    if folder is None:
        raise AdaspecConfigError(f"{POLICY_KEY}: policy {policy!r} needs a trained exit head with a calibration "
                                 "predictor; this configuration drafts with the untrained exit (exit_head 'none' or "
                                 "none ships for this model / exit_layer)")
    try:
        meta = read_meta(folder)
    except FileNotFoundError:
        raise AdaspecConfigError(f"{POLICY_KEY}: policy {policy!r} needs a calibration predictor in the exit head "
                                 f"folder {folder} (no {META}); {fix}") from None
    except ValueError as e:  # not JSON, or another format
        raise AdaspecConfigError(f"{POLICY_KEY}: policy {policy!r}: {one_line(e)}") from None
    weights = os.path.join(folder, WEIGHTS)
    try:
        _tensor_names(weights)
    except Exception as e:
        raise AdaspecConfigError(f"{POLICY_KEY}: policy {policy!r}: cannot read {weights} ({one_line(e)}); "
                                 f"{fix}") from None
    if meta.get("exit_head_hash") != exit_head_hash(folder):
        raise AdaspecConfigError(f"{POLICY_KEY}: policy {policy!r}: the calibration predictor in {folder} was trained "
                                 f"for another exit head (hash {meta.get('exit_head_hash')}, this head "
                                 f"{exit_head_hash(folder)}); {fix}")
