"""bench.run's ceiling (how close saturation can come to the offline limit when every input also costs CPU
outside the model on the cores the model needs) and the cost points its ideal batcher is fitted on."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from bench.offline import cost_points
from bench.run import outside_budget, saturation_ceiling

from carpool.runtime.engine.instances import instance_pool


class SleepyEngine:
    """A forward pass of 1 ms a token that records how many ran at once."""

    def __init__(self) -> None:
        self.info = SimpleNamespace(device="cpu", packed=True)
        self.running = 0
        self.most = 0
        self.lock = threading.Lock()

    def forward(self, batch: list[list[int]]) -> None:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(0.001 * sum(len(ids) for ids in batch))
        with self.lock:
            self.running -= 1


def test_cpu_outside_the_model_caps_saturation_at_the_cores_it_leaves_the_model() -> None:
    # 2 cores, a model that does 800 inputs/s alone (2.5 ms of CPU each): 0.25 ms more per input takes
    # a tenth more CPU, so at most 1 / 1.1 of the limit.
    assert saturation_ceiling(800.0, 0.25e-3, 2) == pytest.approx(1 / 1.1)
    assert saturation_ceiling(800.0, 0.0, 2) == 1.0
    # the same CPU weighs less beside a slower model, or spread over more cores
    assert saturation_ceiling(300.0, 0.25e-3, 2) > saturation_ceiling(800.0, 0.25e-3, 2)
    assert saturation_ceiling(800.0, 0.25e-3, 4) > saturation_ceiling(800.0, 0.25e-3, 2)


def test_the_budget_is_the_cpu_outside_the_model_that_reaches_the_share_exactly() -> None:
    budget = outside_budget(816.0, 0.93, 2)
    assert budget == pytest.approx(0.185e-3, abs=0.001e-3)  # issue 26's bound on this host
    assert saturation_ceiling(816.0, budget, 2) == pytest.approx(0.93)
    assert saturation_ceiling(816.0, budget * 1.1, 2) < 0.93


def test_cost_points_time_each_batch_while_every_instance_runs_one() -> None:
    engine: Any = SleepyEngine()
    texts = [[1] * n for n in (2, 3, 4, 5)]
    points = cost_points(engine, texts, sizes=(1, 2), repeats=2, pool=instance_pool(engine, 2))
    assert engine.most == 2  # two batches at once, as a loaded server with two instances runs them
    assert len(points) == 2 * 2 * 2  # sizes x repeats x instances (each instance's first batch untimed)
    for tokens, seconds in points:
        assert seconds >= 0.001 * tokens  # each batch's own time, not the pair's
    one: Any = SleepyEngine()
    assert len(cost_points(one, texts, sizes=(1, 2), repeats=2)) == 2 * 2
    assert one.most == 1


def test_the_before_after_table_shows_each_servers_tail_and_cores_at_30_and_70_percent() -> None:
    from types import SimpleNamespace

    from bench.run import comparison

    def load(p50: float, p95: float, p99: float) -> SimpleNamespace:
        return SimpleNamespace(p50=p50, p95=p95, p99=p99)

    def report(p99_low: float, cores: str) -> SimpleNamespace:
        return SimpleNamespace(
            saturation=SimpleNamespace(inputs_per_s=700.0),
            open_loops={"30%": load(0.02, 0.05, p99_low), "70%": load(0.04, 0.09, 0.2)},
            _server_cores=lambda phase: cores,
        )

    table = comparison([("before", report(0.85, "1.53")), ("after", report(0.07, "0.61"))])  # type: ignore[list-item]
    assert "| before | 700.0 inputs/s | 20.00 ms / 50.00 ms / 850.00 ms | 1.53 |" in table
    assert "| after | 700.0 inputs/s | 20.00 ms / 50.00 ms / 70.00 ms | 0.61 |" in table
