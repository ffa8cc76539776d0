"""Self-Draft branches (paper 003): draft n-grams the target writes for free inside its verification forwards.

Each request keeps N branches of at most L tokens. Every verification forward that carries the request's tree also
carries its branches as extra rows (runtime/): each branch is a chain hanging off the root (the
last committed token), so under the tree's ancestor mask it sees the committed prefix, the root and its own earlier
tokens only, and no other branch or tree node. Those rows are never verified; their outputs are harvested:

    branch x_1 .. x_l, target's argmax after each: d_1 .. d_l
    grams:  for every k, the window x_{k-G+2} .. x_k (up to G - 1 tokens) + d_k, keyed by its first token
    update: the branch becomes (x_1 .. x_l, d_l)[-L:] (only the last prediction extends it: paper, Eq. 5)

The grams go into the request's LRU cache (`GramCache`), and `propose_branches` turns the grams under the request's
last token into a candidate tree for MultiBranchProposer's trie, like every other pool. `BranchesPool` holds, per
request, its branches (the rows its next tree verification carries) and its gram cache. Branch tokens never reach
the output: they are not verified, their KV sits in slots the step does not commit. Pure Python: no vLLM, no torch.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Callable

from vllm_adaspec.pools import Candidates, Taps, TailPool, as_ints, continuation_trie

GRAM = 4  # gram length G (the paper's): a key token and up to three continuation tokens
BRANCH_INITS = ("prompt", "random")


class GramCache:
    """One request's grams: key token -> its continuations, most recently seen last; at most `per_key`
    continuations per key and `max_keys` keys (least recently touched dropped first). Bounded: a request's cache
    never holds more than max_keys * per_key grams."""

    def __init__(self, per_key: int = 8, max_keys: int = 2048):
        self.per_key, self.max_keys = per_key, max_keys
        self.grams: OrderedDict[int, OrderedDict[tuple[int, ...], int]] = OrderedDict()  # key -> {cont: hits}
        self.size = 0  # grams held (read every step for /metrics: kept, not counted)

    def add(self, key: int, cont: tuple[int, ...]) -> None:
        conts = self.grams.get(key)
        if conts is None:
            conts = self.grams[key] = OrderedDict()
            if len(self.grams) > self.max_keys:
                self.size -= len(self.grams.popitem(last=False)[1])
        else:
            self.grams.move_to_end(key)
        hits = conts.pop(cont, 0)
        conts[cont] = hits + 1
        self.size += hits == 0
        if len(conts) > self.per_key:
            conts.popitem(last=False)
            self.size -= 1

    def lookup(self, key: int) -> list[tuple[tuple[int, ...], int]]:
        """(continuation, hits) under `key`, most recent first."""
        conts = self.grams.get(key)
        return [] if not conts else list(reversed(conts.items()))

    def __len__(self) -> int:
        return self.size


def init_branches(prompt: list[int], n: int, length: int, how: str, seed: int, vocab_size: int) -> list[list[int]]:
    """N branches of L tokens: windows of the prompt at spread, seeded offsets ("prompt") or uniform random tokens
    ("random", the paper's padding). A prompt shorter than L gives its whole self."""
    rng = random.Random(seed)
    if how == "random":
        return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(n)]
    if how != "prompt":
        raise ValueError(f"branch init must be one of {BRANCH_INITS}, got {how!r}")
    span = max(1, len(prompt) - length + 1)
    return [list(prompt[o:o + length]) for o in
            (min(span - 1, (b * span) // n + rng.randrange(max(1, span // n))) for b in range(n))]


def branch_grams(tokens: list[int], predicted: list[int], gram: int = GRAM) -> list[tuple[int, tuple[int, ...]]]:
    """tokens [l] a branch, predicted [l] the target's argmax after each of its prefixes -> (key, continuation)
    for every window ending at each k: tokens[k - gram + 2 .. k] + predicted[k]."""
    out = []
    for k, d in enumerate(predicted):
        window = tokens[max(0, k - gram + 2):k + 1]
        out.append((window[0], tuple(window[1:]) + (d,)))
    return out


def update_branch(tokens: list[int], predicted: list[int], length: int) -> list[int]:
    """The branch after a forward: extended by the prediction after its last token, its oldest dropped past L."""
    return (tokens + [predicted[-1]])[-length:]


def harvest(branches: list[list[int]], predicted: list[int], cache: GramCache, length: int,
            gram: int = GRAM) -> tuple[list[list[int]], int]:
    """Outputs of one forward's branch rows (predicted: the argmax at each row, branches in order; fewer than the
    branch tokens when the scheduler cut the tail) -> (the branches after it, grams added). A branch whose rows
    were cut gives the grams of its rows that ran and is not extended."""
    out, added, at = [], 0, 0
    for tokens in branches:
        got = predicted[at:at + len(tokens)]
        at += len(tokens)
        for key, cont in branch_grams(tokens[:len(got)], got, gram):
            cache.add(key, cont)
            added += 1
        out.append(update_branch(tokens, got, length) if len(got) == len(tokens) and got else tokens)
    return out, added


def append_branches(tokens: list[int], parents: list[int], branches: list[list[int]]) -> tuple[list[int], list[int]]:
    """A tree (breadth-first nodes, parents; -1 = the root) with every branch appended as a chain off the root: the
    ancestor mask then gives each branch row the prefix, the root and its own earlier rows only."""
    tokens, parents = list(tokens), list(parents)
    for branch in branches:
        for j, t in enumerate(branch):
            parents.append(-1 if j == 0 else len(tokens) - 1)
            tokens.append(t)
    return tokens, parents


def propose_branches(cache: GramCache, last_token: int, depth: int, max_nodes: int = 64) -> Candidates:
    """The trie of the grams under the request's last token (each continuation up to `depth` tokens): a node's
    probability given its parent is its share of the parent's hits, as in the context pool."""
    found = cache.lookup(last_token)
    matches = min(len(found), 4)
    return continuation_trie(found, depth, max_nodes, "branches", matches)


class BranchesPool(TailPool):
    """Per request: its N branches (set up from its prompt at start, moved on by each harvest), its GramCache and
    its last token (the key its grams are looked up under). The drafter appends `branches_of(req)` to the request's
    tree and hands back what those rows predicted (`observe_branches`). num_branches 0: no branches, no grams."""
    name = "branches"
    keep = 1

    def __init__(self, num_branches: int, length: int, init: str, vocab_size: int,
                 seed: Callable[[str], int] = lambda req_id: 0):
        super().__init__()
        self.num_branches, self.length, self.init, self.vocab_size, self.seed = (num_branches, length, init,
                                                                                  vocab_size, seed)
        self.branches: dict[str, list[list[int]]] = {}
        self.grams: dict[str, GramCache] = {}

    @classmethod
    def from_build(cls, build):
        return cls(build.num_branches, build.branch_length, build.branch_init, build.vocab_size, build.branch_seed)

    def start(self, req_id, prompt) -> None:
        super().start(req_id, prompt)
        self.grams[req_id] = GramCache()
        self.branches[req_id] = (init_branches(as_ints(prompt), self.num_branches, self.length, self.init,
                                               self.seed(req_id), self.vocab_size) if self.num_branches else [])

    def stop(self, req_id) -> None:
        super().stop(req_id)
        self.grams.pop(req_id, None)
        self.branches.pop(req_id, None)

    def branches_of(self, req_id: str) -> list[list[int]]:
        """The branches the request's next tree verification should carry ([] when none)."""
        return self.branches.get(req_id, [])

    def grams_held(self) -> int:
        return sum(map(len, self.grams.values()))

    def observe_branches(self, req_id: str, sent: list[list[int]], predicted: list[int]) -> int:
        cache = self.grams.get(req_id)
        if cache is None or not sent or not predicted:
            return 0
        self.branches[req_id], added = harvest(sent, predicted, cache, self.length)
        return added

    def propose(self, requests: list[str], budgets: list[int], taps: Taps) -> list[Candidates]:
        return [propose_branches(self.grams[r], self.tails[r][-1], depth=b) for r, b in zip(requests, budgets)]
