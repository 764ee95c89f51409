"""The latency objective's saturation signal (`batching.saturation`), driven with a fake clock, no threads.

The claim the autoscaler relies on: 1.0 is the load at which the objective's percentile just holds, and
the signal is proportional to load (the HPA sizes `ceil(sum of saturation)`). The first is checked
against a discrete-event simulation of the real scheduler (Poisson arrivals, batch time linear in tokens):
at the predicted rate, the simulated percentile is the objective.
"""

from __future__ import annotations

import random

import pytest

from carpool.runtime.batching.request import WorkItem
from carpool.runtime.batching.saturation import (
    ArrivalMeter,
    BatchLimits,
    Objective,
    SaturationEstimator,
    ServiceModel,
    objective_estimator,
)
from carpool.runtime.config import ObjectiveConfig
from tests.runtime.factories import item, scheduler

FIXED, PER_TOKEN, WORK = 0.02, 1e-5, 100
"""A model whose batch takes 20 ms plus 10 us per token, serving inputs of 100 tokens."""
WIDE = BatchLimits(64, 1 << 20)


def batch_time(tokens: int, fixed: float = FIXED, per_token: float = PER_TOKEN) -> float:
    return fixed + per_token * tokens


def warmed(
    objective: Objective,
    limits: BatchLimits = WIDE,
    fixed: float = FIXED,
    per_token: float = PER_TOKEN,
    work: int = WORK,
    smoothing_s: float = 10.0,
    generation: bool = False,
) -> SaturationEstimator:
    estimator = SaturationEstimator(objective, limits, smoothing_s=smoothing_s, generation=generation)
    for size in (1, 8, 32, 64):
        estimator.warmup_batch(size * work, batch_time(size * work, fixed, per_token))
    return estimator


def fitted(model: ServiceModel) -> tuple[float, float]:
    fit = model.fit()
    assert fit is not None
    return fit


def sustainable(estimator: SaturationEstimator) -> float:
    rate, _ = estimator.sustainable_rate(0.0)
    assert rate is not None
    return rate


def feed(
    estimator: SaturationEstimator,
    rate: float,
    start: float,
    seconds: float,
    work: int = WORK,
    backlog_s: float = 0.0,
) -> float:
    """Arrivals at `rate` per second for `seconds`, the scheduler's backlog `backlog_s` meanwhile
    (updating as the engine does, every 10 ms); the time at the end."""
    now, step = start, 0.01
    carry = 0.0
    while now < start + seconds:
        carry += rate * step
        count = int(carry)
        carry -= count
        if count:
            estimator.arrive(now, count, count * work)
        estimator.update(now, backlog_s)
        now += step
    return now


def simulate_percentile(rate: float, q: float, seconds: float = 30.0, seed: int = 7) -> float:
    """The q-quantile of latency of the real scheduler (no window, batches of up to 64) under Poisson
    arrivals at `rate`, each batch taking `batch_time` of its tokens."""
    rng = random.Random(seed)
    s = scheduler(max_batch_size=64, max_batch_tokens=1 << 20, max_queue_size=100_000)
    now, arrival, done_at = 0.0, rng.expovariate(rate), 0.0
    running: list[WorkItem] | None = None
    latencies: list[float] = []
    while now < seconds:
        if running is not None and done_at <= arrival:
            now = done_at
            latencies += [now - i.arrival for i in running if i.arrival > seconds / 5]  # after the start
            s.complete(running, done_at)
            running = None
        else:
            now = arrival
            s.submit([item(length=WORK, arrival=now)], now)
            arrival = now + rng.expovariate(rate)
        if running is None and (batch := s.schedule(now).batch):
            running, done_at = batch, now + batch_time(sum(i.length for i in batch))
    latencies.sort()
    return latencies[int(q * len(latencies))]


def test_objective_leaves_one_batch_time_per_one_plus_q() -> None:
    assert Objective(0.19, 0.9).batch_budget_s == pytest.approx(0.1)
    assert Objective(0.199, 0.99).batch_budget_s == pytest.approx(0.1)
    with pytest.raises(ValueError, match="percentile"):
        Objective(0.1, 90)


