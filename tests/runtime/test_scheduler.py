"""The batching rules, each driven with a fake clock and no threads: every test fails if its rule breaks."""

from __future__ import annotations

import pytest

from carpool.runtime.batching.request import ItemState
from carpool.runtime.batching.scheduler import Scheduler
from carpool.runtime.batching.throughput import ArrivalRate
from carpool.runtime.errors import QueueFull
from tests.runtime.factories import item, scheduler


def lengths(batch: list) -> list[int]:  # type: ignore[type-arg]
    return [i.length for i in batch]


# -- dispatch timing -------------------------------------------------------------------------------


def test_idle_executor_dispatches_a_lone_request_at_once_even_with_a_window() -> None:
    s = scheduler(window_s=0.050)
    s.submit([item(arrival=0.0)], now=0.0)
    plan = s.schedule(now=0.0)
    assert plan.batch is not None and len(plan.batch) == 1


def test_nothing_is_dispatched_while_the_executor_is_busy() -> None:
    s = scheduler()
    s.submit([item()], now=0.0)
    first = s.schedule(now=0.0).batch
    assert first is not None
    s.submit([item(arrival=0.001)], now=0.001)
    assert s.schedule(now=0.002).batch is None
    s.complete(first, seconds=0.01)
    second = s.schedule(now=0.011).batch
    assert second is not None and len(second) == 1


def test_inputs_arriving_during_a_batch_ride_together_in_the_next_one() -> None:
    s = scheduler()
    s.submit([item()], now=0.0)
    first = s.schedule(now=0.0).batch
    assert first is not None
    for k in range(5):
        s.submit([item(arrival=0.001 * k)], now=0.001 * k)
    s.complete(first, seconds=0.01)
    batch = s.schedule(now=0.01).batch
    assert batch is not None and len(batch) == 5


def test_holds_for_a_fuller_batch_only_when_arrivals_promise_one_within_the_window() -> None:
    s = scheduler(window_s=0.010)
    # A busy recent past: 200 arrivals over the last second (200/s) -> 2 expected in the 10 ms window.
    for k in range(199):
        s.arrivals.record(now=k / 200)
    s.submit([item(arrival=1.0)], now=1.0)
    plan = s.schedule(now=1.0)
    assert plan.batch is None
    assert plan.wake_at == pytest.approx(1.010)


def test_does_not_hold_at_low_arrival_rate() -> None:
    s = scheduler(window_s=0.010)
    for k in range(9):  # 10/s: less than one arrival expected within the window
        s.arrivals.record(now=k / 10)
    s.submit([item(arrival=1.0)], now=1.0)
    assert s.schedule(now=1.0).batch is not None


def test_window_is_measured_from_the_oldest_waiting_input() -> None:
    s = scheduler(window_s=0.010, max_batch_size=20)
    for k in range(2000):  # 2000/s
        s.arrivals.record(now=k / 2000)
    s.submit([item(arrival=1.000)], now=1.000)
    assert s.schedule(now=1.000).batch is None
    for k in range(1, 17):  # 2000/s during the hold too: 17 waiting, 4 more expected in the last 2 ms
        s.submit([item(arrival=1.0 + k / 2000)], now=1.0 + k / 2000)
    plan = s.schedule(now=1.008)
    assert plan.batch is None and plan.wake_at == pytest.approx(1.010)
    batch = s.schedule(now=1.010).batch  # window of the oldest input closes: go with what is there
    assert batch is not None and len(batch) == 17


def test_zero_window_never_holds() -> None:
    s = scheduler(window_s=0.0)
    for k in range(10_000):
        s.arrivals.record(now=k / 10_000)
    s.submit([item(arrival=1.0)], now=1.0)
    assert s.schedule(now=1.0).batch is not None


def _lone_client_request(s: Scheduler, now: float) -> float:
    """A closed-loop client's next request, served alone: returns when its batch was dispatched."""
    s.submit([item(arrival=now)], now=now)
    plan = s.schedule(now=now)
    if plan.batch is None:  # held: nothing else can arrive, so the window closes on it alone
        assert plan.wake_at is not None
        now = plan.wake_at
        plan = s.schedule(now=now)
    assert plan.batch is not None and len(plan.batch) == 1
    s.complete(plan.batch, seconds=0.0006)
    return now


