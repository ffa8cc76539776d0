"""A trained EESD exit head inside vLLM: vLLM decoder layer(s) of the target's own class, a norm, and the draft
vocabulary's rows of the LM head.

KV of the exit layer. It is a full attention layer, so it needs keys/values over the whole sequence, computed from
the layer-N hidden states of the tokens. It is built as a vLLM attention layer named `adaspec_exit.layers.{L+j}`
while the drafter loads, so the engine sees it in the model's KV-cache spec: its cache is allocated, accounted in
the memory budget and paged with the same block table as the target's layers (same spec, same group), and
prefix caching / preemption / rollback treat it like any other layer. It is kept up to date incrementally: a
forward hook on target layer N-1 runs the exit layer on h_N of every token the target computes (prompt chunks
and verified drafts), which writes their KV at their slots; draft steps write theirs at the lookahead slots the
next verification overwrites. No prefix is ever recomputed.

A draft layer (`"input": "features"` in the checkpoint: training/draft_layer.py) sits on all L layers and reads the
target's final-normed hidden state instead: its input at position p is fc([norm(f_{p-1}) ; embed(x_p)]), f_{p-1}
being the target's feature of the token before. No hook runs in the target's forward: at each propose call the
drafter writes its KV for the tokens the step committed, from the forward's own hidden states (engine/drafting.py
`feed`), then drafts with each step's output as the next step's feature. A layer trained on fused features
(`"feature_layers"`: EAGLE-3's low / middle / high depths, then L) reads, for a committed token, the residual streams
after those layers beside the final state: vLLM's model returns them from the same forward as EAGLE-3's auxiliary
hidden states (engine/runner_hooks.py asks for them before the graph compiles), each is normed and the fuse map
makes one feature of them.

A draft layer's weights (its input maps, its layer's linears, its head) run as int8 rows with a scale each
(`draft_weights: "int8"`, the default on CPU: kernels/int8_linear.py) on calls of a few rows: a pass at batch 1 reads
every weight once, so its time is their bytes. Calls with more rows keep the float weights. Only drafts change.
"""

from __future__ import annotations

import copy
import logging
import time

import torch

from vllm_adaspec.config import AdaspecConfigError
from vllm_adaspec.engine.vllm_surface import vllm_object
from vllm_adaspec.kernels.int8_linear import Int8Rows, few_rows, int8_available, int8_linear
from vllm_adaspec.training.layers import rms_norm

logger = logging.getLogger("vllm_adaspec")

PREFIX = "adaspec_exit.layers"
_STACKED = {".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v"),
            ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}


def _new_decoder_layer(target_model, vllm_config, index: int):
    """One decoder layer of the target's own class at layer index `index` (past the target's last).

    Built under the model's dtype as torch's default, as vLLM builds the model itself: the drafter loads after the
    model, when the default is float32 again, and a layer built then keeps float32 weights in a bfloat16 / float16
    model. On CPU its GEMMs are then prepared for float32 weights and fed half-precision activations, which gives
    garbage (the shipped head accepted 1 draft in 249 in bfloat16)."""
    set_current_vllm_config = vllm_object("set_current_vllm_config")
    LlamaDecoderLayer = vllm_object("LlamaDecoderLayer")
    Qwen2DecoderLayer = vllm_object("Qwen2DecoderLayer")
    set_default_torch_dtype = vllm_object("set_default_torch_dtype")

    cls = type(target_model.model.layers[0])
    hf = copy.copy(vllm_config.model_config.hf_text_config)
    if getattr(hf, "layer_types", None):  # per-layer attention types are indexed by layer index
        hf.layer_types = list(hf.layer_types) + [hf.layer_types[-1]] * (index + 1 - len(hf.layer_types))
    prefix = f"{PREFIX}.{index}"
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(vllm_config.model_config.dtype):
        if issubclass(cls, LlamaDecoderLayer):
            layer = cls(vllm_config=vllm_config, prefix=prefix, config=hf)
        elif issubclass(cls, Qwen2DecoderLayer):
            layer = cls(config=hf, cache_config=vllm_config.cache_config, quant_config=vllm_config.quant_config,
                        prefix=prefix)
        else:
            raise AdaspecConfigError(f"vllm_adaspec: trained exit heads are not supported for {cls.__name__}")
    return layer


