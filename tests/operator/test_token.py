"""A rotated token file: read again when it changes, used by the reconciler's client from the next
request on, and found in a kubeconfig's `tokenFile` (which kopf's own kubeconfig login ignores)."""

from __future__ import annotations

import os
from pathlib import Path

import kopf
import yaml

from carpool.operator.kube import Kube
from carpool.operator.token import TokenFile, kubeconfig_token_file


def _swap(path: Path, token: str) -> None:
    beside = path.with_name(path.name + ".new")
    beside.write_text(token + "\n")
    os.replace(beside, path)


def test_a_token_file_is_read_again_once_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "token"
    _swap(path, "first")
    source = TokenFile(path)
    assert source.token() == "first"
    _swap(path, "second")
    assert source.token() == "second"
    path.unlink()  # mid-swap: the last token read
    assert source.token() == "second"


async def test_the_reconcilers_client_sends_the_rotated_token_and_keeps_its_session(tmp_path: Path) -> None:
    path = tmp_path / "token"
    _swap(path, "first")
    kube = Kube()
    info = kopf.ConnectionInfo(server="https://api.example:6443", token="first")
    kube.connect(info, path)
    assert kube._authorization() == {"Authorization": "Bearer first"}
    session = kube._client()[0]
    _swap(path, "second")
    assert kube._authorization() == {"Authorization": "Bearer second"}
    # kopf logs in again (the credentials from a file expire after a minute): same session.
    kube.connect(kopf.ConnectionInfo(server="https://api.example:6443", token="second"), path)
    assert kube._client()[0] is session
    # Another server is another connection.
    kube.connect(kopf.ConnectionInfo(server="https://other.example:6443", token="second"), path)
    assert kube._client()[0] is not session
    # Without a token file, the session's own header stands.
    kube.connect(kopf.ConnectionInfo(server="https://api.example:6443", token="fixed"))
    assert kube._authorization() == {}
    await kube.close()


def test_a_kubeconfig_token_file_is_found_unless_an_inline_token_wins(tmp_path: Path) -> None:
    config = {
        "current-context": "c",
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": {"server": "https://api.example:6443"}}],
        "users": [{"name": "u", "user": {"tokenFile": str(tmp_path / "token")}}],
    }
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump(config))
    assert kubeconfig_token_file({"KUBECONFIG": str(path)}) == tmp_path / "token"
    config["users"][0]["user"]["token"] = "inline"  # type: ignore[index]
    path.write_text(yaml.safe_dump(config))
    assert kubeconfig_token_file({"KUBECONFIG": str(path)}) is None
