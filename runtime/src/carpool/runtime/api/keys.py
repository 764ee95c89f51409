"""The API keys a server accepts: read from `server.api_keys_file`, re-read when the file changes.

The file holds one key per line; blank lines and lines starting with `#` are ignored. In a cluster it
is a Secret mounted by the operator, which the kubelet updates by swapping a symlink (`..data`) to a
new folder, never by writing in place; by hand it may be rewritten or replaced with `mv`. Both change
what `os.stat` (which follows symlinks) reports, so the file is stat'ed at most once per
`check_interval_s` on the request path (a cheap syscall) and re-read only when its identity (device,
inode, size, modification time) differs. The new keys replace the old ones in one assignment, so a
request sees either set, never a mix. A file that cannot be read while the server runs (mid-swap,
deleted by mistake) keeps the last good keys and logs a warning once: failing open is not an option
and locking every client out for a transient error would be an outage.

Keys are never logged and never kept as text: only their SHA-256 digests are held, and a presented
token is hashed and compared with every digest with `hmac.compare_digest`, so neither the outcome's
timing nor its length tells a caller how close a guess was or which key matched.

Used by `api.auth.ApiKeyAuth`; `api.app.create_app` builds it at start-up, so a missing or empty file
stops the server before it listens.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from carpool.runtime.config import ServerConfig

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0
"""How often, at most, the file's identity is checked on the request path."""


class KeyFileError(ValueError):
    """The keys file cannot be used at start-up; the message names the file and why (never a key)."""


def parse_keys(text: str) -> list[str]:
    """The keys of a keys file's text: one per line, stripped; blank lines and `#` comments skipped."""
    keys = []
    for line in text.splitlines():
        key = line.strip()
        if key and not key.startswith("#"):
            keys.append(key)
    return keys


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _identity(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)  # follows symlinks: a Kubernetes Secret's `..data` swap changes the inode
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class KeyFile:
    """The accepted keys, reloaded from `path` when it changes. `clock` is injected for tests."""

    def __init__(
        self,
        path: Path,
        check_interval_s: float = CHECK_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.check_interval_s = check_interval_s
        self._clock = clock
        try:
            identity = _identity(path)
            keys = parse_keys(path.read_text())
        except (OSError, UnicodeDecodeError) as exc:
            raise KeyFileError(f"server.api_keys_file {path}: cannot read it: {exc}") from None
        if not keys:
            raise KeyFileError(
                f"server.api_keys_file {path} holds no key (one key per line; blank lines and "
                f"# comments are ignored): every request would be refused"
            )
        self._digests: tuple[bytes, ...] = tuple(_digest(key) for key in keys)
        self._identity = identity
        self._checked = clock()
        self._warned: str | None = None
        log.info("API keys loaded from %s: %d key(s)", path, len(keys))

    @property
    def count(self) -> int:
        """How many keys are accepted now."""
        return len(self._digests)

    def accepts(self, token: str) -> bool:
        """True when `token` is one of the keys; constant time over every key."""
        self.refresh()
        presented = _digest(token)
        matched = False
        for digest in self._digests:
            # No early exit: every key is compared whatever the outcome.
            matched |= hmac.compare_digest(presented, digest)
        return matched

    def refresh(self) -> None:
        """Re-read the file if it changed, at most once per `check_interval_s`."""
        now = self._clock()
        if now - self._checked < self.check_interval_s:
            return
        self._checked = now
        try:
            identity = _identity(self.path)
            if identity == self._identity:
                return
            keys = parse_keys(self.path.read_text())
        except (OSError, UnicodeDecodeError) as exc:
            self._warn(f"cannot read {self.path} ({type(exc).__name__}); keeping the previous keys")
            return
        self._identity = identity
        # An emptied file revokes every key: refusing all is what its author asked for.
        self._digests = tuple(_digest(key) for key in keys)
        self._warned = None
        log.info("API keys reloaded from %s: %d key(s)", self.path, len(keys))
        if not keys:
            log.warning("%s now holds no key: every authenticated route answers 401", self.path)

    def _warn(self, message: str) -> None:
        if message != self._warned:
            log.warning(message)
            self._warned = message


def load_keys(server: ServerConfig) -> KeyFile | None:
    """The keys of `server.api_keys_file`, or None when API keys are off; raises KeyFileError."""
    return None if server.api_keys_file is None else KeyFile(server.api_keys_file)
