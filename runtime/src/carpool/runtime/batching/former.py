"""Batch formation: when to cut a batch and what goes in it. Pure: no clock, no threads.

Given the waiting inputs in the order they are owed service, `form` returns either a batch to run now
or a time to hold until. The rules, in order:

1. The head (highest priority, oldest; with a latency objective, inputs past it after the rest of their
   level, see `queue`) is always in the batch: nothing starves, and deadlines are honoured in order.
2. The batch fills, highest priority first, up to `max_batch_size` inputs and `max_batch_tokens`
   computed tokens: the sum of the lengths when the engine packs inputs end to end, batch size x longest
   input when it pads. Packed batches take inputs in the order they are owed service (no padding to
   save). Padded ones, with length grouping, take inputs closest in length to the head first (within a
   level, those not late first), and an input that would make padding exceed both `max_padding_ratio` of
   the batch and `padding_slack_tokens` stays for a later batch.
3. A batch that cannot grow (size or budget reached, or the next candidates would not fit) goes at once,
   as does any batch once its oldest input has waited `window_s`.
4. With preferred batch sizes, a batch is cut to the largest preferred size that fits in it and goes
   as soon as one can be formed (as Triton's dynamic batcher does).
5. Otherwise the executor is idle and the batch is partial: it goes at once unless the recent arrival rate
   promises to grow it to its target (the smallest preferred size, else double its size) before the
   window closes. Waiting is worth it only then; at low load nothing ever waits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from carpool.runtime.batching.request import WorkItem

if TYPE_CHECKING:
    from carpool.runtime.config import BatchingConfig


@dataclass(frozen=True)
class FormationPolicy:
    """The knobs of batch formation (a projection of `BatchingConfig`)."""

    max_batch_size: int = 32
    max_batch_tokens: int = 8192
    window_s: float = 0.005
    preferred_batch_sizes: tuple[int, ...] = ()
    length_grouping: bool = True
    max_padding_ratio: float = 0.1
    padding_slack_tokens: int = 64
    lookahead: int = 128
    packed: bool = False
    """The engine computes no padding (`EngineInfo.packed`): the budget counts real tokens."""

    @classmethod
    def from_config(cls, config: BatchingConfig) -> FormationPolicy:
        return cls(
            max_batch_size=config.max_batch_size,
            max_batch_tokens=config.max_batch_tokens,
            window_s=config.batch_window_ms / 1000.0,
            preferred_batch_sizes=tuple(sorted(set(config.preferred_batch_sizes))),
            length_grouping=config.length_grouping,
            max_padding_ratio=config.max_padding_ratio,
            padding_slack_tokens=64 if config.padding_slack_tokens is None else config.padding_slack_tokens,
            lookahead=config.lookahead,
        )


@dataclass(frozen=True)
class Formation:
    """Either `batch` (run these now) or `hold_until` (ask again then, or on the next arrival)."""

    batch: list[WorkItem] | None = None
    hold_until: float | None = None


def padded_tokens(items: list[WorkItem]) -> int:
    """Tokens a padding engine computes for a batch: every input padded to the longest."""
    return len(items) * max((item.length for item in items), default=0)


def computed_tokens(items: list[WorkItem], packed: bool) -> int:
    """Tokens the engine computes for a batch: the real ones when it packs, else padded."""
    return sum(item.length for item in items) if packed else padded_tokens(items)


def select(candidates: list[WorkItem], policy: FormationPolicy) -> tuple[list[WorkItem], bool]:
    """Choose the batch around the head; the flag says whether some candidate was left out for lack
    of room (size, token budget or padding), that is whether the batch is as full as it can get."""
    head = candidates[0]
    grouping = policy.length_grouping and not policy.packed
    if grouping:
        rest = sorted(
            candidates[1:],
            key=lambda item: (-item.priority, item.late, abs(item.length - head.length), item.seq),
        )
    else:
        rest = candidates[1:]
    chosen = [head]
    longest = head.length
    real = head.length
    left_out = False
    for item in rest:
        if len(chosen) >= policy.max_batch_size:
            return chosen, True
        new_longest = max(longest, item.length)
        padded = (len(chosen) + 1) * new_longest
        if (real + item.length if policy.packed else padded) > policy.max_batch_tokens:
            left_out = True
            continue
        if grouping:
            waste = padded - (real + item.length)
            if waste > policy.padding_slack_tokens and waste > policy.max_padding_ratio * padded:
                left_out = True
                continue
        chosen.append(item)
        longest = new_longest
        real += item.length
    return chosen, left_out


def _cut_to_preferred(batch: list[WorkItem], preferred: tuple[int, ...]) -> list[WorkItem]:
    fitting = [size for size in preferred if size <= len(batch)]
    # `batch` is in choice order (head first, then closest fit), so the cut keeps the best-grouped part.
    return batch[: max(fitting)] if fitting else batch


def form(
    candidates: list[WorkItem],
    policy: FormationPolicy,
    now: float,
    oldest_arrival: float,
    arrival_rate: float,
) -> Formation:
    """Decide for an idle executor. `candidates` are in service order (see `RequestQueue.candidates`);
    `arrival_rate` is inputs per second over the recent past."""
    if not candidates:
        return Formation()
    batch, left_out = select(candidates, policy)
    size = len(batch)
    window_end = oldest_arrival + policy.window_s
    if left_out or size >= policy.max_batch_size or now >= window_end:
        return Formation(batch=_cut_to_preferred(batch, policy.preferred_batch_sizes))
    preferred = policy.preferred_batch_sizes
    if preferred and size >= preferred[0]:
        return Formation(batch=_cut_to_preferred(batch, preferred))  # a preferred size is formed: go
    target = preferred[0] if preferred else min(policy.max_batch_size, 2 * size)
    expected = arrival_rate * (window_end - now)
    if size + expected >= target:
        return Formation(hold_until=window_end)
    return Formation(batch=batch)
