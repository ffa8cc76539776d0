"""The `adaspec` section of vLLM's `additional_config`, parsed into a typed, validated object.

Everything here is pure Python so it can be checked in the front-end process, before any engine starts,
and unit-tested in milliseconds. Every error names the offending key and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

SECTION = "adaspec"
# Decoder-only models whose vLLM implementation exposes embed_tokens / layers / norm / lm_head and
# whose decoder layers take (positions, hidden_states, residual).
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
)


class AdaspecConfigError(ValueError):
    """A bad `adaspec` setting, a bad speculative config, or an unsupported model."""


# Which settings each proposer reads: a common part (draft-length policy, speed guard, token trees) and a part of
# its own. Keys of another proposer are refused like unknown keys.
COMMON_KEYS = ("policy", "cost_model", "speed_guard", "tree")
PROPOSER_KEYS = {
    "early_exit": ("exit_layer", "policy", "exit_head", "cost_model", "speed_guard", "tree", "acceptance"),
    "multi_branch": ("pools", "corpus", "medusa", "policy", "cost_model", "speed_guard", "tree", "acceptance",
                     "branches", "branch_length", "branch_init"),
    "probe": ("policy", "cost_model", "speed_guard", "tree"),
}
# How drafts are sized against what verifying them costs (policies/cost_model.py):
#   "online"  the step cost model, fitted online from the engine's own step times, starting from the shipped curve
#   "prior"   the shipped curve only, never refitted (MultiBranchProposer; early exit: as "off")
#   "off"     no cost model: every candidate within the budget is verified (early exit: the policy's length)
COST_MODELS = ("online", "prior", "off")
OLD_NAMES = ("speed_guard",)  # still accepted, not listed
PROPOSER_CLASSES = {"early_exit": "EarlyExitProposer", "multi_branch": "MultiBranchProposer",
                    "probe": "ProbeProposer"}
# Tree keys per proposer: early exit grows its trees from the exit head (top_k, depth; the builder picks nodes by
# joint probability or by C2T's classifier); the candidate trees of multi_branch come from its pools.
TREE_KEYS = {"early_exit": ("budget", "top_k", "depth", "max_depth", "kv_copy_tokens", "builder", "beta",
                            "second_top_k"),
             "multi_branch": ("budget", "kv_copy_tokens"), "probe": ("budget", "kv_copy_tokens")}
# Candidate pools of MultiBranchProposer (vllm_adaspec/pools/); the default is the best measured set.
POOLS = ("context", "suffix", "recycled", "corpus", "medusa", "branches")
# context + suffix + corpus + medusa: first in the offline replay on HumanEval and MT-Bench and ahead of the old
# default (context + suffix + recycled) in the engine at batch 1 and 8 (benchmarks/RESULTS.md, session 9). A model
# without a corpus table or Medusa heads runs the others (proposers/multi_branch.usable_pools).
DEFAULT_POOLS = ("context", "suffix", "corpus", "medusa")


# Self-Draft branches: off by default (benchmarks/RESULTS.md, session 12: the extra rows do not pay on this CPU).
DEFAULT_BRANCHES = 0
DEFAULT_BRANCH_LENGTH = 4
MAX_DRAFTS = 128  # vLLM verifies at most this many drafts per request and step


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
    # How drafts are sized against their verification cost (COST_MODELS). `speed_guard` is its older name:
    # true = "online", false = "prior" (MultiBranchProposer) / "off" (early exit), what it meant before.
    cost_model: str = "online"
    # Token-tree drafting (engine/tree_verification.py): {"budget": nodes per tree, "top_k": children per chain
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

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "policy_params"]  # parameters live inside `policy`


def _parse_acceptance(value: Any) -> Acceptance:
    if value is None or value == "exact":
        return Acceptance()
    if value == "typical":
        return Acceptance("typical")
    if not isinstance(value, Mapping) or value.get("name") not in ("exact", "typical"):
        raise _fail("acceptance", f"must be 'exact', 'typical' or {{\"name\": \"typical\", \"epsilon\": 0.09, "
                                  f"\"delta\": 0.3}}; got {value!r}")
    unknown = sorted(set(value) - {"name", "epsilon", "delta"})
    if unknown or (value["name"] == "exact" and len(value) > 1):
        raise _fail("acceptance", f"unknown key(s) {', '.join(map(repr, unknown or sorted(set(value) - {'name'})))}; "
                                  "typical takes epsilon and delta")
    out = {}
    for key, default in (("epsilon", 0.09), ("delta", 0.3)):
        v = value.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
            raise _fail("acceptance", f"{key} must be a number in (0, 1], got {v!r}")
        out[key] = float(v)
    return Acceptance(value["name"], **out)


TREE_BUILDERS = ("joint", "c2t")
# C2T's defaults for the shipped SmolLM2 classifier, the fastest of the measured settings (benchmarks/RESULTS.md,
# session 11: beta 0.1-0.4 at max depth 6). The paper's 0.5 / 10 fit its classifier and its cheaper draft model.
C2T_BETA = 0.4
C2T_MAX_DEPTH = 6


@dataclass(frozen=True)
class TreeSettings:
    budget: int  # nodes per tree (verified rows besides the root)
    top_k: int = 2  # candidates per depth (the chain's token and top_k - 1 alternatives)
    depth: int | None = None  # chain depth drafted; None = ceil(budget / top_k)
    # Most KV positions the tree path may hold in its per-request contiguous copies (engine/tree_verification.py),
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
        raise _fail("tree", f"must be an object like {{\"budget\": 16, \"top_k\": 2}}, got {value!r}")
    allowed = TREE_KEYS[proposer]
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise _fail("tree", f"unknown key(s) {', '.join(map(repr, unknown))} for {PROPOSER_CLASSES[proposer]}; "
                            f"allowed: {', '.join(allowed)}")
    if "budget" not in value:
        raise _fail("tree", "needs 'budget' (tree nodes verified per step)")
    budget = _check_int("tree.budget", value["budget"])
    top_k = _check_int("tree.top_k", value.get("top_k", 2))
    if "depth" in value and "max_depth" in value:
        raise _fail("tree", "give 'max_depth' or its older name 'depth', not both")
    depth = value.get("max_depth", value.get("depth"))
    builder = value.get("builder", "joint")
    if builder not in TREE_BUILDERS:
        raise _fail("tree", f"builder must be one of {', '.join(map(repr, TREE_BUILDERS))}, got {builder!r}")
    c2t_only = sorted(set(value) & {"beta", "second_top_k"})
    if c2t_only and builder != "c2t":
        raise _fail("tree", f"{', '.join(map(repr, c2t_only))} appl{'ies' if len(c2t_only) == 1 else 'y'} to "
                            "\"builder\": \"c2t\" only")
    beta = value.get("beta", C2T_BETA)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
        raise _fail("tree", f"beta must be a number in [0, 1) (the classifier's confidence threshold), got {beta!r}")
    second = value.get("second_top_k")
    if second is not None:
        second = _check_int("tree.second_top_k", second)
        if not 1 <= second <= budget:
            raise _fail("tree", f"second_top_k must be in 1..budget ({budget}), got {second}")
    if not 1 <= budget <= 128:
        raise _fail("tree", f"budget must be in 1..128 (vLLM verifies at most 128 drafts), got {budget}")
    if not 1 <= top_k <= 16:
        raise _fail("tree", f"top_k must be in 1..16, got {top_k}")
    if depth is not None:
        depth = _check_int("tree.max_depth", depth)
        if not 1 <= depth <= budget:
            raise _fail("tree", f"max_depth must be in 1..budget ({budget}), got {depth}")
    copy_tokens = value.get("kv_copy_tokens")
    if copy_tokens is not None:
        copy_tokens = _check_int("tree.kv_copy_tokens", copy_tokens)
        if copy_tokens < 1:
            raise _fail("tree", f"kv_copy_tokens must be >= 1 (KV positions), got {copy_tokens}")
    return TreeSettings(budget=budget, top_k=top_k, depth=depth, kv_copy_tokens=copy_tokens, builder=builder,
                        beta=float(beta), second_top_k=second)


def _fail(key: str, msg: str) -> AdaspecConfigError:
    return AdaspecConfigError(f"additional_config['{SECTION}']['{key}']: {msg}")


def _check_int(key: str, value: Any) -> int:
    # bool is an int subclass: `true` is never a layer count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(key, f"must be an integer, got {type(value).__name__} {value!r}")
    return value


def parse_adaspec_config(additional_config: Mapping[str, Any] | None, proposer: str = "early_exit") -> AdaspecConfig:
    """Parse `additional_config` (the whole dict) into an AdaspecConfig for `proposer` (a PROPOSER_KEYS name).
    Model-independent checks only."""
    section = (additional_config or {}).get(SECTION, {})
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise AdaspecConfigError(
            f"additional_config['{SECTION}'] must be a JSON object (dict), got {type(section).__name__} {section!r}"
        )
    allowed = PROPOSER_KEYS[proposer]
    unknown = sorted(set(section) - set(allowed))
    if unknown:
        other = [k for k in unknown if k in AdaspecConfig.keys()]
        hint = (f" ({', '.join(map(repr, other))} belong to another proposer)" if other else "")
        raise AdaspecConfigError(
            f"additional_config['{SECTION}']: unknown key(s) {', '.join(map(repr, unknown))} for "
            f"{PROPOSER_CLASSES[proposer]}{hint}; allowed keys: {', '.join(k for k in allowed if k not in OLD_NAMES)}"
        )
    exit_layer = section.get("exit_layer")
    if exit_layer is not None:
        exit_layer = _check_int("exit_layer", exit_layer)
        if exit_layer < 1:
            raise _fail("exit_layer", f"must be >= 1 (the number of target layers the drafter runs), got {exit_layer}")
    policy, policy_params = _parse_policy(section.get("policy", "fixed"))
    exit_head = section.get("exit_head", "auto")
    if not isinstance(exit_head, str) or not exit_head:
        raise _fail("exit_head", f"must be 'auto', 'none' or a checkpoint folder; got {exit_head!r}")
    cost_model = _parse_cost_model(section, proposer)
    return AdaspecConfig(exit_layer=exit_layer, policy=policy, policy_params=policy_params, exit_head=exit_head,
                         cost_model=cost_model, tree=_parse_tree(section.get("tree"), proposer),
                         pools=_parse_pools(section.get("pools", DEFAULT_POOLS)), pools_given="pools" in section,
                         corpus=_parse_artifact("corpus", section, "a corpus table (corpus.npz or its folder)"),
                         medusa=_parse_artifact("medusa", section, "a Medusa heads folder (`adaspec train medusa`)"),
                         acceptance=_parse_acceptance(section.get("acceptance")),
                         **_parse_branches(section))


def _parse_cost_model(section: Mapping, proposer: str) -> str:
    if "cost_model" in section and "speed_guard" in section:
        raise _fail("cost_model", "give 'cost_model' or its older name 'speed_guard', not both")
    if "speed_guard" in section:
        guard = section["speed_guard"]
        if not isinstance(guard, bool):
            raise _fail("speed_guard", f"must be true or false, got {type(guard).__name__} {guard!r} (it is the "
                                       f"older name of 'cost_model': one of {', '.join(map(repr, COST_MODELS))})")
        return "online" if guard else ("prior" if proposer == "multi_branch" else "off")
    value = section.get("cost_model", "online")
    if value not in COST_MODELS:
        raise _fail("cost_model", f"must be one of {', '.join(map(repr, COST_MODELS))}, got {value!r}")
    return value


def _parse_branches(section: Mapping) -> dict:
    from vllm_adaspec.pools.branches import BRANCH_INITS

    n = _check_int("branches", section.get("branches", DEFAULT_BRANCHES))
    length = _check_int("branch_length", section.get("branch_length", DEFAULT_BRANCH_LENGTH))
    init = section.get("branch_init", "prompt")
    if not 0 <= n <= 32:
        raise _fail("branches", f"must be in 0..32 (draft branches per request; 0 = off), got {n}")
    if not 1 <= length <= 16:
        raise _fail("branch_length", f"must be in 1..16 (tokens per branch), got {length}")
    if init not in BRANCH_INITS:
        raise _fail("branch_init", f"must be one of {', '.join(map(repr, BRANCH_INITS))}, got {init!r}")
    if n == 0 and ("branch_length" in section or "branch_init" in section):
        raise _fail("branches", "is 0 (off), so 'branch_length' / 'branch_init' would do nothing; set branches "
                                "(e.g. 2) or drop them")
    pools = section.get("pools", ())
    if n == 0 and isinstance(pools, (list, tuple)) and "branches" in pools:
        raise _fail("pools", "lists 'branches', which is fed by draft branches: set 'branches' (e.g. 2) too")
    return {"branches": n, "branch_length": length, "branch_init": init}


def _parse_artifact(pool: str, section: Mapping, what: str) -> str:
    """The file a pool loads (setting named like the pool): "auto" or a path, and only with the pool in use."""
    value = section.get(pool, "auto")
    pools = section.get("pools", DEFAULT_POOLS)
    if not isinstance(value, str) or not value:
        raise _fail(pool, f"must be 'auto' or the path of {what}, got {value!r}")
    if value != "auto" and pool not in pools:
        raise _fail(pool, f"names a file but {pool!r} is not in pools ({list(pools)!r}); add it or drop {pool!r}")
    return value


def _parse_pools(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        raise _fail("pools", f"must be a non-empty list of pool names ({', '.join(POOLS)}), got {value!r}")
    unknown = [v for v in value if v not in POOLS]
    if unknown:
        raise _fail("pools", f"unknown pool(s) {', '.join(map(repr, unknown))}; known: {', '.join(POOLS)}")
    if len(set(value)) != len(value):
        raise _fail("pools", f"lists a pool twice: {list(value)!r}")
    return tuple(value)


def _parse_policy(value: Any) -> tuple[str, dict]:
    from vllm_adaspec.policies import POLICIES, check_policy

    if isinstance(value, Mapping):
        params = dict(value)
        name = params.pop("name", None)
        if name is None:
            raise _fail("policy", f"an object needs a 'name' (one of {', '.join(POLICIES)}); got {value!r}")
    else:
        name, params = value, {}
    if not isinstance(name, str) or name not in POLICIES:
        raise _fail("policy", f"must be one of {', '.join(POLICIES)} (or an object with 'name'); got {name!r}")
    try:
        check_policy(name, params)
    except ValueError as e:
        raise _fail("policy", str(e)) from None
    return name, params


@dataclass(frozen=True)
class ResolvedConfig:
    """AdaspecConfig checked against the model and the speculative config: every value concrete."""

    exit_layer: int
    num_layers: int
    num_speculative_tokens: int
    policy: str
    exit_head: str | None = None  # checkpoint folder, or None for the untrained exit
    policy_params: dict = field(default_factory=dict)
    cost_model: str = "online"
    exit_head_setting: str = "auto"  # what the user asked for: "auto", "none" or a folder
    tree: TreeSettings | None = None
    pools: tuple[str, ...] = DEFAULT_POOLS
    pools_given: bool = False
    corpus: str = "auto"
    medusa: str = "auto"
    acceptance: Acceptance = field(default_factory=Acceptance)
    branches: int = 0
    branch_length: int = DEFAULT_BRANCH_LENGTH
    branch_init: str = "prompt"


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
    if proposer in ("multi_branch", "probe"):
        return _resolve_multi_branch(cfg, num_layers, _check_k(num_speculative_tokens))
    archs = list(architectures or [])
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise AdaspecConfigError(
            f"vllm_adaspec: model architecture {archs or 'unknown'} is not supported by early-exit drafting; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    k = _check_k(num_speculative_tokens)
    if num_layers < 2:
        raise AdaspecConfigError(f"vllm_adaspec: the model has {num_layers} layer(s); early exit needs at least 2")
    head, exit_layer = None, cfg.exit_layer
    if hf_config is not None and cfg.exit_head != "none":
        from vllm_adaspec.heads import check_against_model, find_shipped, load_exit_head

        if cfg.exit_head == "auto":
            head = find_shipped(hf_config, cfg.exit_layer)
        else:
            head = cfg.exit_head
            meta, _ = load_exit_head(head, tensors=False)
            check_against_model(meta, head, hf_config, cfg.exit_layer)
        if head is not None:
            exit_layer = load_exit_head(head, tensors=False)[0]["exit_layer"]
    from vllm_adaspec.policies import POLICIES

    if hf_config is not None and getattr(POLICIES[cfg.policy], "needs_score", False):
        from vllm_adaspec.heads import check_calibration

        check_calibration(head, cfg.policy)
    if cfg.tree is not None and k < cfg.tree.budget:
        raise AdaspecConfigError(
            f"additional_config['{SECTION}']['tree']['budget'] = {cfg.tree.budget} needs "
            f"speculative_config['num_speculative_tokens'] >= {cfg.tree.budget} (every tree node is a draft vLLM "
            f"verifies), got {k}")
    if cfg.acceptance.name == "typical" and cfg.tree is None:
        raise _fail("acceptance", "'typical' applies to token trees; set 'tree' (e.g. {\"budget\": 4}) or drop it")
    if hf_config is not None and cfg.tree is not None and cfg.tree.builder == "c2t":
        from vllm_adaspec.heads.c2t import load_c2t

        load_c2t(head)  # the classifier must exist for this exit head and match it (errors name the fix)
    if exit_layer is None:
        exit_layer = max(1, num_layers // 4)
    if not 1 <= exit_layer < num_layers:
        raise _fail(
            "exit_layer",
            f"must satisfy 1 <= exit_layer < {num_layers} (the model has {num_layers} layers), got {exit_layer}",
        )
    return ResolvedConfig(exit_layer=exit_layer, num_layers=num_layers, num_speculative_tokens=k, policy=cfg.policy,
                          policy_params=cfg.policy_params,
                          exit_head=head, cost_model=cfg.cost_model, exit_head_setting=cfg.exit_head,
                          tree=cfg.tree, acceptance=cfg.acceptance)


def _check_k(num_speculative_tokens) -> int:
    if num_speculative_tokens is None:
        raise AdaspecConfigError("speculative_config['num_speculative_tokens'] is required (K, the most drafts per step)")
    if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int):
        raise AdaspecConfigError(
            f"speculative_config['num_speculative_tokens'] must be an integer, got {num_speculative_tokens!r}")
    if num_speculative_tokens < 1:
        raise AdaspecConfigError(f"speculative_config['num_speculative_tokens'] must be >= 1, got {num_speculative_tokens}")
    return num_speculative_tokens


# Policies that need the drafter's own distribution (entropy, top probability, a predictor) have nothing to read
# in a model-free proposer.
MODEL_FREE_POLICIES = ("fixed", "thompson-beta")


def _resolve_multi_branch(cfg: AdaspecConfig, num_layers: int, k: int) -> ResolvedConfig:
    """MultiBranchProposer: model-free, any architecture vLLM runs; every proposal is a tree of at most
    tree.budget nodes (default K)."""
    if cfg.policy not in MODEL_FREE_POLICIES:
        raise _fail("policy", f"{cfg.policy!r} reads a drafting model's distribution, which MultiBranchProposer does "
                              f"not have; use one of {', '.join(MODEL_FREE_POLICIES)}")
    # Default budget: what K leaves after the branch rows, at most DEFAULT_BUDGET.
    tree = cfg.tree or TreeSettings(budget=max(1, min(k - cfg.branches * cfg.branch_length, DEFAULT_BUDGET)))
    if tree.budget > k:
        raise AdaspecConfigError(
            f"additional_config['{SECTION}']['tree']['budget'] = {tree.budget} needs "
            f"speculative_config['num_speculative_tokens'] >= {tree.budget} (every tree node is a draft vLLM "
            f"verifies), got {k}")
    rows = tree.budget + cfg.branches * cfg.branch_length
    if cfg.branches and rows > k:
        raise AdaspecConfigError(
            f"additional_config['{SECTION}']: branches * branch_length + tree budget = {cfg.branches} * "
            f"{cfg.branch_length} + {tree.budget} = {rows} rows per request, more than the "
            f"speculative_config['num_speculative_tokens'] = {k} draft slots the scheduler reserves; raise "
            f"num_speculative_tokens to {rows} or shrink branches / branch_length / tree.budget")
    if rows > MAX_DRAFTS:
        raise AdaspecConfigError(
            f"additional_config['{SECTION}']: branches * branch_length + tree budget = {rows}, but vLLM verifies at "
            f"most {MAX_DRAFTS} drafts per request")
    pools = cfg.pools + (("branches",) if cfg.branches and "branches" not in cfg.pools else ())
    if "suffix" in cfg.pools:
        from vllm_adaspec.pools.suffix import suffix_available

        if not suffix_available():
            raise _fail("pools", "'suffix' needs the package arctic-inference==0.1.1, which is not installed (its "
                                 "sdist must be built against the installed torch: scripts/setup.sh shows how); "
                                 "remove 'suffix' from pools to run without it")
    return ResolvedConfig(exit_layer=0, num_layers=num_layers, num_speculative_tokens=k, policy=cfg.policy,
                          policy_params=cfg.policy_params, cost_model=cfg.cost_model, exit_head_setting="none",
                          tree=tree, pools=pools, pools_given=cfg.pools_given, corpus=cfg.corpus, medusa=cfg.medusa,
                          acceptance=cfg.acceptance, branches=cfg.branches, branch_length=cfg.branch_length,
                          branch_init=cfg.branch_init)


DEFAULT_BUDGET = 16  # MultiBranchProposer's node budget when `tree` is not given (capped at K)
