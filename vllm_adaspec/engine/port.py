"""The engine port: everything a drafter may ask of vLLM's model runner, in one narrow object, so that drafters
(vllm_adaspec/proposers/) never see the runner. The runner hooks (engine/runner_hooks.py) fill its feedback during
a step; the drafter reads it once, at its next propose call.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from vllm_adaspec.controls import DEFAULT as DEFAULT_CONTROLS
from vllm_adaspec.controls import ControlError, parse_controls
from vllm_adaspec.engine.grammar import GrammarCopies
from vllm_adaspec.engine.tree_sampler import needs_own_sampler, plain_rows, tree_verifiable
from vllm_adaspec.step import BatchView, RequestTraits, Taps
from vllm_adaspec.engine.vllm_surface import vllm_object


class EnginePort:
    def __init__(self, runner, runtime=None, observers=()):
        self.runner = runner
        self.runtime = runtime  # runtime/base.TreeRuntime when trees can be verified, else None
        self.observers = list(observers)  # vllm_adaspec/observers.py (tests, C2T training data)
        self.taps = Taps()
        self.verified_rows: list[int] | None = None  # drafts each batch row took in the last verification
        self._traits: dict[str, RequestTraits] = {}  # per request, read once (step.RequestTraits)
        # structured-output requests' grammars, copied for token trees (engine/grammar.py)
        self.grammars = GrammarCopies(runner.vllm_config) if runtime is not None else None

    # --- the batch ---
    def view(self, sampled: list, num_tokens: np.ndarray, token_ids: np.ndarray) -> BatchView:
        b = self.runner.input_batch
        return BatchView(b.req_ids, sampled, num_tokens, token_ids, b.num_prompt_tokens, b.temperature_cpu)

    # --- the requests ---
    def traits(self, req_id: str) -> RequestTraits:
        """What the request allows (its per-request controls, controls.py) and needs (engine/tree_sampler.py:
        whether trees can verify it, whether only the tree sampler applies its settings; a structured-output
        request gets a copy of its grammar when trees can be verified), read once."""
        traits = self._traits.get(req_id)
        if traits is None:
            sp = self.sampling_params(req_id)
            try:
                controls = parse_controls(getattr(sp, "extra_args", None))
            except ControlError:  # checked when the request arrived (engine/plugin.py); defaults otherwise
                controls = DEFAULT_CONTROLS
            grammar = getattr(sp, "structured_outputs", None) is not None
            tree = tree_verifiable(sp) and self.grammars is not None
            if tree and grammar:
                tree = self.grammars.start(req_id, sp)
            traits = self._traits[req_id] = RequestTraits(controls, tree, needs_own_sampler(sp), grammar,
                                                          plain_rows(sp))
        return traits

    def forget(self, req_ids) -> None:
        """Finished requests: their traits and grammar copies go."""
        for r in req_ids:
            self._traits.pop(r, None)
        if self.grammars is not None:
            self.grammars.finish(req_ids)

    def sampling_params(self, req_id: str):
        return getattr(self.runner.requests.get(req_id), "sampling_params", None)

    def output(self, row: int) -> list[int]:
        """The committed output tokens of the request at batch row `row` (the tree sampler)."""
        b = self.runner.input_batch
        return b.token_ids_cpu[row, b.num_prompt_tokens[row]:b.num_tokens_no_spec[row]].tolist()

    def grammar_valid(self, req_id: str, output, tokens: list[int], parents: list[int]) -> list[bool] | None:
        """Per candidate node (parents before children): does the request's grammar accept its path, after the
        committed `output` tokens (fed to its copy first). None: no usable copy (the request drafts chains)."""
        if self.grammars is None or not self.grammars.advance(req_id, output):
            return None
        return self.grammars.valid_nodes(req_id, tokens, parents)

    def grammar_rows(self, req_id: str, output, tree) -> "torch.Tensor | None":
        """[n + 1, V] bool: the grammar's next-token mask at each verification row of the request's tree, after the
        committed `output` tokens. None: no usable copy."""
        if self.grammars is None or not self.grammars.advance(req_id, output):
            return None
        return self.grammars.row_masks(req_id, tree.tokens.tolist(), tree.parents.tolist())

    def live(self) -> dict:
        return {"request_traits": len(self._traits), "grammar_copies": len(self.grammars or ())}

    def kv_positions(self) -> int:
        """Token positions the engine's KV cache holds."""
        cfg = self.runner.kv_cache_config
        return cfg.num_blocks * cfg.kv_cache_groups[0].kv_cache_spec.block_size

    @property
    def device(self) -> torch.device:
        return self.runner.device

    # --- what drafters build on the target model (vLLM hands it to their load_model) ---
    def target_prefix(self, target_model, exit_layer: int, exit_head: str, exit_setting: str,
                      draft_weights: str = "float"):
        """The target's first `exit_layer` layers + the exit (trained or not) as a drafter (engine/drafting.py),
        reading the runner's KV cache and block tables and marking its tree steps on the runtime."""
        from vllm_adaspec.engine.drafting import TargetPrefix
        from vllm_adaspec.engine.exit_head import load_trained_exit

        config = self.runner.vllm_config
        trained = load_trained_exit(target_model, config, exit_head, exit_layer, exit_setting, draft_weights)
        runs = 0 if trained is not None and trained.reads_features else exit_layer  # a draft layer runs none
        prefix = TargetPrefix(target_model, runs, config, trained_exit=trained)
        prefix.bind(self.runner, self.runtime)
        return prefix

    @staticmethod
    def acceptance_calibration(exit_head, policy: str, device):
        from vllm_adaspec.engine.exit_head import load_calibration

        return load_calibration(exit_head, policy, device)

    def medusa_heads(self, target_model, folder: str):
        from vllm_adaspec.engine.medusa_heads import load_medusa_heads

        return load_medusa_heads(target_model, self.runner.vllm_config, folder)

    # --- feedback, read once per propose call ---
    def feedback(self) -> tuple[dict, int, Taps, list[int] | None]:
        """(tree results {batch row: (accepted nodes, bonus, branch argmax)}, KV slots compaction moved, taps,
        drafts each batch row took in the last verification or None)."""
        results, moves = self.runtime.take_results() if self.runtime is not None else ({}, 0)
        taps, rows = self.taps, self.verified_rows
        self.taps, self.verified_rows = Taps(), None
        return results, moves, taps, rows

    # --- tree runtime ---
    def drop_trees(self, req_ids) -> None:
        if self.runtime is not None:
            self.runtime.drop(req_ids)

    def held_copy_tokens(self) -> int:
        return self.runtime.held_copy_tokens() if self.runtime is not None else 0

    def tree_copies(self) -> bool:
        """Whether tree requests hold KV copies outside vLLM's cache (the CPU runtime: admission is capped)."""
        return self.runtime is not None and self.runtime.keeps_copies

    def tree_counts(self) -> dict:
        """Trees verified on the device in one batch so far (the GPU runtime's plain trees), and of them sampled; the
        tree kernel's cold launches and fallbacks."""
        rt = self.runtime
        return {"tree_batched": rt.batched_total if rt is not None else 0,
                "tree_batched_sampled": rt.batched_sampled_total if rt is not None else 0,
                # tree-kernel launches of a variant start-up did not compile (a compile while serving), and layers
                # computed by the torch fallback after a failed launch
                "tree_kernel_cold": rt.kernel_cold if rt is not None else 0,
                "tree_kernel_fallbacks": rt.kernel_fallbacks if rt is not None else 0}

    # --- tensor parallelism ---
    @staticmethod
    def from_rank0(value):
        get_tp_group = vllm_object("get_tp_group")

        return get_tp_group().broadcast_object(value, src=0)

    @staticmethod
    def largest_over_ranks(values: list[int]) -> list[int]:
        """Each value's largest over the tensor-parallel ranks (one all-reduce on the host's group: no device
        wait)."""
        import torch.distributed as dist
        get_tp_group = vllm_object("get_tp_group")

        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=get_tp_group().cpu_group)
        return t.tolist()

    @staticmethod
    def tp_rank() -> int:
        get_tp_group = vllm_object("get_tp_group")

        return get_tp_group().rank_in_group

    # --- test instrumentation ---
    def observer_stats(self) -> dict:
        """Copies: in a single-process engine the stats RPC hands back these very objects, and callers diff
        snapshots."""
        out = {}
        for obs in self.observers:
            out.update(obs.stats())
        return copy.deepcopy(out)

    def observer_live(self) -> dict:
        out = {}
        for obs in self.observers:
            out.update(obs.live())
        return out
