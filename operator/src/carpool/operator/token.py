"""Bearer tokens read from a file that someone else rotates: a pod's projected service-account token
(the kubelet rewrites it before it expires: at 80% of its lifetime, an hour by default) or a kubeconfig
user's `tokenFile`.

client-go reads such a file again every minute (`transport.NewCachedFileTokenSource`); here the file is
read again as soon as it changes (a `stat` per request: its inode, size or modification time differ, as
they do after the kubelet's atomic symlink swap) and at least every minute, so a rotated token is used
from the next request on, before the old one expires or is revoked. kopf's own requests get the new
token through the login handler: the credentials it returns expire after `REREAD_SECONDS`, and kopf
logs in again (reading the file) before its next request after that, or at once on a 401.
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path
from typing import Any

import yaml

SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
REREAD_SECONDS = 60.0
"""At most this old a token read (client-go's cache period for token files)."""


class TokenFile:
    """The current token in `path` (stripped), read again when the file changes or every minute."""

    def __init__(self, path: Path, reread_seconds: float = REREAD_SECONDS) -> None:
        self.path = path
        self.reread_seconds = reread_seconds
        self._token = ""
        self._stamp: tuple[int, int, int] | None = None
        self._read_at = 0.0

    def token(self) -> str:
        try:
            info = os.stat(self.path)
        except OSError:
            return self._token  # gone for a moment (a swap in progress): the last one read
        stamp = (info.st_ino, info.st_size, info.st_mtime_ns)
        if stamp != self._stamp or time.monotonic() - self._read_at >= self.reread_seconds:
            text = self.path.read_text(encoding="utf-8").strip()
            if text:
                self._token, self._stamp, self._read_at = text, stamp, time.monotonic()
        return self._token


def kubeconfig_token_file(environ: dict[str, str] | None = None) -> Path | None:
    """The current context user's `tokenFile` in the kubeconfig (`KUBECONFIG`, else ~/.kube/config), if
    it has one and no inline `token` (kubectl's order: an inline token wins)."""
    env = os.environ if environ is None else environ
    paths = [Path(p).expanduser() for p in (env.get("KUBECONFIG") or "~/.kube/config").split(os.pathsep) if p]
    current: str | None = None
    contexts: dict[str, Any] = {}
    users: dict[str, Any] = {}
    for path in paths:
        if not path.is_file():
            continue
        config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        current = current or config.get("current-context")
        for item in config.get("contexts") or []:
            contexts.setdefault(item["name"], item.get("context") or {})
        for item in config.get("users") or []:
            users.setdefault(item["name"], item.get("user") or {})
    user = users.get((contexts.get(current or "") or {}).get("user", "")) or {}
    if user.get("token") or not user.get("tokenFile"):
        return None
    return Path(user["tokenFile"]).expanduser()


def expires_for_reread(now: datetime.datetime | None = None) -> datetime.datetime:
    """When credentials read from a token file are to be read again (kopf's `ConnectionInfo.expiration`)."""
    return (now or datetime.datetime.now(datetime.UTC)) + datetime.timedelta(seconds=REREAD_SECONDS)
