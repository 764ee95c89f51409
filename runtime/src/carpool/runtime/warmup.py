"""Which dummy batches warm a model up before it reports ready (pure; the service runs them).

The first batches at a new shape pay for allocator growth, kernel selection and (on CUDA) autotuning;
running them before ready keeps that cost out of users' latency.
"""

from __future__ import annotations

from carpool.runtime.config import BatchingConfig, WarmupConfig


def warmup_shapes(
    warmup: WarmupConfig, batching: BatchingConfig, max_input_tokens: int
) -> list[tuple[int, int]]:
    """(batch size, input length) pairs, each within the batch limits; the largest runs last."""
    if not warmup.enabled:
        return []
    sizes = warmup.batch_sizes or sorted({1, batching.max_batch_size})
    shapes: set[tuple[int, int]] = set()
    for size in sizes:
        size = min(size, batching.max_batch_size)
        fits = max(1, batching.max_batch_tokens // size)
        lengths = warmup.sequence_lengths or [16, fits]
        for length in lengths:
            shapes.add((size, max(2, min(length, max_input_tokens, fits))))
    return sorted(shapes, key=lambda shape: (shape[0] * shape[1], shape))


def padding_slack(points: list[tuple[int, float]], limit: int) -> int:
    """Tokens of padding worth tolerating, from timed batches (padded tokens, seconds): the fixed cost
    of one batch over the cost of one token, fitted by least squares, within 0..limit."""
    if len({tokens for tokens, _ in points}) < 2:
        return 0
    n = len(points)
    mean_x = sum(t for t, _ in points) / n
    mean_y = sum(s for _, s in points) / n
    var = sum((t - mean_x) ** 2 for t, _ in points)
    per_token = sum((t - mean_x) * (s - mean_y) for t, s in points) / var
    fixed = mean_y - per_token * mean_x
    if per_token <= 0:
        return limit  # tokens cost nothing measurable: padding is free
    return int(min(limit, max(0.0, fixed / per_token)))
