"""The fatal error of a runtime process, written where Kubernetes shows it.

The kubelet copies `/dev/termination-log` into the container's `lastState.terminated.message`, which the
operator turns into the BatchedModel's condition and Event (a crash loop on a 401 from the model hub
then says so, instead of "warming up"). Written only where that file exists (in a pod) or where
`CARPOOL_TERMINATION_LOG` names one; the kubelet keeps at most 4096 bytes, so the end of the message is
kept. Never raises: reporting must not hide the error being reported.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

DEFAULT_PATH = "/dev/termination-log"
LIMIT_BYTES = 4096


def termination_log_path() -> Path | None:
    configured = os.environ.get("CARPOOL_TERMINATION_LOG")
    if configured:
        return Path(configured)
    path = Path(DEFAULT_PATH)
    return path if path.exists() else None


def write_termination_message(message: str) -> None:
    path = termination_log_path()
    if path is None:
        return
    data = message.strip().encode("utf-8", "replace")
    if len(data) > LIMIT_BYTES:
        data = b"..." + data[-(LIMIT_BYTES - 3) :]
    with contextlib.suppress(OSError):
        path.write_bytes(data)