def test_a_lone_closed_loop_client_is_held_once_per_horizon_not_on_every_request() -> None:
    """A client sending its next request when the last one is answered arrives ~1,000 times a second on a
    fast model, yet nothing arrives while its request is held: the first hold shows it, and the following
    requests go at once (on an H100 every request of a lone client waited out the whole window, +5.6 ms)."""
    s = scheduler(window_s=0.005)
    for k in range(1000):  # its recent past: 1,000 requests a second
        s.arrivals.record(now=k / 1000)
    dispatched = _lone_client_request(s, now=1.0)
    assert dispatched == pytest.approx(1.005)  # the first request is held for the window (nothing known yet)
    now = 1.006
    for _ in range(100):  # the next 100 requests within the horizon: none waits
        assert _lone_client_request(s, now) == now
        now += 0.001
    for _ in range(1000):  # a horizon later, the hold is tried again, once
        s.arrivals.record(now=now)
        now += 0.001
    assert _lone_client_request(s, now) == pytest.approx(now + 0.005)


def test_the_rate_during_holds_counts_only_the_held_time_within_the_horizon() -> None:
    rate = ArrivalRate(horizon_s=1.0)
    rate.hold(0.0)
    rate.record(0.1)
    rate.record(0.2)
    rate.release(0.5)
    rate.record(0.6)  # not held: counts for the overall rate only
    rate.hold(0.8)
    rate.record(0.85)
    rate.release(0.9)
    # From 0.2 to 1.2: 0.3 s of the first hold and 0.1 s of the second, with arrivals at 0.2 and 0.85.
    assert rate.rate(1.2) == pytest.approx(2 / 0.4)
    # From 0.55 (at 1.55): the first hold has left the horizon, 0.1 s held with one arrival.
    assert rate.rate(1.55) == pytest.approx(1 / 0.1)
    # From 2.0 no hold is left: all arrivals in the horizon (none) per second.
    assert rate.rate(2.0) == 0.0


def test_holds_go_on_while_inputs_arrive_during_them() -> None:
    s = scheduler(window_s=0.010, max_batch_size=2)
    for k in range(1000):
        s.arrivals.record(now=k / 1000)
    s.submit([item(arrival=1.0)], now=1.0)
    assert s.schedule(now=1.0).batch is None  # held
    s.submit([item(arrival=1.002)], now=1.002)  # an input arrives during the hold and fills the batch
    batch = s.schedule(now=1.002).batch
    assert batch is not None and len(batch) == 2
    s.complete(batch, seconds=0.001)
    s.submit([item(arrival=1.004)], now=1.004)
    plan = s.schedule(now=1.004)  # one arrival per 2 ms held: 5 expected in the window, so hold again
    assert plan.batch is None and plan.wake_at == pytest.approx(1.014)


# -- batch contents --------------------------------------------------------------------------------


def test_batch_never_exceeds_max_batch_size() -> None:
    s = scheduler(max_batch_size=4)
    s.submit([item() for _ in range(10)], now=0.0)
    batch = s.schedule(now=0.0).batch
    assert batch is not None and len(batch) == 4
    assert s.waiting == 6


def test_token_budget_counts_padded_tokens() -> None:
    # Budget 100: one 40-token input pads the batch so that only two fit (2 x 40 = 80; 3 x 40 = 120).
    s = scheduler(max_batch_tokens=100, length_grouping=False)
    s.submit([item(40), item(5), item(5), item(5)], now=0.0)
    batch = s.schedule(now=0.0).batch
    assert batch is not None
    assert lengths(batch) == [40, 5]
    assert len(batch) * max(lengths(batch)) <= 100


