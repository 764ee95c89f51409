"""Generates the Python code of `grpc_predict_v2.proto` with grpcio-tools (a dev dependency), and says
whether the committed code is stale (tests/runtime/test_grpc_generated.py).

    python -m carpool.runtime.api.grpc.generate

protoc runs from `runtime/src`, so the code imports itself as `carpool.runtime.api.grpc...`. One rewrite
follows: the messages are registered in a descriptor pool of their own instead of protobuf's default
pool. The protocol's package must stay `inference` (the service's full name, `/inference.
GRPCInferenceService/ModelInfer`, is what every client calls), and tritonclient's and KServe's own
generated code register the same `inference.*` names in the default pool: one process holding any two
of them would fail at import ("duplicate symbol"). A test process holds all three; so may a user's.

Staleness ignores the version stamps protoc writes (the protobuf and grpcio versions of the generator,
which also set the lowest runtime versions the code accepts): regenerated with another grpcio-tools, the
code is the same code.
"""

from __future__ import annotations

import difflib
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE_ROOT = HERE.parents[3]
"""`runtime/src`: the proto path protoc resolves `carpool/runtime/api/grpc/...` against."""
PROTO = HERE / "grpc_predict_v2.proto"
OUTPUTS = ("grpc_predict_v2_pb2.py", "grpc_predict_v2_pb2.pyi", "grpc_predict_v2_pb2_grpc.py")

_DEFAULT_POOL = "_descriptor_pool.Default().AddSerializedFile("
_OWN_POOL = "_descriptor_pool.DescriptorPool().AddSerializedFile("
_VERSION_STAMPS = (
    re.compile(r"^# Protobuf Python Version: .*$", re.M),
    re.compile(r"_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)", re.S),
    re.compile(r"^GRPC_GENERATED_VERSION = .*$", re.M),
)


def _protoc(out: Path) -> dict[str, str]:
    from grpc_tools import protoc  # dev dependency: only the generator needs it

    relative = PROTO.relative_to(SOURCE_ROOT)
    include = Path(protoc.__file__).parent / "_proto"
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{SOURCE_ROOT}",
            f"-I{include}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(relative),
        ]
    )
    if code != 0:
        raise RuntimeError(f"protoc failed on {relative} (exit {code})")
    folder = out / relative.parent
    files = {name: (folder / name).read_text() for name in OUTPUTS}
    pb2 = files["grpc_predict_v2_pb2.py"]
    if _DEFAULT_POOL not in pb2:
        raise RuntimeError("protoc's output no longer registers in the default pool: revisit the rewrite")
    files["grpc_predict_v2_pb2.py"] = pb2.replace(_DEFAULT_POOL, _OWN_POOL)
    return files


def generated() -> dict[str, str]:
    """The files as grpcio-tools generates them now: name -> text."""
    with tempfile.TemporaryDirectory() as out:
        return _protoc(Path(out))


def _unstamped(text: str) -> str:
    for stamp in _VERSION_STAMPS:
        text = stamp.sub("<version>", text)
    return text


def stale() -> list[str]:
    """Diffs of the committed files that differ from a fresh generation (version stamps aside)."""
    problems = []
    for name, text in generated().items():
        path = HERE / name
        committed = path.read_text() if path.exists() else ""
        if _unstamped(committed) != _unstamped(text):
            diff = difflib.unified_diff(
                committed.splitlines(),
                text.splitlines(),
                f"committed/{name}",
                f"generated/{name}",
                lineterm="",
            )
            problems.append("\n".join(list(diff)[:40]))
    return problems


def main() -> int:
    for name, text in generated().items():
        (HERE / name).write_text(text)
        print(f"wrote {HERE / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
