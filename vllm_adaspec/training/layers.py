"""A Llama / Qwen2 decoder stack in plain torch, for training the exit layer without vLLM.

Same maths as vLLM's and transformers' `LlamaDecoderLayer` / `Qwen2DecoderLayer` (pre-norm, RoPE with the
rotate-half convention, grouped-query attention, SwiGLU MLP; Qwen2 adds q/k/v biases). Parameter names follow
the Hugging Face checkpoints (`self_attn.q_proj.weight`, ...), so weights load from and save to that layout.
Used to compute h_N (the target's first N layers, frozen) and as the trainable exit layer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LayerShape", "DecoderLayer", "ExitHead", "read_hf_tensors", "target_prefix_layers", "rms_norm"]


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    rope_theta: float
    qkv_bias: bool

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "LayerShape":
        scaling = cfg.get("rope_scaling") or {}
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ValueError(f"rope_scaling {scaling} is not supported by the exit-layer trainer")
        theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        heads = cfg["num_attention_heads"]
        arch = (cfg.get("architectures") or [""])[0]
        return cls(hidden=cfg["hidden_size"], heads=heads, kv_heads=cfg.get("num_key_value_heads", heads),
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, intermediate=cfg["intermediate_size"],
                   eps=cfg["rms_norm_eps"], rope_theta=float(theta),
                   qkv_bias=arch.startswith("Qwen2") or bool(cfg.get("attention_bias", False)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [B, T, h, d], positions [B, T] -> x rotated (first half / second half pairing, as Llama in HF)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.float()[..., None] * inv_freq  # [B, T, d/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, :, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, :, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, s: LayerShape):
        super().__init__()
        self.s = s
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(s.hidden, s.heads * s.head_dim, bias=s.qkv_bias)
        self.self_attn.k_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=s.qkv_bias)
        self.self_attn.v_proj = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=s.qkv_bias)
        self.self_attn.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.mlp.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.mlp.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.ones(s.hidden))
        self.post_attention_layernorm = nn.Module()
        self.post_attention_layernorm.weight = nn.Parameter(torch.ones(s.hidden))

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """h [B, T, H] residual stream, positions [B, T] -> [B, T, H]; causal over T (right padding is harmless)."""
        s, a = self.s, self.self_attn
        b, t, _ = h.shape
        x = rms_norm(h, self.input_layernorm.weight, s.eps)
        q = rope(a.q_proj(x).view(b, t, s.heads, s.head_dim), positions, s.rope_theta)
        k = rope(a.k_proj(x).view(b, t, s.kv_heads, s.head_dim), positions, s.rope_theta)
        v = a.v_proj(x).view(b, t, s.kv_heads, s.head_dim)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=s.kv_heads != s.heads)  # [B, heads, T, d]
        h = h + a.o_proj(o.transpose(1, 2).reshape(b, t, s.heads * s.head_dim))
        x = rms_norm(h, self.post_attention_layernorm.weight, s.eps)
        m = self.mlp
        return h + m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))


class ExitHead(nn.Module):
    """EESD's early-exiting layer(s) + RMSNorm on top of h_N. The LM head (shared) is applied outside."""

    def __init__(self, s: LayerShape, num_layers: int = 1):
        super().__init__()
        self.s = s
        self.layers = nn.ModuleList(DecoderLayer(s) for _ in range(num_layers))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(s.hidden))

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(h, positions)
        return rms_norm(h, self.norm.weight, self.s.eps)


def read_hf_tensors(model_dir: str, names: list[str]) -> dict[str, torch.Tensor]:
    """Named tensors from a Hugging Face folder's safetensors files (float32 on CPU)."""
    from safetensors import safe_open

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            where = json.load(f)["weight_map"]
    else:
        where = {}
    files: dict[str, list[str]] = {}
    for n in names:
        files.setdefault(where.get(n, "model.safetensors"), []).append(n)
    out = {}
    for fn, group in files.items():
        with safe_open(os.path.join(model_dir, fn), framework="pt") as f:
            have = set(f.keys())
            for n in group:
                if n not in have:
                    raise KeyError(f"{n} not in {os.path.join(model_dir, fn)}")
                out[n] = f.get_tensor(n).float()
    return out


def layer_tensor_names(i: int, qkv_bias: bool) -> list[str]:
    p = f"model.layers.{i}."
    names = [p + n + ".weight" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                         "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                                         "input_layernorm", "post_attention_layernorm")]
    if qkv_bias:
        names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
    return names


def load_layer(layer: DecoderLayer, model_dir: str, i: int) -> DecoderLayer:
    """Copy target layer i's weights into `layer`."""
    t = read_hf_tensors(model_dir, layer_tensor_names(i, layer.s.qkv_bias))
    prefix = f"model.layers.{i}."
    layer.load_state_dict({k[len(prefix):]: v for k, v in t.items()}, strict=True)
    return layer


class PrefixStack(nn.Module):
    """The target's embedding + first N layers (frozen): token ids -> h_N."""

    def __init__(self, embed: torch.Tensor, layers: list[DecoderLayer]):
        super().__init__()
        self.embed = nn.Embedding.from_pretrained(embed, freeze=True)
        self.layers = nn.ModuleList(layers)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, capture: tuple[int, ...]) -> dict[int, torch.Tensor]:
        """ids, positions [B, T] -> {n: h_n [B, T, H]} for each n in capture (n = layers run)."""
        h = self.embed(ids)
        out = {}
        for i, layer in enumerate(self.layers):
            h = layer(h, positions)
            if i + 1 in capture:
                out[i + 1] = h
        return out


def target_prefix_layers(model_dir: str, num_layers: int) -> PrefixStack:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    s = LayerShape.from_hf_config(cfg)
    embed = read_hf_tensors(model_dir, ["model.embed_tokens.weight"])["model.embed_tokens.weight"]
    layers = [load_layer(DecoderLayer(s), model_dir, i) for i in range(num_layers)]
    stack = PrefixStack(embed, layers).eval()
    for p in stack.parameters():
        p.requires_grad_(False)
    return stack


@torch.inference_mode()
def exit_head_drafts(model_dir: str, head_dir: str, token_ids: list[int], dtype=torch.float32) -> list[int]:
    """Plain-torch reference of a trained exit head: for every position of `token_ids`, the draft (a full token id)
    the head proposes for the next token, computed in `dtype`: the target's first N layers, the exit layer(s), the
    exit norm and the LM-head rows of the draft vocabulary, argmax. What the engine's drafter must reproduce."""
    from vllm_adaspec.heads import load_exit_head

    meta, t = load_exit_head(head_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    s = LayerShape.from_hf_config(cfg)
    stack = target_prefix_layers(model_dir, meta["exit_layer"]).to(dtype)
    head = ExitHead(s, meta["num_exit_layers"])
    head.load_state_dict({k: v for k, v in t.items() if k.startswith(("layers.", "norm."))}, strict=True)
    head = head.eval().to(dtype)
    vocab = t["draft_vocab"].long()
    shared = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"
    rows = t["lm_head.weight"] if "lm_head.weight" in t else read_hf_tensors(model_dir, [shared])[shared][vocab]
    ids = torch.tensor([token_ids])
    positions = torch.arange(len(token_ids))[None]
    h = head(stack(ids, positions, (meta["exit_layer"],))[meta["exit_layer"]], positions)  # [1, T, H]
    logits = h[0] @ rows.to(dtype).T  # [T, V']
    return vocab[logits.float().argmax(-1)].tolist()
