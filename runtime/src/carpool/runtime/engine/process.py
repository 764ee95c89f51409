"""The engine process's entry point: build the engine the config names, then load, warm up and serve.

The supervisor (`server.py`) starts it with the `spawn` method (a fresh interpreter: torch and CUDA never
cross a fork). SIGTERM or SIGINT during load or warm-up exits at once (there is nothing to finish);
afterwards they start a drain (see `core`). The process exits 0 when drained, 1 when the model failed
to load or the loop stopped.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable
from typing import cast

from carpool.runtime import threads
from carpool.runtime.config import RuntimeConfig, Task
from carpool.runtime.engine.core import EngineCore
from carpool.runtime.engine.encoder import EncoderCore
from carpool.runtime.engine.generation import GenerationCore
from carpool.runtime.engine.tasks import LoopHandle, TaskCore
from carpool.runtime.logs import configure
from carpool.runtime.metrics import RuntimeMetrics
from carpool.runtime.models.base import AnyEngine, Engine, GenerativeEngine
from carpool.runtime.wire import Addresses

log = logging.getLogger(__name__)

EngineFactory = Callable[[RuntimeConfig], AnyEngine]


def load_engine(config: RuntimeConfig) -> AnyEngine:
    """The transformers engine the config asks for (imports torch: only in the engine process)."""
    from carpool.runtime.models.loader import load_engine as load

    return load(config)


def factory_from(path: str | None) -> EngineFactory:
    """`module:attribute` naming a callable (config) -> engine; None: the transformers engines."""
    if not path:
        return load_engine
    module, _, attribute = path.partition(":")
    factory = getattr(importlib.import_module(module), attribute)
    return cast(EngineFactory, factory)


def task_core(
    engine: AnyEngine, config: RuntimeConfig, metrics: RuntimeMetrics, loop: LoopHandle | None = None
) -> TaskCore:
    """The task family's core around a loaded engine."""
    if engine.info.task is Task.GENERATE:
        return GenerationCore(cast(GenerativeEngine, engine), config, metrics, loop=loop)
    return EncoderCore(cast(Engine, engine), config, metrics)


def build_core(
    config: RuntimeConfig,
    addresses: Addresses,
    factory: EngineFactory,
    metrics: RuntimeMetrics,
    parent_pid: int | None = None,
    engine: int = 0,
) -> EngineCore:
    def load() -> TaskCore:
        return task_core(factory(config), config, metrics, core)

    if config.objective.latency_s is not None:
        # Loading and warming up, the pod carries no load: 0 from the first scrape, so that the HPA
        # counts it as capacity on its way instead of missing (see `batching.saturation`).
        metrics.set_saturation(0.0)
    core = EngineCore(addresses, load, metrics, parent_pid=parent_pid, engine=engine)
    return core


def main(
    config_data: dict[str, object], addresses: Addresses, factory_path: str | None = None, engine: int = 0
) -> None:
    """Run engine process number `engine` (the target the supervisor spawns); exits with the core's
    code."""
    threads.name_thread(threads.ENGINE)  # before torch starts its OpenMP workers: they take this name
    config = RuntimeConfig.model_validate(config_data)
    configure(config.server.log_level, config.server.log_format)
    metrics = RuntimeMetrics(config.served_name())
    core = build_core(
        config, addresses, factory_from(factory_path), metrics, parent_pid=os.getppid(), engine=engine
    )
    core.on_signals()
    sys.exit(core.run())
