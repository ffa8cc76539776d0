"""Context pool: every earlier occurrence of the request's last n tokens (n = max_n down to 1: the longest that
occurred before), in its own prompt and output, with all distinct continuations weighted by how often each occurs.

vLLM's `ngram` keeps the first match only; here the continuations of every match (the most recent `max_matches`)
form a trie: a node's probability given its parent is the share of the parent's matches that continue with it.
Matches are found by one vectorised scan of the request's tokens per drafting step."""

from __future__ import annotations

import numpy as np

from vllm_adaspec.compiled import AVAILABLE, compiled, warmed
from vllm_adaspec.pools import Candidates, Pool, Taps, continuation_trie


class ContextIndex:
    """One request's tokens (prompt and output), searched for its last tokens when it drafts. A vectorised scan over
    the tokens per step costs a few microseconds and nothing per committed token, where a dict of every n-gram's ends
    cost ~0.7 ms to build over an 800-token prompt and four inserts per token."""

    def __init__(self, max_n: int = 4):
        self.max_n = max_n
        self._buf = np.zeros(64, dtype=np.int64)  # the tokens, for the scan
        self.token_list: list[int] = []  # the same, for the few matches' checks and the continuations
        self._size = 0

    @property
    def tokens(self) -> np.ndarray:
        return self._buf[:self._size]

    def extend(self, tokens) -> None:
        """tokens: a list of ints (PoolSet.extend's, every step: no array made of it) or an array (a prompt)."""
        new = tokens if isinstance(tokens, list) else np.asarray(tokens, dtype=np.int64).reshape(-1).tolist()
        end = self._size + len(new)
        if end > len(self._buf):
            grown = np.zeros(max(end, 2 * len(self._buf)), dtype=np.int64)
            grown[:self._size] = self._buf[:self._size]
            self._buf = grown
        self._buf[self._size:end] = new
        self.token_list += new
        self._size = end

    def matches(self) -> tuple[int, list[int]]:
        """(n, positions after each earlier occurrence of the last n tokens) for the longest n <= max_n that occurred
        (positions p < len with tokens[p - n:p] equal to the last n, increasing)."""
        size, toks = self._size, self.token_list
        if size < 2:
            return 0, []
        ends = np.flatnonzero(self._buf[:size - 1] == toks[-1]) + 1  # after an earlier occurrence of the last token
        if not len(ends):
            return 0, []
        n = 1
        if len(ends) <= 32:  # the usual case: a few matches, checked in Python
            ends = ends.tolist()
            for k in range(2, self.max_n + 1):  # longer matches are among the shorter ones' positions
                want = toks[size - k] if k <= size else None
                longer = [p for p in ends if p >= k and toks[p - k] == want]
                if not longer:
                    break
                ends, n = longer, k
            return n, ends
        buf = self._buf
        for k in range(2, self.max_n + 1):
            longer = ends[ends >= k]
            longer = longer[buf[longer - k] == buf[size - k]]
            if not len(longer):
                break
            ends, n = longer, k
        return n, ends.tolist()


def propose_context(index: ContextIndex, depth: int, max_matches: int = 8, max_nodes: int = 16) -> Candidates:
    """The trie of the continuations (up to `depth` tokens) of the last tokens' most recent matches. (8 matches, 16
    nodes: a step verifies ~4 nodes a request; 32 matches / 64 nodes scored 3x the nodes for the same tokens per
    step, benchmarks/log/2026-11-26.md.)"""
    n, ends = index.matches()
    if not n:
        return Candidates(pool="context")
    toks = index.token_list
    return continuation_trie(((toks[p:p + depth], 1) for p in ends[-max_matches:]), depth, max_nodes, "context", n)


def _context_trie(buf, size, max_n, depth, max_matches, max_nodes, out_tok, out_par, out_prob):
    """ContextIndex.matches + propose_context's trie in one compiled pass (numba) over a request's tokens buf[:size]:
    (nodes written to out_*, the match length n; 0 nodes when nothing matched). The same nodes and probabilities."""
    if size < 2:
        return 0, 0
    last = buf[size - 1]
    ends = np.empty(size, np.int64)  # after each earlier occurrence of the last token, increasing
    m = 0
    for i in range(size - 1):
        if buf[i] == last:
            ends[m] = i + 1
            m += 1
    if m == 0:
        return 0, 0
    n = 1
    for k in range(2, max_n + 1):  # longer matches are among the shorter ones' positions
        if k > size:
            break
        want, kept = buf[size - k], 0
        for j in range(m):
            if ends[j] >= k and buf[ends[j] - k] == want:
                ends[kept] = ends[j]
                kept += 1
        if kept == 0:
            break
        m, n = kept, k
    count = np.zeros(max_nodes, np.int64)
    total, nodes = 0, 0
    for j in range(max(0, m - max_matches), m):  # continuation_trie, each match weighing 1
        total += 1
        parent = -1
        for q in range(ends[j], min(ends[j] + depth, size)):
            t = buf[q]
            node = -1
            for c in range(nodes):
                if out_par[c] == parent and out_tok[c] == t:
                    node = c
                    break
            if node < 0:
                if nodes >= max_nodes:
                    break
                node = nodes
                out_tok[node], out_par[node] = t, parent
                nodes += 1
            count[node] += 1
            parent = node
    for c in range(nodes):
        out_prob[c] = count[c] / (count[out_par[c]] if out_par[c] >= 0 else total)
    return nodes, n


if AVAILABLE:  # (else propose_context: the same nodes)
    _context_trie = compiled(_context_trie)


def propose_context_compiled(index: ContextIndex, depth: int, max_matches: int = 8, max_nodes: int = 16,
                             out: tuple | None = None) -> Candidates:
    """propose_context in one compiled pass (out: three scratch arrays of max_nodes, reused)."""
    tok, par, prob = out if out is not None else (np.empty(max_nodes, np.int64), np.empty(max_nodes, np.int64),
                                                  np.empty(max_nodes, np.float64))
    nodes, n = _context_trie(index._buf, index._size, index.max_n, depth, max_matches, max_nodes, tok, par, prob)
    if not nodes:
        return Candidates(pool="context")
    return Candidates(tok[:nodes].tolist(), par[:nodes].tolist(), prob[:nodes].tolist(), [n] * nodes, "context")


class ContextPool(Pool):
    """Per request: its ContextIndex (every token, prompt included, and its n-gram ends)."""
    name = "context"

    def __init__(self, max_n: int = 4):
        self.max_n = max_n
        self.index: dict[str, ContextIndex] = {}
        self._out = (np.empty(16, np.int64), np.empty(16, np.int64), np.empty(16, np.float64))
        warm = ContextIndex(max_n)
        warm.extend([1, 2, 1, 2])
        self.compiled = warmed(lambda: propose_context_compiled(warm, 2, out=self._out),  # matches and trie compiled
                               "the context pool's compiled matching did not compile; it matches in Python")

    def start(self, req_id, prompt) -> None:
        self.index[req_id] = ContextIndex(self.max_n)
        self.index[req_id].extend(prompt)

    def extend(self, req_id, tokens) -> None:
        self.index[req_id].extend(tokens)

    def stop(self, req_id) -> None:
        self.index.pop(req_id, None)

    def live(self) -> int:
        return len(self.index)

    def propose(self, requests: list[str], budgets: list[int], taps: Taps) -> list[Candidates]:
        if self.compiled:
            return [propose_context_compiled(self.index[r], b, out=self._out) for r, b in zip(requests, budgets)]
        return [propose_context(self.index[r], depth=b) for r, b in zip(requests, budgets)]
