"""The BatchedModel spec: the single source of truth for the resource's shape.

`crd` generates `crds/batchedmodel.yaml` from these models (attribute docstrings become the schema's
descriptions, `Field` bounds its bounds, `x-kubernetes-validations` its CEL rules), the builders read a
validated `BatchedModelSpec`, and `carpool render` parses user files with it. The runtime's own sections
(model, batching, generation, warm-up) are subclassed from `carpool.runtime.config` with camelCase
aliases, so the operator and the runtime can never disagree on a bound or a default.

Cross-field rules live twice on purpose: as CEL in the CRD (the API server refuses the object) and as
pydantic validators here (the operator refuses it too when a server without the CRD's rules, or an old
CRD, let it through).
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel

from carpool.operator.spec_pods import (
    CAMEL,
    RESERVED_ENV,
    RESERVED_LABEL_PREFIX,
    CredentialsSpec,
    ModelCacheSpec,
    Quantity,
    RolloutSpec,
)
from carpool.runtime.config import (
    MAX_DRAIN_KEEP_ALIVE_S,
    MAX_DRAIN_S,
    BatchingConfig,
    EngineKind,
    GenerationConfig,
    LoraConfig,
    ModelConfig,
    ServerConfig,
    Task,
    WarmupConfig,
)

GPU_RESOURCE = "nvidia.com/gpu"

DEFAULT_IMAGE = "ghcr.io/carpool-serving/carpool-runtime:0.1.0"
"""The runtime image (CUDA build) unless the operator is told another (`carpool operator --runtime-image`,
the chart's `runtime.image`). The CPU-only build carries the same tag with a `-cpu` suffix; either with
vLLM's engine installed, the tag with `-vllm` after it (`Dockerfile` targets `runtime-vllm` and
`runtime-cpu-vllm`)."""

CPU_IMAGE_SUFFIX = "-cpu"

VLLM_IMAGE_SUFFIX = "-vllm"
"""Appended to the runtime image's tag (after `-cpu` where no GPU is requested) for pods that run vLLM's
engine: the image whose /opt/.venv-vllm holds the vLLM release carpool is tested against."""

_CAMEL = CAMEL  # one camelCase configuration for every spec model (spec_pods defines it)

KubernetesObject = Annotated[
    dict[str, Any], WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})
]
"""A Kubernetes API object passed through unchanged (validated by the API server where it lands)."""


def _rules(*rules: tuple[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": [{"rule": rule, "message": message} for rule, message in rules]}


def _autoscaled(obj: str) -> str:
    """CEL: autoscaling is on for this spec (`autoscaling.enabled` absent means its default, true)."""
    return f"(!has({obj}.autoscaling) || !has({obj}.autoscaling.enabled) || {obj}.autoscaling.enabled)"


def _default(model: type[BaseModel], field: str) -> Any:
    return model.model_fields[field].default


class _Spec(BaseModel):
    model_config = _CAMEL


_TENSOR = "(has(self.tensorParallelSize) ? self.tensorParallelSize : 1)"
_PIPELINE = "(has(self.pipelineParallelSize) ? self.pipelineParallelSize : 1)"
_PARALLEL = f"{_TENSOR} > 1 || {_PIPELINE} > 1 || (has(self.nodes) && self.nodes > 1)"
"""CEL, on the model section: the model is split over several devices or nodes."""


# --- the runtime's sections, camelCased -------------------------------------------------------------


class ModelSpec(ModelConfig):
    """Which model to serve and how to load it (the runtime's `model` section, plus where the operator
    keeps its files and the credentials to fetch them)."""

    model_config = ConfigDict(
        **_CAMEL,
        json_schema_extra=_rules(
            (
                "!has(self.quantization) || !(self.quantization in ['int4', 'int8', 'fp8']) || "
                "(has(self.task) && self.task == 'generate')",
                "quantization int4, int8 and fp8 apply to task generate only",
            ),
            (
                "!has(self.instances) || self.instances == 1 || !has(self.task) || self.task != 'generate'",
                "instances above 1 apply to embed, classify and rerank: generate runs one continuous batch",
            ),
            (
                "!has(self.processes) || self.processes == 1 || !has(self.task) || self.task != 'generate'",
                "processes above 1 apply to embed, classify and rerank: generate runs in one engine process",
            ),
            (
                f"!({_PARALLEL}) || !has(self.engine) || self.engine in ['auto', 'vllm']",
                "tensorParallelSize, pipelineParallelSize and nodes above 1 run on vLLM: engine must be "
                "vllm or auto",
            ),
            (
                f"!({_PARALLEL}) || (has(self.task) && self.task == 'generate')",
                "tensorParallelSize, pipelineParallelSize and nodes above 1 apply to task generate only",
            ),
            (
                "!has(self.engine) || self.engine != 'vllm' || (has(self.task) && self.task == 'generate')",
                "engine vllm serves task generate only",
            ),
            (
                f"!has(self.attentionHeads) || self.attentionHeads % {_TENSOR} == 0",
                "tensorParallelSize must divide attentionHeads: vLLM splits the attention heads evenly "
                "over the tensor-parallel ranks",
            ),
            (
                f"!has(self.nodes) || ({_TENSOR} * {_PIPELINE}) % self.nodes == 0",
                "nodes must divide tensorParallelSize x pipelineParallelSize: every node of a group runs "
                "the same number of ranks",
            ),
            (
                # nodeRank has a schema default (0), which the API server fills in.
                "(!has(self.nodeRank) || self.nodeRank == 0) && !has(self.leaderAddress)",
                "nodeRank and leaderAddress are set by the operator in each pod (from its LeaderWorkerSet "
                "group); leave them out",
            ),
        ),
    )

    cache: ModelCacheSpec | None = None
    """Where the model's files are kept (mounted at /var/cache/carpool). Default: an emptyDir per pod
    (sized by `modelCacheSizeLimit`), so every new pod downloads the model again. With a cache, an init
    container (`carpool fetch`) downloads or copies the model there and verifies it before the runtime
    starts, so `startupTimeoutSeconds` covers only loading and warm-up."""

    credentials: CredentialsSpec | None = None
    """Secret with the model hub token (for gated or private Hugging Face models)."""

    fetch: bool | None = None
    """Run the `carpool fetch` init container. Default: on when `cache` is set."""

    attention_heads: int | None = Field(default=None, ge=1, le=65_536)
    """The model's attention heads (`num_attention_heads` in its config.json), when you state them: the
    API server then refuses a `tensorParallelSize` that does not divide them, which vLLM would otherwise
    refuse only in the pods, after the model's download. Not passed to the runtime."""

    OPERATOR_ONLY: ClassVar[frozenset[str]] = frozenset({"cache", "credentials", "fetch", "attention_heads"})
    """Fields the operator consumes; the rendered runtime config leaves them out."""

    PER_POD: ClassVar[frozenset[str]] = frozenset({"node_rank", "leader_address"})
    """Runtime fields the operator sets in each pod of a LeaderWorkerSet group, never the user."""

    def fetches(self) -> bool:
        return self.fetch if self.fetch is not None else self.cache is not None

    def multi_node(self) -> bool:
        """One replica spans several pods (a LeaderWorkerSet group), not one (a Deployment's pod)."""
        return self.nodes > 1

    def parallel(self) -> bool:
        """Split over several devices or nodes (vLLM's tensor or pipeline parallelism)."""
        return max(self.tensor_parallel_size, self.pipeline_parallel_size, self.nodes) > 1

    def runs_vllm(self) -> bool:
        """The pods run vLLM's engine: `engine: vllm`, or `auto` for a split model (only vLLM splits one;
        `auto` for a model on one device serves whatever the image has)."""
        if self.task is not Task.GENERATE:
            return False
        return self.engine is EngineKind.VLLM or (self.engine is EngineKind.AUTO and self.parallel())

    def devices_per_node(self) -> int:
        """Devices (GPUs) each pod of a replica runs: tensor x pipeline size over the nodes."""
        return self.tensor_parallel_size * self.pipeline_parallel_size // self.nodes

    @model_validator(mode="after")
    def _check_parallelism(self) -> Self:
        if self.parallel() and self.task is not Task.GENERATE:
            raise ValueError(
                f"model.tensorParallelSize {self.tensor_parallel_size}, pipelineParallelSize "
                f"{self.pipeline_parallel_size}, nodes {self.nodes}: parallelism applies to task generate "
                f"(vLLM) only, not {self.task.value}"
            )
        heads = self.attention_heads
        if heads is not None and heads % self.tensor_parallel_size:
            raise ValueError(
                f"model.tensorParallelSize {self.tensor_parallel_size} does not divide model.attentionHeads "
                f"{heads}: vLLM splits the attention heads evenly over the tensor-parallel ranks "
                f"(use one of {[n for n in range(1, heads + 1) if heads % n == 0][-6:]})"
            )
        # What the schema defaults (nodeRank 0) may be present: only a value of the user's is refused.
        per_pod = sorted(
            to_camel(field)
            for field in self.PER_POD & self.model_fields_set
            if getattr(self, field) != type(self).model_fields[field].default
        )
        if per_pod:
            raise ValueError(
                f"model.{', model.'.join(per_pod)}: set by the operator in each pod (from its "
                "LeaderWorkerSet group); leave them out"
            )
        return self


