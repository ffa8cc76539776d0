"""Train C2T's node classifier (paper 004, appendix B) from labelled tree nodes.

    data   = (features [N, 3] = joint probability, top-1000 entropy, depth; accepted [N] bool) from fully verified
             draft trees
    train  = BCE, Adam (lr 1e-3), batches of 1024, negatives subsampled to `neg_per_pos` per positive (accepted
             nodes are rare: a few per tree of hundreds)
    judge  = recall of accepted nodes and positive rate (the share of nodes kept) at a threshold beta, on a held-out
             split: recall first, then the smaller positive rate

This module is the pure part (no vLLM): collecting labelled trees inside the engine comes on top of it.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_adaspec.trees.c2t import classifier_logits, confidence, init_classifier

__all__ = ["fit_classifier", "recall_and_positive_rate"]


def fit_classifier(feats: np.ndarray, accepted: np.ndarray, epochs: int = 10, lr: float = 1e-3, batch: int = 1024,
                   neg_per_pos: float = 4.0, seed: int = 0) -> dict[str, torch.Tensor]:
    """feats [N, 3], accepted [N] -> classifier parameters (trees/c2t.py layout)."""
    if feats.ndim != 2 or feats.shape[1] != 3 or len(feats) != len(accepted):
        raise ValueError(f"feats must be [N, 3] with one label per row, got {feats.shape} and {len(accepted)} labels")
    pos = np.flatnonzero(accepted)
    neg = np.flatnonzero(~accepted.astype(bool))
    if not len(pos) or not len(neg):
        raise ValueError(f"need accepted and rejected nodes, got {len(pos)} and {len(neg)}")
    rng = np.random.default_rng(seed)
    params = {k: v.clone().requires_grad_(True) for k, v in init_classifier(seed=seed).items()}
    opt = torch.optim.Adam(params.values(), lr=lr)
    x_all = torch.as_tensor(feats, dtype=torch.float32)
    y_all = torch.as_tensor(accepted, dtype=torch.float32)
    for _ in range(epochs):  # a fresh negative sample each epoch
        keep = np.concatenate([pos, rng.choice(neg, size=min(len(neg), int(neg_per_pos * len(pos))), replace=False)])
        rng.shuffle(keep)
        for lo in range(0, len(keep), batch):
            idx = torch.as_tensor(keep[lo:lo + batch])
            loss = torch.nn.functional.binary_cross_entropy_with_logits(classifier_logits(params, x_all[idx]),
                                                                        y_all[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {k: v.detach() for k, v in params.items()}


@torch.no_grad()
def recall_and_positive_rate(params: dict[str, torch.Tensor], feats: np.ndarray, accepted: np.ndarray,
                             beta: float) -> tuple[float, float]:
    """(share of accepted nodes with confidence > beta, share of all nodes with confidence > beta)."""
    kept = (confidence(params, torch.as_tensor(feats, dtype=torch.float32)) > beta).numpy()
    acc = accepted.astype(bool)
    return float(kept[acc].mean()) if acc.any() else 0.0, float(kept.mean())
