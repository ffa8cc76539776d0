"""Copies of structured-output requests' grammars in the worker, for token trees.

vLLM keeps each request's grammar matcher in the scheduler and checks drafts as a chain (the longest valid prefix
survives); verification masks each row with the grammar state after the drafts before it. A token tree needs
both per path. The drafter proposes in the worker, so the worker keeps a copy of each structured request's matcher,
compiled by vLLM's own structured-output backend from the request's settings and advanced by the tokens the request
commits. With it:
- before a request's candidate nodes are chosen, every node is checked along its path (accept, recurse, roll back:
  the matcher's own rollback), and forbidden nodes with their subtrees are dropped (`valid_nodes`);
- the tree sampler masks every tree row with the grammar state after that row's path (`row_masks`), where vLLM's
  bitmask would have used the chain order;
- the scheduler (engine/scheduler.py) neither cuts the tree as a chain nor masks its node rows (it is told which
  requests' drafts are trees); the committed tokens (accepted path + bonus) advance vLLM's own matcher as always.

Requests whose grammar applies only after a reasoning section (a reasoning parser without `enable_in_reasoning`)
get no copy: they draft chains, which vLLM checks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from vllm_adaspec.engine.vllm_surface import vllm_object

logger = logging.getLogger("vllm_adaspec")


@dataclass
class GrammarCopy:
    grammar: object  # vllm StructuredOutputGrammar (its own matcher)
    fed: int = 0  # output tokens accepted so far
    broken: bool = False  # the copy disagreed with the committed tokens: no more trees for this request


class GrammarCopies:
    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.manager = None  # vLLM's StructuredOutputManager: picks and builds the backend as the scheduler does
        self.copies: dict[str, GrammarCopy | None] = {}  # None: the request has a grammar but no copy (reasoning)
        self.bitmask = None  # [rows, words] int32, the backend's own buffer
        self.vocab = vllm_config.model_config.get_vocab_size()

    def _manager(self):
        if self.manager is None:
            StructuredOutputManager = vllm_object("StructuredOutputManager")

            self.manager = StructuredOutputManager(self.vllm_config)
        return self.manager

    def supported(self) -> bool:
        """Copies are exact only where the grammar constrains from the first output token."""
        m = self._manager()
        return m.reasoner_cls is None or m.enable_in_reasoning

    def start(self, req_id: str, sampling_params) -> bool:
        """Compile the request's grammar (synchronously: every tensor-parallel rank must have it at the same step).
        False: no copy (unsupported, or compilation failed; the request drafts chains)."""
        if req_id in self.copies:
            return self.copies[req_id] is not None
        StructuredOutputRequest = vllm_object("StructuredOutputRequest")

        copy = None
        so = StructuredOutputRequest.from_sampling_params(sampling_params)
        if so is not None and self.supported():
            request = SimpleNamespace(request_id=req_id, sampling_params=sampling_params, structured_output_request=so)
            try:
                self._manager().grammar_init(request)
                grammar = so._grammar.result() if hasattr(so._grammar, "result") else so._grammar
                copy = GrammarCopy(grammar)
            except Exception as e:  # noqa: BLE001 (vLLM's scheduler reports it to the request; we draft chains)
                logger.warning("vllm_adaspec: no grammar copy for request %s (%s): it drafts chains", req_id, e)
        self.copies[req_id] = copy
        return copy is not None

    def advance(self, req_id: str, output: list[int]) -> bool:
        """Feed the copy the request's committed output tokens it has not seen. False if it has no usable copy."""
        copy = self.copies.get(req_id)
        if copy is None or copy.broken:
            return False
        new = output[copy.fed:]
        if new:
            if not copy.grammar.accept_tokens(req_id, list(new)):
                copy.broken = True
                logger.warning("vllm_adaspec: grammar copy of request %s rejected committed tokens: it drafts chains",
                               req_id)
                return False
            copy.fed = len(output)
        return True

    def valid_nodes(self, req_id: str, tokens: list[int], parents: list[int]) -> list[bool] | None:
        """Per node (parents before children): does the grammar accept the path from the root to it. None: the
        request has no usable copy."""
        copy = self.copies.get(req_id)
        if copy is None or copy.broken:
            return None
        grammar = copy.grammar
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            kids.setdefault(p, []).append(i)
        ok = [False] * len(tokens)

        def walk(node: int) -> None:  # the matcher stands at `node`'s state
            for c in kids.get(node, ()):
                if not accepts(grammar, req_id, tokens[c]):
                    continue
                ok[c] = True
                walk(c)
                grammar.rollback(1)

        walk(-1)
        return ok

    def row_masks(self, req_id: str, tokens: list[int], parents: list[int]) -> torch.Tensor | None:
        """[n + 1, V] bool, True = allowed: the grammar's next-token mask at the root row and after each node's
        path (a node the grammar rejects keeps its parent's mask: verification never reaches it). None: no copy."""
        copy = self.copies.get(req_id)
        if copy is None or copy.broken:
            return None
        grammar = copy.grammar
        n = len(tokens)
        bits = self._bitmask(n + 1)
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            kids.setdefault(p, []).append(i)

        def fill(row: int, like: int | None = None) -> None:
            if like is not None:
                bits[row].copy_(bits[like])
            elif grammar.is_terminated():  # as vLLM: a finished grammar constrains nothing
                bits[row].fill_(-1)
            else:
                grammar.fill_bitmask(bits, row)

        def walk(node: int) -> None:
            for c in kids.get(node, ()):
                if accepts(grammar, req_id, tokens[c]):
                    fill(c + 1)
                    walk(c)
                    grammar.rollback(1)
                else:
                    fill(c + 1, like=node + 1)
                    for d in _descendants(kids, c):
                        fill(d + 1, like=node + 1)

        fill(0)
        walk(-1)
        return unpack_bitmask(bits[:n + 1], self.vocab)

    def _bitmask(self, rows: int):
        if self.bitmask is None or self.bitmask.shape[0] < rows:
            self.bitmask = self._manager().backend.allocate_token_bitmask(max(rows, 64))
        return self.bitmask

    def finish(self, req_ids) -> None:
        for r in req_ids:
            self.copies.pop(r, None)

    def __len__(self) -> int:
        return sum(c is not None for c in self.copies.values())


def accepts(grammar, req_id: str, token: int) -> bool:
    """Advance the matcher by `token` if the grammar allows it (checked first: vLLM's accept_tokens logs an error
    for a token its grammar refuses, which for candidate nodes is the expected answer)."""
    if grammar.is_terminated() or not grammar.validate_tokens([token]):
        return False
    return grammar.accept_tokens(req_id, [token])


def _descendants(kids: dict[int, list[int]], node: int) -> list[int]:
    out, stack = [], list(kids.get(node, ()))
    while stack:
        c = stack.pop()
        out.append(c)
        stack.extend(kids.get(c, ()))
    return out


def unpack_bitmask(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, W] int32 (bit j of word w: token 32 w + j allowed) -> [R, vocab] bool."""
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().reshape(bits.shape[0], -1)
    if allowed.shape[1] < vocab:  # tokens past the grammar's vocabulary (padding) are never allowed
        allowed = torch.cat([allowed, allowed.new_zeros(bits.shape[0], vocab - allowed.shape[1])], dim=1)
    return allowed[:, :vocab]