class BatchingSpec(BatchingConfig):
    """How requests share a batch (the runtime's `batching` section)."""

    model_config = ConfigDict(
        **_CAMEL,
        json_schema_extra=_rules(
            (
                "!has(self.preferredBatchSizes) || self.preferredBatchSizes.all(s, s >= 1 && s <= "
                "(has(self.maxBatchSize) ? self.maxBatchSize : "
                f"{_default(BatchingConfig, 'max_batch_size')}))",
                "every preferredBatchSizes entry must lie in 1..maxBatchSize",
            ),
            (
                f"(has(self.defaultPriority) ? self.defaultPriority : 0) < "
                f"(has(self.priorityLevels) ? self.priorityLevels : "
                f"{_default(BatchingConfig, 'priority_levels')})",
                "defaultPriority must be below priorityLevels",
            ),
            (
                "!has(self.maxItemsPerRequest) || self.maxItemsPerRequest <= "
                "(has(self.maxQueueSize) ? self.maxQueueSize : "
                f"{_default(BatchingConfig, 'max_queue_size')})",
                "maxItemsPerRequest must not exceed maxQueueSize",
            ),
        ),
    )


class GenerationSpec(GenerationConfig):
    """Continuous batching for text generation (the runtime's `generation` section; task `generate`)."""

    model_config = _CAMEL


