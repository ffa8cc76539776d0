"""The `adaspec` section of vLLM's `additional_config`, parsed into a typed, validated object.

Everything here is pure Python so it can be checked in the front-end process, before any engine starts,
and unit-tested in milliseconds. Every error is one line naming the offending key and what is allowed; every number
must be finite and inside a stated range (vLLM's JSON parser accepts Infinity and NaN). The checks that need the
engine's config (files for this tokenizer, tree verification on this platform, what the scheduler can hold) live in
engine/startup.py, which runs all of them once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from vllm_adaspec.errors import (SECTION, AdaspecConfigError, Interval, is_number, one_line, show,  # noqa: F401
                                 typed)
from vllm_adaspec.pools import POOLS as POOL_SPECS
from vllm_adaspec.pools import default_pools

# Decoder-only models whose vLLM implementation exposes embed_tokens / layers / norm / lm_head and
# whose decoder layers take (positions, hidden_states, residual).
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
)




# Which settings each proposer reads: a common part (draft-length policy, speed guard, token trees) and a part of
# its own. Keys of another proposer are refused like unknown keys.
COMMON_KEYS = ("policy", "cost_model", "speed_guard", "tree", "fault_limit")
PROPOSER_KEYS = {
    "early_exit": ("exit_layer", "policy", "exit_head", "cost_model", "speed_guard", "tree", "acceptance",
                   "draft_weights", "fault_limit"),
    "multi_branch": ("pools", "corpus", "medusa", "policy", "cost_model", "speed_guard", "tree", "acceptance",
                     "branches", "branch_length", "branch_init", "suffix_cache_requests", "fault_limit"),
    "probe": ("policy", "cost_model", "speed_guard", "tree", "fault_limit"),
}
# How drafts are sized against what verifying them costs (policies/cost_model.py):
#   "online"  the step cost model, fitted online from the engine's own step times, starting from the shipped curve
#   "prior"   the shipped curve only, never refitted (MultiBranchProposer; early exit: as "off")
#   "off"     no cost model: every candidate within the budget is verified (early exit: the policy's length)
COST_MODELS = ("online", "prior", "off")
DRAFT_WEIGHTS = ("int8", "float")
OLD_NAMES = ("speed_guard",)  # still accepted, not listed
PROPOSER_CLASSES = {"early_exit": "EarlyExitProposer", "multi_branch": "MultiBranchProposer",
                    "probe": "ProbeProposer"}
# Tree keys per proposer: early exit grows its trees from the exit head (top_k, depth; the builder picks nodes by
# joint probability or by C2T's classifier); the candidate trees of multi_branch come from its pools.
TREE_KEYS = {"early_exit": ("budget", "top_k", "depth", "max_depth", "kv_copy_tokens", "builder", "beta",
                            "second_top_k"),
             "multi_branch": ("budget", "kv_copy_tokens"), "probe": ("budget", "kv_copy_tokens")}
# Candidate pools of MultiBranchProposer: declared once, in vllm_adaspec/pools/ (POOLS, the registry: names in merge
# order, defaults, files). The default is the best measured set: context + suffix + corpus + medusa, first in the
# offline replay on HumanEval and MT-Bench and ahead of context + suffix + recycled in the engine at batch 1 and 8
# (benchmarks/log/2026-11-23.md). A model without a corpus table or Medusa heads runs the others
# (engine/startup.usable_pools).
POOLS = tuple(POOL_SPECS)
DEFAULT_POOLS = default_pools()


# Self-Draft branches: off by default (benchmarks/log/2026-11-23.md: the extra rows do not pay on this CPU).
DEFAULT_BRANCHES = 0
DEFAULT_BRANCH_LENGTH = 4
MAX_BRANCHES = 32
MAX_BRANCH_LENGTH = 16
MAX_DRAFTS = 128  # vLLM verifies at most this many drafts per request and step
MAX_TOP_K = 16
MAX_KV_COPY_TOKENS = 2**31 - 1  # KV positions are int32 indices
# Contained drafter faults (vllm_adaspec/faults.py) after which speculation is off for the engine's life.
DEFAULT_FAULT_LIMIT = 10
MAX_FAULT_LIMIT = 10**6
# The suffix pool's global cache of earlier outputs keeps this many recent requests (arctic-inference's
# max_cached_requests; about 0.7 MiB each, benchmarks/log/2026-11-23.md). vLLM's own `suffix` method uses
# 10000 by default.
DEFAULT_SUFFIX_CACHE_REQUESTS = 1000
MAX_SUFFIX_CACHE_REQUESTS = 10**6


# --- numbers: finite, in a stated range -------------------------------------------------------------------------

def key_name(path: tuple[str, ...] | str) -> str:
    """additional_config['adaspec']['tree']['budget'] for ("tree", "budget")."""
    path = (path,) if isinstance(path, str) else path
    return f"additional_config['{SECTION}']" + "".join(f"[{p!r}]" for p in path)


def _fail(path: tuple[str, ...] | str, msg: str) -> AdaspecConfigError:
    return AdaspecConfigError(f"{key_name(path)}: {msg}")


def check_number(path, value: Any, interval: Interval) -> float:
    if not is_number(value) or value not in interval:
        raise _fail(path, f"must be a finite number in {interval}, got {typed(value)}")
    return float(value)


def _check_int(path, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(path, f"must be an integer, got {type(value).__name__} {show(value)}")
    return value


def _check_int_in(path, value: Any, lo: int, hi: int, what: str = "") -> int:
    value = _check_int(path, value)
    if not lo <= value <= hi:
        raise _fail(path, f"must be in {lo}..{hi}{f' ({what})' if what else ''}, got {show(value)}")
    return value


def _names(keys) -> str:
    """Unknown keys, sorted, as errors list them (a Python caller's keys need not be strings)."""
    return ", ".join(show(k) for k in sorted(keys, key=show))


def _check_choice(path, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise _fail(path, f"must be one of {', '.join(map(repr, choices))}, got {show(value)}")
    return value


# --- parsed settings (model-independent) --------------------------------------------------------------------------

ACCEPTANCE_EPSILON = Interval(0, 1, lo_open=True)  # a probability threshold; 0 would accept every node
ACCEPTANCE_DELTA = Interval(0, 1, lo_open=True)


@dataclass(frozen=True)
class Acceptance:
    name: str = "exact"  # or "typical"
    epsilon: float = 0.09  # typical: accept a node whose target probability exceeds min(epsilon, delta * exp(-H))
    delta: float = 0.3


@dataclass(frozen=True)
class AdaspecConfig:
    # N: how many of the target's layers the drafter runs before its exit head. None = a quarter of the layers.
    exit_layer: int | None = None
    # Draft-length policy: one object per request decides how many tokens to draft each step. In the config a
    # name ("fixed", "thompson-beta", "adaedl", "max-confidence") or {"name": ..., <parameter>: value, ...}.
    policy: str = "fixed"
    policy_params: dict = field(default_factory=dict)
    # Trained exit head: a checkpoint folder from `adaspec train exit-layer`; "auto" = the one shipped for this
    # model if there is one (else the untrained exit, with a warning); "none" = the untrained exit
    # (final norm + LM head on h_N).
    exit_head: str = "auto"
    # A draft layer's weights on CPU (DRAFT_WEIGHTS): "int8" rows with a scale each for passes of a few rows
    # (kernels/int8_linear.py), "float" the checkpoint's weights in the model's dtype.
    draft_weights: str = "int8"
    # How drafts are sized against their verification cost (COST_MODELS). `speed_guard` is its older name:
    # true = "online", false = "prior" (MultiBranchProposer) / "off" (early exit), what it meant before.
    cost_model: str = "online"
    # Token-tree drafting (runtime/): {"budget": nodes per tree, "top_k": children per chain
    # node, "depth": chain depth (default ceil(budget / top_k))}. None = chains.
    tree: "TreeSettings | None" = None
    # MultiBranchProposer: the candidate pools that feed its trees.
    pools: tuple[str, ...] = DEFAULT_POOLS
    pools_given: bool = False  # False: the default set, of which a model runs the pools it has files for
    # The corpus pool's table: "auto" = the one shipped or built (`adaspec build corpus`) for this tokenizer;
    # else a corpus.npz or its folder.
    corpus: str = "auto"
    # The medusa pool's heads: "auto" = the ones shipped for this model; else a folder from `adaspec train medusa`.
    medusa: str = "auto"
    # How tree nodes are accepted at temperature > 0: "exact" (lossless, the default) or Medusa's typical acceptance
    # (paper 002, 3.3.1), LOSSY: {"name": "typical", "epsilon": 0.09, "delta": 0.3}. Greedy is exact either way.
    acceptance: Acceptance = field(default_factory=Acceptance)
    # Self-Draft (paper 003, pools/branches.py): N branches of L tokens ride in every tree verification forward
    # and feed the `branches` pool (added to the pools when N > 0). 0 = off.
    branches: int = DEFAULT_BRANCHES
    branch_length: int = DEFAULT_BRANCH_LENGTH
    branch_init: str = "prompt"  # or "random" (the paper's padding)
    # The suffix pool's global cache bound, in requests (memory grows with it up to the bound, then stays flat).
    suffix_cache_requests: int = DEFAULT_SUFFIX_CACHE_REQUESTS
    # Contained faults after which the drafter turns itself off (faults.py).
    fault_limit: int = DEFAULT_FAULT_LIMIT

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name not in ("policy_params", "pools_given")]


def _parse_acceptance(value: Any) -> Acceptance:
    if value is None or value == "exact":
        return Acceptance()
    if value == "typical":
        return Acceptance("typical")
    if not isinstance(value, Mapping) or value.get("name") not in ("exact", "typical"):
        raise _fail("acceptance", f"must be 'exact', 'typical' or {{\"name\": \"typical\", \"epsilon\": 0.09, "
                                  f"\"delta\": 0.3}}; got {show(value)}")
    unknown = set(value) - {"name", "epsilon", "delta"}
    if unknown or (value["name"] == "exact" and len(value) > 1):
        raise _fail("acceptance", f"unknown key(s) {_names(unknown or set(value) - {'name'})}; "
                                  "typical takes epsilon and delta")
    return Acceptance(value["name"],
                      epsilon=check_number(("acceptance", "epsilon"), value.get("epsilon", 0.09), ACCEPTANCE_EPSILON),
                      delta=check_number(("acceptance", "delta"), value.get("delta", 0.3), ACCEPTANCE_DELTA))


TREE_BUILDERS = ("joint", "c2t")
# C2T's defaults for the shipped SmolLM2 classifier, the fastest of the measured settings (benchmarks/log/2026-11-23.md:
# beta 0.1-0.4 at max depth 6). The paper's 0.5 / 10 fit its classifier and its cheaper draft model.
C2T_BETA = 0.4
C2T_MAX_DEPTH = 6
C2T_BETA_RANGE = Interval(0, 1, hi_open=True)  # the classifier's confidence threshold; 1 would keep nothing


@dataclass(frozen=True)
class TreeSettings:
    budget: int  # nodes per tree (verified rows besides the root)
    top_k: int = 2  # candidates per depth (the chain's token and top_k - 1 alternatives)
    depth: int | None = None  # chain depth drafted; None = ceil(budget / top_k)
    # Most KV positions the tree path may hold in its per-request contiguous copies (runtime/),
    # all requests together; requests past it draft chains. None = an eighth of the KV cache's token capacity.
    kv_copy_tokens: int | None = None
    # Which nodes enter the tree: "joint" (the `budget` most probable by joint probability) or "c2t" (paper 004:
    # a node is kept when the classifier's confidence is above `beta`; of each kept node's children only the top_k
    # are scored; `second_top_k` keeps at most that many per layer; the budget still caps the tree).
    builder: str = "joint"
    beta: float = C2T_BETA
    second_top_k: int | None = None

    @property
    def max_depth(self) -> int:
        if self.depth is not None:
            return self.depth
        if self.builder == "c2t":  # growth stops by itself where nothing passes
            return min(self.budget, C2T_MAX_DEPTH)
        return -(-self.budget // self.top_k)


def _parse_tree(value: Any, proposer: str = "early_exit") -> TreeSettings | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _fail("tree", f"must be an object like {{\"budget\": 16, \"top_k\": 2}}, got {show(value)}")
    allowed = TREE_KEYS[proposer]
    unknown = set(value) - set(allowed)
    if unknown:
        raise _fail("tree", f"unknown key(s) {_names(unknown)} for {PROPOSER_CLASSES[proposer]}; "
                            f"allowed: {', '.join(allowed)}")
    if "budget" not in value:
        raise _fail("tree", "needs 'budget' (tree nodes verified per step)")
    if "depth" in value and "max_depth" in value:
        raise _fail("tree", "give 'max_depth' or its older name 'depth', not both")
    budget = _check_int_in(("tree", "budget"), value["budget"], 1, MAX_DRAFTS,
                           f"vLLM verifies at most {MAX_DRAFTS} drafts")
    top_k = _check_int_in(("tree", "top_k"), value.get("top_k", 2), 1, MAX_TOP_K, "children per chain node")
    builder = _check_choice(("tree", "builder"), value.get("builder", "joint"), TREE_BUILDERS)
    c2t_only = sorted(set(value) & {"beta", "second_top_k"})
    if c2t_only and builder != "c2t":
        raise _fail("tree", f"{', '.join(map(repr, c2t_only))} appl{'ies' if len(c2t_only) == 1 else 'y'} to "
                            "\"builder\": \"c2t\" only")
    beta = check_number(("tree", "beta"), value.get("beta", C2T_BETA), C2T_BETA_RANGE)
    second = value.get("second_top_k")
    if second is not None:
        second = _check_int_in(("tree", "second_top_k"), second, 1, budget, f"1..budget, the budget is {budget}")
    depth_key = "max_depth" if "max_depth" in value else "depth"
    depth = value.get(depth_key)
    if depth is not None:
        depth = _check_int_in(("tree", depth_key), depth, 1, budget, f"1..budget, the budget is {budget}")
    copy_tokens = value.get("kv_copy_tokens")
    if copy_tokens is not None:
        copy_tokens = _check_int_in(("tree", "kv_copy_tokens"), copy_tokens, 1, MAX_KV_COPY_TOKENS, "KV positions")
    return TreeSettings(budget=budget, top_k=top_k, depth=depth, kv_copy_tokens=copy_tokens, builder=builder,
                        beta=beta, second_top_k=second)


def section_of(additional_config: Any) -> Mapping:
    """The `adaspec` section of additional_config ({} when there is none). vLLM also allows an object with a
    compute_hash() there instead of a dict: such an object has no `adaspec` section."""
    if not isinstance(additional_config, Mapping):
        return {}
    section = additional_config.get(SECTION)
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise AdaspecConfigError(f"additional_config['{SECTION}'] must be a JSON object (dict), got {typed(section)}")
    return section


def parse_adaspec_config(additional_config: Mapping[str, Any] | None, proposer: str = "early_exit") -> AdaspecConfig:
    """Parse `additional_config` (the whole dict) into an AdaspecConfig for `proposer` (a PROPOSER_KEYS name).
    Model-independent checks only."""
    section = section_of(additional_config)
    allowed = PROPOSER_KEYS[proposer]
    unknown = set(section) - set(allowed)
    if unknown:
        other = [k for k in unknown if k in AdaspecConfig.keys()]
        hint = (f" ({_names(other)} belong to another proposer)" if other else "")
        raise AdaspecConfigError(
            f"additional_config['{SECTION}']: unknown key(s) {_names(unknown)} for "
            f"{PROPOSER_CLASSES[proposer]}{hint}; allowed keys: {', '.join(k for k in allowed if k not in OLD_NAMES)}"
        )
    exit_layer = section.get("exit_layer")
    if exit_layer is not None:
        exit_layer = _check_int("exit_layer", exit_layer)
        if exit_layer < 1:  # the upper end is the model's layer count (resolve_config)
            raise _fail("exit_layer", f"must be >= 1 (the number of target layers the drafter runs), got "
                                      f"{show(exit_layer)}")
    policy, policy_params = _parse_policy(section.get("policy", "fixed"))
    exit_head = section.get("exit_head", "auto")
    if not isinstance(exit_head, str) or not exit_head:
        raise _fail("exit_head", f"must be 'auto', 'none' or a checkpoint folder; got {show(exit_head)}")
    draft_weights = section.get("draft_weights", "int8")
    if draft_weights not in DRAFT_WEIGHTS:
        raise _fail("draft_weights", f"must be one of {', '.join(map(repr, DRAFT_WEIGHTS))}; got {show(draft_weights)}")
    pools = _parse_pools(section.get("pools", DEFAULT_POOLS))
    return AdaspecConfig(exit_layer=exit_layer, policy=policy, policy_params=policy_params, exit_head=exit_head,
                         draft_weights=draft_weights,
                         cost_model=_parse_cost_model(section, proposer),
                         tree=_parse_tree(section.get("tree"), proposer),
                         pools=pools, pools_given="pools" in section,
                         corpus=_parse_artifact("corpus", section, pools, "a corpus table (corpus.npz or its folder)"),
                         medusa=_parse_artifact("medusa", section, pools,
                                                "a Medusa heads folder (`adaspec train medusa`)"),
                         acceptance=_parse_acceptance(section.get("acceptance")),
                         suffix_cache_requests=_parse_suffix_cache(section, pools),
                         fault_limit=_check_int_in("fault_limit", section.get("fault_limit", DEFAULT_FAULT_LIMIT), 1,
                                                   MAX_FAULT_LIMIT, "contained faults before drafting stops"),
                         **_parse_branches(section, pools))


def _parse_suffix_cache(section: Mapping, pools: tuple[str, ...]) -> int:
    if "suffix_cache_requests" not in section:
        return DEFAULT_SUFFIX_CACHE_REQUESTS
    if "suffix" not in pools:
        raise _fail("suffix_cache_requests", f"bounds the 'suffix' pool's cache, which is not in pools "
                                             f"({list(pools)!r}); add 'suffix' or drop the key")
    return _check_int_in("suffix_cache_requests", section["suffix_cache_requests"], 1, MAX_SUFFIX_CACHE_REQUESTS,
                         "requests the suffix pool's global cache keeps")


def _parse_cost_model(section: Mapping, proposer: str) -> str:
    if "cost_model" in section and "speed_guard" in section:
        raise _fail("cost_model", "give 'cost_model' or its older name 'speed_guard', not both")
    if "speed_guard" in section:
        guard = section["speed_guard"]
        if not isinstance(guard, bool):
            raise _fail("speed_guard", f"must be true or false, got {typed(guard)} (it is the "
                                       f"older name of 'cost_model': one of {', '.join(map(repr, COST_MODELS))})")
        return "online" if guard else ("prior" if proposer == "multi_branch" else "off")
    return _check_choice("cost_model", section.get("cost_model", "online"), COST_MODELS)


def _parse_branches(section: Mapping, pools: tuple[str, ...]) -> dict:
    from vllm_adaspec.pools.branches import BRANCH_INITS

    n = _check_int_in("branches", section.get("branches", DEFAULT_BRANCHES), 0, MAX_BRANCHES,
                      "draft branches per request; 0 = off")
    length = _check_int_in("branch_length", section.get("branch_length", DEFAULT_BRANCH_LENGTH), 1, MAX_BRANCH_LENGTH,
                           "tokens per branch")
    init = _check_choice("branch_init", section.get("branch_init", "prompt"), BRANCH_INITS)
    if n == 0 and ("branch_length" in section or "branch_init" in section):
        raise _fail("branches", "is 0 (off), so 'branch_length' / 'branch_init' would do nothing; set branches "
                                "(e.g. 2) or drop them")
    if n == 0 and "branches" in pools and "pools" in section:
        raise _fail("pools", "lists 'branches', which is fed by draft branches: set 'branches' (e.g. 2) too")
    return {"branches": n, "branch_length": length, "branch_init": init}


def _parse_artifact(pool: str, section: Mapping, pools: tuple[str, ...], what: str) -> str:
    """The file a pool loads (setting named like the pool): "auto" or a path, and only with the pool in use."""
    value = section.get(pool, "auto")
    if not isinstance(value, str) or not value:
        raise _fail(pool, f"must be 'auto' or the path of {what}, got {show(value)}")
    if value != "auto" and pool not in pools:
        raise _fail(pool, f"names a file but {pool!r} is not in pools ({list(pools)!r}); add it or drop {pool!r}")
    return value


def _parse_pools(value: Any) -> tuple[str, ...]:
    known = ", ".join(POOL_SPECS)
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        raise _fail("pools", f"must be a non-empty list of pool names ({known}), got {show(value)}")
    unknown = [v for v in value if not isinstance(v, str) or v not in POOL_SPECS]
    if unknown:
        raise _fail("pools", f"unknown pool(s) {', '.join(map(show, unknown))}; known: {known}")
    if len(set(value)) != len(value):
        raise _fail("pools", f"lists a pool twice: {list(value)!r}")
    return tuple(value)


def _parse_policy(value: Any) -> tuple[str, dict]:
    from vllm_adaspec.policies import POLICIES, PolicyError, check_policy

    if isinstance(value, Mapping):
        params = dict(value)
        name = params.pop("name", None)
        if name is None:
            raise _fail("policy", f"an object needs a 'name' (one of {', '.join(POLICIES)}); got {show(value)}")
    else:
        name, params = value, {}
    if not isinstance(name, str) or name not in POLICIES:
        raise _fail("policy", f"must be one of {', '.join(POLICIES)} (or an object with 'name'); got {show(name)}")
    try:
        return name, check_policy(name, params)
    except PolicyError as e:
        raise _fail(("policy", e.param) if e.param else "policy", str(e)) from None


# --- resolved settings: one frozen dataclass per proposer over a common part ------------------------------------

@dataclass(frozen=True, kw_only=True)
class CommonSettings:
    """What every proposer reads, checked against the model and the speculative config: every value concrete."""
    num_speculative_tokens: int  # K: the most drafts per request and step (speculative_config)
    num_layers: int  # the target's decoder layers
    policy: str = "fixed"
    policy_params: dict = field(default_factory=dict)
    cost_model: str = "online"
    tree: TreeSettings | None = None
    acceptance: Acceptance = field(default_factory=Acceptance)
    fault_limit: int = DEFAULT_FAULT_LIMIT
    # Set by engine/startup.check_engine, which checked these settings against the engine: then `tree_unsupported`
    # says why this engine cannot verify token trees (None: it can), and a MultiBranchProposer's `pools` are the ones
    # this engine runs and its `corpus` / `medusa` the files checked for this model (concrete paths), so the worker
    # loads them without looking again.
    checked: bool = False
    tree_unsupported: str | None = None


@dataclass(frozen=True, kw_only=True)
class EarlyExitSettings(CommonSettings):
    exit_layer: int
    exit_head: str | None = None  # checkpoint folder, or None for the untrained exit
    exit_head_setting: str = "auto"  # what the user asked for: "auto", "none" or a folder
    draft_weights: str = "int8"  # DRAFT_WEIGHTS


@dataclass(frozen=True, kw_only=True)
class MultiBranchSettings(CommonSettings):
    pools: tuple[str, ...] = DEFAULT_POOLS
    pools_given: bool = False
    corpus: str = "auto"
    medusa: str = "auto"
    branches: int = 0
    branch_length: int = DEFAULT_BRANCH_LENGTH
    branch_init: str = "prompt"
    suffix_cache_requests: int = DEFAULT_SUFFIX_CACHE_REQUESTS


@dataclass(frozen=True, kw_only=True)
class ProbeSettings(CommonSettings):
    """ProbeProposer reads the common part only."""


# The name callers use for any proposer's resolved settings.
ResolvedConfig = CommonSettings
SETTINGS_CLASSES = {"early_exit": EarlyExitSettings, "multi_branch": MultiBranchSettings, "probe": ProbeSettings}

# The settings engine/startup.check_engine resolved travel on the VllmConfig object as this attribute: vLLM pickles
# the config (its __dict__ included) to the engine-core and worker processes. Not inside additional_config, which
# vLLM hashes with json.dumps (VllmConfig.compute_hash): a dataclass there would break it, any entry would change it.
KEPT = "_adaspec_settings"


def settings_fingerprint(vllm_config, proposer: str) -> str | None:
    """What kept settings were computed from besides the model (the section, K): a config whose settings changed is
    checked again. None (never equal to a kept one) when the inputs do not serialise."""
    try:
        section = section_of(getattr(vllm_config, "additional_config", None))
        k = getattr(getattr(vllm_config, "speculative_config", None), "num_speculative_tokens", None)
        return json.dumps([proposer, section, k], sort_keys=True, default=repr)
    except (AdaspecConfigError, TypeError, ValueError):
        return None


def keep_settings(vllm_config, proposer: str, settings: CommonSettings) -> None:
    object.__setattr__(vllm_config, KEPT, (settings_fingerprint(vllm_config, proposer), settings))


def carried_settings(vllm_config, proposer: str) -> CommonSettings | None:
    """The settings the front end's start-up checks left on this config for `proposer` (pure: what a drafter may
    call without importing the engine glue), or None when there are none or they are for other inputs."""
    kept = getattr(vllm_config, KEPT, None)
    if kept is None or kept[0] is None or kept[0] != settings_fingerprint(vllm_config, proposer):
        return None
    return kept[1]


def resolve_config(
    cfg: AdaspecConfig,
    *,
    architectures: list[str] | None,
    num_layers: int,
    num_speculative_tokens: int | None,
    hf_config=None,
    proposer: str = "early_exit",
) -> ResolvedConfig:
    """Check the settings against the target model; fill defaults that depend on it.

    With `hf_config` the exit head is resolved too: an explicit checkpoint must match the model's config and N
    (its weights are checked when the worker loads it); "auto" finds a shipped one.
    """
    k = _check_k(num_speculative_tokens)
    if proposer in ("multi_branch", "probe"):
        return _resolve_multi_branch(cfg, num_layers, k, proposer)
    archs = list(architectures or [])
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise AdaspecConfigError(
            f"vllm_adaspec: model architecture {archs or 'unknown'} is not supported by early-exit drafting; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if num_layers < 2:
        raise AdaspecConfigError(f"vllm_adaspec: the model has {num_layers} layer(s); early exit needs at least 2")
    head, head_meta, exit_layer = None, {}, cfg.exit_layer
    if hf_config is not None and cfg.exit_head != "none":
        from vllm_adaspec.heads import check_against_model, find_shipped, load_exit_head

        if cfg.exit_head == "auto":
            head = find_shipped(hf_config, cfg.exit_layer)
        else:
            head = cfg.exit_head
            meta, _ = load_exit_head(head, tensors=False)
            check_against_model(meta, head, hf_config, cfg.exit_layer)
        if head is not None:
            head_meta = load_exit_head(head, tensors=False)[0]
            exit_layer = head_meta["exit_layer"]
    from vllm_adaspec.policies import POLICIES

    if hf_config is not None and getattr(POLICIES[cfg.policy], "needs_score", False):
        from vllm_adaspec.heads import check_calibration

        check_calibration(head, cfg.policy)
    _check_budget_fits(cfg.tree, k)
    if cfg.acceptance.name == "typical" and cfg.tree is None:
        raise _fail("acceptance", "'typical' applies to token trees; set 'tree' (e.g. {\"budget\": 4}) or drop it")
    if hf_config is not None and cfg.tree is not None and cfg.tree.builder == "c2t":
        from vllm_adaspec.heads.c2t import load_c2t

        load_c2t(head)  # the classifier must exist for this exit head and match it (errors name the fix)
    if exit_layer is None:
        exit_layer = max(1, num_layers // 4)
    # a draft layer reading the target's last features sits on all of its layers
    top = head is not None and head_meta.get("input") == "features"
    if not 1 <= exit_layer < num_layers + top:
        raise _fail(
            "exit_layer",
            f"must satisfy 1 <= exit_layer < {num_layers} (the model has {num_layers} layers), got {show(exit_layer)}",
        )
    return EarlyExitSettings(exit_layer=exit_layer, num_layers=num_layers, num_speculative_tokens=k,
                             policy=cfg.policy, policy_params=cfg.policy_params, exit_head=head,
                             cost_model=cfg.cost_model, exit_head_setting=cfg.exit_head, tree=cfg.tree,
                             draft_weights=cfg.draft_weights,
                             acceptance=cfg.acceptance, fault_limit=cfg.fault_limit)


K_KEY = "speculative_config['num_speculative_tokens']"


def _check_k(num_speculative_tokens) -> int:
    if num_speculative_tokens is None:
        raise AdaspecConfigError(f"{K_KEY} is required (K, the most drafts per step)")
    if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int):
        raise AdaspecConfigError(f"{K_KEY} must be an integer, got {type(num_speculative_tokens).__name__} "
                                 f"{show(num_speculative_tokens)}")
    if num_speculative_tokens < 1:
        raise AdaspecConfigError(f"{K_KEY} must be >= 1, got {show(num_speculative_tokens)}")
    if num_speculative_tokens > MAX_DRAFTS:
        raise AdaspecConfigError(f"{K_KEY} must be in 1..{MAX_DRAFTS} (vLLM verifies at most {MAX_DRAFTS} drafts per "
                                 f"request and step), got {show(num_speculative_tokens)}")
    return num_speculative_tokens


def _check_budget_fits(tree: TreeSettings | None, k: int) -> None:
    if tree is not None and tree.budget > k:
        raise AdaspecConfigError(
            f"additional_config['{SECTION}']['tree']['budget'] = {tree.budget} needs {K_KEY} >= {tree.budget} (every "
            f"tree node is a draft vLLM verifies), got {k}")


# Policies that need the drafter's own distribution (entropy, top probability, a predictor) have nothing to read
# in a model-free proposer.
MODEL_FREE_POLICIES = ("fixed", "thompson-beta")


def _resolve_multi_branch(cfg: AdaspecConfig, num_layers: int, k: int, proposer: str = "multi_branch"):
    """MultiBranchProposer (and ProbeProposer): model-free, any architecture vLLM runs; every proposal is a tree of
    at most tree.budget nodes (default K)."""
    if cfg.policy not in MODEL_FREE_POLICIES:
        raise _fail("policy", f"{cfg.policy!r} reads a drafting model's distribution, which "
                              f"{PROPOSER_CLASSES[proposer]} does not have; use one of "
                              f"{', '.join(MODEL_FREE_POLICIES)}")
    # Default budget: what K leaves after the branch rows, at most DEFAULT_BUDGET.
    tree = cfg.tree or TreeSettings(budget=max(1, min(k - cfg.branches * cfg.branch_length, DEFAULT_BUDGET)))
    _check_budget_fits(tree, k)
    common = dict(num_layers=num_layers, num_speculative_tokens=k, policy=cfg.policy, policy_params=cfg.policy_params,
                  cost_model=cfg.cost_model, tree=tree, acceptance=cfg.acceptance, fault_limit=cfg.fault_limit)
    if proposer == "probe":
        return ProbeSettings(**common)
    rows = tree.budget + cfg.branches * cfg.branch_length
    if cfg.branches and rows > k:
        raise AdaspecConfigError(
            f"additional_config['{SECTION}']: branches * branch_length + tree budget = {cfg.branches} * "
            f"{cfg.branch_length} + {tree.budget} = {rows} rows per request, more than the "
            f"{K_KEY} = {k} draft slots the scheduler reserves; raise "
            f"num_speculative_tokens to {rows} or shrink branches / branch_length / tree.budget")
    pools = cfg.pools + (("branches",) if cfg.branches and "branches" not in cfg.pools else ())
    if "suffix" in cfg.pools:
        from vllm_adaspec.pools.suffix import suffix_available

        if not suffix_available():
            raise _fail("pools", "'suffix' needs the package arctic-inference==0.1.1, which is not installed (its "
                                 "sdist must be built against the installed torch: scripts/setup.sh shows how); "
                                 "remove 'suffix' from pools to run without it")
    return MultiBranchSettings(**common, pools=pools, pools_given=cfg.pools_given, corpus=cfg.corpus,
                               medusa=cfg.medusa, branches=cfg.branches, branch_length=cfg.branch_length,
                               branch_init=cfg.branch_init, suffix_cache_requests=cfg.suffix_cache_requests)


DEFAULT_BUDGET = 16  # MultiBranchProposer's node budget when `tree` is not given (capped at K)
