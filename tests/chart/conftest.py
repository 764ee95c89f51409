"""Renders the chart with the real Helm binary (unpacked from the dev extra's packages by tests.tools)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import tools

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "carpool"
ALL_FEATURES = CHART / "ci" / "all-features-values.yaml"
KUBE_VERSIONS = ("1.29.0", "1.35.0")

Render = Callable[..., list[dict[str, Any]]]


@pytest.fixture(scope="session")
def helm() -> Path:
    return tools.helm()


def run_helm(helm: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *map(str, args)], capture_output=True, text=True, check=False, cwd=ROOT)


@pytest.fixture(scope="session")
def render(helm: Path, tmp_path_factory: pytest.TempPathFactory) -> Render:
    """`render(values={...}, files=[...], kube_version=...)`: the chart's objects, as `helm template` makes
    them (release `carpool` in namespace `carpool-system`). Renders are cached: tests share them."""
    cache: dict[str, list[dict[str, Any]]] = {}
    scratch = tmp_path_factory.mktemp("values")

    def _render(
        values: dict[str, Any] | None = None, files: tuple[Path, ...] = (), kube_version: str = "1.35.0"
    ) -> list[dict[str, Any]]:
        key = repr((sorted((values or {}).items()), files, kube_version))
        if key not in cache:
            args: list[str | Path] = ["template", "carpool", CHART, "--namespace", "carpool-system"]
            args += ["--kube-version", kube_version]
            for file in files:
                args += ["-f", file]
            if values:
                extra = scratch / f"values-{len(cache)}.yaml"
                extra.write_text(yaml.safe_dump(values))
                args += ["-f", extra]
            done = run_helm(helm, *args)
            assert done.returncode == 0, done.stderr
            cache[key] = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
        return cache[key]

    return _render


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = find(objects, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]
