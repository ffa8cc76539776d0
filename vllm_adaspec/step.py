"""The step contract between a drafter and the engine glue: what a drafter needs, what it proposes, what it learns.

One trip each way per step. Drafting: the drafter returns a `DraftPlan` per request; the glue hands the plans'
tokens to vLLM's scheduler and, for trees, to the tree runtime (runtime/). Feedback: after
verification the glue builds one `Outcome` per decoding request and hands them, with the target outputs the
drafter asked for (`Taps`), to the drafter in one `observe` call before the next propose. Plain Python and torch: no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_adaspec.controls import DEFAULT as DEFAULT_CONTROLS
from vllm_adaspec.controls import RequestControls
from vllm_adaspec.trees.tree import is_chain


@dataclass(frozen=True)
class Needs:
    """What a drafter asks of the engine, declared once (the glue installs exactly these hooks)."""
    target_hidden: bool = False  # the final hidden state of the row that produced each request's last token
    verified_logits: int = 0  # > 0: the top-k of the target's logits at every verified row (k = this)
    trees: bool = False  # plans may be token trees (tree-mask attention, tree sampler, KV compaction)
    forward_rows: bool = False  # every row of the step's forward: its final hidden state, token and position
    # target layers whose residual streams the forward returns too (vLLM's auxiliary hidden states): forward rows'
    # features are then [those streams ; the final hidden state], in this order
    aux_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class DraftPlan:
    """One request's drafts for the next verification forward.

    tokens: drafts in the order vLLM schedules them (trees: breadth-first, a parent before its children);
    parents: None for a chain, else each node's parent (-1 = the root, the last committed token);
    verified: how many of the first nodes are verified; the rows after them are read-only draft-branch rows
    (pools/branches.py), None = all; tree_path: verify it in the tree path even where it is a chain (requests whose
    sampling settings only the tree sampler applies, RequestTraits.own_sampler)."""
    tokens: tuple[int, ...]
    parents: tuple[int, ...] | None = None
    verified: int | None = None
    tree_path: bool = False

    @property
    def num_verified(self) -> int:
        return len(self.tokens) if self.verified is None else self.verified

    def __post_init__(self):  # (is_tree is read several times a step per plan: worked out once)
        object.__setattr__(self, "_is_tree", self.parents is not None and (
            self.tree_path or self.num_verified < len(self.tokens) or not is_chain(self.parents)))

    @property
    def is_tree(self) -> bool:
        """Verified in the tree path: the nodes branch, read-only rows ride along, or the request asks for it."""
        return self._is_tree

    def scheduled(self, n: int) -> "DraftPlan":
        """The plan as verified when the scheduler kept only its first n drafts: breadth-first order keeps a
        tree a tree, and read-only rows, which come last, go first."""
        if n >= len(self.tokens):
            return self
        verified = None if self.verified is None else min(self.verified, n)
        return DraftPlan(self.tokens[:n], None if self.parents is None else self.parents[:n], verified,
                         self.tree_path)


@dataclass(frozen=True)
class RequestTraits:
    """What one request allows and needs of speculation, read once when the drafter first sees it.

    controls: its per-request settings (controls.py); tree: the tree sampler can verify it exactly (every sampling
    setting it carries is applied per tree row: engine/tree_sampler.py); own_sampler: some of its settings (min_p,
    logit_bias) are applied by the tree sampler only (vLLM's chain verification ignores them), so its drafts go
    through the tree path or not at all; grammar: structured output (candidates are checked against a copy of its
    grammar before they are chosen, and only a request whose copy is ready drafts trees); plain: "greedy" or
    "sampled" when its rows need nothing but an argmax or an unseeded draw after temperature / top-k / top-p (a device
    runtime verifies such trees in one batch), else None."""
    controls: RequestControls = DEFAULT_CONTROLS
    tree: bool = True
    own_sampler: bool = False
    grammar: bool = False
    plain: str | None = None


@dataclass(frozen=True)
class Outcome:
    """What verification made of one request's plan in one step.

    drafted: drafts verified (the plan's nodes as scheduled, read-only rows not counted; 0 = none proposed);
    accepted: accepted nodes, root to deepest (a chain: 0 .. a-1); branch_argmax: the target's argmax at each
    read-only branch row; row: the output row (sampled rows, batch order) of the request's bonus token."""
    drafted: int
    accepted: tuple[int, ...]
    bonus: int
    row: int
    tree: bool = False
    branch_argmax: tuple[int, ...] = ()


@dataclass(frozen=True)
class BatchView:
    """What a drafter reads of the batch at a propose call, in batch order (rows = vLLM's input batch rows).

    sampled [B]: tokens the step committed per row (empty: a prefill chunk or a discarded step); num_tokens [B]:
    committed tokens per row; token_ids [B, max_len]: every row's tokens (the first num_tokens are committed);
    num_prompt [B]; temperature [B] (host copies)."""
    req_ids: list
    sampled: list
    num_tokens: object  # np.ndarray [B]
    token_ids: object  # np.ndarray [B, max_len]
    num_prompt: object  # np.ndarray [B]
    temperature: object  # np.ndarray [B]

    def decoding(self) -> int:
        return sum(1 for s in self.sampled if s)

    def tokens(self, row: int):
        """The committed tokens of a row (a view)."""
        return self.token_ids[row, :int(self.num_tokens[row])]


@dataclass
class Taps:
    """Target outputs a drafter asked for (`Needs`), gathered by the glue during the step.

    hidden [rows, H]: final hidden states of the sampled rows (index with Outcome.row);
    logits_topk: one entry per sampler call of the step, (req_ids [N], tokens [N], ids [N, k], probs [N, k]):
    for every output row, its request, the token the row follows (its root or a draft) and the target's top-k
    next tokens with their probabilities."""
    hidden: object | None = None
    logits_topk: list = field(default_factory=list)
    forward: "ForwardRows | None" = None


@dataclass
class ForwardRows:
    """Every row of the step's forward (Needs.forward_rows), in the forward's order: requests in batch order, a
    request's rows contiguous from query_start[i] (host [B + 1]). parts: [N, H] each, the residual streams after
    Needs.aux_layers (ascending), then the final-normed state; input_ids, positions: the runner's buffers (their
    first N rows are the forward's)."""
    parts: tuple
    input_ids: object
    positions: object
    query_start: object

    def features(self, rows):
        """rows [M] -> [M, len(parts) * H] those rows' features (gathered before joining: a step feeds a few rows
        of a forward that may hold thousands)."""
        return self.parts[0][rows] if len(self.parts) == 1 else torch.cat([p[rows] for p in self.parts], -1)


# Tree drafting (a drafter that runs the target's own layers over tree nodes, proposers/early_exit.py) hands the
# runtime one DraftMask per draft step (runtime/base.TreeRuntime.drafting).

@dataclass
class DraftPrefix:
    """The prefixes (through the root) of the trees of one propose call. They do not change while the trees are
    drafted, so their K, V are gathered once per attention layer and reused by every depth."""
    block_rows: torch.Tensor  # [T, max_blocks] each tree's block row
    positions: torch.Tensor  # [T, P] key positions 0..root (padding: position 0, masked off)
    kv: dict = field(default_factory=dict)  # cache address -> (K, V) [T, P, H, D]


@dataclass
class DraftMask:
    """A draft step of tree drafting over R of the call's trees: row m of tree r is the flattened row rows[r, m]
    (valid[r, m]); its keys are the tree's prefix (P columns) then its node slots root + 1 .. (node_pos), and it
    sees key c iff visible[r, m, c] (the prefix, the root and its own ancestors-or-self among drafted nodes)."""
    num_tokens: int
    prefix: DraftPrefix
    trees: torch.Tensor  # [R] index into prefix's trees
    rows: torch.Tensor  # [R, M] (padding repeats the tree's first row)
    valid: torch.Tensor  # [R, M] bool
    node_pos: torch.Tensor  # [R, N] slot positions of the tree's drafted nodes (padding: the root, masked off)
    visible: torch.Tensor  # [R, M, P + N] bool
    roots: torch.Tensor | None = None  # [R] each tree's root position (its prefix: positions 0 .. root)
    tree_lens: torch.Tensor | None = None  # [R] nodes run so far (at root + 1 ..), the step's own included
