"""Generation on vLLM's engine, under carpool's busy loop (`engine.core.EngineCore`): the task core that
turns the wire's requests into vLLM requests and vLLM's token ids back into the wire's outputs.

Pure: it drives a `VllmBackend` (protocol below) and never imports vllm, so its rules are tested with a
scripted backend in carpool's own environment; `vllm.backend` is the real one.

What stays carpool's: admission (the bounded queue, 429 with Retry-After), deadlines (a request past its
deadline is aborted in vLLM and answered 504), withdrawals (a client that went away, a stop string the
front saw: aborted in vLLM), priorities (passed on to vLLM's priority scheduler), LoRA adapter names, and
the metrics, with the same names as carpool's own engine (queue depth and running sequences and KV-cache
use from vLLM's scheduler stats). What is vLLM's: the schedule, the KV cache, the model.

vLLM's engine core is not thread-safe: every call into it (add, abort, step, LoRA) happens in the model
thread, in `Launch.run`, between two steps. The busy loop only records what to do next; requests that
arrive while a step runs join at the next one, as they do in vLLM's own `EngineCoreProc`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from carpool.runtime.batching.saturation import BatchLimits, objective_estimator
from carpool.runtime.config import ConfigError, RuntimeConfig, adapter_name_problem
from carpool.runtime.engine.tasks import EXPIRED, Launch, LoopHandle, Output, publish_saturation
from carpool.runtime.errors import (
    BatchFailed,
    CarpoolError,
    DeadlineExceeded,
    InvalidAdapter,
    InvalidInput,
    ModelNotFound,
    QueueFull,
)
from carpool.runtime.metrics import RuntimeMetrics
from carpool.runtime.sampling import SamplingParams
from carpool.runtime.vllm.args import vllm_priority
from carpool.runtime.wire import (
    AdapterDone,
    AdapterInfo,
    EngineInfo,
    FrontMessage,
    GenerateRequest,
    LoadAdapter,
    TextSpec,
    TokenLogprobs,
    TokenOutput,
    UnloadAdapter,
    VllmOutputs,
    VllmRequest,
    error_output,
)

log = logging.getLogger(__name__)

_NO_PARAMS = SamplingParams()
"""The unused `params` of an `Add` that carries vLLM's own request."""


@dataclass(frozen=True)
class Add:
    """A request for vLLM (`request_id` is carpool's rid as text)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    """vLLM's order (lowest first), already mapped from carpool's."""
    arrival: float
    adapter: Adapter | None = None
    request: list[bytes] | None = None
    """vLLM's own request as vLLM's surface sent it (`wire.VllmRequest`: vLLM's `EngineCoreRequest`,
    rendered and checked there): `prompt` and `params` are then unused."""
    prepared: object | None = None
    """What the backend made of it as it arrived (`VllmBackend.prepare`), for the step that adds it."""
    prompt_tokens: int | None = None
    """A request from vLLM's surface: its prompt's length, once prepared (`prompt` is empty)."""

    @property
    def prompt_length(self) -> int:
        return len(self.prompt) if self.request is None else (self.prompt_tokens or 0)


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter as vLLM knows it (`LoRARequest`)."""

    name: str
    id: int
    path: str
    source: str


@dataclass(frozen=True)
class Delta:
    """New token ids of one request from a step; `finish` is vLLM's reason when it ended there."""

    request_id: str
    ids: list[int]
    finish: str | None = None
    """`stop` (end of text or a stop token, which is in `ids`), `length`, `abort` or `error`."""
    logprobs: TokenLogprobs | None = None
    """One row per id, where the request asked (vLLM's `new_logprobs`: as wide as the widest request of
    the step asked, so cut to this request's own width here)."""
    raw: object | None = None
    """vLLM's own output (`EngineCoreOutput`), for a request from vLLM's surface: what goes back to it."""


@dataclass(frozen=True)
class Stats:
    """vLLM's scheduler after a step."""

    running: int
    waiting: int
    kv_usage: float


@dataclass
class StepResult:
    deltas: list[Delta] = field(default_factory=list)
    stats: Stats | None = None
    controls: list[tuple[Control, CarpoolError | None]] = field(default_factory=list)
    """The adapter loads and unloads done before the step, each with its error (None: done)."""
    refused: list[tuple[str, str]] = field(default_factory=list)
    """Requests vLLM's input validation refused when they were added: (request id, vLLM's reason)."""
    preempted: int = 0
    """Requests vLLM's scheduler preempted in the step (its PREEMPTED events)."""
    queue_waits: list[float] = field(default_factory=list)
    """Seconds from arrival to first scheduling, of each request vLLM scheduled for the first time."""
    tokens: int = 0
    """Tokens the step computed (vLLM's schedule: prompt tokens, cached ones not, and one per decoding
    sequence): the step's size in the latency objective's service model."""


