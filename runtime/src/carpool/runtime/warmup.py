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
