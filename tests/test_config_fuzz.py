"""Thousands of random and hostile `adaspec` sections thrown at the pure validator (parse_adaspec_config +
resolve_config, with a fake model): each is accepted or refused with one AdaspecConfigError line naming a key, never
another exception, never a hang; an accepted config's policy runs rounds without hanging or raising.

A seeded generator (hypothesis is not a dependency): the same cases every run, a failure names its seed and case."""

import random
import signal
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from vllm_adaspec.config import (MAX_DRAFTS, POOLS, PROPOSER_KEYS, TREE_KEYS, AdaspecConfigError, parse_adaspec_config,
                                 resolve_config, show)
from vllm_adaspec.policies import PARAM_RANGES, POLICIES, make_policy, policy_params

CASES = 3000
CASE_SECONDS = 2.0  # one case: parse, resolve, and a few policy rounds (milliseconds when nothing hangs)
TOTAL_SECONDS = 60.0  # all of them, with room for a loaded machine
NAMES_A_KEY = ("additional_config['adaspec']", "speculative_config['num_speculative_tokens']")

# The shipped SmolLM2 (its exit head, classifier and predictor resolve: thompson-cali and c2t run) and a model with
# nothing shipped (the untrained exit: those policies and builders are refused).
SMOL = SimpleNamespace(architectures=["LlamaForCausalLM"], hidden_size=576, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                       vocab_size=49152, rms_norm_eps=9.999999747378752e-06, rope_theta=100000.0,
                       tie_word_embeddings=True)
