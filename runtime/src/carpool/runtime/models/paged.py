"""The paged KV cache and the attention that reads it, for `GenerationEngine`.

`PagedKVCache` keeps every layer's keys and values in one pool of token slots, handed out in blocks by
the scheduler's `BlockAllocator`. transformers runs the model's own forward pass (any decoder that
routes its keys and values through `Cache.update`, as Llama, Mistral, Qwen and most others do) and
hands the cache's answer to the attention function named by `config._attn_implementation`.

For a model that takes a custom attention function (`install` says whether it did), a whole step is
one forward pass: every decoding token and every prompt chunk laid end to end as one row, and
`paged_attention` attends each `Segment` of that row over its own sequence's slots (`segments`: one
call per sequence, reading its slots in place, or one call for all decoding sequences over a padded
gather of their slots, whichever the engine measured faster at load). A separate forward pass per
prompt chunk read all the weights again. Models that cannot take the custom function gather
with a padded mask and run transformers' SDPA.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from carpool.runtime.models import attention
from carpool.runtime.models.segments import RowSlots, Segment, Segments, attend_segments

__all__ = ["ATTENTION", "PagedKVCache", "RowSlots", "Segment", "Segments", "attend_segments", "install"]

ATTENTION = "carpool_paged"


class PagedKVCache(Cache):
    """Keys and values of all sequences in one pool of token slots per layer.

    Before each forward pass the engine sets `write_slots` (where the new tokens' keys and values go)
    and `read_slots`: which slots each row attends to, padded (the mask hides the padding), or None
    when `paged_attention` reads the pools in place, so `update` returns them untouched.
    """

    def __init__(
        self, layers: int, slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__(layers=[])
        shape = (slots, kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.write_slots = torch.zeros(0, dtype=torch.long, device=device)
        self.read_slots: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, heads, length, dim = key_states.shape
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(0, self.write_slots, key_states.transpose(1, 2).reshape(rows * length, heads, dim))
        values.index_copy_(
            0, self.write_slots, value_states.transpose(1, 2).reshape(rows * length, heads, dim)
        )
        if self.read_slots is None:
            return keys, values
        # index_select copies whole slot rows; advanced indexing (keys[read_slots]) is ~5x slower on CPU
        batch, width = self.read_slots.shape
        flat = self.read_slots.reshape(-1)
        gathered_keys = keys.index_select(0, flat).view(batch, width, heads, dim)
        gathered_values = values.index_select(0, flat).view(batch, width, heads, dim)
        return gathered_keys.transpose(1, 2), gathered_values.transpose(1, 2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly

    def __len__(self) -> int:
        return len(self.keys)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    paged_segments: Segments | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention for one row of sequences laid end to end, each over its own slots of the pool.

    `query` is [1, heads, tokens, dim]; `key` and `value` are a layer's pools [slots, kv_heads, dim].
    Without `paged_segments`, the cache has gathered and this is transformers' SDPA attention.
    """
    if paged_segments is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # [1, heads, tokens, dim] -> [tokens, heads, dim] (a view), and the result back to transformers' layout
    return attend_segments(query[0].transpose(0, 1), key, value, paged_segments, scaling).unsqueeze(0), None


def sliding_window(config: Any) -> int | None:
    """The sliding attention window a decoder's config asks for (keys older than this many tokens are not
    attended), or None where every layer attends to the whole context. Neither decoder's paged attention
    applies a window: the engine caps its context at the window instead, where both are the same."""
    window = getattr(config, "sliding_window", None)
    if not window or not getattr(config, "use_sliding_window", True):
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:  # per-layer attention kinds (Qwen2 and newer configs)
        return int(window) if "sliding_attention" in layer_types else None
    limit = int(getattr(config, "max_position_embeddings", 0) or 0)
    return int(window) if not limit or window < limit else None  # a window over every position is none


attention.register(ATTENTION, paged_attention)


def install(model: PreTrainedModel) -> bool:
    """Make `model` attend with `paged_attention`; False when it cannot take a custom attention function."""
    return attention.use(model, ATTENTION)
