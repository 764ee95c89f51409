"""The repository layout keeps Python working: no root package shadows the standard library."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_operator_from_the_repository_root_is_the_standard_library() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import operator; print(operator.__file__)"],
        cwd=ROOT,
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