def _load_layer_weights(layer, tensors: dict[str, torch.Tensor], j: int) -> None:
    params = dict(layer.named_parameters())
    prefix = f"layers.{j}."
    for name, w in tensors.items():
        if not name.startswith(prefix):
            continue
        local = name[len(prefix):]
        shard = None
        for old, (new, sid) in _STACKED.items():
            if old in local:
                local, shard = local.replace(old, new), sid
                break
        if local not in params:
            raise AdaspecConfigError(f"exit head tensor {name} has no place in {type(layer).__name__}")
        p = params[local]
        loader = getattr(p, "weight_loader", None)
        w = w.to(p.dtype)
        if shard is not None:
            loader(p, w, shard)
        elif loader is not None:
            loader(p, w)
        else:
            p.data.copy_(w)


def _head_dtype(rows: torch.Tensor, reps: int = 20) -> torch.dtype:
    """The dtype the draft head's GEMM runs in: bfloat16 where the weights are float32 on a CPU that multiplies
    bfloat16 faster (a draft pass reads the head's [V', H] rows from memory every time: half the bytes, and CPUs
    with AVX-512 BF16 or AMX multiply them natively; 0.2 against 1.0 ms for 8192 x 576 on one row on an EPYC), else
    the weights' own.
    Only drafts change, and drafts never change the output. Timed here on the machine, not guessed."""
    if rows.device.type != "cpu" or rows.dtype != torch.float32:
        return rows.dtype
    x = torch.zeros(4, rows.shape[1])
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        w, xi = rows.to(dtype), x.to(dtype)
        torch.nn.functional.linear(xi, w)
        t = time.perf_counter()
        for _ in range(reps):
            torch.nn.functional.linear(xi, w)
        seconds[dtype] = time.perf_counter() - t
    return torch.bfloat16 if seconds[torch.bfloat16] < 0.8 * seconds[torch.float32] else torch.float32


class _Int8OrDense:
    """A vLLM linear's method: int8 rows on calls of a few rows, the layer's own method (its float weight) else."""

    def __init__(self, dense, rows: Int8Rows):
        self.dense, self.rows = dense, rows

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if few_rows(x):
            return int8_linear(x, self.rows, bias)
        return self.dense.apply(layer, x, bias)

    def __getattr__(self, name):  # anything else vLLM asks of a linear's method
        return getattr(self.dense, name)


def _cpu_kernels(layer) -> None:
    """Dispatch the vLLM custom ops of a draft layer (norms, rotary embedding, activation) to their CPU kernels.

    In compiled mode vLLM turns its custom ops off, for inductor to fuse their torch code into the target's graph. A
    draft layer runs outside that graph, where an op turned off runs its torch code eagerly, some of it behind a
    torch.compile of its own (SiluAndMul: a guard check and a graph call, ~0.3 ms a pass for a [1, 3072] product).
    Only this layer's modules change; vLLM's record of which ops are on is left alone."""
    CustomOp = vllm_object("CustomOp")
    for m in layer.modules():
        if isinstance(m, CustomOp):
            m._forward_method = m.forward_cpu


