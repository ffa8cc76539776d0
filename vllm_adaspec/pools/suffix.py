"""Suffix pool: arctic-inference's suffix trees (SuffixDecoding), asked for a whole speculation tree.

One cache per proposer: each active request's prompt tree, and a global tree of earlier outputs bounded to the
`max_cached_requests` most recent requests (the cache evicts the oldest). vLLM's `suffix` method asks the same
cache for one path; here `use_tree_spec=True` returns its best-first tree (node probabilities are path
probabilities, turned into probabilities given the parent). Needs `arctic-inference` (an optional dependency:
the proposer refuses `"suffix"` at start-up without it)."""

from __future__ import annotations

import numpy as np

from vllm_adaspec.pools import Candidates, Taps, TailPool, as_ints


def suffix_available() -> bool:
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
    except ImportError:
        return False
    return True


class SuffixPool(TailPool):
    """One arctic-inference cache for all requests (each active request's prompt tree + the global tree of earlier
    outputs); per request: its last `max_depth` tokens (the context a speculation matches against)."""
    name = "suffix"

    def __init__(self, max_depth: int = 24, max_cached_requests: int = 1000, min_token_prob: float = 0.05,
                 max_spec_factor: float = 2.0, max_spec_offset: float = 1.0):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        super().__init__()
        self.cache = SuffixDecodingCache(max_tree_depth=max_depth, max_cached_requests=max_cached_requests)
        self.max_depth = self.keep = max_depth
        self.min_token_prob = min_token_prob
        self.max_spec_factor = max_spec_factor
        self.max_spec_offset = max_spec_offset
        self._trees = _native_trees(self.cache)

    @classmethod
    def from_build(cls, build):
        return cls(max_cached_requests=build.suffix_cache_requests)

    def start(self, req_id, prompt) -> None:
        if req_id in self.cache.active_requests:
            self.cache.stop_request(req_id)
        self.cache.start_request(req_id, np.ascontiguousarray(prompt, dtype=np.int32))
        super().start(req_id, prompt)

    def extend(self, req_id, tokens) -> None:
        if len(tokens):
            if type(tokens) is not list:  # (a short list goes to the cache as is: cheaper than an array and its checks)
                tokens = as_ints(tokens)
            if self._trees is None:
                self.cache.add_active_response(req_id, tokens)
            else:  # add_active_response's two extends without its Python around them (~2 us a request a step)
                extend, local, seq_ids, global_tree = self._trees
                extend(local[req_id], 0, tokens)  # (KeyError: not started, as the cache's ValueError)
                seq = seq_ids.get(req_id)
                if seq is not None:
                    extend(global_tree, seq, tokens)
            super().extend(req_id, tokens)

    def stop(self, req_id) -> None:
        if req_id in self.cache.active_requests:
            self.cache.stop_request(req_id)
        super().stop(req_id)

    def live(self) -> int:
        return len(self.cache.active_requests)

    def propose(self, requests: list[str], budgets: list[int], taps: Taps) -> list[Candidates]:
        return [self.speculate(r, self.tails[r], max_nodes=b) for r, b in zip(requests, budgets)]

    def speculate(self, req_id, context, max_nodes: int) -> Candidates:
        """One request's tree given its context [T] (its last tokens, a list or an array; the cache matches at most
        max_depth)."""
        context = context[-self.max_depth:]
        if not isinstance(context, list):  # (the pool's own tails are lists of ints already)
            context = as_ints(context)
        if self._trees is None:
            draft = self.cache.speculate(req_id, context, max_spec_tokens=int(max_nodes),
                                         max_spec_factor=self.max_spec_factor, max_spec_offset=self.max_spec_offset,
                                         min_token_prob=self.min_token_prob, use_tree_spec=True)
        else:  # the cache's speculate (the request's prompt tree and the global tree, the better score) without its
            # Python and its result's copy (~2.5 us a request a step)
            _, local, _, global_tree = self._trees
            args = (context, int(max_nodes), self.max_spec_factor, self.max_spec_offset, self.min_token_prob, True)
            own, other = local[req_id].speculate(*args), global_tree.speculate(*args)
            draft = own if own.score >= other.score else other
        path, parents = draft.probs, draft.parents
        # given the parent: a root child's path probability, else its share of the parent's
        probs = [min(1.0, p) if q < 0 else (min(1.0, p / path[q]) if path[q] > 0 else 0.0)
                 for q, p in zip(parents, path)]
        return Candidates(draft.token_ids, parents, probs, [min(draft.match_len, 8)] * len(probs), "suffix")


def _native_trees(cache):
    """(SuffixTree.extend, the active requests' trees, request -> global sequence id, the global tree) of an
    arctic-inference 0.1.1 cache, read by `extend` and `speculate` in place of the cache's Python methods (the same
    calls on the same trees); None where the cache is not laid out so (another version: its public methods)."""
    try:
        from arctic_inference.suffix_decoding._C import SuffixTree

        trees = (SuffixTree.extend, cache._local_trees, cache._req_to_seq_id, cache._global_tree)
    except (ImportError, AttributeError):
        return None
    if not (isinstance(trees[1], dict) and isinstance(trees[2], dict) and isinstance(trees[3], SuffixTree)):
        return None
    return trees
