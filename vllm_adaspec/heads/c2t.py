"""C2T classifier checkpoints (trees/c2t.py holds the maths): EXIT_HEAD/c2t.safetensors (w1 [3, 48], b1 [48],
w2 [48, 1], b2 [1]) + EXIT_HEAD/c2t.json, which records the sha256 of the exit head the classifier was trained on:
its features come from that head's distributions, so another head's trees would be judged on the wrong scale."""

from __future__ import annotations

import json
import os

import torch

from vllm_adaspec.errors import SECTION, AdaspecConfigError

FORMAT = "vllm-adaspec/c2t/1"
KEYS = ("w1", "b1", "w2", "b2")


def save_c2t(folder: str, params: dict[str, torch.Tensor], meta: dict) -> None:
    """Write the classifier next to the exit head in `folder`, tied to that head's weights."""
    from safetensors.torch import save_file

    from vllm_adaspec.heads import exit_head_hash

    save_file({k: params[k].detach().float().contiguous() for k in KEYS}, os.path.join(folder, "c2t.safetensors"))
    with open(os.path.join(folder, "c2t.json"), "w") as f:
        json.dump({"format": FORMAT, "exit_head_hash": exit_head_hash(folder), **meta}, f, indent=1, sort_keys=True)


def load_c2t(folder: str | None) -> tuple[dict, dict[str, torch.Tensor]]:
    """The classifier trained for the exit head in `folder`; AdaspecConfigError naming what is missing or stale."""
    from vllm_adaspec.heads import exit_head_hash, load_checkpoint

    key = f"additional_config['{SECTION}']['tree']['builder']"
    fix = "train one with `adaspec train c2t --exit-head <folder>`, or use \"builder\": \"joint\""
    if folder is None:
        raise AdaspecConfigError(f"{key}: 'c2t' needs a trained exit head with a classifier; this configuration "
                                 "drafts with the untrained exit")
    meta, t = load_checkpoint(folder, "c2t", FORMAT, True,
                              f"{key}: 'c2t' needs a classifier in the exit head folder {folder} (no c2t.json); {fix}",
                              key=key)
    if meta.get("exit_head_hash") != exit_head_hash(folder):
        raise AdaspecConfigError(f"{key}: the classifier in {folder} was trained for another version of that exit "
                                 f"head (its weights changed since); {fix}")
    missing = [k for k in KEYS if k not in t]
    if missing or t["w1"].shape[0] != 3:
        raise AdaspecConfigError(f"{key}: {folder}/c2t.safetensors lacks {missing or 'a [3, H] first layer'}; {fix}")
    return meta, t
