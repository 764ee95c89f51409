"""Split a folder into checksummed pieces of bounded size, and put it back together.

Standard library only: the machine that reassembles a bundle may have nothing installed but Python.
A transfer that carries at most so many megabytes at a time (a copy tool, an upload form, a removable
disk) takes the pieces one at a time; `join` refuses a bundle with a missing, extra or corrupted piece
instead of installing half of it.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "MANIFEST.json"
PIECE_PREFIX = "piece-"


class BundleError(Exception):
    """A bundle that cannot be put back together; the message says which piece and why."""


@dataclass(frozen=True)
class Piece:
    name: str
    size: int
    sha256: str


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pack(source: Path) -> bytes:
    """The folder as an uncompressed tar (wheels and weights are compressed already), with sorted,
    relative names and no owner or time, so the same folder gives the same bytes."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(p for p in source.rglob("*") if p.is_file()):
            info = tarfile.TarInfo(path.relative_to(source).as_posix())
            info.size = path.stat().st_size
            info.mode = 0o644
            with path.open("rb") as handle:
                tar.addfile(info, handle)
    return buffer.getvalue()


def split(source: Path, out: Path, piece_bytes: int) -> list[Piece]:
    """Write `source` as pieces of at most `piece_bytes` into `out`, one piece per folder
    (`out/piece-000/piece-000`, ...), so each can be carried on its own, plus the manifest in every folder."""
    if piece_bytes <= 0:
        raise ValueError(f"piece size must be positive, got {piece_bytes}")
    data = pack(source)
    pieces: list[Piece] = []
    for index, start in enumerate(range(0, max(len(data), 1), piece_bytes)):
        chunk = data[start : start + piece_bytes]
        piece = Piece(f"{PIECE_PREFIX}{index:03d}", len(chunk), _sha256(chunk))
        folder = out / piece.name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / piece.name).write_bytes(chunk)
        pieces.append(piece)
    manifest = json.dumps(
        {
            "sha256": _sha256(data),
            "size": len(data),
            "pieces": [{"name": p.name, "size": p.size, "sha256": p.sha256} for p in pieces],
        },
        indent=2,
    )
    for piece in pieces:
        (out / piece.name / MANIFEST).write_text(manifest + "\n")
    return pieces


def _find(roots: Iterable[Path], name: str) -> Path | None:
    for root in roots:
        for candidate in (root / name, root / name / name):
            if candidate.is_file():
                return candidate
    return None


def join(roots: list[Path], destination: Path) -> int:
    """Check every piece against the manifest, reassemble, and unpack into `destination`.
    `roots` are folders holding pieces (or piece folders), in any arrangement. Returns the bundle's size."""
    manifest_path = next(
        (p for root in roots for p in sorted(root.rglob(MANIFEST)) if p.is_file()),
        None,
    )
    if manifest_path is None:
        raise BundleError(f"no {MANIFEST} under {', '.join(map(str, roots))}: is this a carpool bundle?")
    manifest = json.loads(manifest_path.read_text())
    parts: list[bytes] = []
    for entry in manifest["pieces"]:
        found = _find([root for r in roots for root in (r, *r.iterdir()) if root.is_dir()], entry["name"])
        if found is None:
            raise BundleError(f"{entry['name']} is missing: copy every piece-NNN folder before installing")
        chunk = found.read_bytes()
        if len(chunk) != entry["size"] or _sha256(chunk) != entry["sha256"]:
            raise BundleError(f"{entry['name']} is corrupted ({len(chunk)} bytes, expected {entry['size']})")
        parts.append(chunk)
    data = b"".join(parts)
    if _sha256(data) != manifest["sha256"]:
        raise BundleError("the reassembled bundle does not match its checksum")
    destination.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        tar.extractall(destination, filter="data")
    return len(data)