def _linear(x: torch.Tensor, weight: torch.Tensor, rows: Int8Rows | None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T, with int8 rows where there are some and the call has few rows."""
    if rows is not None and few_rows(x):
        return int8_linear(x, rows)
    return torch.nn.functional.linear(x.to(weight.dtype), weight).to(x.dtype)


class TrainedExit:
    """Exit layers + norm + draft-vocabulary head, and the hook that keeps the exit layers' KV current."""

    def __init__(self, target_model, vllm_config, folder: str, exit_layer: int, draft_weights: str = "float"):
        RMSNorm = vllm_object("RMSNorm")
        LinearBase = vllm_object("LinearBase")
        process_weights_after_loading = vllm_object("process_weights_after_loading")

        from vllm_adaspec.heads import check_against_model, load_exit_head

        hf = vllm_config.model_config.hf_text_config
        meta, tensors = load_exit_head(folder)
        num_layers = hf.num_hidden_layers
        params = dict(target_model.named_parameters())
        check_against_model(meta, folder, hf, exit_layer, get_weights=params.__getitem__)  # raises on mismatch
        if vllm_config.parallel_config.tensor_parallel_size > 1:
            raise AdaspecConfigError("vllm_adaspec: trained exit heads need tensor_parallel_size == 1 for now")
        device = next(target_model.parameters()).device
        dtype = vllm_config.model_config.dtype
        self.meta = meta
        self.reads_features = meta.get("input") == "features"
        # int8 rows for a draft layer only: an exit layer on h_N also runs inside the target's compiled forward
        # (the hook below), where a branch on the row count would be traced once
        self.int8 = draft_weights == "int8" and self.reads_features and int8_available(device)
        self.layers = []
        for j in range(meta["num_exit_layers"]):
            layer = _new_decoder_layer(target_model, vllm_config, num_layers + j).to(device)
            _load_layer_weights(layer, tensors, j)
            linears = [m for m in layer.modules() if isinstance(m, LinearBase)]
            rows = [Int8Rows.of(m.weight) for m in linears] if self.int8 else []  # before vLLM repacks the weights
            process_weights_after_loading(layer, vllm_config.model_config, device)
            for m, r in zip(linears, rows):
                m.quant_method = _Int8OrDense(m.quant_method, r)
            if self.reads_features and device.type == "cpu":  # (an exit layer on h_N is traced into the target's graph)
                _cpu_kernels(layer)
            self.layers.append(layer)
        self.norm = RMSNorm(hf.hidden_size, eps=hf.rms_norm_eps).to(device=device, dtype=dtype)
        self.norm.weight.data.copy_(tensors["norm.weight"].to(dtype))
        self.vocab = tensors["draft_vocab"].to(device)  # [V'] full ids
        if "lm_head.weight" in tensors:
            self.head_rows = tensors["lm_head.weight"].to(device, dtype)
        else:  # shared: the target's own LM head rows (a copy: [V', H] contiguous for one GEMM)
            self.head_rows = target_model.lm_head.weight[: hf.vocab_size][self.vocab].detach().clone()
        self.head_int8 = Int8Rows.of(self.head_rows) if self.int8 else None
        self.head_rows = self.head_rows.to(_head_dtype(self.head_rows))
        self.layer_names = [layer.self_attn.attn.layer_name for layer in self.layers]
        # a draft layer on several depths (EAGLE-3's fused features): the residual streams of these target layers
        # come with every forward (vLLM's auxiliary hidden states), before the last layer's final-normed state
        self.aux_layers, self.feature_width = (), hf.hidden_size
        if self.reads_features:
            layers = tuple(meta.get("feature_layers", [num_layers]))
            if list(layers) != sorted(set(layers)) or not 1 <= layers[0] or layers[-1] != num_layers:
                raise AdaspecConfigError(f"vllm_adaspec: exit head {folder} reads features of layers {list(layers)}; "
                                         f"they must rise from 1 or more to the last ({num_layers})")
            self.aux_layers, self.feature_width = layers[:-1], hf.hidden_size * len(layers)
            self.fuse_int8 = None
            if self.aux_layers:
                self.part_norm = tensors["input.part_norm.weight"].to(device, dtype)  # [n, H]
                self.fuse_weight = tensors["input.fuse.weight"].to(device, dtype)  # [H, n * H]
                self.fuse_int8 = Int8Rows.of(self.fuse_weight) if self.int8 else None
            self.fc_weight = tensors["input.fc.weight"].to(device, dtype)  # [H, 2H]
            self.fc_int8 = Int8Rows.of(self.fc_weight) if self.int8 else None
            self.feat_norm = RMSNorm(hf.hidden_size, eps=hf.rms_norm_eps).to(device=device, dtype=dtype)
            self.feat_norm.weight.data.copy_(tensors["input.feat_norm.weight"].to(dtype))
            self.feeding = True  # whether the current step's committed rows get fed (EarlyExitDrafter._feed)
            self._hook = None
        else:
            self.feeding = True
            self._hook = target_model.model.layers[exit_layer - 1].register_forward_hook(self._feed,
                                                                                          with_kwargs=True)
        logger.info("vllm_adaspec: exit head %s (N=%d, %d exit layer(s), draft vocabulary %d, %s weights)", folder,
                    exit_layer, len(self.layers), len(self.vocab), "int8" if self.int8 else "float")

    def _feed(self, module, args, kwargs, output):
        """After target layer N-1: write the exit layers' KV for every token of this target forward.

        Under torch.compile this hook is traced into the target's graph (once: vLLM compiles without guards), so it
        holds no branch on what changes per step: a dummy or profiling forward (no attention metadata) runs the exit
        layers too, and their attention, like every vLLM attention layer, writes nothing without metadata. The one
        branch, `feeding`, is a setting the trace reads once: early exit pauses the feed only in eager mode
        (proposers/early_exit.py), and draft passes, which clear it, run the layers eagerly."""
        if not self.feeding:
            return None
        positions = args[0] if args else kwargs["positions"]
        hidden, residual = output
        h = hidden + residual if residual is not None else hidden.clone()  # never touch the target's tensors
        self.run_layers(positions, h, None)
        return None

    def input_rows(self, features: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """A draft layer's input: features [B, H] (the target's final-normed state of the token before, or the
        layer's own output for a drafted one) or [B, n * H] (the target's features at n depths: each normed, then
        fused), embeds [B, H] (the token's embedding) -> [B, H]."""
        if features.shape[-1] != embeds.shape[-1]:
            parts = features.unflatten(-1, (len(self.part_norm), -1))  # [B, n, H]
            # (the trainer's norm: the engine drafts with the numerics the layer was trained with)
            parts = rms_norm(parts, self.part_norm, self.feat_norm.variance_epsilon)
            features = _linear(parts.flatten(-2), self.fuse_weight, self.fuse_int8)
        return _linear(torch.cat([self.feat_norm(features), embeds], -1), self.fc_weight, self.fc_int8)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """normed [B, H] -> float32 logits over the draft vocabulary [B, V']."""
        return _linear(normed, self.head_rows, self.head_int8).float()

    def run_layers(self, positions, hidden, residual):
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return hidden, residual


def load_trained_exit(target_model, vllm_config, folder: str | None, exit_layer: int, setting: str,
                      draft_weights: str = "float"):
    """TrainedExit, or None for the untrained exit. `setting` is the user's `exit_head` ("auto", "none" or a
    folder). A shipped head picked by "auto" that does not fit the loaded weights falls back to the untrained exit
    with a warning; an explicitly named one fails start-up."""
    if folder is None:
        if setting == "auto":
            logger.warning("vllm_adaspec: no exit head ships for this model%s; drafting with the untrained exit "
                           "(final norm + LM head on h_N), which drafts poorly. Train one: `adaspec distill` then "
                           "`adaspec train exit-layer`", f" with exit_layer={exit_layer}" if exit_layer else "")
        return None
    try:
        return TrainedExit(target_model, vllm_config, folder, exit_layer, draft_weights)
    except AdaspecConfigError as e:
        if setting not in ("auto", "none"):
            raise
        logger.warning("vllm_adaspec: not using the shipped exit head (%s); drafting with the untrained exit", e)
        return None


def load_calibration(folder: str | None, policy: str, device):
    """thompson-cali's acceptance predictor from the exit head folder (checked against that head), on `device`."""
    from vllm_adaspec.heads import check_calibration
    from vllm_adaspec.policies.calibration import CalibrationPredictor

    check_calibration(folder, policy)
    return CalibrationPredictor.load(folder).to(device)
