"""Context pool: every earlier occurrence of the request's last n tokens (n = max_n down to 1: the longest that
occurred before), in its own prompt and output, with all distinct continuations weighted by how often each occurs.

vLLM's `ngram` keeps the first match only; here the continuations of every match (the most recent `max_matches`)
form a trie: a node's probability given its parent is the share of the parent's matches that continue with it.
Matches are found by one vectorised scan of the request's tokens per drafting step."""

from __future__ import annotations

import numpy as np

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
    step, benchmarks/RESULTS.md, session 22.)"""
    n, ends = index.matches()
    if not n:
        return Candidates(pool="context")
    toks = index.token_list
    return continuation_trie(((toks[p:p + depth], 1) for p in ends[-max_matches:]), depth, max_nodes, "context", n)


class ContextPool(Pool):
    """Per request: its ContextIndex (every token, prompt included, and its n-gram ends)."""
    name = "context"

    def __init__(self, max_n: int = 4):
        self.max_n = max_n
        self.index: dict[str, ContextIndex] = {}

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
        return [propose_context(self.index[r], depth=b) for r, b in zip(requests, budgets)]
