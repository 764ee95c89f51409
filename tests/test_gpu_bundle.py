"""The offline bundle (bench/gpu): pieces reassemble to the same files, a missing or corrupted piece
is refused before anything is installed, and the requirement lists never carry torch."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from bench.gpu.bundle import ROOT, runtime_requirements, wheel_requirements
from bench.gpu.pieces import BundleError, join, split


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "wheels").mkdir(parents=True)
    (src / "wheels" / "a-1.0-py3-none-any.whl").write_bytes(bytes(range(256)) * 300)
    (src / "models").mkdir()
    (src / "models" / "m.whl").write_bytes(b"weights" * 5000)
    (src / "wheels.txt").write_text("a-1.0-py3-none-any.whl\n")
    return src


def test_pieces_are_bounded_and_reassemble_to_the_same_files(source: Path, tmp_path: Path) -> None:
    pieces = split(source, tmp_path / "out", piece_bytes=10_000)
    assert len(pieces) > 5
    assert all(p.size <= 10_000 for p in pieces)
    # Carried separately: each piece folder under a different root, in any order.
    roots = []
    for index, piece in enumerate(reversed(pieces)):
        root = tmp_path / f"carried{index}"
        (tmp_path / "out" / piece.name).rename(root)
        roots.append(root)
    join(roots, tmp_path / "back")
    assert _tree(tmp_path / "back") == _tree(source)


def test_a_missing_piece_is_refused(source: Path, tmp_path: Path) -> None:
    pieces = split(source, tmp_path / "out", piece_bytes=10_000)
    (tmp_path / "out" / pieces[2].name / pieces[2].name).unlink()
    with pytest.raises(BundleError, match=f"{pieces[2].name} is missing"):
        join([tmp_path / "out"], tmp_path / "back")
    assert not (tmp_path / "back").exists()


def test_a_corrupted_piece_is_refused(source: Path, tmp_path: Path) -> None:
    pieces = split(source, tmp_path / "out", piece_bytes=10_000)
    path = tmp_path / "out" / pieces[1].name / pieces[1].name
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=f"{pieces[1].name} is corrupted"):
        join([tmp_path / "out"], tmp_path / "back")


def test_the_bundle_never_asks_for_torch() -> None:
    requirements = runtime_requirements(ROOT / "pyproject.toml")
    everything = requirements.resolved + requirements.no_deps
    assert not [r for r in everything if r.lower().startswith("torch")]
    assert any(r.startswith("transformers") for r in requirements.resolved)
    # accelerate requires torch: fetched alone, so that pip cannot pull a CUDA build into the bundle.
    assert [r for r in requirements.no_deps if r.startswith("accelerate")]
    assert not [r for r in requirements.resolved if r.startswith("accelerate")]


def test_a_wheels_own_requirements_leave_out_torch_and_extras(tmp_path: Path) -> None:
    wheel = tmp_path / "acc-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(
            "acc-1.0.dist-info/METADATA",
            "Name: acc\nRequires-Dist: numpy>=1.17\nRequires-Dist: torch>=2.0.0\n"
            "Requires-Dist: psutil\nRequires-Dist: pytest; extra == 'test'\n",
        )
    assert wheel_requirements(wheel) == ["numpy>=1.17", "psutil"]