class LoraSpec(LoraConfig):
    """LoRA adapters served on the base model, mixed in one batch (the runtime's `lora` section; task
    `generate`). Sources are given as for `model.source`; a hub repo id is downloaded into the same model
    cache as the base model, a folder must be in it (under /var/cache/carpool) or in the image."""

    model_config = ConfigDict(
        **_CAMEL,
        json_schema_extra=_rules(
            (
                "!has(self.maxCpuLoras) || self.maxCpuLoras >= "
                f"(has(self.maxLoras) ? self.maxLoras : {_default(LoraConfig, 'max_loras')})",
                "maxCpuLoras must be at least maxLoras",
            ),
        ),
    )


class WarmupSpec(WarmupConfig):
    """Dummy batches run after loading and before the pod reports ready (the runtime's `warmup`)."""

    model_config = _CAMEL


RESERVED_PORTS = (8000, 9090)
"""The runtime's HTTP port and its /metrics port under TLS: the gRPC port must be another."""


PRE_STOP_SECONDS = 5
"""`server.preStopSeconds` unset: the pause of the pods' preStop hook."""
MAX_PRE_STOP_SECONDS = 600


class ServerSpec(_Spec):
    """The runtime's HTTP server (address and port fixed by the operator: port 8000) and its gRPC port."""

    model_config = ConfigDict(
        **_CAMEL,
        json_schema_extra=_rules(
            (
                f"!has(self.grpcPort) || !(self.grpcPort in {list(RESERVED_PORTS)})",
                f"grpcPort must differ from the HTTP port {RESERVED_PORTS[0]} and the metrics port "
                f"{RESERVED_PORTS[1]}",
            ),
        ),
    )

    GRPC_PORT_NAME: ClassVar[str] = "grpc"
    """The name of the gRPC port on the container and the Service."""

    drain_timeout_seconds: float | None = Field(default=None, ge=0.0, le=MAX_DRAIN_S)
    """On shutdown, how long a pod keeps finishing accepted requests before it exits. The pod's
    termination grace period is set above it. Unset: the request deadline (`batching.defaultTimeoutS`,
    else 30 s, or 300 s for `generate`), so that a scale-down cuts off no accepted request."""

    drain_keep_alive_seconds: float | None = Field(default=None, ge=0.0, le=MAX_DRAIN_KEEP_ALIVE_S)
    """On shutdown, how long a keep-alive connection idle at SIGTERM stays open for its client's next
    request, which the pod answers with `Connection: close` (closing an idle connection races a request
    its client may be sending on it, and that request is lost); within the drain. Unset: the runtime's
    `server.drain_keep_alive_s`, 2 s. Raise it for clients that pause longer between requests."""

    pre_stop_seconds: int = Field(default=PRE_STOP_SECONDS, ge=0, le=MAX_PRE_STOP_SECONDS)
    """How long a deleted pod goes on serving as before (its preStop hook's pause) until SIGTERM starts its
    drain: time for its endpoint's removal to reach every kube-proxy (`--iptables-min-sync-period`, 1 s
    by default, plus the rule update, which can take seconds on a busy node) and every load balancer in
    front of the Service. A new connection that still reaches the pod after that is turned away. The
    pod's termination grace period is set above it and the drain."""

    max_body_bytes: int = Field(default=_default(ServerConfig, "max_body_bytes"), ge=1024)
    """Largest request body accepted; bigger ones get 413."""

    log_level: str = Field(default="info", pattern="^(debug|info|warning|error|critical)$")
    """Runtime log level."""

    log_format: str = Field(default="json", pattern="^(text|json)$")
    """Runtime log line format: `json` for log pipelines (default in a cluster), `text` for people."""

    workers: int | None = Field(default=None, ge=1, le=64)
    """HTTP front processes in each pod, sharing the port (each parses, validates and tokenizes; one
    engine process runs the model for all of them). Unset: the runtime's `auto`, one front where the
    container has at most 2 CPUs (its CPU limit, else the node's), else half its CPUs, at most 4."""

    grpc_port: int = Field(default=_default(ServerConfig, "grpc_port"), ge=0, le=65535)
    """Port of KServe v2 over gRPC (`inference.GRPCInferenceService`, for `tritonclient.grpc` and KServe's
    `InferenceGRPCClient`) and `grpc.health.v1.Health` in each pod, with the API keys and TLS of the HTTP
    port: the container port and a Service port named `grpc` (`appProtocol: grpc`), opened by the
    NetworkPolicy to whoever may reach the HTTP port. 0 turns gRPC off. Default 8001, as Triton."""

    @model_validator(mode="after")
    def _check_grpc_port(self) -> Self:
        if self.grpc_port in RESERVED_PORTS:
            raise ValueError(
                f"server.grpcPort {self.grpc_port} must differ from the HTTP port {RESERVED_PORTS[0]} and "
                f"the metrics port {RESERVED_PORTS[1]}"
            )
        return self