@dataclass(frozen=True)
class Control:
    """An adapter to load (`adapter`) or unload (`unload`) in the model thread."""

    front: int
    rid: int
    adapter: Adapter
    unload: bool = False


class VllmBackend(Protocol):
    """vLLM's engine core as this core uses it. Called from the model thread only (`run`, `warm_up`)."""

    @property
    def info(self) -> EngineInfo: ...

    def text_spec(self) -> TextSpec: ...

    @property
    def eos_ids(self) -> set[int]: ...

    @property
    def limits(self) -> BatchLimits:
        """What one step may carry: vLLM's `max_num_seqs` and `max_num_batched_tokens` as resolved."""
        ...

    def run(self, adds: list[Add], aborts: list[str], controls: list[Control]) -> StepResult:
        """Apply the adds, aborts and adapter changes, then run one step if vLLM has work."""
        ...

    def prepare(self, add: Add) -> Add:
        """Called from the loop thread as a request from vLLM's surface arrives, while a step may be
        running: what vLLM's own engine does in its input thread as a request comes in (a structured-output
        request's grammar starts compiling then, and is ready for the next step's schedule, not one step
        later). The add to hand to `run`, carrying what was prepared."""
        ...

    def has_work(self) -> bool: ...

    def begin_serving(self) -> None:
        """Warm-up is over: vLLM's own metrics count from here (`vllm.stats`)."""
        ...

    def dummy_prompt(self, length: int) -> list[int]: ...

    def read_adapter(self, name: str, source: str) -> str:
        """The local folder of a PEFT adapter (raises InvalidAdapter with the reason)."""
        ...

    def pack(self, outputs: list[object]) -> list[bytes]:
        """vLLM's outputs of one step for one surface (`Delta.raw`s), as vLLM's `EngineCoreOutputs` in
        vLLM's own encoding (`wire.VllmOutputs`)."""
        ...

    def check(self) -> None:
        """Raise when a process the backend depends on (vLLM's surface processes) has gone."""
        ...


@dataclass(eq=False)
class _Stream:
    rid: int
    front: int
    deadline: float
    arrival: float
    adapter: str | None
    logprobs: int | None = None
    """The top logprobs asked for per token (None: none)."""
    surface: bool = False
    """From vLLM's surface: answered with vLLM's own outputs (`VllmOutputs`), not `TokenOutput`s."""
    tokens: int = 0
    last_token_at: float | None = None


