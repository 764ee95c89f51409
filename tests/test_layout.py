"""The repository layout keeps Python working: no root package shadows the standard library."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("folder", ["", "bench"])
def test_import_operator_from_the_repository_root_is_the_standard_library(folder: str) -> None:
    # bench/operator/ (`python -m bench.operator`) has no __init__.py either: `python bench/run.py`
    # puts bench/ first on sys.path, where a regular `operator` package would shadow the stdlib's.
    done = subprocess.run(
        [sys.executable, "-c", "import operator; print(operator.__file__)"],
        cwd=ROOT / folder,
        capture_output=True,
        text=True,
        check=True,
    )
    location = Path(done.stdout.strip()).resolve()
    assert location.parent == Path(sysconfig.get_paths()["stdlib"]).resolve()


def test_carpool_is_a_namespace_package_over_both_source_trees() -> None:
    for tree in ("operator/src", "runtime/src"):
        assert not (ROOT / tree / "carpool" / "__init__.py").exists()
    for folder in ("operator", "runtime"):
        assert not (ROOT / folder / "__init__.py").exists()
    import carpool

    assert {Path(p).resolve() for p in carpool.__path__} >= {(ROOT / "runtime/src/carpool").resolve()}
