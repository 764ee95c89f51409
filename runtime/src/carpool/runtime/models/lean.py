"""carpool's own step for Llama-family decoders: transformers' arithmetic in fewer operators.

transformers' Llama runs about forty operators per layer for a step (three projections where one
would do, rotary embeddings recomputed per layer, masks, views and casts for a batch layout this engine
does not use), each a few microseconds of Python and dispatch whatever its size; on a small model at 16
decoding rows that was a third of the step (bench.step, bench/RESULTS.md). `LeanDecoder` runs the same
model, with the same weights (views, not copies), over the step's row of tokens laid end to end:

- q, k and v in one matmul, gate and up in one matmul (their weights concatenated once, at load; the
  model's own `q_proj`/`k_proj`/... weights become views of the fused ones, so memory is not doubled);
- rotary cos/sin computed once per step by the model's own `rotary_emb` (so every RoPE scaling type it
  knows is honoured), applied to q and k together with one `roll`;
- each layer's new keys and values written to the paged pools with one `index_copy_` each;
- attention by `paged.attend_segments`, as transformers' forward gets it from `paged.paged_attention`;
- the final norm and `lm_head` only on the rows that sample.

Norms are the model's own modules, and everything else follows transformers' order of operations, so
float32 logits equal transformers' to rounding.

Projections that are not plain `nn.Linear` (4-bit and 8-bit layers, LoRA-wrapped layers) are called as
modules, one per projection, with the same input tensor, so quantization and multi-LoRA work unchanged.
`supports` says which models take this path; the rest keep transformers' forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from carpool.runtime.models.paged import PagedKVCache, Segments, attend_segments, sliding_window

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
"""Decoders whose layers are Llama's: RMSNorm, q/k/v/o projections with rotary q and k, SiLU-gated MLP."""


def supports(model: nn.Module) -> str | None:
    """None when `model` can run on `LeanDecoder`; otherwise why not (for the log)."""
    name = type(model).__name__
    if name not in SUPPORTED:
        return f"{name} is not one of {', '.join(SUPPORTED)}"
    config: Any = model.config
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act}"
    if sliding_window(config) is not None:
        return "sliding-window attention"
    if getattr(config, "mlp_bias", False):
        return "an MLP with biases"
    inner: Any = model.model
    layer = inner.layers[0]
    for part in ("input_layernorm", "post_attention_layernorm"):
        if not isinstance(getattr(layer, part, None), nn.Module):
            return f"its layers have no {part}"
    if hasattr(layer.self_attn, "q_norm"):
        return "q/k norms"
    return None


Projection = Callable[[torch.Tensor], Sequence[torch.Tensor]]


def _fused(modules: Sequence[nn.Module]) -> Projection:
    """One matmul for sibling projections of the same input, when all are plain `nn.Linear`; the
    modules' weights become views of the fused weight. Otherwise each module is called."""
    plain = all(type(m) is nn.Linear for m in modules)
    if plain:
        linears = [m for m in modules if isinstance(m, nn.Linear)]
        weight = torch.cat([m.weight.detach() for m in linears])
        biases = [m.bias for m in linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [
                    b.detach() if b is not None else weight.new_zeros(m.out_features)
                    for m, b in zip(linears, biases, strict=True)
                ]
            )
        sizes = [m.out_features for m in linears]
        start = 0
        for m, size in zip(linears, sizes, strict=True):
            m.weight = nn.Parameter(weight[start : start + size], requires_grad=False)
            if bias is not None and m.bias is not None:
                m.bias = nn.Parameter(bias[start : start + size], requires_grad=False)
            start += size

        def fused(x: torch.Tensor) -> Sequence[torch.Tensor]:
            return torch.split(F.linear(x, weight, bias), sizes, dim=-1)

        return fused

    def each(x: torch.Tensor) -> Sequence[torch.Tensor]:
        return [m(x) for m in modules]

    return each


@dataclass
class _Layer:
    input_norm: nn.Module
    post_norm: nn.Module
    qkv: Projection
    o_proj: nn.Module
    gate_up: Projection
    down_proj: nn.Module


class LeanDecoder:
    """The step of a Llama-family `model` over `cache`'s pools (see the module docstring)."""

    def __init__(self, model: nn.Module, cache: PagedKVCache) -> None:
        config: Any = model.config
        inner: Any = model.model
        self.cache = cache
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.half = self.head_dim // 2
        self.scaling = float(getattr(inner.layers[0].self_attn, "scaling", self.head_dim**-0.5))
        self.embed: nn.Module = inner.embed_tokens
        self.rotary: nn.Module = inner.rotary_emb
        self.final_norm: nn.Module = inner.norm
        self.lm_head: nn.Module = model.lm_head  # type: ignore[assignment]
        self.layers: list[_Layer] = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    input_norm=layer.input_layernorm,
                    post_norm=layer.post_attention_layernorm,
                    qkv=_fused([attn.q_proj, attn.k_proj, attn.v_proj]),
                    o_proj=attn.o_proj,
                    gate_up=_fused([mlp.gate_proj, mlp.up_proj]),
                    down_proj=mlp.down_proj,
                )
            )

    def rotary_tables(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [tokens, 1, head_dim] for `x * cos + roll(x, half) * sin`, which is
        transformers' `x * cos + rotate_half(x) * sin`."""
        cos, sin = self.rotary(like, positions[None, :])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]
        signed = torch.cat([-sin[..., : self.half], sin[..., self.half :]], dim=-1)
        return cos, signed

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        segments: Segments,
        keep: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [len(keep), vocab] of the step's row of `tokens` at `positions` ([T] each); the new
        keys and values go to `cache.write_slots`."""
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        count = tokens.shape[0]
        hidden = self.embed(tokens)
        cos, sin = self.rotary_tables(positions, hidden)
        write = self.cache.write_slots
        for index, layer in enumerate(self.layers):
            x = layer.input_norm(hidden)
            q, k, v = layer.qkv(x)
            qk = torch.cat([q.view(count, heads, dim), k.view(count, kv_heads, dim)], dim=1)
            qk = torch.addcmul(qk * cos, qk.roll(self.half, dims=-1), sin)
            query, key = torch.split(qk, [heads, kv_heads], dim=1)
            keys, values = self.cache.keys[index], self.cache.values[index]
            keys.index_copy_(0, write, key)
            values.index_copy_(0, write, v.view(count, kv_heads, dim))
            attended = attend_segments(query, keys, values, segments, self.scaling)
            hidden = hidden + layer.o_proj(attended.view(count, heads * dim))
            x = layer.post_norm(hidden)
            gate, up = layer.gate_up(x)
            hidden = hidden + layer.down_proj(F.silu(gate) * up)
        last = hidden.index_select(0, keep)
        logits: torch.Tensor = self.lm_head(self.final_norm(last))
        return logits
