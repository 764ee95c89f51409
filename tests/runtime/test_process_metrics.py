"""How /metrics folds the values of several engine processes (`model.processes`) into one per pod.

Each engine process writes its gauges to files in PROMETHEUS_MULTIPROC_DIR; the scrape combines them
by each gauge's mode. Real processes write them here (prometheus_client picks its file-backed values
when it is imported with that variable set), and the test reads them as a front's scrape does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest, multiprocess
from prometheus_client.parser import text_string_to_metric_families

WRITE = """
import sys
from carpool.runtime.metrics import RuntimeMetrics
metrics = RuntimeMetrics("m")
metrics.set_ready(sys.argv[1] == "1")
metrics.set_queue(int(sys.argv[2]), float(sys.argv[3]))
"""


def _engine(folder: Path, ready: int, depth: int, backlog: float) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder)}
    subprocess.run(
        [sys.executable, "-c", WRITE, str(ready), str(depth), str(backlog)], env=env, check=True, timeout=120
    )


def _scrape(folder: Path) -> dict[str, float]:
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(folder))  # type: ignore[no-untyped-call]
    families = text_string_to_metric_families(generate_latest(registry).decode())
    return {sample.name: sample.value for family in families for sample in family.samples}


def _front(folder: Path) -> None:
    """A front's process: it makes the same metrics (it counts requests) and never sets readiness."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder)}
    code = "from carpool.runtime.metrics import RuntimeMetrics; RuntimeMetrics('m').count_request(200)"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def test_the_pod_is_ready_only_when_every_engine_process_is_and_queues_add_up(tmp_path: Path) -> None:
    # Engine 0 warmed up and ready; engine 1, which wrote last, still warming (or draining): the pod's
    # carpool_ready is 0, whichever process wrote last. Queue depths add up; the backlog is the largest.
    _engine(tmp_path, ready=1, depth=3, backlog=0.5)
    _engine(tmp_path, ready=0, depth=4, backlog=0.2)
    values = _scrape(tmp_path)
    assert values["carpool_ready"] == 0.0
    assert values["carpool_queue_depth"] == 7.0
    assert values["carpool_queue_backlog_seconds"] == 0.5
    # And the other order: the one still warming wrote first.
    other = tmp_path / "other"
    other.mkdir()
    _engine(other, ready=0, depth=0, backlog=0.0)
    _engine(other, ready=1, depth=0, backlog=0.0)
    assert _scrape(other)["carpool_ready"] == 0.0
    # Every engine ready, with a front's process beside them: ready.
    every = tmp_path / "every"
    every.mkdir()
    _front(every)
    _engine(every, ready=1, depth=0, backlog=0.0)
    _engine(every, ready=1, depth=0, backlog=0.0)
    assert _scrape(every)["carpool_ready"] == 1.0
