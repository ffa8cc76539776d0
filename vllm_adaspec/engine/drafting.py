"""Run the target's own first N decoder layers on a batch of draft tokens, inside vLLM.

Each call is one draft step: one token per drafting request at its position. Attention reads the prefix KV of
layers < N straight from vLLM's paged cache (the target computed it; nothing is recomputed or copied) and
writes the new token's KV into the slot the next verification will overwrite anyway (the scheduler reserves
these lookahead slots, see scheduler.py). So one draft step costs about N/L of a target decode step.

A draft layer reading the target's features (engine/exit_head.py) runs no target layer: a draft step is its input
map, its one layer and the head; `feed` writes its KV for the tokens each step commits.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from vllm_adaspec.config import AdaspecConfigError
from vllm_adaspec.engine.vllm_surface import vllm_object

set_forward_context = vllm_object("set_forward_context")
CommonAttentionMetadata = vllm_object("CommonAttentionMetadata")


class TargetPrefix:
    """The target model's embedding + first `num_layers` decoder layers (+ a trained exit), callable on drafts."""

    def __init__(self, target_model: torch.nn.Module, num_layers: int, vllm_config, trained_exit=None):
        inner = getattr(target_model, "model", None)
        missing = [a for a in ("embed_tokens", "layers", "norm") if not hasattr(inner, a)]
        if inner is None or missing or not hasattr(target_model, "compute_logits"):
            raise AdaspecConfigError(
                f"vllm_adaspec: {type(target_model).__name__} does not expose model.embed_tokens/layers/norm and "
                "compute_logits; early-exit drafting cannot run on it"
            )
        self.model = target_model
        self.inner = inner
        self.layers = list(inner.layers[:num_layers])
        self.exit = trained_exit  # engine/exit_head.TrainedExit or None (untrained exit)
        self.reads_features = trained_exit is not None and trained_exit.reads_features
        self.layer_names = [layer.self_attn.attn.layer_name for layer in self.layers]
        if trained_exit is not None:
            self.layer_names += trained_exit.layer_names
        self.vllm_config = vllm_config
        self.runner = None
        self.runtime = None  # runtime/base.TreeRuntime: tree drafting's mask goes there
        self.gid = None  # the KV-cache group of our layers, once found

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B] -> [B, H] the target's token embeddings. With one rank, a plain row lookup: vLLM's embedding module
        masks ids through a torch.compile'd function (for tensor parallelism), which costs a compile of ~1.5 s on the
        first draft pass of a process and a guard check on every call."""
        emb = self.inner.embed_tokens
        if self.vllm_config.parallel_config.tensor_parallel_size == 1 and isinstance(emb.weight, torch.Tensor):
            return F.embedding(tokens, emb.weight)
        return emb(tokens)

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def bind(self, runner, runtime=None) -> None:
        """The model runner whose KV cache and block tables the drafts use, and the worker's tree runtime."""
        self.runner, self.runtime, self.gid = runner, runtime, None

    def ensure_attached(self) -> None:
        """Find the KV-cache group and metadata builders of our layers (they exist once the KV cache does)."""
        if self.gid is not None:
            return
        runner = self.runner
        groups = runner.kv_cache_config.kv_cache_groups
        gids = {gid for gid, g in enumerate(groups) if set(self.layer_names) & set(g.layer_names)}
        if len(gids) != 1:
            raise AdaspecConfigError(
                f"vllm_adaspec: the first {len(self.layers)} layers span {len(gids)} KV-cache groups; need exactly one"
            )
        self.gid = gids.pop()
        self.builders = []  # (builder, [layer names it serves])
        for attn_group in runner.attn_groups[self.gid]:
            names = [n for n in attn_group.layer_names if n in self.layer_names]
            if names:
                self.builders.append((attn_group.get_metadata_builder(), names))
        self.block_size = groups[self.gid].kv_cache_spec.block_size

    def block_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Block-table rows of the drafting requests [B, max_blocks]; gathered once per propose call."""
        table = self.runner.input_batch.block_table[self.gid].get_device_tensor(self.runner.input_batch.num_reqs)
        return table[rows]

    def forward(self, blocks: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, max_seq_len: int,
                slot_positions: torch.Tensor | None = None, tree_mask=None, features: torch.Tensor | None = None):
        """One draft step through the first N layers.

        blocks [B, max_blocks] (from block_rows), tokens [B], positions [B] (RoPE); max_seq_len: an upper bound
        on the rows' slot positions + 1, passed in so no device->host sync is needed. Tree drafting: the rows'
        KV go to `slot_positions` [B] (default: positions) and attention follows `tree_mask`
        (step.DraftMask). A draft layer reads `features` [B, H] (the feature of the token before each row's).
        Returns (hidden, residual), each [B, H].
        """
        b = tokens.shape[0]
        at = positions if slot_positions is None else slot_positions
        slots = blocks.gather(1, (at // self.block_size).unsqueeze(1)).squeeze(1).long() * self.block_size + (
            at % self.block_size
        )
        seq_lens = (at + 1).to(torch.int32)
        qsl_cpu = torch.arange(b + 1, dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=qsl_cpu.to(tokens.device),
            query_start_loc_cpu=qsl_cpu,
            seq_lens=seq_lens,
            num_reqs=b,
            num_actual_tokens=b,
            max_query_len=1,
            max_seq_len=max_seq_len,
            block_table_tensor=blocks,
            slot_mapping=slots,
            causal=True,
            positions=positions,
        )
        attn_metadata = {}
        for builder, names in self.builders:
            md = builder.build(common_prefix_len=0, common_attn_metadata=common)
            attn_metadata.update({n: md for n in names})
        slot_mapping = {n: slots for n in self.layer_names}
        drafting = self.runtime.drafting(tree_mask) if self.runtime is not None else contextlib.nullcontext()
        with set_forward_context(attn_metadata, self.vllm_config, num_tokens=b, slot_mapping=slot_mapping), drafting:
            hidden = self.embed(tokens)
            residual = None
            if self.reads_features:
                return self.exit.run_layers(positions, self.exit.input_rows(features, hidden), None)
            feeding = self.exit.feeding if self.exit is not None else False
            if self.exit is not None:
                self.exit.feeding = False  # the hook is for target forwards; here the exit runs explicitly
            try:
                for layer in self.layers:
                    hidden, residual = layer(positions, hidden, residual)
            finally:
                if self.exit is not None:
                    self.exit.feeding = feeding
            if self.exit is not None:
                hidden, residual = self.exit.run_layers(positions, hidden, residual)
        return hidden, residual

    def feed(self, rows: torch.Tensor, counts: list[int], first: torch.Tensor, feats: torch.Tensor,
             input_ids: torch.Tensor, positions: torch.Tensor, batch_rows: torch.Tensor, max_seq_len: int,
             blocks: torch.Tensor | None = None) -> None:
        """A draft layer's KV for the tokens a step committed, from that step's forward: for each request (batch row
        `batch_rows` [R]) its `counts` [R] committed tokens are the forward's rows `rows` [M] (concatenated per
        request, in order); the first of them reads the feature `first` [R, W] (carried from the step before), each
        other `feats` [M, W], the forward's features of the row before it. input_ids, positions: the forward's [N].
        blocks [R, max_blocks]: the requests' block-table rows (default: the batch's rows `batch_rows`)."""
        r, m = len(counts), int(rows.shape[0])
        device = feats.device
        qsl_cpu = torch.zeros(r + 1, dtype=torch.int32)
        qsl_cpu[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int32), 0)
        qsl = qsl_cpu.to(device)
        pos = positions[rows]  # [M]
        heads = qsl[:-1].long()  # each request's first row
        # a request's first row reads the carried feature (none at position 0: a prompt's start, or a
        # preempted request computed again)
        feats[heads] = torch.where((pos[heads] == 0)[:, None], 0, first.to(feats.dtype))
        if blocks is None:
            blocks = self.block_rows(batch_rows)  # [R, max_blocks]
        blk = blocks.repeat_interleave(torch.tensor(counts, device=device), 0)  # [M, max_blocks]
        slots = blk.gather(1, (pos // self.block_size).unsqueeze(1)).squeeze(1).long() * self.block_size + (
            pos % self.block_size)
        seq_lens = (pos[qsl[1:].long() - 1] + 1).to(torch.int32)  # [R] through each request's last row
        common = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl_cpu, seq_lens=seq_lens, num_reqs=r, num_actual_tokens=m,
            max_query_len=max(counts), max_seq_len=max_seq_len, block_table_tensor=blocks, slot_mapping=slots,
            causal=True, positions=pos)
        attn_metadata = {}
        for builder, names in self.builders:
            md = builder.build(common_prefix_len=0, common_attn_metadata=common)
            attn_metadata.update({n: md for n in names})
        with set_forward_context(attn_metadata, self.vllm_config, num_tokens=m,
                                 slot_mapping={n: slots for n in self.layer_names}):
            tokens = input_ids[rows].long()
            self.exit.run_layers(pos, self.exit.input_rows(feats, self.embed(tokens)), None)

    def head(self, hidden: torch.Tensor, residual: torch.Tensor):
        """[B, H] -> (logits [B, V'], vocab [V'] full ids of the logit columns or None when V' is the vocabulary,
        normed [B, H] the hidden state the logits came from).

        Trained exit: its norm + the draft vocabulary's LM-head rows. Untrained: the target's final norm + LM head.
        """
        if self.exit is not None:
            normed, _ = self.exit.norm(hidden, residual)
            return self.exit.logits(normed), self.exit.vocab, normed
        normed, _ = self.inner.norm(hidden, residual)
        return self.model.compute_logits(normed), None, normed

    def exit_kv_layers(self) -> list[str]:
        """Exit-layer attention layers that have KV in the engine's cache config (proof it is engine-owned)."""
        if self.exit is None or self.runner is None or getattr(self.runner, "kv_cache_config", None) is None:
            return []
        groups = self.runner.kv_cache_config.kv_cache_groups
        return [n for n in self.exit.layer_names if any(n in g.layer_names for g in groups)]
