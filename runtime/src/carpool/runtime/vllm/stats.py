"""vLLM's own Prometheus metrics for a model on vLLM's engine: vLLM's `PrometheusStatLogger`, in the engine
process, fed what vLLM's own server feeds it. Runs in vLLM's environment only (imported by `backend`).

Under `vllm serve` the engine core sends each step's `EngineCoreOutputs` (scheduler stats, and per request
its new tokens, events and prefill stats) to the API server, whose output processor turns them into
`IterationStats` (`vllm.v1.engine.output_processor`, `_update_stats_from_output` and
`_update_stats_from_finished`) and hands both to the stat logger. carpool's engine process holds vLLM's
engine core itself and its fronts never see vLLM's outputs, so this module does the output processor's
stats part here, with vLLM's own classes (`RequestStateStats`, `IterationStats`, `LoRARequestStates`):
every vLLM series (names, types, labels, buckets, `vllm:cache_config_info`) is vLLM's, computed by vLLM's
code from the same numbers. Arrival is the front's (carpool's `arrival`, when the request reached the
front), where vLLM's is its API server's.

How the series reach /metrics: prometheus_client in vLLM's environment writes them, as it writes
carpool's own, to the pod's PROMETHEUS_MULTIPROC_DIR (the supervisor's folder, which the engine process
inherits); any front's scrape (and the metrics port) merges every process's files, so one answer per pod
carries carpool's series and vLLM's. vLLM's own server reads its series the same way (its API server's
registry is a `MultiProcessCollector` over that folder).

Differences from vLLM's own server, written down: a request carpool withdraws (client gone, deadline, a
stop string the front saw; the wire does not say which) is forgotten as vLLM's API server forgets an
aborted one, so it is not in `vllm:request_success` or the per-request histograms; and carpool adds
`vllm:gpu_cache_usage_perc` (the KV-cache use under the name EPP releases before v1.3.0 read by default, which
vLLM dropped after 0.9). Requests of carpool's warm-up are not counted (stats start when serving does).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import Gauge
from vllm.config import VllmConfig
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.stats import IterationStats, LoRARequestStates, RequestStateStats

ENGINE = 0
"""vLLM's engine index: one engine core per carpool pod."""


@dataclass
class _Request:
    stats: RequestStateStats
    arrival: float
    """carpool's arrival (monotonic, the clock of vLLM's engine-core timestamps)."""
    prompt_len: int
    max_tokens: int | None
    lora_name: str | None
    prefilling: bool = True
    cached_tokens: int = 0
    scheduled: bool = False


@dataclass
class StepCounts:
    """What carpool's own series take from a step: sequences preempted, and each request's wait from
    arrival to its first scheduling (`carpool_preemptions_total`, `carpool_queue_wait_seconds`)."""

    preempted: int = 0
    queue_waits: list[float] = field(default_factory=list)


class VllmStats:
    """vLLM's stat logger and the output processor's stats state, for one engine core."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self._logger = PrometheusStatLogger(vllm_config, [ENGINE])
        self._logger.log_engine_initialized()  # vllm:cache_config_info, now that the cache is sized
        self._lora = LoRARequestStates(log_stats=True)
        self._requests: dict[str, _Request] = {}
        model_name = vllm_config.model_config.served_model_name
        self._gpu_cache_usage = Gauge(
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage. The name the Gateway API Inference Extension's "
            "endpoint picker reads by default (vLLM's before 0.9); the same value as "
            "vllm:kv_cache_usage_perc.",
            ["model_name", "engine"],
            multiprocess_mode="mostrecent",
        ).labels(model_name, str(ENGINE))
        self._gpu_cache_usage.set(0.0)

    def added(
        self, request_id: str, arrival: float, prompt_len: int, max_tokens: int | None, lora: str | None
    ) -> None:
        """A request vLLM's engine core accepted; `arrival` on the monotonic clock (carpool's)."""
        wall = time.time() - (time.monotonic() - arrival)  # vLLM's arrival_time is wall-clock
        self._requests[request_id] = _Request(
            RequestStateStats(arrival_time=wall), arrival, prompt_len, max_tokens, lora
        )

    def dropped(self, request_ids: list[str]) -> None:
        """Requests carpool aborted: forgotten, as vLLM's output processor forgets an aborted one."""
        for request_id in request_ids:
            request = self._requests.pop(request_id, None)
            if request is not None:
                self._lora.request_finished(request_id, request.lora_name)

    def step(self, outputs: EngineCoreOutputs) -> StepCounts:
        """One step's outputs, recorded as vLLM's AsyncLLM output handler records them."""
        counts = StepCounts()
        iteration = IterationStats() if outputs.outputs else None
        for output in outputs.outputs:
            request = self._requests.get(output.request_id)
            if request is None or iteration is None:
                continue
            preempted_before = iteration.num_preempted_reqs
            iteration.update_from_output(
                output,
                outputs.timestamp,
                request.prefilling,
                request.stats,
                self._lora,
                request.lora_name,
            )
            counts.preempted += iteration.num_preempted_reqs - preempted_before
            if not request.scheduled and request.stats.scheduled_ts:
                request.scheduled = True
                counts.queue_waits.append(max(0.0, request.stats.scheduled_ts - request.arrival))
            if request.prefilling:
                if output.prefill_stats is not None:
                    request.cached_tokens = output.prefill_stats.num_cached_tokens
                request.prefilling = False
            if output.finish_reason is not None:
                del self._requests[output.request_id]
                iteration.update_from_finished_request(
                    finish_reason=output.finish_reason,
                    request_id=output.request_id,
                    num_prompt_tokens=request.prompt_len,
                    max_tokens_param=request.max_tokens,
                    req_stats=request.stats,
                    num_cached_tokens=request.cached_tokens,
                )
                self._lora.request_finished(output.request_id, request.lora_name)
                # ParentRequest.observe_finished_request for a request without n > 1 children
                iteration.max_num_generation_tokens_iter.append(request.stats.num_generation_tokens)
                iteration.n_params_iter.append(1)
        self._lora.update_scheduler_stats(outputs.scheduler_stats)
        self._logger.record(
            scheduler_stats=outputs.scheduler_stats, iteration_stats=iteration, engine_idx=ENGINE
        )
        if outputs.scheduler_stats is not None:
            self._gpu_cache_usage.set(outputs.scheduler_stats.kv_cache_usage)
        return counts
