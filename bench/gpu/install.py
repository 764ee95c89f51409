"""Install an offline bundle on a machine without network (standard library and pip only).

    python3 -m bench.gpu.install .gpu-bundle --target /tmp/site     # then PYTHONPATH=/tmp/site
    python3 -m bench.gpu.install .gpu-bundle                         # into the running Python's env

The pieces may lie in several folders (each carried separately): pass them all. Every piece is checked
against the manifest before anything is installed. torch is not in the bundle: the machine's own build
(CUDA) is used.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gpu.pieces import BundleError, join


def install(roots: list[Path], target: Path | None, unpacked: Path) -> list[Path]:
    """Reassemble into `unpacked` and pip-install every wheel (the bundle holds the whole closure, so
    `--no-deps`); returns the wheels installed."""
    size = join(roots, unpacked)
    wheels = sorted((unpacked / "wheels").glob("*.whl")) + sorted((unpacked / "models").glob("*.whl"))
    print(f"bundle of {size / 1e6:.1f} MB: installing {len(wheels)} wheels", flush=True)
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile"]
    command += ["--no-cache-dir", "--upgrade"]
    if target is not None:
        command += ["--target", str(target)]
    subprocess.run(command + [str(w) for w in wheels], check=True)
    return wheels


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Install a carpool offline bundle.")
    parser.add_argument("roots", nargs="+", type=Path, help="folders holding the bundle's pieces")
    parser.add_argument("--target", type=Path, help="install into this folder (use it on PYTHONPATH)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            install(args.roots, args.target, Path(tmp))
        except BundleError as exc:
            raise SystemExit(f"carpool bundle: {exc}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
