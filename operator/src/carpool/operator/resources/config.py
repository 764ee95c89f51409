"""The runtime config a BatchedModel renders to, and the ConfigMap that carries it into the pods."""

from __future__ import annotations

import hashlib
from decimal import Decimal, InvalidOperation
from typing import Any

import yaml
from pydantic import ValidationError

from carpool.operator import RUNTIME_PORT
from carpool.operator.resources.access import server_settings
from carpool.operator.resources.labels import CONFIG_FILE, config_map_name, standard_labels
from carpool.operator.spec import BatchedModelSpec
from carpool.operator.validation import SpecError
from carpool.runtime.config import ConfigError, RuntimeConfig


def _cpu_threads(spec: BatchedModelSpec) -> int | None:
    """Torch threads for a CPU-only pod: its CPU allotment, not the node's core count (which would
    oversubscribe the container's CPU quota)."""
    if spec.resources.gpus():
        return None
    value = spec.resources.limits.get("cpu", spec.resources.requests.get("cpu"))
    if value is None:
        return None
    text = str(value)
    try:
        cores = Decimal(text[:-1]) / 1000 if text.endswith("m") else Decimal(text)
    except InvalidOperation:
        return None
    return max(1, int(cores))


def runtime_config(spec: BatchedModelSpec) -> RuntimeConfig:
    """The runtime's config for this spec; raises SpecError when the runtime would refuse it."""
    # cache, credentials, fetch are the operator's (volumes, an init container); the runtime sees files.
    model = spec.model.model_dump(by_alias=False, exclude_unset=True, exclude=set(spec.model.OPERATOR_ONLY))
    # vLLM's CPU workers bind their own threads (torch_threads is one of the settings it ignores).
    if (
        "torch_threads" not in model
        and not spec.model.runs_vllm()
        and (threads := _cpu_threads(spec)) is not None
    ):
        model["torch_threads"] = threads
    data: dict[str, Any] = {
        "model": model,
        "batching": spec.batching.model_dump(by_alias=False, exclude_unset=True),
        "warmup": spec.warmup.model_dump(by_alias=False, exclude_unset=True),
        "server": {
            "host": "0.0.0.0",
            "port": RUNTIME_PORT,
            "max_body_bytes": spec.server.max_body_bytes,
            "log_level": spec.server.log_level,
            "log_format": spec.server.log_format,
            "grpc_port": spec.server.grpc_port,
            **({"workers": spec.server.workers} if spec.server.workers is not None else {}),
            **(
                {"drain_timeout_s": spec.server.drain_timeout_seconds}
                if spec.server.drain_timeout_seconds is not None
                else {}
            ),
            **(
                {"drain_keep_alive_s": spec.server.drain_keep_alive_seconds}
                if spec.server.drain_keep_alive_seconds is not None
                else {}
            ),
            **server_settings(spec),
        },
    }
    if spec.generation is not None:
        data["generation"] = spec.generation.model_dump(by_alias=False, exclude_unset=True)
    if spec.lora is not None:
        data["lora"] = {"enabled": True, **spec.lora.model_dump(by_alias=False, exclude_unset=True)}
    if (latency := spec.autoscaling.latency_target()) is not None:
        # The pods compute the autoscaling signal against it (carpool_slo_saturation).
        data["objective"] = {
            "latency_s": latency.seconds,
            "percentile": latency.percentile,
            "late_requests": latency.late_requests.lower(),
        }
    try:
        # model_validate, not RuntimeConfig(...): the settings sources (CARPOOL_* variables, a YAML
        # file) of the operator's own process must not leak into what the pods run.
        return RuntimeConfig.model_validate(data)
    except (ValidationError, ConfigError) as exc:
        raise SpecError("InvalidRuntimeConfig", f"the runtime would refuse this config: {exc}") from None


def render_runtime_config(config: RuntimeConfig) -> str:
    """The YAML the pods read. Only values that differ from the runtime's defaults are written, so a
    runtime image can add settings without the operator pinning their defaults."""
    data = config.model_dump(mode="json", exclude_defaults=True)
    server = data.setdefault("server", {})
    server["port"] = RUNTIME_PORT  # the contract with the probes and the Service, always explicit
    return yaml.safe_dump(data, sort_keys=True)


def config_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def config_map(name: str, text: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": config_map_name(name), "labels": standard_labels(name)},
        "data": {CONFIG_FILE: text},
    }