def test_packed_batches_budget_real_tokens_and_keep_arrival_order() -> None:
    # Packed, a batch costs its real tokens: 10 + 90 fit a budget of 100 (padded, 2 x 90 = 180 would
    # not), the next 10 would make 110. No padding to save, so no reordering by length either.
    s = scheduler(max_batch_tokens=100, packed=True, max_padding_ratio=0.0, padding_slack_tokens=0)
    s.submit([item(10), item(90), item(10)], now=0.0)
    batch = s.schedule(now=0.0).batch
    assert batch is not None and lengths(batch) == [10, 90]
    padded = scheduler(max_batch_tokens=100, max_padding_ratio=0.0, padding_slack_tokens=0)
    padded.submit([item(10), item(90), item(10)], now=0.0)
    batch = padded.schedule(now=0.0).batch
    assert batch is not None and lengths(batch) == [10, 10]


def test_a_batch_that_reached_its_budget_goes_even_inside_the_window() -> None:
    s = scheduler(max_batch_tokens=64, window_s=10.0)
    for k in range(10_000):
        s.arrivals.record(now=k / 10_000)
    s.submit([item(32), item(32), item(32)], now=0.0)
    batch = s.schedule(now=0.0).batch
    assert batch is not None and lengths(batch) == [32, 32]


def test_length_grouping_keeps_short_and_long_inputs_apart() -> None:
    s = scheduler(max_padding_ratio=0.3, padding_slack_tokens=0)
    s.submit([item(10), item(120), item(12), item(118), item(11)], now=0.0)
    first = s.schedule(now=0.0).batch
    assert first is not None and sorted(lengths(first)) == [10, 11, 12]
    s.complete(first, seconds=0.01)
    second = s.schedule(now=0.01).batch
    assert second is not None and sorted(lengths(second)) == [118, 120]


def test_without_length_grouping_inputs_go_in_arrival_order() -> None:
    s = scheduler(length_grouping=False)
    s.submit([item(10), item(120), item(12), item(118), item(11)], now=0.0)
    batch = s.schedule(now=0.0).batch
    assert batch is not None and lengths(batch) == [10, 120, 12, 118, 11]


def test_grouping_picks_the_closest_lengths_to_the_head() -> None:
    s = scheduler(max_batch_size=3)
    s.submit([item(50), item(10), item(90), item(52), item(49), item(30)], now=0.0)
    batch = s.schedule(now=0.0).batch
    assert batch is not None and lengths(batch) == [50, 49, 52]


def test_small_padding_is_tolerated_below_the_slack() -> None:
    s = scheduler(max_padding_ratio=0.0, padding_slack_tokens=16)
    s.submit([item(5), item(12)], now=0.0)  # waste 7 tokens < 16
    batch = s.schedule(now=0.0).batch
    assert batch is not None and len(batch) == 2


def test_the_oldest_input_is_always_in_the_batch_so_outliers_never_starve() -> None:
    s = scheduler(max_batch_size=4, max_padding_ratio=0.2, padding_slack_tokens=0)
    outlier = item(200, arrival=0.0)
    s.submit([outlier], now=0.0)
    s.submit([item(10, arrival=0.001) for _ in range(20)], now=0.001)
    batch = s.schedule(now=0.001).batch
    assert batch is not None and batch[0] is outlier and lengths(batch) == [200]


# -- preferred batch sizes -------------------------------------------------------------------------


def test_batch_is_cut_to_the_largest_preferred_size() -> None:
    s = scheduler(max_batch_size=16, preferred_batch_sizes=(4, 8))
    s.submit([item() for _ in range(6)], now=0.0)
    batch = s.schedule(now=0.0).batch
    assert batch is not None and len(batch) == 4
    assert s.waiting == 2


def test_holds_for_the_next_preferred_size_when_arrivals_will_reach_it() -> None:
    s = scheduler(max_batch_size=16, preferred_batch_sizes=(4, 8), window_s=0.010)
    for k in range(999):  # ~1000/s: 10 expected within the window, enough to reach 4 from 1
        s.arrivals.record(now=k / 1000)
    s.submit([item(arrival=1.0)], now=1.0)
    assert s.schedule(now=1.0).batch is None
    s.submit([item(arrival=1.002) for _ in range(4)], now=1.002)
    batch = s.schedule(now=1.002).batch  # 5 waiting: the preferred 4 is formed and goes at once
    assert batch is not None and len(batch) == 4


