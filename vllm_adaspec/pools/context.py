"""Context pool: every earlier occurrence of the request's last n tokens (n = max_n down to 1: the longest that
occurred before), in its own prompt and output, with all distinct continuations weighted by how often each occurs.

vLLM's `ngram` keeps the first match only; here the continuations of every match (the most recent `max_matches`)
form a trie: a node's probability given its parent is the share of the parent's matches that continue with it.
The index of n-gram ends grows with each committed token (O(max_n) per token), so a step never rescans the
request."""

from __future__ import annotations

from vllm_adaspec.pools import Candidates, Pool, Taps, as_ints, continuation_trie, prob_bucket


class ContextIndex:
    """One request's tokens and, for every n-gram (n <= max_n), the positions right after its occurrences."""

    def __init__(self, max_n: int = 4):
        self.max_n = max_n
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens) -> None:
        for t in tokens:
            p = len(self.tokens)
            for n in range(1, min(self.max_n, p) + 1):
                self.ends.setdefault(tuple(self.tokens[p - n:p]), []).append(p)
            self.tokens.append(int(t))

    def matches(self) -> tuple[int, list[int]]:
        """(n, positions after each earlier occurrence of the last n tokens) for the longest n that occurred."""
        toks = self.tokens
        for n in range(min(self.max_n, len(toks)), 0, -1):
            found = self.ends.get(tuple(toks[len(toks) - n:]))
            if found:
                return n, found
        return 0, []


def propose_context(index: ContextIndex, depth: int, max_matches: int = 8, max_nodes: int = 16) -> Candidates:
    """The trie of the continuations (up to `depth` tokens) of the last tokens' most recent matches. (8 matches, 16
    nodes: a step verifies ~4 nodes a request; 32 matches / 64 nodes scored 3x the nodes for the same tokens per
    step, benchmarks/RESULTS.md, session 22.)"""
    n, ends = index.matches()
    if not n:
        return Candidates()
    toks = index.tokens
    return continuation_trie(((toks[p:p + depth], 1) for p in ends[-max_matches:]), depth, max_nodes,
                             lambda prob: ("context", n, prob_bucket(prob)))


class ContextPool(Pool):
    """Per request: its ContextIndex (every token, prompt included, and its n-gram ends)."""
    name = "context"

    def __init__(self, max_n: int = 4):
        self.max_n = max_n
        self.index: dict[str, ContextIndex] = {}

    def start(self, req_id, prompt) -> None:
        self.index[req_id] = ContextIndex(self.max_n)
        self.index[req_id].extend(as_ints(prompt))

    def extend(self, req_id, tokens) -> None:
        self.index[req_id].extend(as_ints(tokens))

    def stop(self, req_id) -> None:
        self.index.pop(req_id, None)

    def live(self) -> int:
        return len(self.index)

    def propose(self, requests: list[str], budgets: list[int], taps: Taps) -> list[Candidates]:
        return [propose_context(self.index[r], depth=b) for r, b in zip(requests, budgets)]