def test_service_model_fits_fixed_cost_and_cost_per_token() -> None:
    model = ServiceModel()
    for tokens in (100, 800, 3200, 6400):
        model.record(tokens, batch_time(tokens), pinned=True)
    fixed, per_token = fitted(model)
    assert fixed == pytest.approx(FIXED) and per_token == pytest.approx(PER_TOKEN)


def test_service_model_follows_recent_batches_over_warm_up() -> None:
    model = ServiceModel(window=64)
    for tokens in (100, 6400):
        model.record(tokens, batch_time(tokens), pinned=True)
    for _ in range(64):  # the device got three times slower (another tenant, throttling)
        for tokens in (100, 6400):
            model.record(tokens, 3 * batch_time(tokens))
    fixed, per_token = fitted(model)
    assert per_token == pytest.approx(3 * PER_TOKEN) and fixed == pytest.approx(3 * FIXED)


def test_a_slow_first_warm_up_batch_is_forgotten_once_served_batches_span_shapes() -> None:
    model = ServiceModel()
    model.record(100, 5.0, pinned=True)  # the first pass: lazy initialisation, graph capture
    model.record(6400, batch_time(6400), pinned=True)
    fixed, per_token = fitted(model)
    assert fixed + per_token * 100 > 3 * batch_time(100)  # all it knows yet: far too slow
    for tokens in (100, 800, 3200, 6400) * 4:
        model.record(tokens, batch_time(tokens))
    assert fitted(model) == pytest.approx((FIXED, PER_TOKEN))


def test_service_model_with_one_shape_charges_everything_per_token() -> None:
    model = ServiceModel()
    model.record(800, batch_time(800))
    model.record(800, batch_time(800))
    assert fitted(model) == pytest.approx((0.0, batch_time(800) / 800))
    assert ServiceModel().fit() is None


def test_sustainable_rate_is_where_the_batch_time_reaches_the_budget() -> None:
    # p90 <= 95 ms: batches of at most 50 ms; t = 20 ms / (1 - rate * 1e-3) = 50 ms at 600 per second.
    estimator = warmed(Objective(0.095, 0.9))
    estimator.arrive(0.0, 10, 10 * WORK)
    rate, reachable = estimator.sustainable_rate(0.0)
    assert reachable and rate == pytest.approx(600.0)


def test_the_batchers_capacity_caps_the_rate_with_headroom() -> None:
    # A loose objective: the 16-input batch limit binds first, 16 inputs per 36 ms, 90% of it.
    estimator = warmed(Objective(1.0, 0.9), BatchLimits(16, 1 << 20))
    estimator.arrive(0.0, 10, 10 * WORK)
    rate = sustainable(estimator)
    assert rate == pytest.approx(0.9 * 16 / batch_time(16 * WORK))
    # Two model instances carry twice that.
    twice = warmed(Objective(1.0, 0.9), BatchLimits(16, 1 << 20, instances=2))
    twice.arrive(0.0, 10, 10 * WORK)
    assert twice.sustainable_rate(0.0)[0] == pytest.approx(2 * rate)


def test_an_objective_below_one_batch_is_unreachable_and_sized_for_throughput() -> None:
    estimator = warmed(Objective(0.03, 0.9), BatchLimits(16, 1 << 20))  # budget 15.8 ms < 20 ms fixed
    estimator.arrive(0.0, 10, 10 * WORK)
    rate, reachable = estimator.sustainable_rate(0.0)
    assert not reachable and rate == pytest.approx(0.9 * 16 / batch_time(16 * WORK))


@pytest.mark.parametrize(("q", "within"), [(0.5, 0.12), (0.9, 0.12), (0.99, 0.2)])
def test_at_the_predicted_rate_the_simulated_percentile_is_the_objective(q: float, within: float) -> None:
    """Measured: p50 +2%, p90 +6%, p99 +17% (the fluid model leaves out how far a random batch outgrows
    the average one, which the far tail feels)."""
    objective = Objective(0.05 * (1 + q), q)  # a 50 ms batch budget whatever the percentile
    estimator = warmed(objective)
    estimator.arrive(0.0, 10, 10 * WORK)
    rate = sustainable(estimator)
    assert simulate_percentile(rate, q) == pytest.approx(objective.latency_s, rel=within)
    assert simulate_percentile(0.8 * rate, q) < objective.latency_s  # less load: met
    assert simulate_percentile(1.2 * rate, q) > objective.latency_s  # more: missed