# --- the deployment around the runtime --------------------------------------------------------------


class AutoscalingEngine(enum.StrEnum):
    """Which autoscaler drives the replica count."""

    HPA = "hpa"
    KEDA = "keda"


class KedaSpec(_Spec):
    """KEDA settings (used when `engine` is `keda`)."""

    server_address: str = Field(default="http://prometheus-operated.monitoring.svc:9090", min_length=1)
    """Prometheus server KEDA queries."""

    query: str | None = Field(default=None, min_length=1)
    """PromQL returning the total queue depth of this model (or total saturation, for a latency target).
    Default: the sum of `carpool_queue_depth` (or `carpool_slo_saturation`) for this model in this
    namespace. With `minReplicas: 0` no pod exports that metric, so waking from
    zero needs a query on a metric produced in front of the pods (an ingress or gateway request rate)."""

    activation_threshold: float = Field(default=0.0, ge=0.0)
    """The query value above which KEDA scales up from zero."""

    polling_interval_seconds: int = Field(default=15, ge=1, le=3600)
    """How often KEDA evaluates the query."""

    cooldown_period_seconds: int = Field(default=300, ge=0, le=86_400)
    """How long the query must stay at or below the activation threshold before scaling to zero."""


SCALE_TO_ZERO_MESSAGE = (
    "minReplicas: 0 (scale to zero) needs something in front of the pods that holds requests and wakes "
    "the model while no pod runs: routing: inferencePool (the endpoint picker's flow control holds them, "
    "and the autoscaler reads its queue), or engine: keda with a keda.query on a metric produced in "
    "front of the pods (an ingress or gateway request rate); carpool_queue_depth, which only running "
    "pods export, would never start the model. Or set minReplicas: 1"
)


TARGET_TWICE_MESSAGE = "set autoscaling.target or autoscaling.targetQueueDepth, not both"


class LateRequests(enum.StrEnum):
    """What a request past its latency objective does in a pod's queue."""

    YIELD = "Yield"
    FIFO = "FIFO"


class LatencyTargetSpec(_Spec):
    """A latency objective: `percentile` of latency at most `seconds`. Latency is the time to the first
    token for task `generate`, the whole request (arrival to answer) otherwise."""

    seconds: float = Field(gt=0.0, le=3600.0)
    """The objective's bound on latency, in seconds."""

    percentile: float = Field(default=90.0, ge=50.0, le=99.9)
    """Which percentile the bound holds for (90: p90, 99: p99)."""

    late_requests: LateRequests = LateRequests.YIELD
    """What a request that has waited past `seconds` in a pod's queue (it can no longer meet the objective)
    does: `Yield` waits behind the requests of its priority that still can (Triton's queue policy
    `timeout_action: DELAY`), so that a backlog an overload left does not make every later arrival miss
    too; `FIFO` keeps its place. Either way it is answered by its deadline."""


