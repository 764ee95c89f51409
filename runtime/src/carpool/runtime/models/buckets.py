"""Which padded shapes an encoder captures as CUDA graphs, and which one a batch runs in (pure, torch-free).

A CUDA graph replays a fixed sequence of kernels on fixed buffers, so it serves one input shape: a
"bucket" of (batch size, padded length). `bucket_grid` spans the shapes warm-up visits with a ladder of
sizes and lengths; `choose_bucket` picks, for a batch of `size` inputs whose longest has `length` tokens,
the cheapest captured bucket that holds it, but only where its measured replay beats what an eager
forward of the batch is known to cost at least. `models.graphs` captures, measures and replays; this
module only decides, so the decisions are tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from carpool.runtime.config import ConfigError, CudaGraphs

Bucket = tuple[int, int]
"""(batch size, padded length) of one captured graph."""

FLOOR: Bucket = (1, 1)
"""The smallest batch there is: its eager cost is measured too, so every batch has a measured shape at or
below it (a lower bound on its own eager cost)."""


def wants_graphs(setting: CudaGraphs, device_type: str, packed: bool) -> bool:
    """Whether an encoder engine captures graphs; ConfigError when `on` asks for what cannot work."""
    if setting is CudaGraphs.OFF:
        return False
    if setting is CudaGraphs.ON and device_type != "cuda":
        raise ConfigError(f"model.cuda_graphs is on but the model runs on {device_type!r}; it needs CUDA")
    if setting is CudaGraphs.ON and packed:
        raise ConfigError(
            "model.cuda_graphs is on but batches are packed (model.packing): a packed batch has no fixed "
            "shape to capture; set model.packing to padded"
        )
    return device_type == "cuda" and not packed


def ladder(low: int, high: int) -> list[int]:
    """`low`, `high` and every 2^k and 3 x 2^k between them, ascending: from 2 on, each step is at most
    1.5 x the one before, so padding a value up to the next step adds at most half of it."""
    if high < low:
        return []
    steps = {low, high}
    power = 1
    while power <= high:
        steps.update(value for value in (power, 3 * power // 2) if low <= value <= high)
        power *= 2
    return sorted(steps)


def bucket_grid(shapes: Sequence[tuple[int, int]], max_batch_tokens: int) -> list[Bucket]:
    """The buckets to capture for warm-up's (batch size, length) `shapes`: every size on the ladder from 1
    to the largest warm-up size, crossed with every length on the ladder from the shortest to the longest
    warm-up length, keeping size x length within the batch token budget (the largest length a size can
    take is one of its buckets, so a batch the batcher may form at that size has one). Largest first: the
    capture order, so the first graph sizes the memory pool and the others reuse it."""
    if not shapes:
        return []
    top_size = max(size for size, _ in shapes)
    shortest = min(length for _, length in shapes)
    longest = max(length for _, length in shapes)
    grid = [
        (size, length)
        for size in ladder(1, top_size)
        for length in ladder(shortest, min(longest, max_batch_tokens // size))
    ]
    return sorted(grid, key=lambda bucket: (bucket[0] * bucket[1], bucket), reverse=True)


@dataclass(frozen=True)
class CostTable:
    """Seconds per forward, measured at warm-up with the model warm: `graph` for each captured bucket
    (copying the padded inputs in, replay, outputs out), `eager` at each bucket's shape and at `FLOOR`."""

    graph: Mapping[Bucket, float]
    eager: Mapping[Bucket, float]

    def eager_floor(self, size: int, length: int) -> float | None:
        """What an eager forward of `size` inputs up to `length` tokens costs at least: a forward's cost
        does not fall as its batch grows or lengthens, so it is at least the costliest measured shape that
        fits inside it. None when no measured shape does."""
        below = [cost for (rows, tokens), cost in self.eager.items() if rows <= size and tokens <= length]
        return max(below) if below else None


def choose_bucket(table: CostTable, size: int, length: int) -> Bucket | None:
    """The bucket a batch of `size` inputs, the longest `length` tokens, replays in: the captured bucket
    that holds it at the least measured cost, if that cost is below the eager floor of the batch (padding
    up only where it is measured faster than running the batch as it is). None: run it eagerly (no bucket
    holds it, or none is faster)."""
    holding = [
        (cost, bucket) for bucket, cost in table.graph.items() if bucket[0] >= size and bucket[1] >= length
    ]
    if not holding:
        return None
    cost, bucket = min(holding)
    floor = table.eager_floor(size, length)
    return bucket if floor is not None and cost < floor else None