OTHER = SimpleNamespace(**{**vars(SMOL), "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16})


def test_the_fake_model_is_the_one_heads_ship_for():
    from vllm_adaspec.heads import find_shipped

    assert find_shipped(SMOL) is not None and find_shipped(OTHER) is None

HOSTILE = [float("nan"), float("inf"), float("-inf"), -0.0, 0, -1, 1, 2, 0.5, 1e-300, 1e300, 10**30, -10**30,
           10**5000, True, False, None, "", "x", "1", "auto", "none", "nan", [], [1], [[]], {}, {"name": "fixed"},
           {"a": {"b": {"c": [1, {"d": None}]}}}, ("context",), "a" * 10_000, 2**31, 2**63, 1.5, -0.5]


def hostile(rng):
    return rng.choice(HOSTILE)


class Gen:
    """One case's generator: `bad` is the chance that any one value is hostile (cases are mostly sane, so that
    accepted configs reach every policy and builder, or mostly hostile)."""

    def __init__(self, rng: random.Random, bad: float):
        self.rng, self.bad = rng, bad

    def odd(self) -> bool:
        return self.rng.random() < self.bad

    def choice(self, good: list, wrong: list = ()):
        return hostile(self.rng) if self.odd() else self.rng.choice(list(good) + (list(wrong) if self.odd() else []))

    def policy(self):
        rng = self.rng
        if self.odd():
            return self.choice(list(POLICIES), ["greedy", "", None, 3, {"gamma": 1}])
        name = self.choice(list(POLICIES), ["thompson"])
        if not isinstance(name, str) or rng.random() < 0.3:
            return name
        params = list(policy_params(name)) if name in POLICIES else list(PARAM_RANGES)
        out = {"name": name}
        for key in rng.sample(params, k=rng.randint(0, len(params))) + ([rng.choice(["gama", 10**5000])]
                                                                          if self.odd() else []):
            r = PARAM_RANGES.get(key)
            out[key] = (hostile(rng) if self.odd() or r is None else
                        rng.choice([rng.uniform(r.lo, min(r.hi, 10.0)), r.lo, r.hi, (r.lo + min(r.hi, 2.0)) / 2]))
        return out

    def tree(self, proposer, k):
        rng = self.rng
        if self.odd():
            return hostile(rng)
        budget = rng.randint(1, max(1, k)) if not self.odd() else rng.randint(0, 140)
        out = {"budget": budget}
        good = {"top_k": lambda: rng.randint(1, 4), "depth": lambda: rng.randint(1, budget),
                "max_depth": lambda: rng.randint(1, budget), "kv_copy_tokens": lambda: rng.choice([1, 4096, 2**31 - 1]),
                "builder": lambda: rng.choice(["joint", "c2t"]), "beta": lambda: rng.uniform(0, 0.99),
                "second_top_k": lambda: rng.randint(1, budget)}
        for key in TREE_KEYS[proposer]:
            if key != "budget" and rng.random() < 0.3:
                out[key] = hostile(rng) if self.odd() else good[key]()
        if "depth" in out and "max_depth" in out and not self.odd():
            del out["depth"]
        if out.get("builder") == "c2t" or (("beta" in out or "second_top_k" in out) and not self.odd()):
            out["builder"] = "c2t"
        if self.odd():
            out[rng.choice(["width", "budget", 7, 10**5000])] = hostile(rng)
        return out

    def acceptance(self):
        rng = self.rng
        if self.odd():
            return hostile(rng)
        return rng.choice(["exact", "typical", {"name": "typical", **{
            k: (hostile(rng) if self.odd() else rng.uniform(0.01, 1)) for k in rng.sample(["epsilon", "delta"],
                                                                                            k=rng.randint(0, 2))}}])

    def section(self, proposer, k):
        rng = self.rng
        if self.odd() and self.odd():
            return hostile(rng)
        good = {
            "exit_layer": lambda: rng.randint(1, 29),
            "policy": self.policy,
            "exit_head": lambda: self.choice(["auto", "none"], ["/no/such/head", ""]),
            "draft_weights": lambda: self.choice(["int8", "float"], ["int4", "", 8]),
            "cost_model": lambda: self.choice(["online", "prior", "off"], ["fast"]),
            "speed_guard": lambda: self.choice([True, False], ["yes"]),
            "tree": lambda: self.tree(proposer, k),
            "acceptance": self.acceptance,
            "pools": lambda: rng.sample(POOLS[:5], k=rng.randint(1, 5)) + (["ngram"] if self.odd() else []),
            "corpus": lambda: self.choice(["auto"], ["/t/corpus.npz"]),
            "medusa": lambda: self.choice(["auto"], ["/heads"]),
            "branches": lambda: self.choice([0, 1, 2], [-1, 33]),
            "branch_length": lambda: self.choice([1, 2, 4], [0, 17]),
            "branch_init": lambda: self.choice(["prompt", "random"], ["zeros"]),
            "suffix_cache_requests": lambda: self.choice([1, 1000, 10**6], [0, -5, 10**7, 2.5]),
            "fault_limit": lambda: self.choice([1, 10, 10**6], [0, -1, 10**7, "ten"]),
        }
        keys = [key for key in PROPOSER_KEYS[proposer] if rng.random() < 0.5]
        if "speed_guard" in keys and "cost_model" in keys and not self.odd():
            keys.remove("speed_guard")
        out = {key: hostile(rng) if self.odd() else good[key]() for key in keys}
        if self.odd():  # a key of another proposer, or of none
            out[rng.choice(["exit_layer", "pools", "branches", "nonsense", 7, 10**5000, None])] = hostile(rng)
        return out

    def speculative_tokens(self):
        return self.choice([self.rng.randint(1, 24), MAX_DRAFTS], [0, -1, 129, 10**9])


@contextmanager
def deadline(seconds, what):
    def fail(*_):
        raise TimeoutError(f"no answer within {seconds} s: {what}")

    old = signal.signal(signal.SIGALRM, fail)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_policy(cfg, rng):
    """A few rounds of what the drafter asks of the policy: it must answer, not hang or raise."""
    policy = make_policy(cfg.policy, cfg.num_speculative_tokens, rng.randint(0, 2**32), cfg.policy_params)
    for _ in range(4):
        k = policy.begin_round()
        assert 0 <= k <= cfg.num_speculative_tokens
        drafted = 0
        for depth in range(1, k + 1):
            if not policy.accept(depth, rng.random(), rng.uniform(0, 10), rng.random()):
                break
            drafted = depth
            if not policy.keep_drafting(depth):
                break
        policy.observe(drafted, rng.randint(0, drafted))


@pytest.fixture
def suffix_available(monkeypatch):
    import vllm_adaspec.pools.suffix as suffix

    monkeypatch.setattr(suffix, "suffix_available", lambda: True)  # the pool's package need not be installed


def test_random_and_hostile_configs_are_accepted_or_refused_with_a_named_key(suffix_available):
    rng = random.Random(20240531)
    outcomes = {"accepted": 0, "refused": 0}
    start = time.perf_counter()
    for case in range(CASES):
        proposer = rng.choice(list(PROPOSER_KEYS))
        gen = Gen(rng, bad=rng.choice([0.01, 0.05, 0.3]))
        k = gen.speculative_tokens()
        sec, model = gen.section(proposer, k if isinstance(k, int) and 1 <= k <= MAX_DRAFTS else 8), \
            rng.choice([SMOL, OTHER, None])
        what = f"case {case}: {proposer}, K={show(k)}, section={show(sec, 300)}"
        with deadline(CASE_SECONDS, what):
            try:
                cfg = resolve_config(parse_adaspec_config({"adaspec": sec, "other": 1}, proposer=proposer),
                                     architectures=["LlamaForCausalLM"], num_layers=30, num_speculative_tokens=k,
                                     hf_config=model, proposer=proposer)
            except AdaspecConfigError as e:
                msg = str(e)
                assert msg.startswith(NAMES_A_KEY) and "\n" not in msg and len(msg) < 2000, (what, msg)
                outcomes["refused"] += 1
                continue
            except Exception as e:  # noqa: BLE001 - the point: nothing else may escape
                pytest.fail(f"{what}: {type(e).__name__}: {e}")
            run_policy(cfg, rng)
            outcomes["accepted"] += 1
    elapsed = time.perf_counter() - start
    assert elapsed < TOTAL_SECONDS, elapsed
    # The generator reaches both sides: a fuzzer that only ever produced refusals would prove nothing.
    assert outcomes["accepted"] > CASES // 10 and outcomes["refused"] > CASES // 3, outcomes
