"""The Dockerfile: hadolint-clean at the default threshold, both targets run a real `carpool` subcommand
as a non-root user, and the operator image installs nothing that pulls torch (no Docker engine here, so
this reads the Dockerfile and the installed packages' metadata instead of building)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests import tools

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
HEAVY = {"torch", "transformers", "sentence-transformers", "nvidia-cudnn-cu12", "triton"}


def _stages() -> dict[str, list[tuple[str, str]]]:
    """Each stage's instructions as (INSTRUCTION, arguments), continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        if instruction.upper() == "FROM":
            match = re.search(r"\bAS\s+(\S+)", rest, re.IGNORECASE)
            assert match, f"every stage is named: {line}"
            current = stages.setdefault(match.group(1), [])
        current.append((instruction.upper(), rest))
    return stages


def _last(stage: str, instruction: str) -> str:
    found = [rest for ins, rest in _stages()[stage] if ins == instruction]
    assert found, f"stage {stage} has no {instruction}"
    return found[-1]


def test_hadolint_reports_nothing() -> None:
    done = subprocess.run(
        [str(tools.hadolint()), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0 and done.stdout == "", done.stdout + done.stderr


def test_base_images_are_pinned() -> None:
    args = dict(re.findall(r"^ARG (\w+_IMAGE)=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE))
    assert set(args) == {"TORCH_IMAGE", "PYTHON_IMAGE"}
    for image in args.values():
        tag = image.split("@")[0].rsplit(":", 1)[-1]
        assert re.search(r"\d+\.\d+", tag), f"{image} is not pinned to an exact version"
    assert "cuda" in args["TORCH_IMAGE"]


@pytest.mark.parametrize(("target", "command"), [("runtime", "serve"), ("operator", "operator")])
def test_each_target_runs_a_carpool_subcommand_as_non_root(target: str, command: str) -> None:
    entrypoint = json.loads(_last(target, "ENTRYPOINT"))
    assert entrypoint == ["carpool", command]
    assert not _last(target, "USER").startswith(("0", "root"))
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, _function = scripts["carpool"].partition(":")
    # The console script's module exists and accepts the subcommand (its --help exits 0).
    done = subprocess.run(
        [sys.executable, "-m", module, command, "--help"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr


def test_the_runtime_keeps_models_in_a_volume() -> None:
    volume = json.loads(_last("runtime", "VOLUME"))
    env = _last("runtime", "ENV")
    assert f"HF_HOME={volume[0]}/" in env


def _installed_extras(stage: str) -> list[set[str]]:
    """The extras each `pip install` of the carpool wheel in a stage asks for."""
    installs = [rest for ins, rest in _stages()[stage] if ins == "RUN" and "pip install" in rest]
    assert installs, f"stage {stage} installs nothing"
    return [
        set(re.findall(r"\[([a-z,]+)\]", rest)[0].split(",")) if "[" in rest else set() for rest in installs
    ]


def _requirements(extras: set[str]) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = list(project["dependencies"])
    for extra in extras:
        names += project["optional-dependencies"][extra]
    return [Requirement(name) for name in names]


def _closure(requirements: list[Requirement]) -> set[str]:
    """Every distribution these requirements pull in, from the installed packages' metadata (extras of
    dependencies are not followed: a plain install does not pull them either)."""
    seen: set[str] = set()
    todo = list(requirements)
    while todo:
        req = todo.pop()
        name = req.name.lower().replace("_", "-")
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [
            r for r in map(Requirement, requires) if r.marker is None or r.marker.evaluate({"extra": ""})
        ]
    return seen


def test_the_operator_image_installs_no_torch() -> None:
    assert _installed_extras("operator-build") == [set()], "the operator installs the wheel without extras"
    for ins, rest in _stages()["operator"]:
        assert not (ins == "RUN" and "pip" in rest), "the final operator stage installs nothing itself"
    pulled = _closure(_requirements(set()))
    assert not pulled & HEAVY, f"the operator's dependencies pull {pulled & HEAVY}"
    # And the check can see torch where it is: the runtime extra does pull it.
    assert _installed_extras("runtime-build") == [{"runtime"}]
    assert "torch" in _closure(_requirements({"runtime"}))


def test_the_build_context_is_an_allow_list() -> None:
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert ignore[ignore.index("*") :][:1] == ["*"]
    copied = {rest.split()[0] for _, rest in _stages()["wheel"] if rest and _ == "COPY"}
    for path in copied | {"pyproject.toml", "README.md"}:
        assert (ROOT / path).exists(), f"the Dockerfile copies {path}, which does not exist"
