"""What the busy loop needs of a task family (encoders, generation): one protocol, two implementations,
and the part of them that is the same (`ModelCore`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from carpool.runtime.batching.saturation import HPA_PERIOD_S, SaturationEstimator
from carpool.runtime.config import RuntimeConfig
from carpool.runtime.errors import CarpoolError
from carpool.runtime.metrics import RuntimeMetrics
from carpool.runtime.wire import (
    AdapterDone,
    AdapterInfo,
    EncodeOutput,
    EngineInfo,
    ErrorOutput,
    FrontMessage,
    TextSpec,
    TokenOutput,
    VllmOutputs,
    error_output,
)

STARTED = time.monotonic()
"""About when this engine process started (it imports this module first thing, before the model loads)."""

EXPIRED = (
    "the request waited past its deadline and was not run; retry, or allow a longer timeout "
    "(header x-carpool-timeout)"
)
"""The answer (504) to a request still queued at its deadline, whatever the task."""

Output = tuple[int, EncodeOutput | TokenOutput | ErrorOutput | AdapterDone | VllmOutputs]
"""An output and the index of the front it goes to."""


class LoopHandle(Protocol):
    """What a task core may ask of the busy loop beyond its turns (the LoRA adapters use it)."""

    def post(self, work: Callable[[], list[Output]]) -> None:
        """Run `work` in the busy loop's thread at its next turn (from any thread); send its outputs."""
        ...

    def set_adapters(self, adapters: tuple[AdapterInfo, ...]) -> None:
        """Announce the served LoRA adapters to every front (in the engine's status). Busy loop only."""
        ...


@dataclass(eq=False)
class Launch:
    """Model work the scheduler has chosen: `run` goes to the model thread, `complete` gets its result
    (or the exception it raised) back in the busy loop's thread."""

    run: Callable[[], Any]
    complete: Callable[[Any, BaseException | None], list[Output]]


class TaskCore(Protocol):
    """A model with its scheduler. Called from the busy loop's thread only."""

    instances: int
    """Launches that may run at once (`model.instances`): the engine runs that many model threads."""

    @property
    def info(self) -> EngineInfo: ...

    def text_spec(self) -> TextSpec: ...

    def warm_up(self) -> None:
        """Run the warm-up passes (before ready)."""
        ...

    def submit(self, message: FrontMessage, now: float) -> list[Output]:
        """Admit a request (or answer it at once with an error: queue full, wrong task)."""
        ...

    def abort(self, rids: list[int]) -> None:
        """Withdraw these requests: queued work never runs, running sequences stop."""
        ...

    def schedule(self, now: float) -> tuple[list[Output], Launch | None, float | None]:
        """Expire what waited too long, and choose the next batch or step unless one is running: the
        outputs to send now, the work to launch, and when to call again at the latest (None: on the
        next message or completion)."""
        ...

    @property
    def busy(self) -> bool:
        """Requests are queued or running."""
        ...

    def publish_gauges(self) -> None:
        """Set the scheduler gauges (queue depth, backlog, running sequences, cache use)."""
        ...


def publish_saturation(
    saturation: SaturationEstimator | None,
    config: RuntimeConfig,
    metrics: RuntimeMetrics,
    now: float,
    backlog_s: float,
) -> None:
    """Export how near the pod runs to its latency objective (`carpool_slo_saturation`), when one is set:
    what every engine's core does as it publishes its gauges."""
    if saturation is None:
        return
    if config.objective.lead_s is None and not saturation.lead_s:
        # The first turn after ready: a pod added now takes about what this one took.
        saturation.lead_s = time.monotonic() - STARTED + HPA_PERIOD_S
    metrics.set_saturation(saturation.update(now, backlog_s).saturation)


class _Model(Protocol):
    """What every model backend tells about itself (`models.base.Engine`, `GenerativeEngine`)."""

    @property
    def info(self) -> EngineInfo: ...

    def text_spec(self) -> TextSpec: ...


M = TypeVar("M", bound=_Model)


class ModelCore(Generic[M]):
    """What the encoder and generation cores share: their model, config, metrics and clock, the model's
    facts for the fronts, and the answer to a request of the other task family."""

    instances = 1
    saturation: SaturationEstimator | None = None
    """The latency objective's signal (`objective` in the config), or None without one."""

    def __init__(
        self,
        engine: M,
        config: RuntimeConfig,
        metrics: RuntimeMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.clock = clock

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    def text_spec(self) -> TextSpec:
        return self.engine.text_spec()

    def publish_saturation(self, backlog_s: float) -> None:
        """Export how near the pod runs to its latency objective (when one is set)."""
        publish_saturation(self.saturation, self.config, self.metrics, self.clock(), backlog_s)

    def refuse(self, message: FrontMessage, error: CarpoolError) -> list[Output]:
        """Answer `message` at once with `error` (an `Abort` or `Goodbye` has no request to answer)."""
        return [(getattr(message, "front", 0), error_output(getattr(message, "rid", 0), error))]
