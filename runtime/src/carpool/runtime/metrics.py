"""Every Prometheus metric the runtime exports, defined once (names are a contract with the operator,
the chart's prometheus-adapter rules and dashboards: see ARCHITECTURE.md).

A pod runs several processes (the engine and the HTTP fronts, see `server.py`), and one scrape of any
front must cover them all. So, as prometheus_client's multiprocess mode has it, the supervisor points
PROMETHEUS_MULTIPROC_DIR at a fresh folder before it starts them; each process writes its values to
files there and a scrape merges them: counters and histograms summed over processes (requests counted in
every front), the engine's gauges (running sequences, cache use, ready) as last set, queue depth summed
and backlog the largest over the live engine processes (`model.processes`), and in-flight requests summed
over the live fronts. The engine sets its gauges after every scheduling
turn instead of being read at scrape time (a scrape happens in a front, which cannot read the engine).

Without that variable (tests running the engine and a front in one process) each `RuntimeMetrics` keeps
its own registry, so several servers can share a process.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client import (
    GCCollector as _GCCollector,
)
from prometheus_client import (
    PlatformCollector as _PlatformCollector,
)
from prometheus_client import (
    ProcessCollector as _ProcessCollector,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from carpool.runtime.vllm_metrics import VllmNames

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512)
PROTOCOLS = ("http", "grpc")
"""The `protocol` label of the request counters: the HTTP routes, and KServe v2 over gRPC (`api.grpc`)."""

_RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0)
_STARTUP_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)
STARTUP_PHASES = ("start", "load", "warmup")
"""The phases of `carpool_startup_duration_seconds`, in order (see `observe_startup`)."""


class RuntimeMetrics:
    """The runtime's metrics for one served model (label `model`)."""

    def __init__(self, model: str, registry: CollectorRegistry | None = None) -> None:
        self.model = model
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.registry = registry or CollectorRegistry()
        """What `exposition` shows of this process: its own process metrics, and (without multiprocess
        mode) every metric below."""
        _ProcessCollector(registry=self.registry)
        _PlatformCollector(registry=self.registry)
        _GCCollector(registry=self.registry)
        # In multiprocess mode the values live in files and the scrape reads them all from there.
        r = CollectorRegistry() if self.multiprocess else self.registry
        labels = ["model"]
        self.queue_depth = Gauge(
            "carpool_queue_depth",
            "Inputs waiting, not yet in a batch (the autoscaling signal).",
            labels,
            registry=r,
            multiprocess_mode="livesum",  # summed over the engine processes (`model.processes`)
        ).labels(model)
        self.backlog = Gauge(
            "carpool_queue_backlog_seconds",
            "Queued work divided by the throughput of recent batches: seconds to clear the queue.",
            labels,
            registry=r,
            multiprocess_mode="livemax",  # the slowest engine process's (`model.processes`)
        ).labels(model)
        self.inflight = Gauge(
            "carpool_inflight_requests",
            "Requests accepted and not yet answered.",
            labels,
            registry=r,
            multiprocess_mode="livesum",
        ).labels(model)
        self.batch_size = Histogram(
            "carpool_batch_size", "Inputs per executed batch.", labels, buckets=_BATCH_BUCKETS, registry=r
        ).labels(model)
        self.queue_wait = Histogram(
            "carpool_queue_wait_seconds",
            "Time from arrival to the start of the input's batch.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model)
        self.batch_duration = Histogram(
            "carpool_batch_duration_seconds",
            "Model time of one batch.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model)
        durations = Histogram(
            "carpool_request_duration_seconds",
            "Time from arrival to answer, per request (label `protocol`: http or grpc).",
            ["model", "protocol"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_durations = {protocol: durations.labels(model, protocol) for protocol in PROTOCOLS}
        self.request_duration = self.request_durations["http"]
        """The HTTP routes' child of `carpool_request_duration_seconds`."""
        self.padding_ratio = Histogram(
            "carpool_padding_ratio",
            "Share of a batch's computed tokens that are padding.",
            labels,
            buckets=_RATIO_BUCKETS,
            registry=r,
        ).labels(model)
        self._requests = Counter(
            "carpool_requests",
            "Requests answered, by HTTP status code (gRPC calls by the HTTP status their code stands for, "
            "see `api.grpc.status`) and protocol (http or grpc).",
            ["model", "status", "protocol"],
            registry=r,
        )
        self._request_counts: dict[tuple[int, str], Counter] = {}
        """(status, protocol) -> its child of `carpool_requests`: every request counts, and `labels` takes
        a lock and builds the label tuple each time (2 us of the front's CPU a request)."""
        self.warmup_seconds = Gauge(
            "carpool_warmup_seconds",
            "Duration of the warm-up before ready.",
            labels,
            registry=r,
            multiprocess_mode="mostrecent",
        ).labels(model)
        self._ready = Gauge(
            "carpool_ready",
            "1 when loaded, warmed up and not draining.",
            labels,
            registry=r,
            multiprocess_mode="livemin",  # 1 only when every engine process is (`model.processes`)
        )
        """Written by the engine processes alone (`set_ready`): in multiprocess mode a process that only
        made the child would add a 0 of its own to the minimum."""
        self._startup = Histogram(
            "carpool_startup_duration_seconds",
            "Seconds each phase of an engine process's start took, by phase: start (from the server's "
            "start, the container's main process, until the engine begins loading the model: the "
            "interpreter, imports, the engine process's spawn), load (the model onto its device), "
            "warmup (the warm-up batches, until ready). Scheduling and the image pull come before "
            "the container: the scheduler's and the kubelet's metrics measure them.",
            ["model", "phase"],
            buckets=_STARTUP_BUCKETS,
            registry=r,
        )
        self.warmup_batches = Counter(
            "carpool_warmup_batches", "Dummy batches run by the warm-up.", labels, registry=r
        ).labels(model)
        self.running = Gauge(
            "carpool_running_sequences",
            "Sequences in the running batch (generation).",
            labels,
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.kv_usage = Gauge(
            "carpool_kv_cache_usage_ratio",
            "Share of the KV cache's blocks in use (generation).",
            labels,
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self.generated_tokens = Counter(
            "carpool_generated_tokens", "Tokens generated.", labels, registry=r
        ).labels(model)
        self.time_to_first_token = Histogram(
            "carpool_time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model)
        self.inter_token_latency = Histogram(
            "carpool_inter_token_latency_seconds",
            "Time between consecutive tokens of one sequence.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model)
        self.preemptions = Counter(
            "carpool_preemptions",
            "Sequences preempted for lack of KV cache and requeued for recompute.",
            labels,
            registry=r,
        ).labels(model)
        self.oom_splits = Counter(
            "carpool_oom_splits",
            "Batches split in halves after running out of device memory.",
            labels,
            registry=r,
        ).labels(model)
        self._slo_saturation = Gauge(
            "carpool_slo_saturation",
            "Load over the load at which the latency objective just holds (1.0: at the objective; the "
            "autoscaling signal for a latency target). Exported only when an objective is configured.",
            labels,
            registry=r,
            multiprocess_mode="livemax",  # the most loaded engine process's (`model.processes`)
        )
        """Its child exists only once `set_saturation` is called: without an objective the name is absent
        rather than a misleading 0."""
        self._vllm_names: VllmNames | None = None
        self._auth_refusals = Counter(
            "carpool_auth_refusals",
            "Requests refused for want of an accepted API key (any path, method or gRPC method), by reason "
            "and protocol.",
            ["model", "reason", "protocol"],
            registry=r,
        )

    def set_queue(self, depth: int, backlog_seconds: float) -> None:
        """The scheduler's queue, after a scheduling turn (engine)."""
        self.queue_depth.set(depth)
        self.backlog.set(backlog_seconds)

    def set_ready(self, ready: bool) -> None:
        """This engine process is loaded, warmed up and not draining (or not)."""
        self._ready.labels(self.model).set(1 if ready else 0)

    def observe_startup(self, phase: str, seconds: float) -> None:
        """One phase of this engine process's start (`STARTUP_PHASES`), once each (engine)."""
        self._startup.labels(self.model, phase).observe(seconds)

    def set_saturation(self, value: float) -> None:
        """How near the pod runs to its latency objective (engine, objective configured only)."""
        self._slo_saturation.labels(self.model).set(value)

    def set_generation(self, running: int, kv_usage: float) -> None:
        self.running.labels(self.model).set(running)
        self.kv_usage.labels(self.model).set(kv_usage)

    def vllm_names(self) -> VllmNames:
        """vLLM's scheduler series for carpool's own engines (`vllm_metrics`): made on first use, by
        the engine process alone (a front that made them would add its zeros to the pod's sums)."""
        if self._vllm_names is None:
            from carpool.runtime.vllm_metrics import VllmNames

            registry = CollectorRegistry() if self.multiprocess else self.registry
            self._vllm_names = VllmNames(self.model, registry)
        return self._vllm_names

    def count_request(self, status: int, protocol: str = "http", count: int = 1) -> None:
        child = self._request_counts.get((status, protocol))
        if child is None:
            child = self._request_counts[status, protocol] = self._requests.labels(
                self.model, str(status), protocol
            )
        child.inc(count)

    def count_auth_refusal(self, reason: str, protocol: str = "http") -> None:
        """`reason`: `missing_key` (no usable Authorization header) or `invalid_key`."""
        self._auth_refusals.labels(self.model, reason, protocol).inc()

    def exposition(self) -> bytes:
        """The scrape: this process's metrics, and in multiprocess mode every process's carpool metrics."""
        own = generate_latest(self.registry)
        if not self.multiprocess:
            return own
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)  # type: ignore[no-untyped-call]
        return own + generate_latest(merged)


def observe_many(histogram: Histogram, values: Sequence[float]) -> None:
    """`histogram.observe(value)` for each of `values`, each bucket touched and the sum written once: in
    multiprocess mode every write is to a memory-mapped file under a lock (about 2 us), so a batch's or a
    loop turn's observations cost a few writes instead of two per value. `histogram` is a labelled child;
    this reads the same fields `Histogram.observe` writes (prometheus_client's `_upper_bounds`,
    `_buckets`, `_sum`; a test holds the two equal)."""
    if not values:
        return
    bounds: list[float] = histogram._upper_bounds
    counts = [0] * len(bounds)
    for value in values:
        index = bisect.bisect_left(bounds, value)  # the first bound >= value, as `observe` picks it
        if index < len(bounds):
            counts[index] += 1
    histogram._sum.inc(sum(values))
    buckets = histogram._buckets
    for index, count in enumerate(counts):
        if count:
            buckets[index].inc(count)
