"""The engine process's side of vLLM's surface: start one surface process per front (`vllm.surface`, in
vLLM's environment, with this interpreter), wait until each serves, notice when one dies, stop them.

The surface processes are the engine's children, not the supervisor's: they need vLLM's configuration as
the engine built it (handed over as a pickle, as vLLM hands its `VllmConfig` to `EngineCoreProc`), and the
engine is what the fronts already watch, so a surface that dies fails the engine (the pod restarts) like
any other part of it. They ignore SIGINT and SIGTERM (the engine drains first, then stops them).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from carpool.runtime.wire import Addresses

log = logging.getLogger(__name__)

READY_LINE = b"carpool-surface-ready\n"
"""What a surface process writes on its stdout once it serves."""
START_TIMEOUT_S = 600.0
"""Importing vLLM's serving stack and loading the tokenizer: 10-60 s on a loaded 2-core host."""


class SurfaceProcesses:
    """vLLM's surface processes of one engine, one per front."""

    def __init__(self, procs: list[subprocess.Popen[bytes]]) -> None:
        self._procs = procs
        self._stopping = False

    @classmethod
    def start(
        cls,
        config: dict[str, Any],
        addresses: Addresses,
        vllm_config: Any,
        tasks: tuple[str, ...],
        model: str,
        frontend_args: list[str],
        folder: Path,
    ) -> SurfaceProcesses:
        """Start one surface per front and wait until each serves (RuntimeError naming the one that did
        not, with its exit code)."""
        folder.mkdir(parents=True, exist_ok=True)
        pickled = folder / "vllm-config.pickle"
        pickled.write_bytes(pickle.dumps(vllm_config))
        procs = []
        for front in range(len(addresses.outputs)):
            payload = {
                "config": config,
                "front": front,
                "slot": len(addresses.outputs) + front,
                "engine_input": addresses.input,
                "front_output": addresses.outputs[front],
                "surface_input": addresses.surface_input(front),
                "surface_output": addresses.surface_output(front),
                "vllm_config": str(pickled),
                "tasks": list(tasks),
                "model": model,
                "frontend_args": frontend_args,
            }
            command = [sys.executable, "-m", "carpool.runtime.vllm", "surface", json.dumps(payload)]
            procs.append(subprocess.Popen(command, stdout=subprocess.PIPE))
        surfaces = cls(procs)
        try:
            surfaces._wait_ready()
        except BaseException:
            surfaces.stop()
            raise
        return surfaces

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for front, proc in enumerate(self._procs):
            assert proc.stdout is not None
            line = b""
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(
                        f"vLLM's surface for front {front} did not start in {START_TIMEOUT_S:.0f} s"
                    )
                readable, _, _ = select.select([proc.stdout], [], [], min(left, 1.0))
                if readable:
                    chunk = os.read(proc.stdout.fileno(), 256)
                    if not chunk:
                        code = proc.wait()
                        raise RuntimeError(
                            f"vLLM's surface for front {front} exited with {code} while starting"
                        )
                    line += chunk
            if line != READY_LINE:
                raise RuntimeError(f"vLLM's surface for front {front} said {line!r} instead of being ready")
            log.info("vLLM's OpenAI surface for front %d serves (pid %d)", front, proc.pid)

    def check(self) -> None:
        """RuntimeError when a surface process has exited (the engine then fails, and the pod restarts)."""
        if self._stopping:
            return
        for front, proc in enumerate(self._procs):
            code = proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"vLLM's surface process for front {front} (pid {proc.pid}) exited with {code}"
                )

    def stop(self) -> None:
        self._stopping = True
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self._procs:
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