def test_below_every_preferred_size_the_window_expiry_sends_what_there_is() -> None:
    s = scheduler(max_batch_size=16, preferred_batch_sizes=(4, 8), window_s=0.010)
    for k in range(999):
        s.arrivals.record(now=k / 1000)
    s.submit([item(arrival=1.0), item(arrival=1.0)], now=1.0)
    assert s.schedule(now=1.005).batch is None
    batch = s.schedule(now=1.010).batch
    assert batch is not None and len(batch) == 2


# -- priorities ------------------------------------------------------------------------------------


def test_higher_priority_goes_first_and_fifo_within_a_level() -> None:
    s = scheduler(max_batch_size=3, length_grouping=False)
    low = [item(priority=0, arrival=0.0) for _ in range(3)]
    high = [item(priority=2, arrival=0.1) for _ in range(2)]
    mid = [item(priority=1, arrival=0.2) for _ in range(2)]
    s.submit(low, now=0.0)
    s.submit(high, now=0.1)
    s.submit(mid, now=0.2)
    batch = s.schedule(now=0.2).batch
    assert batch == [high[0], high[1], mid[0]]
    s.complete(batch, seconds=0.01)
    batch = s.schedule(now=0.3).batch
    assert batch == [mid[1], low[0], low[1]]


def test_priority_outranks_a_better_length_fit() -> None:
    s = scheduler(max_batch_size=2)
    s.submit([item(10, priority=2)], now=0.0)
    s.submit([item(10, priority=0)], now=0.0)
    s.submit([item(40, priority=1)], now=0.0)
    batch = s.schedule(now=0.0).batch
    assert batch is not None and [i.priority for i in batch] == [2, 1]


# -- requests past a latency objective ------------------------------------------------------------


def test_inputs_past_the_objective_yield_to_those_that_can_still_meet_it() -> None:
    # A backlog an overload left: 4 inputs waiting since 0; at 3 s, past the 2 s objective, 2 new ones.
    s = scheduler(max_batch_size=2, late_after_s=2.0, length_grouping=False)
    old = [item(arrival=0.0) for _ in range(4)]
    s.submit(old, now=0.0)
    new = [item(arrival=3.0) for _ in range(2)]
    s.submit(new, now=3.0)
    batch = s.schedule(now=3.0).batch
    assert batch == new  # served while they can still meet it
    s.complete(batch, seconds=0.1)
    assert s.schedule(now=3.1).batch == old[:2]  # then the backlog, oldest first
    assert all(i.state is ItemState.RUNNING for i in old[:2]) and s.waiting == 2


def test_without_an_objective_the_backlog_keeps_its_place() -> None:
    s = scheduler(max_batch_size=2, length_grouping=False)
    old = [item(arrival=0.0) for _ in range(4)]
    s.submit(old, now=0.0)
    s.submit([item(arrival=3.0) for _ in range(2)], now=3.0)
    assert s.schedule(now=3.0).batch == old[:2]


def test_a_late_input_still_goes_before_every_lower_level_and_keeps_its_deadline() -> None:
    s = scheduler(max_batch_size=1, late_after_s=2.0)
    high_late = item(arrival=0.0, priority=2, deadline=10.0)
    expiring = item(arrival=0.0, priority=2, deadline=4.0)
    low_new = item(arrival=3.0, priority=1)
    s.submit([high_late, expiring], now=0.0)
    s.submit([low_new], now=3.0)
    plan = s.schedule(now=3.0)
    assert plan.batch == [high_late] and plan.expired == []
    s.complete(plan.batch, seconds=0.1)
    assert s.schedule(now=3.5).batch == [expiring]  # late, but still above level 1
    s.submit([again := item(arrival=4.0, priority=2, deadline=4.5)], now=4.0)
    plan = s.schedule(now=4.6)  # a late input still expires at its deadline
    assert plan.expired == [again] and again.state is ItemState.EXPIRED