class AutoscalingTargetSpec(_Spec):
    """What the autoscaler holds each pod at: a latency objective, or a queue depth (one of them)."""

    model_config = ConfigDict(
        **_CAMEL,
        json_schema_extra=_rules(
            ("has(self.latency) != has(self.queueDepth)", "set exactly one of latency and queueDepth"),
        ),
    )

    latency: LatencyTargetSpec | None = None
    """Scale so that each pod serves within this objective: every pod exports `carpool_slo_saturation`,
    its load over the load at which the objective just holds (predicted from its own batch times,
    arrival rate and queue), and the autoscaler holds its average at 1."""

    queue_depth: float | None = Field(default=None, gt=0.0, le=1_000_000.0)
    """Target average number of waiting (not yet batched) inputs per pod (as `targetQueueDepth`)."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if (self.latency is None) == (self.queue_depth is None):
            raise ValueError("autoscaling.target: set exactly one of latency and queueDepth")
        return self


class AutoscalingSpec(_Spec):
    """Autoscaling on a latency objective or on queue depth. While enabled, the autoscaler owns the
    replica count."""

    model_config = ConfigDict(
        **_CAMEL,
        json_schema_extra=_rules(
            (
                "(has(self.minReplicas) ? self.minReplicas : 1) <= "
                "(has(self.maxReplicas) ? self.maxReplicas : 4)",
                "minReplicas must not exceed maxReplicas",
            ),
            ("!has(self.target) || !has(self.targetQueueDepth)", TARGET_TWICE_MESSAGE),
        ),
    )

    enabled: bool = True
    """Scale on queue depth. When off, `replicas` is the replica count."""

    engine: AutoscalingEngine = AutoscalingEngine.HPA
    """`hpa`: a HorizontalPodAutoscaler on the pods metric `carpool_queue_depth` (or
    `carpool_slo_saturation` for a latency target), served through the custom metrics API (e.g.
    prometheus-adapter). `keda`: a KEDA ScaledObject with a Prometheus trigger,
    which also allows scaling to zero."""

    min_replicas: int = Field(default=1, ge=0, le=1000)
    """Fewest replicas. 0 (scale to zero) only where something in front of the pods holds requests and
    wakes the model: `routing: inferencePool` (the endpoint picker's flow control holds them; the
    autoscaler also reads its queue), or `engine: keda` with a `keda.query` that works at zero replicas.
    With `engine: hpa` the cluster needs the HPAScaleToZero feature gate (alpha; off by default)."""

    max_replicas: int = Field(default=4, ge=1, le=1000)
    """Most replicas."""

    target_queue_depth: float | None = Field(default=None, gt=0.0, le=1_000_000.0)
    """Target average number of waiting (not yet batched) inputs per pod (per group's leader). Default:
    for task generate, the running-sequence limit (`generation.maxRunningSequences`, else the engine's:
    16 on carpool's engine; vLLM's server's `max_num_seqs` for vLLM's: 256 on GPUs, 128 on CPU), so a
    replica is added once a whole batch waits; 8 for the other tasks."""

    target: AutoscalingTargetSpec | None = None
    """What to hold each pod at: `latency` (an objective such as p90 time to first token <= 0.5 s) or
    `queueDepth` (the same as `targetQueueDepth`). Default: `targetQueueDepth`."""

    behavior: KubernetesObject | None = None
    """HPA `behavior` (autoscaling/v2 HorizontalPodAutoscalerBehavior), passed through. Default: scale
    up at once, by up to 100% or 4 pods (whichever is more) per period of `startupTimeoutSeconds`
    (30 s to 1800 s): a new pod adds capacity only once it has loaded and warmed up, so adding more
    pods for the same queue before then would run to maxReplicas. Scale down after 5 minutes of lower
    demand, by at most half the pods per minute (queue depth is bursty: damped to avoid flapping)."""

    keda: KedaSpec = Field(default_factory=KedaSpec)
    """KEDA settings (engine `keda` only)."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"autoscaling.minReplicas ({self.min_replicas}) must not exceed "
                f"autoscaling.maxReplicas ({self.max_replicas})"
            )
        if self.target is not None and self.target_queue_depth is not None:
            raise ValueError(TARGET_TWICE_MESSAGE)
        return self

    def latency_target(self) -> LatencyTargetSpec | None:
        return self.target.latency if self.target is not None else None


def _default_resources() -> ResourcesSpec:
    return ResourcesSpec(requests={"cpu": "2", "memory": "8Gi"}, limits={"memory": "16Gi", GPU_RESOURCE: 1})