class VllmCore:
    """A `TaskCore` on vLLM's engine (see the module docstring)."""

    instances = 1

    def __init__(
        self,
        backend: VllmBackend,
        config: RuntimeConfig,
        metrics: RuntimeMetrics,
        loop: LoopHandle | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.config = config
        self.metrics = metrics
        self.loop = loop
        self.clock = clock
        self._streams: dict[str, _Stream] = {}
        self._adds: list[Add] = []
        self._aborts: list[str] = []
        self._controls: list[Control] = []
        self._in_step = 0
        """Adds applied by the running step, not yet in vLLM's stats."""
        self._stepping = False
        self._stats = Stats(0, 0, 0.0)
        self._adapters: dict[str, Adapter] = {}
        self._next_adapter_id = 1
        self._tokens_per_s = 0.0
        """Recent generation speed (tokens/s, smoothed): what the backlog is measured in."""
        self._tokens_per_request = float(config.generation.default_max_tokens)
        self.saturation = objective_estimator(config.objective, backend.limits, generation=True)
        """The latency objective's signal (`carpool_slo_saturation`), fitted to vLLM's steps."""
        if config.lora.adapters:
            for name, source in config.lora.adapters.items():
                try:
                    path = backend.read_adapter(name, source)
                except InvalidAdapter as exc:
                    raise ConfigError(f"lora.adapters.{name}: {exc.message}") from exc
                self._adapters[name] = self._adapter(name, path, source)
        self._announce()

    # -- what the busy loop asks ----------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self.backend.info

    def text_spec(self) -> TextSpec:
        return self.backend.text_spec()

    @property
    def busy(self) -> bool:
        return bool(self._streams or self._adds or self._aborts or self._controls or self._stepping)

    @property
    def waiting(self) -> int:
        """Requests accepted and not yet running in vLLM: its waiting queue at the last step, plus what
        joined since."""
        return self._stats.waiting + self._in_step + len(self._adds)

    def submit(self, message: FrontMessage, now: float) -> list[Output]:
        if isinstance(message, LoadAdapter | UnloadAdapter):
            return self._control(message)
        if not isinstance(message, GenerateRequest | VllmRequest):
            front = getattr(message, "front", 0)
            error = InvalidInput(
                f"model {self.info.name!r} generates text: use /v1/completions or /v1/chat/completions"
            )
            return [(front, error_output(getattr(message, "rid", 0), error))]
        adapter: Adapter | None = None
        if message.adapter is not None:
            adapter = self._adapters.get(message.adapter)
            if adapter is None:
                served = ", ".join(sorted(self._adapters)) or "no LoRA adapters"
                error_: CarpoolError = ModelNotFound(
                    f"model {message.adapter!r} is not served here; this server serves {self.info.name!r} "
                    f"and {served}"
                )
                return [(message.front, error_output(message.rid, error_))]
        if self.waiting >= self.config.batching.max_queue_size:
            error_ = QueueFull(
                f"the queue is full ({self.waiting} requests waiting); retry later",
                max(1.0, round(self.backlog_seconds(), 1)),
            )
            return [(message.front, error_output(message.rid, error_))]
        request_id = str(message.rid)
        surface = isinstance(message, VllmRequest)
        self._streams[request_id] = _Stream(
            message.rid,
            message.front,
            message.deadline,
            message.arrival,
            message.adapter,
            None if isinstance(message, VllmRequest) else message.params.logprobs,
            surface,
        )
        levels = self.config.batching.priority_levels
        priority = vllm_priority(min(message.priority, levels - 1), levels)
        if isinstance(message, VllmRequest):
            add = Add(request_id, [], _NO_PARAMS, priority, message.arrival, adapter, message.request)
            add = self.backend.prepare(add)
        else:
            add = Add(request_id, message.prompt, message.params, priority, message.arrival, adapter)
        self._adds.append(add)
        if self.saturation is not None:
            self.saturation.arrive(now, 1, add.prompt_length)
        return []

    def abort(self, rids: list[int]) -> None:
        for rid in rids:
            self._withdraw(str(rid))

    def schedule(self, now: float) -> tuple[list[Output], Launch | None, float | None]:
        self.backend.check()
        outputs: list[Output] = []
        for request_id, stream in list(self._streams.items()):
            if stream.deadline <= now:
                message = EXPIRED if stream.tokens == 0 else _ran_out(stream.tokens)
                outputs.append((stream.front, error_output(stream.rid, DeadlineExceeded(message))))
                self._withdraw(request_id)
        next_deadline = min((s.deadline for s in self._streams.values()), default=None)
        if self._stepping:
            return outputs, None, next_deadline
        if not (self._adds or self._aborts or self._controls or self._streams):
            return outputs, None, next_deadline
        adds, aborts, controls = self._adds, self._aborts, self._controls
        self._adds, self._aborts, self._controls = [], [], []
        self._in_step = len(adds)
        self._stepping = True
        started = self.clock()
        backend = self.backend

        def run() -> StepResult:
            return backend.run(adds, aborts, controls)

        def complete(result: StepResult | None, exc: BaseException | None) -> list[Output]:
            self._stepping = False
            self._in_step = 0
            if result is None:
                return self._failed(adds, exc)
            return self._complete(result, self.clock() - started)

        return outputs, Launch(run, complete), None

    def publish_gauges(self) -> None:
        backlog = self.backlog_seconds()
        self.metrics.set_queue(self.waiting, backlog)
        self.metrics.set_generation(self._stats.running, self._stats.kv_usage)
        publish_saturation(self.saturation, self.config, self.metrics, self.clock(), backlog)

    def backlog_seconds(self) -> float:
        """Queued work over recent speed: the tokens the waiting requests will likely generate, at the
        tokens per second the engine has lately produced (0 before it has produced any)."""
        if self._tokens_per_s <= 0:
            return 0.0
        return self.waiting * self._tokens_per_request / self._tokens_per_s

    # -- warm-up --------------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Prefill and decode through vLLM at the configured batch sizes and prompt lengths, before the
        first request (vLLM compiles at load; this also runs its scheduler, sampler and cache paths)."""
        warmup, generation = self.config.warmup, self.config.generation
        if not warmup.enabled:
            self.backend.begin_serving()
            return
        started = time.perf_counter()
        sizes = warmup.batch_sizes or sorted({1, generation.running_sequences()})
        limit = self.info.max_input_tokens
        lengths = warmup.sequence_lengths or [16, min(512, limit // 2)]
        params = SamplingParams(max_tokens=4, temperature=0.0)
        count = 0
        for size in sizes:
            for length in lengths:
                length = max(1, min(length, limit - 8))
                for _ in range(warmup.iterations):
                    began = time.perf_counter()
                    adds = [
                        Add(f"warmup-{count}-{n}", self.backend.dummy_prompt(length), params, 0, 0.0)
                        for n in range(min(size, generation.running_sequences()))
                    ]
                    count += 1
                    steps = 0
                    self._warmup_step(adds)
                    while self.backend.has_work():
                        self._warmup_step([])
                        steps += 1
                    self.metrics.warmup_batches.inc()
                    log.info(
                        "warm-up through vLLM: %d sequences x %d prompt tokens, %d steps: %.1f ms",
                        len(adds),
                        length,
                        steps,
                        (time.perf_counter() - began) * 1000,
                    )
        total = time.perf_counter() - started
        self.metrics.warmup_seconds.set(total)
        log.info("warm-up finished in %.2fs", total)
        self.backend.begin_serving()

    def _warmup_step(self, adds: list[Add]) -> None:
        """One step of the warm-up; its size and time seed the latency objective's service model (the
        warm-up spans the configured shapes, so the fit has a slope before the first request)."""
        began = time.perf_counter()
        result = self.backend.run(adds, [], [])
        if self.saturation is not None:
            self.saturation.warmup_batch(result.tokens, time.perf_counter() - began)

    # -- internals ------------------------------------------------------------------------------

    def _withdraw(self, request_id: str) -> None:
        """Forget a request; vLLM aborts it at the next step (or never sees it, if it was not added)."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        pending = [add for add in self._adds if add.request_id == request_id]
        if pending:
            self._adds.remove(pending[0])
        else:
            self._aborts.append(request_id)

    def _complete(self, result: StepResult, seconds: float) -> list[Output]:
        outputs: list[Output] = []
        for control, error in result.controls:
            name = control.adapter.name
            if error is None:
                action = "unloaded" if control.unload else "loaded"
                outputs.append((control.front, AdapterDone(control.rid, name, action)))
                continue
            if not control.unload and self._adapters.get(name) is control.adapter:
                del self._adapters[name]
            outputs.append((control.front, error_output(control.rid, error)))
        if result.controls:
            self._announce()
        for request_id, reason in result.refused:
            refused = self._streams.pop(request_id, None)
            if refused is not None:  # a client error: 400 with vLLM's words, the step's others run on
                error_ = InvalidInput(f"vLLM refused the request: {reason}")
                outputs.append((refused.front, error_output(refused.rid, error_)))
        if result.stats is not None:
            self._stats = result.stats
        if self.saturation is not None:
            self.saturation.batch(result.tokens, seconds)
        if result.preempted:
            self.metrics.preemptions.inc(result.preempted)
        for wait in result.queue_waits:
            self.metrics.queue_wait.observe(wait)
        now = self.clock()
        produced = 0
        surfaced: dict[int, list[object]] = {}
        """vLLM's own outputs of this step, by the surface they go back to."""
        for delta in result.deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue  # withdrawn meanwhile: its abort is on its way
            if stream.surface:
                # vLLM's surface reads vLLM's output whole (its detokenizer, stop strings, logprobs,
                # parsers); carpool counts the tokens and forgets the request when vLLM finishes it.
                produced += len(delta.ids)
                self._tokens(stream, len(delta.ids), now)
                surfaced.setdefault(stream.front, []).append(delta.raw)
                if delta.finish is not None:
                    del self._streams[delta.request_id]
                    self._finished(stream)
                continue
            ids = delta.ids
            if delta.finish == "stop" and ids and ids[-1] in self.backend.eos_ids:
                ids = ids[:-1]  # the end-of-text token is not part of the answer (as carpool's own engine)
            logprobs = delta.logprobs
            if logprobs is not None:
                asked = stream.logprobs
                logprobs = logprobs.head(len(ids), None if asked is None else asked + 1) if ids else None
            produced += len(delta.ids)
            self._tokens(stream, len(delta.ids), now)
            if delta.finish in ("abort", "error"):
                error = BatchFailed(f"vLLM ended the request ({delta.finish})")
                outputs.append((stream.front, error_output(stream.rid, error)))
                del self._streams[delta.request_id]
                continue
            outputs.append((stream.front, TokenOutput(stream.rid, ids, delta.finish, logprobs)))
            if delta.finish is not None:
                del self._streams[delta.request_id]
                self._finished(stream)
        for front, raws in surfaced.items():
            outputs.append((front, VllmOutputs(self.backend.pack(raws))))
        if produced:
            self.metrics.batch_duration.observe(seconds)
            self.metrics.batch_size.observe(len(result.deltas))
            speed = produced / max(seconds, 1e-6)
            self._tokens_per_s = speed if self._tokens_per_s <= 0 else 0.8 * self._tokens_per_s + 0.2 * speed
        return outputs

    def _finished(self, stream: _Stream) -> None:
        """A request vLLM ended: its length feeds the backlog's estimate and the objective's model (a
        sequence's decode steps)."""
        self._tokens_per_request += 0.1 * (stream.tokens - self._tokens_per_request)
        if self.saturation is not None:
            self.saturation.finished(stream.tokens)

    def _tokens(self, stream: _Stream, count: int, now: float) -> None:
        if count <= 0:
            return
        self.metrics.generated_tokens.inc(count)
        if stream.last_token_at is None:
            self.metrics.time_to_first_token.observe(now - stream.arrival)
        else:
            self.metrics.inter_token_latency.observe((now - stream.last_token_at) / count)
        stream.last_token_at = now
        stream.tokens += count

    def _failed(self, adds: list[Add], exc: BaseException | None) -> list[Output]:
        """A step raised: every request vLLM holds is failed (its state is unknown), and the engine goes
        on with the next requests."""
        log.error("vLLM step failed; failing its %d requests", len(self._streams), exc_info=exc)
        error = BatchFailed(f"the model failed on this step: {type(exc).__name__}: {exc}")
        outputs: list[Output] = [(s.front, error_output(s.rid, error)) for s in self._streams.values()]
        self._aborts.extend(self._streams)
        self._streams.clear()
        return outputs

    # -- LoRA -----------------------------------------------------------------------------------

    def _adapter(self, name: str, path: str, source: str) -> Adapter:
        adapter = Adapter(name, self._next_adapter_id, path, source)
        self._next_adapter_id += 1
        return adapter

    def _control(self, message: LoadAdapter | UnloadAdapter) -> list[Output]:
        if not self.config.lora.active:
            error: CarpoolError = InvalidInput(
                f"model {self.info.name!r} serves no LoRA adapters: start it with lora.enabled"
            )
            return [(message.front, error_output(message.rid, error))]
        if isinstance(message, UnloadAdapter):
            adapter = self._adapters.pop(message.name, None)
            if adapter is None:
                return [
                    (message.front, error_output(message.rid, ModelNotFound(f"no adapter {message.name!r}")))
                ]
            self._controls.append(Control(message.front, message.rid, adapter, unload=True))
            return []
        problem = adapter_name_problem(message.name)
        if problem or message.name == self.info.name:
            why = problem or f"{message.name!r} is the base model's own name"
            return [(message.front, error_output(message.rid, InvalidInput(why)))]
        if message.name in self._adapters:
            error = InvalidInput(f"adapter {message.name!r} is already loaded; unload it first")
            return [(message.front, error_output(message.rid, error))]
        try:
            path = self.backend.read_adapter(message.name, message.source)
        except CarpoolError as exc:
            return [(message.front, error_output(message.rid, exc))]
        adapter = self._adapter(message.name, path, message.source)
        self._adapters[message.name] = adapter
        self._controls.append(Control(message.front, message.rid, adapter))
        return []

    def _announce(self) -> None:
        if self.loop is None:
            return
        base = self.config.served_name()
        self.loop.set_adapters(tuple(AdapterInfo(a.name, base, a.source) for a in self._adapters.values()))


def _ran_out(tokens: int) -> str:
    return (
        f"the request ran past its deadline after generating {tokens} tokens and was stopped; allow a longer "
        "timeout (header x-carpool-timeout) or ask for fewer tokens (max_tokens)"
    )
