"""A child process started with `subprocess` that the supervisor watches as it watches a `multiprocessing`
child: `pid`, `sentinel` (a pidfd, readable once it has ended), `exitcode`, `is_alive`, `join`, `kill`.
vLLM's engine process (`vllm.launch.EngineProcess`) and the native front (`native.NativeFront`) are such
children: neither is a Python function a spawn could run."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence


class PopenChild:
    name = "carpool-child"

    def __init__(self) -> None:
        self._popen: subprocess.Popen[bytes] | None = None
        self._pidfd = -1

    def _launch(
        self, argv: Sequence[str], env: Mapping[str, str] | None = None, pass_fds: Sequence[int] = ()
    ) -> None:
        self._popen = subprocess.Popen(list(argv), env=env, pass_fds=tuple(pass_fds))
        self._pidfd = os.pidfd_open(self._popen.pid)

    @property
    def pid(self) -> int | None:
        return None if self._popen is None else self._popen.pid

    @property
    def sentinel(self) -> int:
        """Readable once the process has ended (`multiprocessing.connection.wait` takes it)."""
        return self._pidfd

    @property
    def exitcode(self) -> int | None:
        """As multiprocessing reports it: negative for a process killed by a signal."""
        return None if self._popen is None else self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        if self._popen is None:
            return
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    def kill(self) -> None:
        if self.is_alive() and self._popen is not None:
            self._popen.send_signal(signal.SIGKILL)
