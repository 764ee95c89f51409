"""The engine's LoRA adapters: names, loading and unloading, references of requests, and before each step
the device slots of the running sequences' adapters. Used by `engine.generation.GenerationCore`.

Everything here runs in the busy loop's thread except reading an adapter's files, which a reader thread
of its own does (resolving the source, perhaps downloading it, reading and checking the tensors); the
result comes back through the loop (`LoopHandle.post`). So a load at run time never holds a step: the
running sequences keep stepping while the files are read, and the adapter reaches a device slot with one
copy at the first step that uses it (`AdapterBackend.prepare`, in the model thread before the forward).
An adapter that fell out of the host tier is read again the same way when a request names it; that
request joins the queue once its adapter's weights are back.

The served adapters travel to every front in the engine's `Status` (`LoopHandle.set_adapters`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from carpool.runtime import threads
from carpool.runtime.adapters import AdapterRegistry
from carpool.runtime.batching.continuous import Sequence, Work
from carpool.runtime.config import ConfigError, RuntimeConfig, adapter_name_problem
from carpool.runtime.engine.tasks import LoopHandle, Output
from carpool.runtime.errors import BatchFailed, CarpoolError, InvalidAdapter, ModelNotFound
from carpool.runtime.lora_metrics import LoraMetrics
from carpool.runtime.metrics import RuntimeMetrics
from carpool.runtime.models.base import AdapterBackend
from carpool.runtime.wire import AdapterDone, AdapterInfo, LoadAdapter, UnloadAdapter, error_output

log = logging.getLogger(__name__)

Refetched = Callable[[CarpoolError | None], list[Output]]
"""Told when the weights a parked request waits for are back on the host (None) or could not be read."""


class EngineAdapters:
    """The served adapters of one generative engine."""

    def __init__(
        self,
        backend: AdapterBackend,
        config: RuntimeConfig,
        metrics: RuntimeMetrics,
        loop: LoopHandle,
        clock: Callable[[], float],
    ) -> None:
        lora = config.lora
        self.backend = backend
        self.base = config.served_name()
        self.loop = loop
        self.clock = clock
        self.registry = AdapterRegistry(lora.max_loras, lora.cpu_slots)
        self.metrics = LoraMetrics(metrics)
        self._host: dict[str, Any] = {}
        """Host weights by adapter name (the registry decides which stay)."""
        self._given: dict[str, str] = {}
        """Each adapter's source as given (what the status shows and a re-read resolves again)."""
        self._loading: set[str] = set()
        self._waiting: dict[str, list[Refetched]] = {}
        """Requests parked until their adapter's weights are read again, by adapter."""
        self._reader = threads.one_thread_pool("carpool-lora-read", threads.LORA_READER)
        for name, source in lora.adapters.items():
            try:
                weights = backend.read(name, source)
            except InvalidAdapter as exc:
                raise ConfigError(f"lora.adapters.{name}: {exc.message}") from exc
            self._add(name, source, weights)
            log.info("LoRA adapter %s from %s", name, source)
        self._announce()

    @property
    def busy(self) -> bool:
        """Reads are in flight (a drain waits for their answers)."""
        return bool(self._loading or self._waiting)

    # -- requests -------------------------------------------------------------------------------

    def acquire(self, name: str) -> bool:
        """A request names `name`: hold it until `release`. True when it can be queued now; False when
        its weights are being read again (`park` it). ModelNotFound for a name not served."""
        try:
            hosted = self.registry.acquire(name)
        except ModelNotFound:
            raise ModelNotFound(
                f"model {name!r} is not served here; this server serves {self.base!r} and the LoRA "
                f"adapters {self.registry.names()}"
            ) from None
        self.metrics.request(name)
        return hosted

    def park(self, name: str, then: Refetched) -> None:
        """Hold a request until `name`'s weights are read back onto the host."""
        waiting = self._waiting.setdefault(name, [])
        waiting.append(then)
        if len(waiting) == 1:
            log.info("LoRA adapter %s is no longer in host memory: reading it again", name)
            self._read(
                name, self.registry.source(name), lambda weights, error: self._refetched(name, weights, error)
            )

    def release(self, name: str) -> None:
        self.registry.release(name)
        self._free(self.registry.take_dropped())

    def token(self, name: str) -> None:
        self.metrics.token(name)

    # -- steps ----------------------------------------------------------------------------------

    def place(
        self, running: Iterable[Sequence], work: Iterable[Work]
    ) -> tuple[list[tuple[int, Any]], dict[int, int]]:
        """Slots for the adapters of the running sequences (the scheduler keeps them within max_loras):
        the (slot, weights) to copy before the step, and the slot of each sequence of the step."""
        names = {seq.adapter for seq in running if seq.adapter is not None}
        if not names:
            return [], {}
        placement = self.registry.place(names, self.clock())
        self._free(placement.dropped)
        loads = [(slot, self._host[name]) for name, slot in placement.load]
        slot_of = {w.seq.seq: placement.slots[w.seq.adapter] for w in work if w.seq.adapter is not None}
        return loads, slot_of

    # -- controls -------------------------------------------------------------------------------

    def control(self, message: LoadAdapter | UnloadAdapter) -> list[Output]:
        try:
            if isinstance(message, UnloadAdapter):
                freed = self.registry.remove(message.name)
                self._free(self.registry.take_dropped())
                self._announce()
                log.info(
                    "unloaded LoRA adapter %s%s",
                    message.name,
                    "" if freed else " (freed when its requests end)",
                )
                return [(message.front, AdapterDone(message.rid, message.name, "unloaded"))]
            self._start_load(message)
            return []
        except CarpoolError as exc:
            return [(message.front, error_output(message.rid, exc))]

    def _start_load(self, message: LoadAdapter) -> None:
        name = message.name
        problem = adapter_name_problem(name)
        if problem:
            raise InvalidAdapter(f"lora_name: {problem}")
        if name == self.base:
            raise InvalidAdapter(f"lora_name {name!r} is the base model's own name")
        if name in self.registry:
            raise InvalidAdapter(f"adapter {name!r} is already loaded; unload it first to replace it")
        if name in self._loading:
            raise InvalidAdapter(f"adapter {name!r} is being loaded already")
        if self.registry.refs(name):
            raise InvalidAdapter(
                f"adapter {name!r} is still finishing requests since it was unloaded; retry shortly"
            )
        self._loading.add(name)

        def loaded(weights: Any, error: CarpoolError | None) -> list[Output]:
            self._loading.discard(name)
            if error is None:
                try:
                    self._add(name, message.source, weights)
                except CarpoolError as exc:
                    error = exc
            if error is not None:
                log.info("refused LoRA adapter %s from %s: %s", name, message.source, error.message)
                return [(message.front, error_output(message.rid, error))]
            self._announce()
            log.info("loaded LoRA adapter %s from %s", name, message.source)
            return [(message.front, AdapterDone(message.rid, name, "loaded"))]

        self._read(name, message.source, loaded)

    # -- internals ------------------------------------------------------------------------------

    def _read(self, name: str, source: str, then: Callable[[Any, CarpoolError | None], list[Output]]) -> None:
        def done(future: Future[Any]) -> None:
            error = future.exception()
            if error is None:
                result = future.result()
                self.loop.post(lambda: then(result, None))
                return
            if not isinstance(error, CarpoolError):
                log.error("reading LoRA adapter %s failed", name, exc_info=error)
                error = InvalidAdapter(f"adapter {name!r} cannot be read: {type(error).__name__}: {error}")
            failure = error
            self.loop.post(lambda: then(None, failure))

        self._reader.submit(self.backend.read, name, source).add_done_callback(done)

    def _refetched(self, name: str, weights: Any, error: CarpoolError | None) -> list[Output]:
        waiting = self._waiting.pop(name, [])
        if error is None:
            if self.registry.holds(name):  # the parked requests hold it, even if it was unloaded since
                self._host[name] = weights
                self.registry.hosted(name, self.clock())
                self._free(self.registry.take_dropped())
        else:
            error = BatchFailed(
                f"LoRA adapter {name!r} could not be read again from its source: {error.message}"
            )
        outputs: list[Output] = []
        for then in waiting:
            outputs.extend(then(error))
        return outputs

    def _add(self, name: str, source: str, weights: Any) -> None:
        self.registry.add(name, source, self.clock())
        self._host[name] = weights
        self._given[name] = source
        self._free(self.registry.take_dropped())

    def _free(self, names: list[str]) -> None:
        for name in names:
            self._host.pop(name, None)

    def _announce(self) -> None:
        names = self.registry.names()
        self.metrics.loaded.set(len(names))
        self.loop.set_adapters(tuple(AdapterInfo(n, self.base, self._given.get(n, "")) for n in names))

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)
