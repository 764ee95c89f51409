"""Warm-up shapes cover the configured sizes and lengths and respect the batch limits."""

from carpool.runtime.config import BatchingConfig, WarmupConfig
from carpool.runtime.warmup import padding_slack, warmup_shapes


def test_default_shapes_cover_one_and_the_largest_batch_within_the_budget() -> None:
    shapes = warmup_shapes(WarmupConfig(), BatchingConfig(max_batch_size=32, max_batch_tokens=4096), 256)
    assert shapes == [(1, 16), (1, 256), (32, 16), (32, 128)]
    assert all(size * length <= 4096 for size, length in shapes)


def test_configured_shapes_are_clipped_to_the_input_limit() -> None:
    warmup = WarmupConfig(batch_sizes=[2], sequence_lengths=[8, 1000])
    assert warmup_shapes(warmup, BatchingConfig(), 512) == [(2, 8), (2, 512)]


def test_disabled_warmup_runs_nothing() -> None:
    assert warmup_shapes(WarmupConfig(enabled=False), BatchingConfig(), 512) == []


def test_padding_slack_is_the_fixed_cost_of_a_batch_in_tokens() -> None:
    # 2 ms per batch plus 0.1 ms per token: a batch costs as much as 20 tokens.
    points = [(tokens, 0.002 + 0.0001 * tokens) for tokens in (16, 4096, 16, 4096)]
    assert padding_slack(points, limit=8192) == 20


def test_padding_slack_is_capped_and_never_negative() -> None:
    assert padding_slack([(16, 0.005), (4096, 0.005)], limit=8192) == 8192  # tokens are free (a big GPU)
    assert padding_slack([(16, 0.001), (4096, 0.5)], limit=8192) == 0
    assert padding_slack([(16, 0.001)], limit=8192) == 0
