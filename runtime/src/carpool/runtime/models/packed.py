"""Unpadded encoder batches: every input of a batch laid end to end in one row, none of it padding.

A padded batch computes `size x longest` tokens; on a device whose cost follows the tokens computed (a
CPU, or a GPU with large batches) a batch of mixed lengths then spends most of its time on padding: 32
inputs of 5-128 tokens are about a third real tokens. `PackedRow` lays the inputs end to end instead, each
with its own position ids, so the embeddings, the projections and the feed-forward layers see only real
tokens, and `packed_attention` (registered with transformers' AttentionInterface) attends each input to
itself alone. The batch then costs what its tokens cost, whatever the mix of lengths, so the batcher
needs no length grouping and can serve inputs in the order they came.

Whether a model can take this is checked, not assumed: `install` switches the model to the attention
function, and `EncoderBatching.enable_packing` compares a packed and a padded forward of the same mixed
batch at load, falling back to padded batches (with a log line) for any model whose outputs differ, for
example one whose position ids are not a plain count from the start of each input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from carpool.runtime.batching import request
from carpool.runtime.models import attention

ATTENTION = "carpool_packed"

# Models whose learned position embeddings start after the padding index (RoBERTa and its descendants
# count positions from padding_idx + 1); every other absolute-position encoder counts from 0.
_POSITIONS_AFTER_PADDING = {"roberta", "xlm-roberta", "camembert", "data2vec-text", "xlm-roberta-xl"}


@dataclass(frozen=True)
class PackedRow:
    """One batch as a single row of tokens, and where each input lies in it."""

    inputs: dict[str, torch.Tensor]
    """Model inputs of shape [1, tokens]: `input_ids`, `position_ids` (and `token_type_ids`)."""
    segments: list[slice]
    """Each input's tokens in the row, in batch order."""
    lengths: torch.Tensor
    """Tokens per input, on the device."""
    segment_ids: torch.Tensor
    """For each token of the row, the index of its input, on the device."""


def position_offset(model_config: Any) -> int:
    """Where the model's position ids start for the first token of an input."""
    if getattr(model_config, "model_type", None) in _POSITIONS_AFTER_PADDING:
        padding = getattr(model_config, "pad_token_id", None)
        return (1 if padding is None else int(padding)) + 1
    return 0


def pack(
    batch: Sequence[Sequence[int]], device: torch.device, token_types: bool, offset: int = 0
) -> PackedRow:
    lengths = [len(ids) for ids in batch]
    segments = []
    start = 0
    for length in lengths:
        segments.append(slice(start, start + length))
        start += length
    input_ids = torch.tensor([token for ids in batch for token in ids], dtype=torch.long)
    length_tensor = torch.tensor(lengths, dtype=torch.long)
    # position of each token within its input: a running count that restarts at every segment
    starts = torch.repeat_interleave(torch.cumsum(length_tensor, 0) - length_tensor, length_tensor)
    position_ids = torch.arange(start, dtype=torch.long) - starts + offset
    inputs = {"input_ids": input_ids.unsqueeze(0), "position_ids": position_ids.unsqueeze(0)}
    if token_types:  # 1 from the second text of a text pair on (`batching.request.TextPair`)
        types = [kind for ids in batch for kind in request.token_types(ids)]
        inputs["token_type_ids"] = torch.tensor(types, dtype=torch.long).unsqueeze(0)
    segment_ids = torch.repeat_interleave(torch.arange(len(lengths)), length_tensor)
    return PackedRow(
        inputs={name: tensor.to(device, non_blocking=True) for name, tensor in inputs.items()},
        segments=segments,
        lengths=length_tensor.to(device, non_blocking=True),
        segment_ids=segment_ids.to(device, non_blocking=True),
    )


def mean_pool(states: torch.Tensor, row: PackedRow) -> torch.Tensor:
    """Mean of each input's token states: [tokens, hidden] -> [inputs, hidden]."""
    sums = torch.zeros(len(row.segments), states.shape[-1], dtype=torch.float32, device=states.device)
    sums.index_add_(0, row.segment_ids, states.float())
    return (sums / row.lengths.unsqueeze(1)).to(states.dtype)


def first_tokens(states: torch.Tensor, row: PackedRow) -> torch.Tensor:
    """Each input's first token state (CLS pooling): [tokens, hidden] -> [inputs, hidden]."""
    return states[[segment.start for segment in row.segments]]


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_segments: list[slice] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Self-attention of each input over its own tokens only; query/key/value are [1, heads, tokens, dim].

    Without `packed_segments` (a padded batch) this is transformers' SDPA attention. Per input, one SDPA
    call on views of the row (no copies); on a GPU that is a small kernel per input and layer, which is
    why packing is the default on CPUs only (see `EncoderBatching`)."""
    if packed_segments is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    out = [
        F.scaled_dot_product_attention(
            query[:, :, segment], key[:, :, segment], value[:, :, segment], scale=scaling
        )[0].transpose(0, 1)
        for segment in packed_segments
    ]
    return torch.cat(out).unsqueeze(0), None


attention.register(ATTENTION, packed_attention)


def install(model: PreTrainedModel) -> bool:
    """Make `model` attend with `packed_attention`; False when it cannot take a custom attention function."""
    return attention.use(model, ATTENTION)