class ResourcesSpec(_Spec):
    """Compute resources of each runtime pod (a core/v1 ResourceRequirements without claims)."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    """Requested resources (`cpu`, `memory`, ...)."""

    limits: dict[str, Quantity] = Field(default_factory=dict)
    """Resource limits. GPUs (`nvidia.com/gpu`) go here."""

    def gpus(self) -> int:
        """GPUs requested per pod (extended resources are whole numbers; limits imply requests)."""
        value = self.limits.get(GPU_RESOURCE, self.requests.get(GPU_RESOURCE, 0))
        try:
            return int(value)
        except ValueError:
            return 0


class EnvVar(_Spec):
    """An environment variable of the runtime container (a core/v1 EnvVar)."""

    name: str = Field(min_length=1, max_length=256)
    """Variable name. `CARPOOL_*` variables override the rendered runtime config."""

    value: str | None = None
    """Literal value."""

    value_from: KubernetesObject | None = None
    """Source of the value (`secretKeyRef`, `configMapKeyRef`, `fieldRef`, `resourceFieldRef`)."""


class ServiceType(enum.StrEnum):
    """How the Service is exposed."""

    CLUSTER_IP = "ClusterIP"
    NODE_PORT = "NodePort"
    LOAD_BALANCER = "LoadBalancer"


class ServiceSpec(_Spec):
    """The Service in front of the runtime pods."""

    type: ServiceType = ServiceType.CLUSTER_IP
    """Service type."""

    port: int = Field(default=8000, ge=1, le=65535)
    """Service port; it forwards to the runtime's port 8000."""

    annotations: dict[str, str] = Field(default_factory=dict)
    """Annotations for the Service (load balancer settings, for example)."""


class Routing(enum.StrEnum):
    """How requests reach one of the model's pods."""

    SERVICE = "service"
    INFERENCE_POOL = "inferencePool"


class DisruptionBudgetSpec(_Spec):
    """The PodDisruptionBudget limiting voluntary evictions (node drains) of runtime pods."""

    enabled: bool = True
    """Create a PodDisruptionBudget."""

    max_unavailable: Quantity = 1
    """Most pods evicted at once: a number or a percentage (`25%`)."""


# --- access: who may call the model, and over what ------------------------------------------------


class SecretKeyRef(_Spec):
    """One key of a Secret in the BatchedModel's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$")
    """Name of the Secret."""

    key: str = Field(default="keys", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")
    """Key of the Secret holding the API keys, one per line (blank lines and `#` comments ignored)."""


class AuthSpec(_Spec):
    """API keys: clients send `Authorization: Bearer <key>` on every inference and model-metadata route.
    Health paths stay open to the kubelet; /metrics to Prometheus."""

    api_keys_secret: SecretKeyRef
    """The Secret holding the accepted keys. It is mounted as a file (never copied into the ConfigMap);
    the pods pick up an edited Secret within a minute or two, without a restart (the kubelet's sync
    period plus one second)."""


class TLSSpec(_Spec):
    """HTTPS on the serving port."""

    secret_name: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$")
    """A `kubernetes.io/tls` Secret (keys `tls.crt` and `tls.key`) in the BatchedModel's namespace, for
    example one cert-manager issues. The probes switch to HTTPS, and /metrics moves to plain HTTP on
    port 9090. A renewed certificate is served without a restart."""


class NetworkPolicySpec(_Spec):
    """The NetworkPolicy of the runtime pods: who may reach the serving port. Traffic the policy does
    not name is dropped (by a CNI that enforces NetworkPolicies). Egress is not restricted: model
    downloads go wherever `model.source` points."""

    enabled: bool = True
    """Render the NetworkPolicy."""

    same_namespace: bool = True
    """Let every pod of the BatchedModel's own namespace reach the serving port."""

    from_namespaces: list[
        Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")]
    ] = Field(default_factory=list)
    """Namespaces (by name) whose pods may reach the serving port, e.g. `[web, batch-jobs]`."""

    ingress_from: list[KubernetesObject] = Field(default_factory=list)
    """More allowed sources, as NetworkPolicyPeer objects (`podSelector`, `namespaceSelector`,
    `ipBlock`): for example the ingress controller's pods, or `ipBlock` CIDRs for a `LoadBalancer`
    Service, whose traffic comes from outside the cluster."""


