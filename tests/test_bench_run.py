"""bench.run's ceiling: how close saturation can come to the offline limit when every input also costs CPU
outside the model on the cores the model needs."""

from __future__ import annotations

import pytest
from bench.run import outside_budget, saturation_ceiling


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
