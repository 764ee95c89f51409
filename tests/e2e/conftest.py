"""End-to-end fixtures: the rendered chart, the Prometheus binaries, and the run's report.

The tests put what they measured into `REPORT` (section -> key -> value); `make e2e` prints it at the
end of the run, whatever passed or failed, so a failing run still shows how far it got.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e import monitoring

REPORT: dict[str, dict[str, Any]] = {}


def record(section: str, **values: Any) -> None:
    REPORT.setdefault(section, {}).update(values)


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_format(v)}" for k, v in value.items())
    return str(value)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not REPORT:
        return
    terminalreporter.section("carpool e2e report")
    for section, values in REPORT.items():
        terminalreporter.write_line(f"{section}:")
        for key, value in values.items():
            terminalreporter.write_line(f"  {key}: {_format(value)}")


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="session")
def chart(workdir: Path) -> list[dict[str, Any]]:
    """charts/carpool rendered by Helm with the PodMonitor, PrometheusRule and adapter rules on."""
    return monitoring.render_chart(workdir)


@pytest.fixture(scope="session")
def promtool() -> str:
    return monitoring.find_binary("promtool")


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    return monitoring.find_binary("prometheus")