class BatchedModelSpec(_Spec):
    """A model served by the carpool runtime with dynamic batching, autoscaled on queue depth."""

    model_config = ConfigDict(
        **_CAMEL,
        json_schema_extra=_rules(
            (
                "!has(self.generation) || (has(self.model) && has(self.model.task) "
                "&& self.model.task == 'generate')",
                "generation settings need model.task: generate",
            ),
            (
                "!has(self.lora) || (has(self.model) && has(self.model.task) "
                "&& self.model.task == 'generate')",
                "lora adapters need model.task: generate",
            ),
            (
                "!has(self.env) || self.env.all(e, !(e.name in "
                + "["
                + ", ".join(f"'{name}'" for name in RESERVED_ENV)
                + "]))",
                "env may not set " + ", ".join(RESERVED_ENV) + ": the operator sets them",
            ),
            (
                # Transition rule: evaluated on updates only (kubectl scale goes through it too).
                # Autoscaling is on unless `autoscaling.enabled` says false (absent means the default).
                f"!({_autoscaled('oldSelf')} && {_autoscaled('self')}) || "
                "(has(self.replicas) ? self.replicas : 1) == (has(oldSelf.replicas) ? oldSelf.replicas : 1)",
                "replicas cannot change while autoscaling is on (the autoscaler owns the replica count): "
                "change autoscaling.minReplicas/maxReplicas, or set autoscaling.enabled: false first",
            ),
            (
                "!has(self.podLabels) || self.podLabels.all(k, !k.startsWith('app.kubernetes.io/'))",
                "podLabels keys under app.kubernetes.io/ are the operator's",
            ),
            (
                "!has(self.model) || !has(self.model.maxInputTokens) || "
                "(has(self.batching) && has(self.batching.maxBatchTokens) ? self.batching.maxBatchTokens : "
                f"{_default(BatchingConfig, 'max_batch_tokens')}) >= self.model.maxInputTokens",
                "batching.maxBatchTokens must be at least model.maxInputTokens",
            ),
            (
                "!has(self.autoscaling) || !has(self.autoscaling.minReplicas) || "
                "self.autoscaling.minReplicas > 0 || "
                "(has(self.routing) && self.routing == 'inferencePool') || "
                "(has(self.autoscaling.engine) && self.autoscaling.engine == 'keda' && "
                "has(self.autoscaling.keda) && has(self.autoscaling.keda.query))",
                SCALE_TO_ZERO_MESSAGE,
            ),
        ),
    )

    # The schema's `default: {}` makes the API server fill in model's own defaults when it is left out,
    # so `kubectl get bm` shows the task of a BatchedModel that names no model.
    model: ModelSpec = Field(default_factory=ModelSpec, json_schema_extra={"default": {}})
    """Which model to serve. Default: the embedded all-MiniLM-L6-v2 sentence embedder."""

    batching: BatchingSpec = Field(default_factory=BatchingSpec)
    """Dynamic batching."""

    generation: GenerationSpec | None = None
    """Continuous batching for text generation (task `generate` only)."""

    lora: LoraSpec | None = None
    """LoRA adapters served on the base model (task `generate` only): `adapters` (name -> source),
    `maxLoras` on the device at once, `maxCpuLoras` in host memory, `maxRank`. More can be loaded at run
    time with `POST /v1/load_lora_adapter` (on each pod)."""

    warmup: WarmupSpec = Field(default_factory=WarmupSpec)
    """Warm-up before a pod reports ready."""

    server: ServerSpec = Field(default_factory=ServerSpec)
    """The runtime's HTTP server."""

    startup_timeout_seconds: int = Field(default=600, ge=30, le=7200)
    """Longest time the runtime container may take to load the model and warm up (until
    /v2/health/ready answers) before the kubelet restarts it: the startup probe checks readiness with
    `failureThreshold x periodSeconds` equal to this. It starts after the init containers, so with
    `model.cache` a download by `carpool fetch` is not counted; without one, raise it for large models
    downloaded at start."""

    replicas: int = Field(default=1, ge=0, le=1000)
    """Replica count while autoscaling is off (the scale subresource, `kubectl scale bm`, sets it). While
    autoscaling is on the autoscaler owns the count, and a change (or `kubectl scale`) is refused."""

    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    """Autoscaling on a latency objective or on queue depth."""

    resources: ResourcesSpec = Field(default_factory=_default_resources)
    """Resources of each pod. Default: one `nvidia.com/gpu`, 2 CPUs, 8Gi memory (16Gi limit).
    Setting this replaces the whole default."""

    image: str | None = Field(default=None, min_length=1)
    """Runtime image. Default: the CUDA build, or its `-cpu` build when no GPU is requested."""

    image_pull_policy: str | None = Field(default=None, pattern="^(Always|IfNotPresent|Never)$")
    """Image pull policy. Default: Kubernetes' own (IfNotPresent for tagged images)."""

    image_pull_secrets: list[str] = Field(default_factory=list)
    """Names of Secrets used to pull the image."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels the pods must match."""

    tolerations: list[KubernetesObject] = Field(default_factory=list)
    """Tolerations (core/v1 Toleration), e.g. for tainted GPU nodes."""

    affinity: KubernetesObject | None = None
    """Affinity rules (core/v1 Affinity)."""

    runtime_class_name: str | None = Field(default=None, min_length=1)
    """RuntimeClass of the pods (e.g. `nvidia`)."""

    priority_class_name: str | None = Field(default=None, min_length=1)
    """PriorityClass of the pods."""

    service_account_name: str | None = Field(default=None, min_length=1)
    """ServiceAccount of the pods (for model downloads that need cloud credentials)."""

    env: list[EnvVar] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    """Extra environment variables of the runtime container, each name once. The operator sets
    `CARPOOL_CONFIG`, `HF_HOME`, `HF_HUB_OFFLINE`, `HF_TOKEN_PATH`, `HOME` and `XDG_CACHE_HOME` itself:
    use the runtime config (or `CARPOOL_*` variables) and `model.cache` instead."""

    pod_annotations: dict[str, str] = Field(default_factory=dict)
    """Extra annotations of the pods."""

    model_cache_size_limit: Quantity | None = None
    """Size limit of the model cache volume when it is an emptyDir (no `model.cache`). Default:
    unlimited."""

    pod_labels: dict[str, str] = Field(default_factory=dict)
    """Extra labels of the pods. Keys under `app.kubernetes.io/` are the operator's and refused."""

    volumes: list[KubernetesObject] = Field(default_factory=list)
    """Extra pod volumes (core/v1 Volume), passed through. Names must not clash with the operator's
    (`config`, `tmp`, `model-cache`, `dshm`, `hub-credentials`, `api-keys`, `tls`)."""

    volume_mounts: list[KubernetesObject] = Field(default_factory=list)
    """Extra mounts of the runtime container (core/v1 VolumeMount), passed through."""

    topology_spread_constraints: list[KubernetesObject] = Field(default_factory=list)
    """How pods spread over zones or nodes (core/v1 TopologySpreadConstraint), passed through."""

    shm_size: Quantity | None = None
    """Size of /dev/shm (a memory-backed emptyDir; it counts against the pod's memory). Default: 16Gi
    for a model split over several devices or nodes (NCCL and vLLM's workers exchange tensors there),
    else the container runtime's 64Mi, too small for tokenizer and data-loader workers that share
    tensors."""

    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    """How a spec change replaces the pods."""

    service: ServiceSpec = Field(default_factory=ServiceSpec)
    """The Service."""

    routing: Routing = Routing.SERVICE
    """How requests pick a pod. `service`: the Service alone (kube-proxy spreads connections at random).
    `inferencePool`: also an InferencePool (inference.networking.k8s.io/v1, the Gateway API Inference
    Extension) named after the model, selecting its serving pods (a multi-node group's leaders) on the
    runtime's port 8000, whose endpoint picker is the Service `<name>-epp` on port 9002 (the chart's
    `endpointPicker` deploys it): a Gateway routing to the pool sends each request to the pod its
    picker chooses from queue depth, KV-cache use, prefix-cache affinity and loaded LoRA adapters. Needs
    the InferencePool CRD; without it the status says so (Degraded, reason InferencePoolApiMissing)
    while the Service keeps serving."""

    disruption_budget: DisruptionBudgetSpec = Field(default_factory=DisruptionBudgetSpec)
    """The PodDisruptionBudget."""

    auth: AuthSpec | None = None
    """API keys the runtime requires. Unset: the API is open to whoever reaches the pods."""

    tls: TLSSpec | None = None
    """HTTPS for the serving port. Unset: plain HTTP."""

    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)
    """The NetworkPolicy limiting who reaches the pods (on by default: the same namespace, plus
    Prometheus from the monitoring namespace the operator is configured with)."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.generation is not None and self.model.task != Task.GENERATE:
            raise ValueError(f"generation settings need model.task: generate, not {self.model.task.value}")
        if self.lora is not None and self.model.task != Task.GENERATE:
            raise ValueError(f"lora adapters need model.task: generate, not {self.model.task.value}")
        reserved = sorted(key for key in self.pod_labels if key.startswith(RESERVED_LABEL_PREFIX))
        if reserved:
            raise ValueError(f"podLabels {reserved}: keys under {RESERVED_LABEL_PREFIX} are the operator's")
        names = [var.name for var in self.env]
        clashes = sorted({name for name in names if name in RESERVED_ENV})
        if clashes:
            raise ValueError(
                f"env {', '.join(clashes)}: set by the operator ({', '.join(RESERVED_ENV)}); remove "
                "the entry (use the runtime config, CARPOOL_* variables or model.cache instead)"
            )
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"env {', '.join(twice)}: named more than once; keep one entry per name")
        scaling = self.autoscaling
        if (
            scaling.min_replicas == 0
            and self.routing != Routing.INFERENCE_POOL
            and (scaling.engine != AutoscalingEngine.KEDA or not scaling.keda.query)
        ):
            raise ValueError("autoscaling." + SCALE_TO_ZERO_MESSAGE)
        return self

    def effective_image(self, runtime_image: str = DEFAULT_IMAGE) -> str:
        """The image the pods run: `image`, else the operator's runtime image (`runtime_image`) with `-cpu`
        when no GPU is requested and `-vllm` when the pods run vLLM's engine."""
        if self.image:
            return self.image
        image = runtime_image if self.resources.gpus() else runtime_image + CPU_IMAGE_SUFFIX
        return image + VLLM_IMAGE_SUFFIX if self.model.runs_vllm() else image