def test_grouping_by_length_takes_inputs_within_the_objective_before_late_ones() -> None:
    s = scheduler(max_batch_size=2, late_after_s=2.0)
    late_same_length = item(8, arrival=0.0)
    s.submit([late_same_length], now=0.0)
    fresh = [item(8, arrival=3.0), item(12, arrival=3.0)]
    s.submit(fresh, now=3.0)
    assert s.schedule(now=3.0).batch == fresh  # the head is fresh; the late input's closer length loses


def test_a_late_input_can_be_cancelled_and_counts_as_waiting() -> None:
    s = scheduler(late_after_s=2.0)
    late, fresh = item(arrival=0.0), item(arrival=3.0)
    s.submit([late], now=0.0)
    s.submit([fresh], now=3.0)
    assert s.queue.age(3.0) == 1 and s.queue.late == 1 and s.waiting == 2
    assert s.queue.oldest_arrival() == 0.0 and s.queue.tokens == 16
    assert s.cancel(late) is True and late.state is ItemState.CANCELLED
    assert s.waiting == 1 and s.queue.late == 0 and s.queue.tokens == 8


# -- deadlines, limits, cancellation ---------------------------------------------------------------


def test_expired_inputs_are_answered_and_never_run() -> None:
    s = scheduler()
    s.submit([item(arrival=0.0)], now=0.0)
    running = s.schedule(now=0.0).batch
    assert running is not None
    late = item(arrival=0.001, deadline=0.5)
    fine = item(arrival=0.001, deadline=5.0)
    s.submit([late, fine], now=0.001)
    plan = s.schedule(now=0.4)
    assert plan.batch is None and plan.expired == []
    assert plan.wake_at == pytest.approx(0.5)  # wakes to answer the deadline even while busy
    plan = s.schedule(now=0.5)
    assert plan.expired == [late] and late.state is ItemState.EXPIRED
    s.complete(running, seconds=0.6)
    batch = s.schedule(now=0.6).batch
    assert batch == [fine]


def test_queue_limit_refuses_a_whole_request_with_a_retry_hint() -> None:
    s = scheduler(max_queue_size=4)
    s.throughput.record(tokens=100, seconds=1.0)  # 100 tokens/s
    s.submit([item(100), item(100), item(100)], now=0.0)
    with pytest.raises(QueueFull) as refused:
        s.submit([item(), item()], now=0.0)
    assert s.waiting == 3  # nothing of the refused request was queued
    assert refused.value.retry_after_s == 3.0  # 300 queued tokens at 100 tokens/s
    s.submit([item()], now=0.0)
    assert s.waiting == 4


def test_cancelled_inputs_leave_the_queue_before_running() -> None:
    s = scheduler()
    a, b = item(), item()
    s.submit([a, b], now=0.0)
    assert s.cancel(a) is True
    batch = s.schedule(now=0.0).batch
    assert batch == [b] and a.state is ItemState.CANCELLED


def test_backlog_is_queued_tokens_over_recent_throughput() -> None:
    s = scheduler()
    assert s.backlog_seconds() == 0.0
    s.throughput.record(tokens=1000, seconds=0.5)
    s.throughput.record(tokens=1000, seconds=1.5)  # 1000 tokens/s over the recent batches
    s.submit([item(250), item(250)], now=0.0)
    assert s.backlog_seconds() == pytest.approx(0.5)
    # Two model instances clear it twice as fast (the meter times each batch on its own).
    s.max_inflight_batches = 2
    assert s.backlog_seconds() == pytest.approx(0.25)
    assert s.retry_after_s() == 1.0


def test_batches_form_while_an_instance_is_free_and_not_beyond() -> None:
    s = scheduler(max_batch_size=1)
    s.max_inflight_batches = 2
    s.submit([item(), item(), item()], now=0.0)
    first, second = s.schedule(now=0.0).batch, s.schedule(now=0.0).batch
    assert first and second and first != second
    assert s.schedule(now=0.0).batch is None  # both instances busy: the third waits
    s.complete(first, seconds=0.01)
    assert s.schedule(now=0.01).batch is not None
