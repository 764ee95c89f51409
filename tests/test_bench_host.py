"""bench.host's arithmetic: each engine process's ceiling from its own inputs and CPU, the engine side's
as their sum, the fronts' CPU per input over the whole server's inputs, and the report's verdict."""

from __future__ import annotations

import math

import pytest
from bench.host import CEILING_BAR, HostReport, ProcessCpu, _processes


def report(processes: list[ProcessCpu], inputs_per_s: float) -> HostReport:
    return HostReport("x", 64, 10.0, inputs_per_s, inputs_per_s, 16.0, processes)


def test_each_engine_process_is_capped_by_its_own_cpu_per_input_and_the_ceilings_add_up() -> None:
    # Two engines sharing 3,000 inputs/s unevenly: 2,000 on 0.5 cores (250 us each: 4,000/s with a core)
    # and 1,000 on 0.1 cores (100 us each: 10,000/s).
    engines = [ProcessCpu(1, "engine", 0.5, 2000.0), ProcessCpu(2, "engine", 0.1, 1000.0)]
    front = ProcessCpu(3, "front", 0.6)
    result = report([*engines, front], 3000.0)
    assert [round(result.us_per_input(p)) for p in engines] == [250, 100]
    assert [round(result.ceiling(p)) for p in engines] == [4000, 10000]
    assert round(result.engine_ceiling) == 14000
    assert round(result.us_per_input(front)) == 200  # a front's CPU over every input the server ran
    assert result.front_cores == [0.6]
    assert f"**14,000 inputs/s** (misses the bar of {CEILING_BAR:,.0f})" in result.markdown()


def test_the_bar_is_met_at_thirty_thousand() -> None:
    engines = [ProcessCpu(k, "engine", 0.25, 2500.0) for k in range(3)]  # 10,000/s each with a core
    assert "(meets the bar" in report(engines, 7500.0).markdown()


def test_processes_sum_their_threads_and_turn_metric_deltas_into_rates() -> None:
    used = {(1, 1): 0.3, (1, 2): 0.1, (1, 3): 0.05, (2, 2): 0.2}
    names = {
        (1, 1): "carpool-engine",
        (1, 2): "carpool-loop",
        (1, 3): "carpool-loop",
        (2, 2): "carpool-front",
    }
    found = _processes(
        [1, 2],
        {1: "engine", 2: "front"},
        used,
        names,
        before={1: (100.0, 10.0)},
        after={1: (300.0, 20.0)},
        seconds=2.0,
    )
    engine, front = found
    assert math.isclose(engine.cores, 0.45)
    assert engine.threads == pytest.approx({"carpool-engine": 0.3, "carpool-loop": 0.15})
    assert (engine.inputs_per_s, engine.batches_per_s) == (100.0, 5.0)
    assert (front.cores, front.inputs_per_s) == (0.2, 0.0)


def test_host_cpu_per_input_counts_every_thread_but_the_models() -> None:
    """Issue 46's measure: fronts, the engines' loop and socket threads and the supervisor, not the model
    threads (the forward pass and its OpenMP workers: `carpool-engine`, `carpool-model-N`)."""
    engine = ProcessCpu(
        1,
        "engine",
        0.7,
        1000.0,
        threads={"carpool-engine": 0.5, "carpool-model-1": 0.1, "carpool-loop": 0.06, "carpool-input": 0.04},
    )
    front = ProcessCpu(2, "front", 0.2, threads={"carpool-front": 0.19, "ZMQbg/IO/0": 0.01})
    supervisor = ProcessCpu(3, "supervisor", 0.01, threads={"carpool": 0.01})
    result = report([engine, front, supervisor], 1000.0)
    assert result.host_us_per_input == pytest.approx(310.0)  # (0.06 + 0.04 + 0.2 + 0.01) / 1000 s
    assert "outside the model's threads (fronts, engines, supervisor) 310.0 us per input" in result.markdown()
