"""carpool's config as vLLM's engine arguments (`vllm.engine.arg_utils.EngineArgs` keywords). Pure: no
vllm import, so the mapping is tested in carpool's own environment.

What carpool schedules itself stays carpool's (admission and the 429 queue bound, deadlines, the front's
stop strings); what the engine does is vLLM's: its scheduler runs with priorities (`scheduling_policy:
priority`), its own KV cache and chunked prefill.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from carpool.runtime.config import (
    DEFAULT_CONTEXT_CAP,
    ConfigError,
    DistributedBackend,
    DType,
    ModelConfig,
    RuntimeConfig,
)

GIB = 1024**3

CPU_KV_CACHE_BYTES = 1 * GIB
"""KV cache of a CPU engine unless `generation.kv_cache_tokens` or `vllm_args` size it: vLLM's own default
reserves 92% of the host's memory, which a shared node does not have (vLLM refuses to start); 1 GiB holds
46,592 tokens of SmolLM2-135M."""


def vllm_priority(priority: int, levels: int) -> int:
    """vLLM runs the lowest value first; carpool's highest level goes first."""
    return levels - 1 - priority


def resolve_dtype(dtype: DType, device: str, cpu_has_bf16: bool) -> str:
    """`model.dtype` for vLLM: `auto` is bfloat16 on a CPU with native bf16 (AVX512-BF16 or AMX: vLLM's
    CPU kernels are written for it, 2.3x float32's tokens/s on SmolLM2), float32 on other CPUs, and
    vLLM's own choice (the checkpoint's, float16 where bf16 is missing) on GPUs."""
    if dtype is not DType.AUTO:
        return dtype.value
    if device == "cpu":
        return "bfloat16" if cpu_has_bf16 else "float32"
    return "auto"


LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
"""Set by the LeaderWorkerSet's pod webhook in every pod of a group: the leader pod's address."""


def leader_address(model: ModelConfig, environ: Mapping[str, str]) -> str:
    """Where a multi-node group's ranks meet (vLLM's `master_addr`): `model.leader_address`, else the
    LeaderWorkerSet's `LWS_LEADER_ADDRESS`. Neither: a ConfigError (vLLM would wait at 127.0.0.1 for
    ranks that never come)."""
    address = model.leader_address or environ.get(LEADER_ADDRESS_ENV, "")
    if not address:
        raise ConfigError(
            f"model.nodes is {model.nodes}: the group's ranks meet at the leader, so set "
            f"model.leader_address (a LeaderWorkerSet sets {LEADER_ADDRESS_ENV} in every pod)"
        )
    return address


def engine_args(
    config: RuntimeConfig,
    model_path: str,
    device: str,
    cpu_has_bf16: bool,
    model_limit: int | None,
    kv_bytes_per_token: int,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Keywords for `EngineArgs`, from the config; `model.vllm_args` win. `model_limit`: the checkpoint's
    longest context (None: unknown); `kv_bytes_per_token`: what one token's keys and values take in the
    cache (to size it from `generation.kv_cache_tokens`); `environ`: the process's environment (for the
    LeaderWorkerSet's leader address)."""
    model, generation, lora = config.model, config.generation, config.lora
    args: dict[str, Any] = {
        "model": model_path,
        "served_model_name": [config.served_name()],
        "dtype": resolve_dtype(model.dtype, device, cpu_has_bf16),
        "max_num_seqs": generation.max_running_sequences,
        "scheduling_policy": "priority",
        "trust_remote_code": model.trust_remote_code,
        "tensor_parallel_size": model.tensor_parallel_size,
        "pipeline_parallel_size": model.pipeline_parallel_size,
        "disable_log_stats": False,
        "max_logprobs": generation.max_logprobs,
    }
    if model.revision:
        args["revision"] = model.revision
    context = generation.max_model_len or min(model_limit or DEFAULT_CONTEXT_CAP, DEFAULT_CONTEXT_CAP)
    args["max_model_len"] = context
    if generation.kv_cache_tokens is not None:
        args["kv_cache_memory_bytes"] = generation.kv_cache_tokens * kv_bytes_per_token
    elif device == "cpu":
        args["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    if model.distributed_executor_backend is not DistributedBackend.AUTO:
        args["distributed_executor_backend"] = model.distributed_executor_backend.value
    if model.nodes > 1:
        args["nnodes"] = model.nodes
        args["node_rank"] = model.node_rank
        args["master_addr"] = leader_address(model, environ or {})
        args["master_port"] = model.leader_port
    if lora.active:
        args.update(
            enable_lora=True,
            max_loras=lora.max_loras,
            max_lora_rank=lora.max_rank,
            max_cpu_loras=lora.cpu_slots,
        )
    args.update({name: yaml.safe_load(text) for name, text in model.vllm_args.items()})
    return args
