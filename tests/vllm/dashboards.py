"""vLLM's own Grafana dashboards, as vLLM publishes them for the version the tier runs: read from vLLM's
source distribution on PyPI (the release's `examples/observability/`), which is fetched once into the
machine's cache and checked against the digest PyPI lists for it. carpool does not copy them: they are
vLLM's, and change with vLLM's metric names from one release to the next.

The dashboards' PromQL uses Grafana's template variables; `queries` substitutes them as Grafana would for
one model and a short time range, so Prometheus can evaluate every panel's query."""

from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VERSION = "0.32.0"
"""The vLLM release the tier runs (Makefile VLLM); `test_metrics` checks vLLM's environment has it."""
SDIST = (
    "https://files.pythonhosted.org/packages/d5/df/5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/"
    f"vllm-{VERSION}.tar.gz"
)
SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"
"""PyPI's digest of that file (https://pypi.org/simple/vllm/)."""
DASHBOARDS = (
    "examples/observability/prometheus_grafana/grafana.json",
    "examples/observability/dashboards/grafana/performance_statistics.json",
    "examples/observability/dashboards/grafana/query_statistics.json",
)
"""vLLM's dashboards: the one its docs' Prometheus and Grafana example imports, and the two of
`examples/observability/dashboards`."""


def _cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "carpool"


def _sdist() -> Path:
    path = _cache() / f"vllm-{VERSION}.tar.gz"
    if not path.exists() or hashlib.sha256(path.read_bytes()).hexdigest() != SHA256:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".part")
        try:
            with urllib.request.urlopen(SDIST, timeout=300) as answer, partial.open("wb") as out:
                while chunk := answer.read(1 << 20):
                    out.write(chunk)
        except OSError as exc:
            raise AssertionError(
                f"vLLM's dashboards come from its source distribution ({SDIST}), which could not be "
                f"fetched: {exc}. Put the file at {path} to run offline."
            ) from exc
        digest = hashlib.sha256(partial.read_bytes()).hexdigest()
        assert digest == SHA256, f"{SDIST}: sha256 {digest}, PyPI lists {SHA256}"
        partial.replace(path)
    return path


def vllm_dashboards() -> dict[str, dict[str, Any]]:
    """Each dashboard's path in vLLM's repository -> its JSON."""
    found: dict[str, dict[str, Any]] = {}
    with tarfile.open(_sdist()) as archive:
        for member in DASHBOARDS:
            data = archive.extractfile(f"vllm-{VERSION}/{member}")
            assert data is not None, f"{member} is not in vLLM {VERSION}'s source distribution"
            found[member] = json.loads(data.read())
    return found


@dataclass(frozen=True)
class Query:
    dashboard: str
    panel: str
    expr: str
    """With the template variables substituted."""


def _panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for panel in panels:
        found.append(panel)
        found += _panels(panel.get("panels", []))
    return found


def _substitute(expr: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m.group(1), m.group(0)), expr)


def queries(dashboards: dict[str, dict[str, Any]], model: str, interval: str) -> list[Query]:
    """Every panel query, its variables set as Grafana sets them for one model (`$model_name` and the
    other dashboards' model variable, `$Deployment_id`) and a range of `interval` (`$__rate_interval`,
    `$__interval`, `$__range`); custom variables take their first option."""
    found: list[Query] = []
    for name, board in dashboards.items():
        values = {"__rate_interval": interval, "__interval": interval, "__range": interval}
        for variable in board.get("templating", {}).get("list", []):
            if variable.get("type") == "query":
                values[variable["name"]] = model
            elif variable.get("type") == "custom":
                first = str(variable.get("query", "")).split(",")[0].split(" : ")[0].strip()
                values[variable["name"]] = first
        for panel in _panels(board["panels"]):
            for target in panel.get("targets", []):
                expr = target.get("expr")
                if not expr:
                    continue
                substituted = _substitute(str(expr), values)
                assert "$" not in substituted, f"{name} {panel.get('title')}: unset variable in {expr}"
                found.append(Query(name, str(panel.get("title")), substituted))
    return found
