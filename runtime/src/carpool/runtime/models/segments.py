"""Attention over a generation step's row of sequences, each over its own slots of the paged KV pools.

A step lays every sequence's new tokens end to end in one row: one token for a decoding sequence, several
for a prompt chunk. Each `Segment` of the row attends to its own sequence's slots of a layer's pools.
carpool's own decoder (`lean`) and transformers' forward (through `paged.paged_attention`) both call
`attend_segments` once per layer, with the step's `Segments`. It runs one of two ways, chosen once per
engine by `choose`, which times both on the device at load (as `quant.choose_kernels` times its kernels):

- **per sequence**: one SDPA call per segment, its keys read in place (a view of the pools when the
  sequence's slots are contiguous, as the allocator keeps them where it can). Nothing is copied, but every
  sequence costs a call and its Python in every layer: 64 sequences x 30 layers = 1,920 calls a step, the
  launches a GPU waits on.
- **batched**: all decoding segments in one SDPA call, all prompt chunks in another, whatever their number
  (a group of one runs as above). A group's keys and values are gathered from the pools into one padded
  batch [sequences, kv_heads, longest, dim] (one `index_select` each per layer) and an additive mask hides
  the padding and, for chunks, each token's future. What every layer shares (the slot table, the mask,
  which padded row is which token) is built once per step, at the first layer's call.

Grouped-query heads: the query heads that share a key head ride as extra query rows of that head
([.., kv_heads, tokens x group, dim]), so neither path copies keys per query head or needs SDPA's
`enable_gqa`, and the masked call may go to any kernel that takes a mask (on CUDA: memory-efficient
attention; the mask's rows are allocated 16-aligned, so that kernel takes it as is).

Not used, and why: torch 2.11's `torch.nn.attention.varlen.varlen_attn` (CUDA only) takes packed keys,
with neither a block table nor grouped-query heads (2.12 adds both), so it needs the same gather plus a
copy of the keys per query head; flex attention needs `torch.compile` to be fast on CUDA, a compile per
new shape, and a block mask built every step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

RowSlots = slice | torch.Tensor
"""The slots one sequence attends to: a contiguous range, or the slot indices in order."""


@dataclass(frozen=True)
class Segment:
    """One sequence's tokens within a step's row, and the slots they attend to."""

    queries: slice
    """Where its tokens sit in the row."""
    keys: RowSlots
    """Its slots up to and including its last token in this step."""
    mask: torch.Tensor | None = None
    """For several tokens, which keys each may see (causal, after the tokens already cached); None for one.
    The per-sequence path uses it; the batched path builds its own from the lengths (the same causal rule)."""

    @property
    def count(self) -> int:
        """Its tokens in this step."""
        return int(self.queries.stop - self.queries.start)

    @property
    def context(self) -> int:
        """The slots it attends to (cached tokens and its own)."""
        if isinstance(self.keys, slice):
            return int(self.keys.stop - self.keys.start)
        return int(self.keys.shape[0])


@dataclass(frozen=True)
class _Group:
    """Segments that attend in one SDPA call: their tokens padded to `width` per sequence, their slots to
    `length`. Built once per step (`_group`)."""

    sequences: int
    width: int
    """Query tokens per sequence after padding (1 for decoding segments)."""
    length: int
    """Slots per sequence after padding."""
    queries: torch.Tensor
    """[sequences x width]: the row position each padded query reads (padding repeats a real token)."""
    slots: torch.Tensor
    """[sequences x length]: the pool slot each padded key reads (padding repeats a real slot)."""
    mask: torch.Tensor | None
    """Additive [sequences, 1, width x group, length], or None where nothing is hidden."""
    keep: torch.Tensor | None
    """Which of the sequences x width padded outputs are real tokens, in row order; None when all are."""
    rows: torch.Tensor | None
    """Where the group's tokens go in the step's row; None when they are the whole row, in order."""


class Segments:
    """A step's segments, and whether they attend batched (see the module docstring). The segments tile the
    step's row in order, end to end from its first token, as the engine lays them out.

    Build one per step: the batched plan (slot tables, masks) is made at the first layer's call and kept for
    the others, so it must not outlive the step."""

    def __init__(self, segments: Sequence[Segment], batched: bool = False) -> None:
        self.segments = list(segments)
        self.batched = batched
        self._plan: list[_Group | Segment] | None = None

    def __len__(self) -> int:
        return len(self.segments)

    def plan(self, query: torch.Tensor, key: torch.Tensor) -> list[_Group | Segment]:
        """The calls each layer makes: a `_Group` per batched group, a `Segment` for a segment alone."""
        if self._plan is None:
            self._plan = _plan(self.segments, query, key) if self.batched else list(self.segments)
        return self._plan


def attend_segments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: Segments,
    scaling: float | None,
) -> torch.Tensor:
    """Each segment's queries (rows of `query` [tokens, heads, dim], the step's row, any strides) over its
    own slots of a layer's pools `key` and `value` [slots, kv_heads, dim].

    Returns a contiguous [tokens, heads, dim] tensor, whatever layout the attention kernel returned (CUDA's
    flash and memory-efficient kernels return a transposed one, the math kernel another): callers may
    `.view` it as [tokens, heads x dim]."""
    tokens, heads, dim = query.shape
    calls = segments.plan(query, key)
    if len(calls) == 1 and isinstance(calls[0], _Group) and calls[0].rows is None:
        return _attend_group(query, key, value, calls[0], scaling).contiguous()
    if all(isinstance(call, Segment) for call in calls):
        parts = [_attend_one(query, key, value, call, scaling) for call in calls if isinstance(call, Segment)]
        # reshape, not view: an output's layout is the kernel's (see test_segments)
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(tokens, heads, dim).contiguous()
    out = query.new_empty((tokens, heads, dim))
    for call in calls:
        if isinstance(call, Segment):
            out[call.queries] = _attend_one(query, key, value, call, scaling)
        elif call.rows is None:
            out.copy_(_attend_group(query, key, value, call, scaling))
        else:
            out.index_copy_(0, call.rows, _attend_group(query, key, value, call, scaling))
    return out


def _attend_one(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segment: Segment, scaling: float | None
) -> torch.Tensor:
    """One segment's [count, heads, dim] (any layout), over its slots read in place.

    SDPA on 4-D tensors (PyTorch's fused CPU kernel takes only those; 3-D inputs run its unfused math)."""
    heads, dim = query.shape[1], query.shape[2]
    kv_heads = key.shape[1]
    keys, values = key.permute(1, 0, 2).unsqueeze(0), value.permute(1, 0, 2).unsqueeze(0)  # [1, kv, slots, d]
    slots = segment.keys
    if isinstance(slots, slice):
        seg_keys, seg_values = keys[:, :, slots], values[:, :, slots]
    else:
        seg_keys, seg_values = keys.index_select(2, slots), values.index_select(2, slots)
    if segment.mask is None:
        # one token's query heads sharing a key head become that head's queries: no mask, no copy of keys
        grouped = query[segment.queries].reshape(-1, kv_heads, heads // kv_heads, dim)
        attended = F.scaled_dot_product_attention(grouped, seg_keys, seg_values, scale=scaling)
        return attended.reshape(-1, heads, dim)
    attended = F.scaled_dot_product_attention(
        query[segment.queries].transpose(0, 1).unsqueeze(0),
        seg_keys,
        seg_values,
        attn_mask=segment.mask,
        scale=scaling,
        enable_gqa=True,
    )
    return attended[0].transpose(0, 1)


def _attend_group(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: _Group, scaling: float | None
) -> torch.Tensor:
    """A group's tokens [tokens of the group, heads, dim], contiguous, in row order."""
    heads, dim = query.shape[1], query.shape[2]
    kv_heads = key.shape[1]
    per_head = heads // kv_heads
    batch, width, length = group.sequences, group.width, group.length
    # [batch x width, heads, dim] -> [batch, kv, width x per_head, dim]: a key head's query heads as rows
    padded = query.index_select(0, group.queries).view(batch, width, kv_heads, per_head, dim)
    grouped = padded.permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, width * per_head, dim)
    keys = key.index_select(0, group.slots).view(batch, length, kv_heads, dim).transpose(1, 2)
    values = value.index_select(0, group.slots).view(batch, length, kv_heads, dim).transpose(1, 2)
    attended = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=group.mask, scale=scaling)
    out = attended.reshape(batch, kv_heads, width, per_head, dim).permute(0, 2, 1, 3, 4)
    out = out.reshape(batch * width, heads, dim)
    return out if group.keep is None else out.index_select(0, group.keep)


