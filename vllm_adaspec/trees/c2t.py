"""C2T (paper 004, section 4): a tiny classifier decides, layer by layer, which draft nodes enter the tree.

    features(node) = (joint probability P = product of draft probabilities from the root,
                      entropy H of the distribution the node was drawn from, over its top-1000 probabilities,
                      depth d)
    C(node)        = sigmoid(w2 . relu(W1 features + b1) + b2)        W1 [3, 48]: a few microseconds per tree

Growth (Algorithm 1): from the root, each kept node's top-K children by draft probability are scored; children
with C > beta are kept and expanded next (optionally only the top-K of a layer by confidence: the second pruning);
growth stops at max_depth, when no child of a layer passes, or when the node budget is spent. Chain mode (top_k 1)
is C2T's dynamic draft length. Pure torch and Python: no vLLM.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from vllm_adaspec.trees.build import GrowingTree
from vllm_adaspec.trees.tree import DraftTree

__all__ = ["ENTROPY_TOP_N", "init_classifier", "node_features", "classifier_logits", "confidence", "select_layer",
           "grow_c2t"]

HIDDEN = 48  # the paper's default hidden size (its appendix: 12-48 all work)
ENTROPY_TOP_N = 1000  # the entropy feature sums over this many most probable tokens (its appendix C: lossless)


def init_classifier(hidden: int = HIDDEN, seed: int = 0, features: int = 3) -> dict[str, torch.Tensor]:
    """Kaiming-uniform-like random init of the two layers (float32); `features` inputs (C2T's three by default)."""
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.rand(features, hidden, generator=g) * 2 - 1) * (6 / features) ** 0.5
    w2 = (torch.rand(hidden, 1, generator=g) * 2 - 1) * (6 / hidden) ** 0.5
    return {"w1": w1, "b1": torch.zeros(hidden), "w2": w2, "b2": torch.zeros(1)}


def node_features(joint: Sequence[float] | torch.Tensor, entropy: Sequence[float] | torch.Tensor,
                  depth: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """[N] each -> [N, 3] float32 (joint probability, entropy in nats, depth from 1)."""
    return torch.stack([torch.as_tensor(joint, dtype=torch.float32), torch.as_tensor(entropy, dtype=torch.float32),
                        torch.as_tensor(depth, dtype=torch.float32)], dim=-1)


def classifier_logits(params: dict[str, torch.Tensor], feats: torch.Tensor) -> torch.Tensor:
    """feats [N, 3] -> [N] logits (what training's BCE reads)."""
    return (torch.relu(feats @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"])[..., 0]


def confidence(params: dict[str, torch.Tensor], feats: torch.Tensor) -> torch.Tensor:
    """feats [N, 3] -> [N] in (0, 1): the classifier's belief that each node will be accepted."""
    return torch.sigmoid(classifier_logits(params, feats))


def select_layer(conf: Sequence[float], beta: float, second_top_k: int | None, room: int) -> list[int]:
    """Indices (into one layer's scored children) kept: confidence above beta, at most second_top_k of them by
    confidence (None: no second pruning), at most `room` (what the node budget has left), best first."""
    passed = sorted((i for i, c in enumerate(conf) if c > beta), key=lambda i: -conf[i])
    if second_top_k is not None:
        passed = passed[:second_top_k]
    return passed[:max(0, room)]


def grow_c2t(children_of: Callable[[tuple[int, ...]], tuple[list[int], list[float], float]],
             score: Callable[[torch.Tensor], torch.Tensor], beta: float, top_k: int, max_depth: int, budget: int,
             second_top_k: int | None = None) -> tuple[DraftTree, GrowingTree]:
    """Algorithm 1. children_of(path of tokens from the root) -> (its top tokens best first, their draft
    probabilities, the entropy of that distribution); score(features [N, 3]) -> confidences [N].

    Returns the tree (breadth-first) and the nodes kept with their joint probabilities and depths. A drafter that
    expands a whole layer in one batched step calls children_of for each kept node of the previous layer."""
    if not 0.0 <= beta < 1.0 or top_k < 1 or max_depth < 1 or budget < 1:
        raise ValueError(f"C2T needs 0 <= beta < 1, top_k >= 1, max_depth >= 1, budget >= 1; got beta={beta}, "
                         f"top_k={top_k}, max_depth={max_depth}, budget={budget}")
    t = GrowingTree()
    paths: list[tuple[int, ...]] = []
    frontier: list[int] = [-1]  # kept nodes of the last layer (-1 = the root)
    for depth in range(1, max_depth + 1):
        cand = []  # (parent, token, joint probability, entropy)
        for parent in frontier:
            path = () if parent < 0 else paths[parent]
            base = 1.0 if parent < 0 else t.probs[parent]
            ids, probs, ent = children_of(path)
            cand += [(parent, int(tok), base * float(p), float(ent)) for tok, p in list(zip(ids, probs))[:top_k]]
        if not cand:
            break
        conf = score(node_features([c[2] for c in cand], [c[3] for c in cand], [depth] * len(cand))).tolist()
        keep = select_layer(conf, beta, second_top_k, budget - len(t.parents))
        if not keep:
            break
        frontier = []
        for i in sorted(keep):  # parents-first order within the layer
            parent, tok, joint, _ = cand[i]
            t.parents.append(parent)
            t.tokens.append(tok)
            t.probs.append(joint)
            t.depths.append(depth)
            paths.append((() if parent < 0 else paths[parent]) + (tok,))
            frontier.append(len(t.parents) - 1)
    # Layer by layer, each layer in its parents' order: already breadth-first.
    return DraftTree(torch.tensor(t.tokens, dtype=torch.long), torch.tensor(t.parents, dtype=torch.long)), t