def test_saturation_is_proportional_to_the_arrival_rate() -> None:
    estimator = warmed(Objective(0.095, 0.9))  # 600 per second at the objective
    now = feed(estimator, 300.0, 0.0, 60.0)
    assert estimator.value == pytest.approx(0.5, rel=0.05)
    now = feed(estimator, 600.0, now, 60.0)
    assert estimator.value == pytest.approx(1.0, rel=0.05)
    feed(estimator, 1200.0, now, 60.0)
    assert estimator.value == pytest.approx(2.0, rel=0.05)


def test_a_backlog_past_the_objective_counts_even_without_arrivals_up_to_twice_the_pods() -> None:
    estimator = warmed(Objective(0.095, 0.9))
    estimator.arrive(0.0, 1, WORK)
    reading = estimator.evaluate(0.0, backlog_s=0.15)  # closed-loop clients: 150 ms of work queued
    assert reading.queue_term == pytest.approx(0.15 / 0.095) and reading.raw == reading.queue_term
    # A backlog ten times the objective still asks for at most twice the pods: a pod cannot tell clients
    # waiting from work a past overload stranded on it.
    assert estimator.evaluate(0.0, backlog_s=0.95).raw == pytest.approx(2.0)


def test_above_capacity_the_arrival_rate_alone_tells_the_demand() -> None:
    estimator = warmed(Objective(0.095, 0.9))  # 600 per second at the objective; the batcher carries more
    now = feed(estimator, 3000.0, 0.0, 20.0, backlog_s=5.0)  # open-loop overload, the queue growing
    reading = estimator.evaluate(now, backlog_s=5.0)
    assert reading.queue_term == 0.0 and reading.raw == pytest.approx(5.0, rel=0.05)


def test_idle_and_warming_pods_read_zero() -> None:
    estimator = SaturationEstimator(Objective(0.1, 0.9), BatchLimits(32, 8192))
    assert estimator.update(0.0, 0.0).saturation == 0.0  # nothing measured yet
    warm = warmed(Objective(0.095, 0.9))
    now = feed(warm, 600.0, 0.0, 30.0)
    assert warm.value > 0.9
    feed(warm, 0.0, now, 120.0)  # the load went elsewhere
    assert warm.value < 0.01


def test_a_short_burst_does_not_cross_one_and_a_sustained_rise_does() -> None:
    estimator = warmed(Objective(0.095, 0.9), smoothing_s=10.0)
    now = feed(estimator, 300.0, 0.0, 60.0)
    now = feed(estimator, 1800.0, now, 1.0)  # six times the load for one second
    peak = estimator.value
    now = feed(estimator, 300.0, now, 30.0)
    assert peak < 1.0 and estimator.value < 0.6
    feed(estimator, 900.0, now, 30.0)  # 1.5 times the objective's load, sustained
    assert estimator.value > 1.3


def test_a_momentary_queue_moves_the_signal_little_and_a_lasting_one_past_one() -> None:
    estimator = warmed(Objective(0.095, 0.9), smoothing_s=10.0)
    now = feed(estimator, 300.0, 0.0, 60.0)
    now = feed(estimator, 300.0, now, 0.2, backlog_s=0.3)  # a fifth of a second of a deep queue
    assert estimator.value < 0.9
    now = feed(estimator, 300.0, now, 30.0)
    feed(estimator, 300.0, now, 30.0, backlog_s=0.3)  # the queue stays
    assert estimator.value > 1.9


def test_the_signal_rises_fast_and_falls_slowly() -> None:
    estimator = warmed(Objective(0.095, 0.9), smoothing_s=10.0)
    now = feed(estimator, 300.0, 0.0, 60.0)
    now = feed(estimator, 1200.0, now, 12.0)  # the horizon (10 s) and a little
    assert estimator.value > 1.8  # from 0.5 to near 2 within 12 s
    feed(estimator, 300.0, now, 12.0)
    assert estimator.value > 1.0  # the horizon has forgotten the load, the smoothing not yet


