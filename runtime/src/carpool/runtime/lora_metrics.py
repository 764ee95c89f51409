"""Per-adapter metrics for LoRA serving, beside `RuntimeMetrics` (the same registry, or in multiprocess
mode the same folder of files, so one scrape of any front shows them).

Kept apart from `metrics` so that a server without adapters exposes none of them. The engine records
them all: it is where requests are admitted and tokens generated, and in multiprocess mode counters are
summed over processes and the gauge is the engine's last value. Labels: `model` (the base model's served
name) and `adapter`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from carpool.runtime.metrics import RuntimeMetrics


class LoraMetrics:
    def __init__(self, metrics: RuntimeMetrics) -> None:
        self.model = metrics.model
        registry = CollectorRegistry() if metrics.multiprocess else metrics.registry
        self._requests = Counter(
            "carpool_lora_requests",
            "Generation requests accepted per LoRA adapter.",
            ["model", "adapter"],
            registry=registry,
        )
        self._tokens = Counter(
            "carpool_lora_generated_tokens",
            "Tokens generated per LoRA adapter.",
            ["model", "adapter"],
            registry=registry,
        )
        self.loaded = Gauge(
            "carpool_lora_adapters_loaded",
            "LoRA adapters loaded (requests may name them).",
            ["model"],
            registry=registry,
            multiprocess_mode="mostrecent",
        ).labels(self.model)
        self._token_counters: dict[str, Counter] = {}

    def request(self, adapter: str) -> None:
        self._requests.labels(self.model, adapter).inc()

    def token(self, adapter: str) -> None:
        counter = self._token_counters.get(adapter)
        if counter is None:
            counter = self._token_counters[adapter] = self._tokens.labels(self.model, adapter)
        counter.inc()
