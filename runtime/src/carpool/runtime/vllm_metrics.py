"""vLLM's metric names, from carpool's own engines' numbers: what the Gateway API Inference Extension's
endpoint picker (EPP), vLLM's dashboards and KEDA recipes read from a model server, exported by carpool's
generation engine and its encoders as vLLM 0.32 exports them (names, types, labels, multiprocess modes:
vllm/v1/metrics/loggers.py `PrometheusStatLogger`).

Under vLLM's engine these series come from vLLM's own stat logger instead (`carpool.runtime.vllm.stats`),
never from here: one exporter per name and pod.

- `vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc` (labels
  `model_name`, `engine`): the scheduler's queue and running batch after each scheduling turn, and the
  share of KV-cache blocks in use (0 for encoders, which keep no cache). Encoders count inputs, as
  `carpool_queue_depth` does; generation counts sequences.
- `vllm:gpu_cache_usage_perc`: the same value under the name EPP releases before v1.3.0 read by default
  (`--kv-cache-usage-percentage-metric`); vLLM renamed it in 0.9 and no longer exports it.
- `vllm:lora_requests_info` (labels `max_lora`, `running_lora_adapters`, `waiting_lora_adapters`; value:
  the time it was last set): only with LoRA adapters on, as in vLLM. The EPP reads the series with the
  largest value.
- `vllm:cache_config_info` (generation only): a gauge at 1 whose labels are vLLM's CacheConfig fields
  (`CACHE_CONFIG_LABELS`); carpool fills those it has (`block_size`, `num_gpu_blocks`, the cache's size
  in tokens, no prefix caching) and leaves the others empty.

With several engine processes (`model.processes`, encoders), the pod exports one series per name (the
EPP reads one per pod): waiting and running summed over the live processes, KV use the largest.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge

LABELS = ("model_name", "engine")
"""vLLM's labels on its per-engine series."""
ENGINE = "0"
"""The `engine` label: vLLM's engine index (data-parallel rank); one engine per carpool pod."""
LORA_LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")

CACHE_CONFIG_LABELS = (
    "block_size",
    "user_specified_block_size",
    "kv_cache_layout",
    "prefix_match_unit",
    "gpu_memory_utilization",
    "cache_dtype",
    "is_attention_free",
    "num_gpu_blocks_override",
    "sliding_window",
    "enable_prefix_caching",
    "prefix_caching_hash_algo",
    "prefix_cache_retention_interval",
    "kv_cache_dtype_skip_layers",
    "mamba_page_size_padded",
    "skip_page_size_padded",
    "mamba_block_size",
    "mamba_cache_dtype",
    "mamba_ssm_cache_dtype",
    "mamba_cache_mode",
    "enable_mamba_shared_prefix_checkpoint",
    "replayssm_buffer_len",
    "use_replayssm",
    "use_kda_recoverssm",
    "num_gpu_blocks",
    "num_cpu_blocks",
    "effective_attention_block_size",
    "kv_cache_size_tokens",
    "kv_cache_max_concurrency",
    "hash_block_size",
    "cache_hit_alignment_tokens",
    "kv_sharing_fast_prefill",
    "swa_bounded_replay",
    "kv_cache_memory_bytes",
    "kv_offloading_size",
    "kv_offloading_backend",
    "_block_size_resolved",
    "engine",
)
"""The labels of vLLM 0.32's `vllm:cache_config_info`: `CacheConfig.metrics_info()` (every field of the
config, in order) and `engine`. The vLLM tier checks them against the labels of vLLM's own series."""


@dataclass(frozen=True)
class CacheFacts:
    """What carpool's generation engine knows of its KV cache, for `vllm:cache_config_info`."""

    block_size: int
    num_blocks: int
    cache_dtype: str = "auto"


class VllmNames:
    """vLLM's scheduler series for one engine process of carpool's own engines (see the module
    docstring). Made once per `RuntimeMetrics` (`RuntimeMetrics.vllm_names`), in the engine process."""

    def __init__(self, model: str, registry: CollectorRegistry) -> None:
        self._registry = registry
        labels = (model, ENGINE)
        self.waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            LABELS,
            registry=registry,
            multiprocess_mode="livesum",
        ).labels(*labels)
        self.running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            LABELS,
            registry=registry,
            multiprocess_mode="livesum",
        ).labels(*labels)
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            LABELS,
            registry=registry,
            multiprocess_mode="livemax",
        ).labels(*labels)
        self.gpu_cache_usage = Gauge(
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage. The name the Gateway API Inference Extension's "
            "endpoint picker reads by default (vLLM's before 0.9); the same value as "
            "vllm:kv_cache_usage_perc.",
            LABELS,
            registry=registry,
            multiprocess_mode="livemax",
        ).labels(*labels)
        self._lora: Gauge | None = None
        self._max_lora = ""
        self._lora_key: tuple[str, str] | None = None
        self._lora_child: Gauge | None = None

    def publish(self, waiting: int, running: int, kv_usage: float) -> None:
        """The scheduler after a turn (the engine's `publish_gauges`)."""
        self.waiting.set(waiting)
        self.running.set(running)
        self.kv_usage.set(kv_usage)
        self.gpu_cache_usage.set(kv_usage)

    def enable_lora(self, max_loras: int) -> None:
        """Serve `vllm:lora_requests_info` (vLLM: only with a LoRA config)."""
        if self._lora is None:
            self._lora = Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                LORA_LABELS,
                registry=self._registry,
                multiprocess_mode="sum",
            )
        self._max_lora = str(max_loras)

    def lora(self, running: Iterable[str | None], waiting: Iterable[str | None]) -> None:
        """The adapters of the running and the waiting requests (None: the base model): the series for
        that pair of sets, set to now, as vLLM sets it after each step."""
        if self._lora is None:
            return
        key = (_names(running), _names(waiting))
        if key != self._lora_key or self._lora_child is None:
            self._lora_key = key
            self._lora_child = self._lora.labels(
                max_lora=self._max_lora, running_lora_adapters=key[0], waiting_lora_adapters=key[1]
            )
        self._lora_child.set(time.time())

    def cache_config(self, facts: CacheFacts) -> None:
        """`vllm:cache_config_info` for carpool's KV cache (set once, after the cache is allocated)."""
        values = dict.fromkeys(CACHE_CONFIG_LABELS, "")
        values.update(
            block_size=str(facts.block_size),
            num_gpu_blocks=str(facts.num_blocks),
            kv_cache_size_tokens=str(facts.block_size * facts.num_blocks),
            cache_dtype=facts.cache_dtype,
            enable_prefix_caching="False",
            engine=ENGINE,
        )
        Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            CACHE_CONFIG_LABELS,
            registry=self._registry,
            multiprocess_mode="mostrecent",
        ).labels(**values).set(1)


def _names(adapters: Iterable[str | None]) -> str:
    """vLLM's label value: the adapters' names joined by commas (sorted here: one series per set)."""
    return ",".join(sorted({a for a in adapters if a is not None}))
