"""Metrics written once per batch or loop turn (issue 46): the same values a write per request gives.

`observe_many` folds many observations into one write per bucket; `TurnTally` gathers a front's request
counts, durations and in-flight count over one event-loop turn. Both must leave /metrics exactly as the
per-request writes did: dashboards and the HPA read these names."""

from __future__ import annotations

import asyncio

from prometheus_client import generate_latest

from carpool.runtime.api.tally import TurnTally
from carpool.runtime.metrics import RuntimeMetrics, observe_many


def _exposition(metrics: RuntimeMetrics) -> list[str]:
    # Without PROMETHEUS_MULTIPROC_DIR every metric is in the object's own registry; the process
    # collectors' lines (CPU, memory, GC) differ between any two scrapes and are left out.
    return [
        line
        for line in generate_latest(metrics.registry).decode().splitlines()
        if line.startswith("carpool_") and "_created{" not in line  # when the object was made
    ]


def test_observe_many_equals_one_observe_per_value() -> None:
    # On bucket bounds, between them, below the first and above the last (the +Inf bucket).
    values = [0.0, 0.001, 0.0011, 0.0025, 0.003, 0.05, 0.0749, 0.1, 2.0, 59.9, 60.0, 61.0, 1e9]
    one, many = RuntimeMetrics("m"), RuntimeMetrics("m")
    for value in values:
        one.queue_wait.observe(value)
    observe_many(many.queue_wait, values)
    observe_many(many.queue_wait, [])  # nothing to write
    assert _exposition(one) == _exposition(many)


def test_a_turns_requests_reach_the_metrics_at_its_end_as_per_request_writes_would() -> None:
    direct, tallied = RuntimeMetrics("m"), RuntimeMetrics("m")
    answers = [(200, 0.004, "http"), (200, 0.2, "http"), (429, None, "http"), (200, 0.03, "grpc")]
    for status, seconds, protocol in answers:
        direct.count_request(status, protocol)
        if seconds is not None:
            direct.request_durations[protocol].observe(seconds)
    direct.inflight.set(2)
    inflight = [0]

    async def turn() -> list[str]:
        tally = TurnTally(tallied, lambda: inflight[0])
        for status, seconds, protocol in answers:
            tally.answered(status, seconds, protocol)
            inflight[0] += 1
            tally.inflight_changed()
        inflight[0] -= 2
        tally.inflight_changed()
        during = _exposition(tallied)  # nothing written yet within the turn
        await asyncio.sleep(0)  # the loop's next turn: the flush has run
        assert during != _exposition(tallied)
        return during

    before = _exposition(RuntimeMetrics("m"))
    assert asyncio.run(turn()) == before
    assert _exposition(tallied) == _exposition(direct)


def test_outside_an_event_loop_the_tally_writes_at_once() -> None:
    metrics = RuntimeMetrics("m")
    TurnTally(metrics, lambda: 0).answered(503)
    assert any(
        line.startswith('carpool_requests_total{model="m",protocol="http",status="503"} 1.0')
        for line in _exposition(metrics)
    )
