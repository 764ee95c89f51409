"""Warm-up shapes cover the configured sizes and lengths and respect the batch limits."""

from carpool.runtime.config import BatchingConfig, WarmupConfig
from carpool.runtime.warmup import warmup_shapes


def test_default_shapes_cover_one_and_the_largest_batch_within_the_budget() -> None:
    shapes = warmup_shapes(WarmupConfig(), BatchingConfig(max_batch_size=32, max_batch_tokens=4096), 256)
    assert shapes == [(1, 16), (1, 256), (32, 16), (32, 128)]
    assert all(size * length <= 4096 for size, length in shapes)


def test_configured_shapes_are_clipped_to_the_input_limit() -> None:
    warmup = WarmupConfig(batch_sizes=[2], sequence_lengths=[8, 1000])
    assert warmup_shapes(warmup, BatchingConfig(), 512) == [(2, 8), (2, 512)]


def test_disabled_warmup_runs_nothing() -> None:
    assert warmup_shapes(WarmupConfig(enabled=False), BatchingConfig(), 512) == []
