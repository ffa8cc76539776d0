"""The acceptance predictor of EESD's calibrated Thompson sampling (EESD Eq. 5), used by `thompson-cali`.

theta_M = sigmoid(W_p [W^i H^T ; H^D_i]), i = min(depth, 10). H^T is the target's last-layer hidden state (after its
final norm) at the row that produced the round's first input token; H^D_i is the drafter's own normed hidden state
that produced draft i. Eq. 5 is linear inside the sigmoid, so W_p (2 x 2d) and the ten d x d matrices W^i collapse
to one vector u_i per depth plus one vector w: the same function class with 10d + d + 10 numbers instead of 10d^2.
We store that collapsed form. Trained by `adaspec train calibration` (training/calibration_trainer.py).
"""

from __future__ import annotations

import json
import os

import torch

MAX_DEPTH = 10  # EESD caps the per-depth matrices at i = 10
FORMAT = "vllm-adaspec/calibration/1"
WEIGHTS = "calibration.safetensors"
META = "calibration.json"


def predictor_logits(ht_proj: torch.Tensor, h_draft: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                     depth: int) -> torch.Tensor:
    """ht_proj [B, 10] = H^T @ U.T (once per round), h_draft [B, d], w [d], b [10] -> logits [B] at `depth`."""
    i = min(depth, MAX_DEPTH) - 1
    return ht_proj[:, i] + h_draft @ w + b[i]


class CalibrationPredictor:
    """Eq. 5 in collapsed form: u [10, d] (target side), w [d] (draft side), b [10]."""

    def __init__(self, u: torch.Tensor, w: torch.Tensor, b: torch.Tensor, meta: dict | None = None):
        if u.shape[0] != MAX_DEPTH or u.shape[1] != w.shape[0] or b.shape != (MAX_DEPTH,):
            raise ValueError(f"calibration predictor shapes do not fit: u {tuple(u.shape)}, w {tuple(w.shape)}, "
                             f"b {tuple(b.shape)}")
        self.u, self.w, self.b, self.meta = u, w, b, meta or {}

    def to(self, device, dtype=torch.float32) -> "CalibrationPredictor":
        return CalibrationPredictor(self.u.to(device, dtype), self.w.to(device, dtype), self.b.to(device, dtype),
                                    self.meta)

    def project_target(self, h_target: torch.Tensor) -> torch.Tensor:
        """[B, d] -> [B, 10]: the target side of every depth's logit."""
        return h_target.to(self.u.dtype) @ self.u.T

    def score(self, ht_proj: torch.Tensor, h_draft: torch.Tensor, depth: int) -> torch.Tensor:
        """theta_M [B] for draft `depth` (1-based)."""
        return torch.sigmoid(predictor_logits(ht_proj, h_draft.to(self.w.dtype), self.w, self.b, depth))

    def save(self, folder: str, meta: dict) -> None:
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        save_file({"u": self.u.float().contiguous(), "w": self.w.float().contiguous(),
                   "b": self.b.float().contiguous()}, os.path.join(folder, WEIGHTS))
        with open(os.path.join(folder, META), "w") as f:
            json.dump({"format": FORMAT, **meta}, f, indent=1, sort_keys=True)

    @classmethod
    def load(cls, folder: str) -> "CalibrationPredictor":
        from safetensors.torch import load_file

        meta = read_meta(folder)
        t = load_file(os.path.join(folder, WEIGHTS))
        return cls(t["u"], t["w"], t["b"], meta)


def read_meta(folder: str) -> dict:
    path = os.path.join(folder, META)
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    with open(path) as f:
        meta = json.load(f)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a calibration predictor "
                         f"({meta.get('format') if isinstance(meta, dict) else type(meta).__name__!r})")
    return meta