def test_a_rising_load_is_sized_for_when_new_pods_serve() -> None:
    # 300 -> 450 per second between two 10 s horizons: 15 per second per second, 30 s ahead: 900.
    ahead = SaturationEstimator(Objective(0.095, 0.9), WIDE, lead_s=30.0)
    now_only = SaturationEstimator(Objective(0.095, 0.9), WIDE)
    for estimator in (ahead, now_only):
        for size in (1, 8, 32, 64):
            estimator.warmup_batch(size * WORK, batch_time(size * WORK))
        now = feed(estimator, 300.0, 0.0, 10.0)
        feed(estimator, 450.0, now, 10.0)
    assert now_only.evaluate(20.0, 0.0).raw == pytest.approx(450 / 600, rel=0.05)
    assert ahead.evaluate(20.0, 0.0).raw == pytest.approx(900 / 600, rel=0.1)
    # Falling, it is sized for now (the HPA's scale-down window waits anyway).
    falling = SaturationEstimator(Objective(0.095, 0.9), WIDE, lead_s=30.0)
    falling.warmup_batch(WORK, batch_time(WORK))
    falling.warmup_batch(64 * WORK, batch_time(64 * WORK))
    now = feed(falling, 450.0, 0.0, 10.0)
    feed(falling, 300.0, now, 10.0)
    assert falling.evaluate(20.0, 0.0).raw == pytest.approx(300 / 600, rel=0.05)


def test_a_step_up_in_arrivals_is_read_at_its_new_rate_within_seconds() -> None:
    # 300 per second for a minute, then 1200: 3 s into the step the horizon (10 s) averages 570.
    estimator = warmed(Objective(0.095, 0.9))  # 600 per second at the objective
    now = feed(estimator, 300.0, 0.0, 60.0)
    now = feed(estimator, 1200.0, now, 3.0)
    reading = estimator.evaluate(now, 0.0)
    assert reading.rate == pytest.approx(1200.0, rel=0.1) and reading.raw > 1.9


def test_a_steady_poisson_stream_is_not_read_as_a_step() -> None:
    rng = random.Random(3)
    meter = ArrivalMeter(10.0)
    now, arrival, readings = 0.0, 0.0, []
    while now < 300.0:
        arrival += rng.expovariate(300.0)
        while now < arrival:
            if now > 20.0:
                readings.append(meter.rate(now))
            now += 0.05
        meter.record(arrival, 1, 100)
    high = [r for r in readings if r > 1.2 * 300.0]
    assert len(high) / len(readings) < 0.01, f"{len(high)} of {len(readings)} readings above 360 per second"


def test_generation_counts_decode_steps_as_work() -> None:
    # TTFT p90 <= 95 ms: steps of at most 50 ms. A request is its prompt plus one token per decode step.
    estimator = warmed(Objective(0.095, 0.9), BatchLimits(4096, 1 << 20), generation=True)
    estimator.arrive(0.0, 10, 10 * 60)
    for _ in range(10):
        estimator.finished(40)
    rate, _ = estimator.sustainable_rate(0.0)
    assert rate == pytest.approx((1 - FIXED / 0.05) / (PER_TOKEN * (60 + 40)))
    # Sequence slots cap it too: 8 running, 40 steps each.
    slots = warmed(Objective(0.095, 0.9), BatchLimits(8, 1 << 20), generation=True)
    slots.arrive(0.0, 10, 10 * 60)
    slots.finished(40)
    capped, _ = slots.sustainable_rate(0.0)
    assert capped == pytest.approx(0.9 * 8 / (40 * batch_time(8 * 100 // 40)))


def test_the_runtime_config_builds_it_only_with_an_objective() -> None:
    limits = BatchLimits(32, 8192)
    assert objective_estimator(ObjectiveConfig(), limits, generation=False) is None
    estimator = objective_estimator(ObjectiveConfig(latency_s=0.2, percentile=99), limits, generation=False)
    assert estimator is not None and estimator.objective == Objective(0.2, 0.99)


def test_requests_past_the_objective_yield_by_default_and_keep_their_place_on_request() -> None:
    assert ObjectiveConfig().late_after_s is None  # no objective: nothing is late
    assert ObjectiveConfig(latency_s=0.2).late_after_s == 0.2
    assert ObjectiveConfig(latency_s=0.2, late_requests="fifo").late_after_s is None
