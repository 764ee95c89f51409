"""The ideal-batcher simulation that bounds the latency bar (bench.queueing): pure, no clock."""

from __future__ import annotations

import pytest
from bench.queueing import CostModel, ideal_latencies, ideal_p99


def test_cost_model_fit_recovers_fixed_and_per_token_cost() -> None:
    points = [(tokens, 0.006 + 0.00015 * tokens) for tokens in (5, 40, 300, 1200)]
    cost = CostModel.fit(points)
    assert cost.fixed_s == pytest.approx(0.006)
    assert cost.per_token_s == pytest.approx(0.00015)
    with pytest.raises(ValueError, match="two different sizes"):
        CostModel.fit([(10, 0.01), (10, 0.02)])


def test_at_low_load_every_request_takes_its_own_service_time() -> None:
    cost = CostModel(fixed_s=0.005, per_token_s=0.0001)
    latencies = ideal_latencies(
        [20], rate=0.1, cost=cost, max_batch_size=32, max_batch_tokens=8192, requests=200
    )
    assert latencies == pytest.approx([0.007] * len(latencies))


def test_batching_keeps_a_load_beyond_one_at_a_time_capacity_stable() -> None:
    # One at a time serves 1 / 7 ms = 143/s; at 200/s only batching (the fixed cost shared) keeps up.
    cost = CostModel(fixed_s=0.005, per_token_s=0.0001)
    p99 = ideal_p99([20], rate=200, cost=cost, max_batch_size=32, max_batch_tokens=8192)
    assert p99 < 0.1
    unbatched = ideal_p99([20], rate=200, cost=cost, max_batch_size=1, max_batch_tokens=8192)
    assert unbatched > 10 * p99


def test_when_cost_follows_tokens_the_tail_grows_with_load() -> None:
    # No fixed cost: batching saves nothing, so this is a plain single-server queue.
    cost = CostModel(fixed_s=0.0, per_token_s=0.0001)
    light = ideal_p99([20, 60], rate=100, cost=cost, max_batch_size=32, max_batch_tokens=8192)
    heavy = ideal_p99([20, 60], rate=200, cost=cost, max_batch_size=32, max_batch_tokens=8192)
    assert heavy > 2 * light


def test_two_instances_serve_at_once_a_load_that_one_cannot_keep_up_with() -> None:
    # 10 ms an input and no batching gain (one input a batch): one instance serves 100/s, two 200/s.
    one = CostModel(fixed_s=0.0, per_token_s=0.0002)
    two = CostModel(fixed_s=0.0, per_token_s=0.0002, instances=2)
    alone = ideal_p99([50], rate=150, cost=one, max_batch_size=1, max_batch_tokens=8192)
    pair = ideal_p99([50], rate=150, cost=two, max_batch_size=1, max_batch_tokens=8192)
    assert pair < 0.1 < 10 * pair < alone
    # at low load a second instance changes nothing: each request takes its own service time
    quiet = ideal_latencies([50], rate=0.1, cost=two, max_batch_size=32, max_batch_tokens=8192, requests=200)
    assert quiet == pytest.approx([0.01] * len(quiet))


def test_the_fitted_cost_is_one_instances_among_those_that_ran_at_once() -> None:
    points = [(tokens, 0.006 + 0.00015 * tokens) for tokens in (5, 40, 300, 1200)]
    assert CostModel.fit(points, instances=2).instances == 2
    assert CostModel.fit(points).instances == 1