def _plan(segments: list[Segment], query: torch.Tensor, key: torch.Tensor) -> list[_Group | Segment]:
    """Decoding segments in one group, prompt chunks in another; a group of one stays a lone segment."""
    decoding = [s for s in segments if s.count == 1]
    chunks = [s for s in segments if s.count > 1]
    whole = len(decoding) == len(segments) or len(chunks) == len(segments)
    calls: list[_Group | Segment] = []
    for members in (decoding, chunks):
        if len(members) == 1:
            calls.append(members[0])
        elif members:
            calls.append(_group(members, query, key, whole))
    # lone segments only: in row order, so their outputs are joined by one `cat`
    if all(isinstance(call, Segment) for call in calls):
        return sorted(calls, key=lambda call: call.queries.start if isinstance(call, Segment) else 0)
    return calls


def _group(members: list[Segment], query: torch.Tensor, key: torch.Tensor, whole: bool) -> _Group:
    """The padded layout of `members` (see `_Group`); `whole` when they are all the step's segments."""
    device = query.device
    per_head = query.shape[1] // key.shape[1]
    counts = torch.tensor([s.count for s in members])
    contexts = torch.tensor([s.context for s in members])
    batch, width, length = len(members), int(counts.max()), int(contexts.max())
    steps = torch.arange(width)
    # padded query t of a sequence reads its token min(t, count - 1)
    within = torch.minimum(steps[None, :], counts[:, None] - 1)
    queries = torch.tensor([s.queries.start for s in members])[:, None] + within
    # slots: position j reads slot min(j, context - 1) of its sequence
    positions = torch.minimum(torch.arange(length)[None, :], contexts[:, None] - 1)
    # a range's slots are its start + position; scattered slots (index tensors, already on the device) are
    # read from their concatenation, at -1 - (their offset in it + position): a constant number of device
    # operations per step, however many sequences' blocks are scattered
    scattered = [s.keys for s in members if not isinstance(s.keys, slice)]
    bases, offset = [], 0
    for segment in members:
        if isinstance(segment.keys, slice):
            bases.append(segment.keys.start)
        else:
            bases.append(-1 - offset)
            offset += segment.context
    base = torch.tensor(bases)[:, None]
    slots = torch.where(base >= 0, base + positions, base - positions).to(device)
    if scattered:
        gathered = torch.cat(scattered).index_select(0, (-1 - slots).clamp(min=0).reshape(-1))
        slots = torch.where(slots >= 0, slots, gathered.view(slots.shape))
    # a token t of a chunk sees the cached slots and its own chunk up to itself: j <= context - count + t
    last = torch.minimum(contexts[:, None] - counts[:, None] + steps[None, :], contexts[:, None] - 1)
    mask = None
    if width > 1 or bool((contexts != length).any()):
        visible = (torch.arange(length, device=device) <= last.to(device)[:, :, None])[:, None, :, None, :]
        visible = visible.expand(batch, 1, width, per_head, length)
        visible = visible.reshape(batch, 1, width * per_head, length)
        # rows 16-aligned: CUDA's memory-efficient kernel copies a mask whose rows are not
        aligned = -(-length // 16) * 16
        storage = torch.zeros((batch, 1, width * per_head, aligned), dtype=query.dtype, device=device)
        mask = storage[..., :length]
        mask.masked_fill_(~visible, float("-inf"))
    keep = None
    if bool((counts != width).any()):
        real = (steps[None, :] < counts[:, None]).reshape(-1)
        keep = torch.nonzero(real).reshape(-1).to(device)
    rows = None
    if not whole:
        rows = torch.cat([torch.arange(s.queries.start, s.queries.stop) for s in members]).to(device)
    return _Group(
        sequences=batch,
        width=width,
        length=length,
        queries=queries.reshape(-1).to(device),
        slots=slots.reshape(-1),
        mask=mask,
        keep=keep,
        rows=rows,
    )


MARGIN = 0.1
"""How much faster batched attention must measure to be chosen. On this project's 2-core CPU, with other
work running, the two measured the same within 25% either way from one start to the next (bench/RESULTS.md);
on a GPU batched saves a launch per sequence per layer."""


@dataclass(frozen=True)
class Choice:
    """Which way `attend_segments` runs on this engine, and the times that chose it."""

    batched: bool
    per_sequence_s: float
    batched_s: float
    sequences: int
    context: int
    layers: int = 1
    """Layers' calls each time covers (one step plan shared by them, as in a step)."""

    def describe(self) -> str:
        if self.sequences < 2:
            return "attention per sequence (at most one sequence runs)"
        kind = "batched (one call per layer for all decodes)" if self.batched else "per sequence"
        return (
            f"attention {kind}: measured {self.sequences} decoding sequences of up to {self.context} tokens, "
            f"per sequence {self.per_sequence_s * 1000:.2f} ms, batched {self.batched_s * 1000:.2f} ms "
            f"for {self.layers} layers"
        )


def choose(
    keys: torch.Tensor,
    values: torch.Tensor,
    heads: int,
    layers: int,
    sequences: int,
    context: int,
    scaling: float,
    best_of: Callable[[Callable[[], Any], torch.device], float],
) -> Choice:
    """Time a decoding step's attention both ways (the calls of `layers` layers, at most 4: every layer
    costs the same, and 4 keep a deep model's start-up short while still sharing one step plan, over one
    layer's pools `keys` and `values`, which it only reads), for `sequences` sequences of `context // 2`
    to `context` tokens. Batched wins where it is at least `MARGIN` faster: within that, the two are the same
    as far as a loaded machine can tell, and per sequence copies nothing. `best_of(run, device)` is the
    timer."""
    layers = min(layers, 4)
    slots, dim = keys.shape[0], keys.shape[2]
    sequences = min(sequences, slots // max(context, 1))
    if sequences < 2:
        return Choice(False, 0.0, 0.0, sequences, context, layers)
    lengths = [context - (context // 2) * i // (sequences - 1) for i in range(sequences)]
    segments = [Segment(slice(i, i + 1), slice(i * context, i * context + n)) for i, n in enumerate(lengths)]
    query = torch.randn((sequences, heads, dim), dtype=keys.dtype, device=keys.device)

    def step(batched: bool) -> Callable[[], None]:
        def run() -> None:
            plan = Segments(segments, batched)
            for _ in range(layers):
                attend_segments(query, keys, values, plan, scaling)

        return run

    times = [float("inf"), float("inf")]
    step(False)()  # untimed: first calls allocate
    step(True)()
    for _ in range(2):  # alternating, so a burst of load elsewhere does not fall on one way only
        for way, batched in enumerate((False, True)):
            times[way] = min(times[way], best_of(step(batched), keys.device))
    return Choice(times[1] < times[0] * (1 - MARGIN), times[0], times[1], sequences, context, layers)
