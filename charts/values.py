"""The chart's values as a typed model: the one source of `values.yaml` and `values.schema.json`.

Every field's docstring becomes its `# +docs` comment in `values.yaml` and its description in the
schema; `extra="forbid"` becomes `additionalProperties: false`, so a misspelt key fails `helm install`
instead of being ignored. Kubernetes objects passed through as they are (resources, affinity, security
contexts) are typed as free-form mappings: the rendered manifests are validated against the Kubernetes
schemas by the chart tests instead. `charts.generate` writes the files; tests/chart checks they are current.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from carpool.operator.leader import DEFAULT_TIMING, Timing
from carpool.operator.reconcile import SLOW_RETRY_SECONDS

Duration = str
"""A Prometheus duration such as `30s`, `5m` or `1h`."""

DURATION_PATTERN = r"^[0-9]+(ms|s|m|h|d|w|y)$"
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class Section(BaseModel):
    """Base of every values object: camelCase keys, unknown keys rejected, docstrings kept."""

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        use_attribute_docstrings=True,
        validate_default=True,
        strict=True,  # as the JSON schema: "yes" is not a boolean, "2" is not an integer
    )


def _map() -> dict[str, Any]:
    return {}


def _list() -> list[Any]:
    return []


class Image(Section):
    """A container image reference."""

    repository: str = "ghcr.io/carpool-dev/carpool-operator"
    """Image repository (the `operator` target of the repository's Dockerfile)."""
    tag: str = ""
    """Image tag; empty means the chart's appVersion."""
    digest: str = Field(default="", pattern=r"^(sha256:[a-f0-9]{64})?$")
    """Image digest (`sha256:...`). When set it pins the image and the tag is only informative."""
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Kubernetes image pull policy."""


class RuntimeImage(Section):
    """The image of the runtime pods (`carpool operator --runtime-image`). Pods that request no GPU run
    its tag plus `-cpu`, pods on vLLM's engine (`engine: vllm`, or `auto` with the model split) its tag
    plus `-vllm` (`-cpu-vllm` without a GPU): the Dockerfile's `runtime`, `runtime-cpu`, `runtime-vllm`
    and `runtime-cpu-vllm` targets, pushed under one repository. A BatchedModel's `spec.image` overrides
    all of them for its pods."""

    repository: str = "ghcr.io/carpool-serving/carpool-runtime"
    """Image repository of the runtime images."""
    tag: str = ""
    """Image tag of the CUDA build; empty means the chart's appVersion."""


class Probe(Section):
    """Timings of one probe on the operator's health endpoint."""

    initial_delay_seconds: int = Field(default=0, ge=0)
    """Seconds after the container starts before the first probe."""
    period_seconds: int = Field(default=10, ge=1)
    """Seconds between probes."""
    timeout_seconds: int = Field(default=5, ge=1)
    """Seconds before one probe times out."""
    failure_threshold: int = Field(default=3, ge=1)
    """Consecutive failures before Kubernetes acts (restarts the pod, or marks it unready)."""


class LeaderElection(Section):
    """How operator replicas elect the one that works: a coordination.k8s.io Lease, with
    controller-runtime's timing by default (the operator's `--leader-elect-*` flags, `Timing` in
    operator/src/carpool/operator/leader.py). The lease duration must exceed the renew deadline, and the
    renew deadline 1.2 retry periods (client-go's checks): the chart refuses other values."""

    lease_name: str = Field(default="", pattern=f"^$|{DNS_LABEL_PATTERN}")
    """Name of the Lease in the release namespace; empty means the release's full name. Used only when
    `operator.replicas` is above 1; a single replica runs without one."""
    lease_duration_seconds: int = Field(default=int(DEFAULT_TIMING.lease_duration), ge=1)
    """How long a standby waits, from when it saw the leader's last renewal, before it takes the Lease
    (`--leader-elect-lease-duration`; the Lease's `leaseDurationSeconds`)."""
    renew_deadline_seconds: float = Field(default=DEFAULT_TIMING.renew_deadline, gt=0)
    """How long the leader goes on without renewing the Lease before it stops writing and exits, to be
    restarted as a standby (`--leader-elect-renew-deadline`)."""
    retry_period_seconds: float = Field(default=DEFAULT_TIMING.retry_period, gt=0)
    """Seconds between attempts to take or renew the Lease (`--leader-elect-retry-period`)."""

    @model_validator(mode="after")
    def _ordered(self) -> LeaderElection:
        Timing(self.lease_duration_seconds, self.renew_deadline_seconds, self.retry_period_seconds)
        return self


class Operator(Section):
    """The operator Deployment."""

    replicas: int = Field(default=1, ge=0)
    """Number of operator pods. Above 1, the pods elect one with a Lease (see
    `operator.leaderElection`): the holder works, the others wait and take over within a retry period,
    the lease duration and a retry period of its last renewal (19 s with the defaults), or at their next
    retry when it shuts down cleanly, as controller-runtime's leader election does."""
    image: Image = Field(default_factory=Image)
    """The operator image."""
    image_pull_secrets: list[dict[str, Any]] = Field(default_factory=_list)
    """Secrets for pulling the operator image from a private registry, e.g. `[{name: my-registry}]`."""
    log_format: Literal["json", "plain", "full"] = "json"
    """Log format on stdout (`carpool operator --log-format`): JSON lines by default."""
    log_level: Literal["info", "verbose", "debug"] = "info"
    """How much the operator logs: `verbose` adds `--verbose`, `debug` adds `--debug` (all of kopf)."""
    slow_retry_period_seconds: float = Field(default=SLOW_RETRY_SECONDS, gt=0)
    """Seconds before the operator tries a model again on its own after the API server refused one of its
    objects (403: RBAC, a ResourceQuota; 5xx) or while an API it needs is missing (KEDA, LeaderWorkerSet,
    InferencePool), and half of it after a name conflict (`--slow-retry-period`). Events (a spec change, a
    child's) reconcile at once regardless."""
    leader_election: LeaderElection = Field(default_factory=LeaderElection)
    """Leader election between operator replicas (used only when `operator.replicas` > 1)."""
    liveness_port: int = Field(default=8080, ge=1, le=65535)
    """Port of the operator's liveness endpoint (`/healthz`, kopf's), probed by Kubernetes."""
    metrics_port: int = Field(default=9090, ge=1, le=65535)
    """Port of the operator's Prometheus metrics (`/metrics`), scraped through the operator Service."""
    liveness_probe: Probe = Field(default_factory=lambda: Probe(period_seconds=20, failure_threshold=3))
    """Liveness probe: the pod restarts when the operator stops answering."""
    readiness_probe: Probe = Field(default_factory=lambda: Probe(period_seconds=10, failure_threshold=3))
    """Readiness probe on the same endpoint."""
    resources: dict[str, Any] = Field(
        default_factory=lambda: {
            "requests": {"cpu": "50m", "memory": "128Mi"},
            "limits": {"cpu": "1", "memory": "256Mi"},
        }
    )
    """Compute resources of the operator container (a Kubernetes ResourceRequirements), from
    `python -m bench.operator.scale` (bench/RESULTS.md): with 100 models the operator peaks at 95-100 MiB
    resident (62 MiB idle, about 0.4 MiB more per model), so the memory request covers 100 models and
    the limit about 450; raise both for more. At rest it uses almost no CPU (0.04 s a minute); converging
    100 models took 20 s of CPU in 57 s, a third of a core, which the CPU limit leaves room for while
    bounding a reconcile storm."""
    pod_security_context: dict[str, Any] = Field(
        default_factory=lambda: {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "runAsGroup": 65532,
            "fsGroup": 65532,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
    )
    """Security context of the operator pod (a Kubernetes PodSecurityContext). The default meets the
    `restricted` Pod Security Standard."""
    security_context: dict[str, Any] = Field(
        default_factory=lambda: {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
    )
    """Security context of the operator container (a Kubernetes SecurityContext)."""
    priority_class_name: str = ""
    """PriorityClass of the operator pods; empty for the cluster default."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels the operator pods must run on."""
    tolerations: list[dict[str, Any]] = Field(default_factory=_list)
    """Tolerations of the operator pods."""
    affinity: dict[str, Any] = Field(default_factory=_map)
    """Affinity of the operator pods (a Kubernetes Affinity)."""
    pod_annotations: dict[str, str] = Field(default_factory=dict)
    """Extra annotations on the operator pods."""
    pod_labels: dict[str, str] = Field(default_factory=dict)
    """Extra labels on the operator pods."""
    extra_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments for `carpool operator`."""
    extra_env: list[dict[str, Any]] = Field(default_factory=_list)
    """Extra environment variables of the operator container (Kubernetes EnvVar objects)."""


class ServiceAccount(Section):
    """The operator's ServiceAccount."""

    create: bool = True
    """Create the ServiceAccount. When false, `serviceAccount.name` must name an existing one."""
    name: str = ""
    """Name of the ServiceAccount; empty means the release's full name."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """Annotations on the ServiceAccount (for example a cloud IAM role binding)."""
    automount_token: bool = True
    """Mount the ServiceAccount's API token in the operator pod (the operator needs it to reach the API)."""


class Rbac(Section):
    """Roles and bindings that grant the operator exactly the API calls it makes."""

    create: bool = True
    """Create the ClusterRole/Roles and their bindings. Without `watchNamespaces` the operator gets a
    ClusterRole; with it, a Role in each watched namespace (and a small ClusterRole only for what is
    cluster-scoped)."""

    aggregate_to_default_roles: bool = True
    """Add BatchedModel permissions to Kubernetes' built-in `edit`/`admin` (create, change, delete,
    scale) and `view` (read) ClusterRoles through aggregation labels, so namespace users can manage
    models without extra bindings. Needs `create`."""


class PrometheusAdapter(Section):
    """Rules for prometheus-adapter that publish `carpool_queue_depth` through the custom metrics API,
    which the HorizontalPodAutoscalers the operator creates read (`autoscaling.engine: hpa`)."""

    enabled: bool = False
    """Create a ConfigMap with the adapter's rules (key `config.yaml`). Point prometheus-adapter at it
    (its chart's `rules.existing`), or paste `files/prometheus-adapter-values.yaml` into its values."""
    namespace: str = ""
    """Namespace of the ConfigMap: prometheus-adapter's own namespace. Empty means the release's."""
    config_map_name: str = ""
    """Name of the ConfigMap; empty means `<release full name>-prometheus-adapter`."""


class ServiceMonitor(Section):
    """A Prometheus Operator ServiceMonitor for the operator's metrics Service."""

    enabled: bool = False
    """Create the ServiceMonitor (needs the Prometheus Operator CRDs)."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Extra labels, e.g. the one your Prometheus' `serviceMonitorSelector` selects
    (`release: prometheus`)."""
    interval: Duration = Field(default="30s", pattern=DURATION_PATTERN)
    """Scrape interval."""
    scrape_timeout: Duration = Field(default="10s", pattern=DURATION_PATTERN)
    """Scrape timeout (at most the interval)."""


class PodMonitor(Section):
    """A Prometheus Operator PodMonitor for the runtime pods of every BatchedModel."""

    enabled: bool = False
    """Create the PodMonitor (needs the Prometheus Operator CRDs). The HPA's queue-depth metric and the
    dashboard come from what it scrapes."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Extra labels, e.g. the one your Prometheus' `podMonitorSelector` selects
    (`release: prometheus`)."""
    interval: Duration = Field(default="15s", pattern=DURATION_PATTERN)
    """Scrape interval. It bounds how fast the autoscaler sees the queue grow."""
    scrape_timeout: Duration = Field(default="10s", pattern=DURATION_PATTERN)
    """Scrape timeout (at most the interval)."""


class QueueGrowingAlert(Section):
    """CarpoolQueueGrowing: the queue keeps growing although the autoscaler should be adding pods."""

    min_depth: int = Field(default=10, ge=0)
    """Alert only while the model's total queue depth is above this many inputs."""
    for_: Duration = Field(default="10m", pattern=DURATION_PATTERN, alias="for")
    """How long the queue must keep growing before the alert fires."""


class WarmupFailingAlert(Section):
    """CarpoolWarmupFailing: a runtime pod answers scrapes but never becomes ready."""

    for_: Duration = Field(default="15m", pattern=DURATION_PATTERN, alias="for")
    """How long a pod may stay not ready (loading, warming up) before the alert fires."""


class Alert(Section):
    """An alert with only a duration to tune."""

    for_: Duration = Field(default="5m", pattern=DURATION_PATTERN, alias="for")
    """How long the condition must hold before the alert fires."""


class Alerts(Section):
    """Alert thresholds."""

    queue_growing: QueueGrowingAlert = Field(default_factory=QueueGrowingAlert)
    """CarpoolQueueGrowing."""
    no_ready_replicas: Alert = Field(default_factory=Alert)
    """CarpoolNoReadyReplicas: a model that had ready pods in the last hour has none."""
    warmup_failing: WarmupFailingAlert = Field(default_factory=WarmupFailingAlert)
    """CarpoolWarmupFailing."""
    autoscaler_metric_unavailable: Alert = Field(default_factory=Alert)
    """CarpoolAutoscalerMetricUnavailable: an HPA cannot read `carpool_queue_depth` (condition
    ScalingActive false, from kube-state-metrics) or KEDA's Prometheus scaler keeps failing."""


class PrometheusRule(Section):
    """A Prometheus Operator PrometheusRule with carpool's recording rules and alerts."""

    enabled: bool = False
    """Create the PrometheusRule (needs the Prometheus Operator CRDs)."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Extra labels, e.g. the one your Prometheus' `ruleSelector` selects (`release: prometheus`)."""
    severity: str = Field(default="warning", pattern=LABEL_VALUE_PATTERN)
    """`severity` label of every alert."""
    alerts: Alerts = Field(default_factory=Alerts)
    """Alert thresholds."""


class GrafanaDashboard(Section):
    """carpool's Grafana dashboard, in a ConfigMap that Grafana's dashboard sidecar loads."""

    enabled: bool = False
    """Create the dashboard ConfigMap."""
    namespace: str = ""
    """Namespace of the ConfigMap (the one Grafana's sidecar watches); empty means the release's."""
    sidecar_label: str = "grafana_dashboard"
    """Label the sidecar looks for (the Grafana chart's `sidecar.dashboards.label`)."""
    sidecar_label_value: str = Field(default="1", pattern=LABEL_VALUE_PATTERN)
    """Value of that label (`sidecar.dashboards.labelValue`)."""
    folder: str = ""
    """Grafana folder for the dashboard (annotation `grafana_folder`, read when the sidecar's
    `folderAnnotation` is set to it); empty leaves the sidecar's default."""


class ApiServerEgress(Section):
    """Where the operator may connect to reach the Kubernetes API server."""

    cidrs: list[str] = Field(default_factory=list, examples=[["10.0.0.1/32"]])
    """The API server's addresses (`kubectl get endpoints kubernetes -n default`), as CIDRs. Empty: any
    address on `ports`. A NetworkPolicy cannot name "the API server" portably: its endpoints often lie
    outside the pod network, and some CNIs (Cilium) need their own policy kinds to match it."""
    ports: list[int] = Field(default_factory=lambda: [443, 6443])
    """API server ports (443 through the `kubernetes` Service, 6443 on the control-plane nodes)."""


class NetworkPolicy(Section):
    """A NetworkPolicy for the operator pods. (The runtime pods get theirs from the operator, per
    BatchedModel: `spec.networkPolicy`.)"""

    enabled: bool = True
    """Create the operator's NetworkPolicy. Ingress: the metrics port from `monitoringNamespaces`;
    nothing else (kubelet probes come from the node, which the common CNIs do not filter). Egress: DNS
    (port 53) and the API server (`networkPolicy.apiServer`); nothing else."""
    api_server: ApiServerEgress = Field(default_factory=ApiServerEgress)
    """Egress to the Kubernetes API server, the only service the operator calls."""


class EndpointPickerImage(Section):
    """The endpoint picker's image: the upstream one, built by the Gateway API Inference Extension."""

    repository: str = "registry.k8s.io/gateway-api-inference-extension/epp"
    """Image repository."""
    tag: str = "v1.5.0"
    """Image tag (the release whose flags and config the chart renders)."""
    digest: str = Field(default="", pattern=r"^(sha256:[a-f0-9]{64})?$")
    """Image digest (`sha256:...`). When set it pins the image and the tag is only informative."""
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Kubernetes image pull policy."""


class EndpointPickerPool(Section):
    """One InferencePool the chart deploys a picker for: a BatchedModel with `spec.routing:
    inferencePool`."""

    name: str = Field(pattern=DNS_LABEL_PATTERN, max_length=59)
    """The BatchedModel's name, which its InferencePool takes. The picker's Deployment, Service,
    ServiceAccount, Role and ConfigMap are named `<name>-epp`: the Service the pool names."""
    namespace: str = Field(default="", pattern=f"^$|{DNS_LABEL_PATTERN}")
    """The BatchedModel's namespace; empty means the release's."""
    flags: dict[str, str | int | bool] = Field(default_factory=dict)
    """Flags for this pool's picker on top of `endpointPicker.flags` (same keys win), e.g.
    `{model-server-metrics-port: 9090}` for a model with `spec.tls`, whose /metrics moves to plain HTTP
    on port 9090."""


def _picker_flags() -> dict[str, str | int | bool]:
    return {
        "v": 1,
        "metrics-endpoint-auth": False,
        "tracing": False,
    }


PICKER_MAX_HELD = "10000"
"""The picker's flow control bound on requests it holds (`flowControl.maxRequests`; Knative's activator
holds up to 10,000 a revision): one past it is answered 429."""
PICKER_HOLD_TTL = "600s"
"""How long the picker holds a request with no pod to send it to (`flowControl.defaultRequestTTL`; then
503): a model's start from zero (scheduling, image, weights, warm-up) within it, as Knative's 600 s."""


def _picker_config() -> dict[str, Any]:
    scorers = {
        "queue-scorer": 2,
        "kv-cache-utilization-scorer": 2,
        "prefix-cache-scorer": 3,
        "lora-affinity-scorer": 1,
    }
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "featureGates": [],
        "flowControl": {"maxRequests": PICKER_MAX_HELD, "defaultRequestTTL": PICKER_HOLD_TTL},
        "plugins": [{"type": name} for name in scorers],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [{"pluginRef": name, "weight": weight} for name, weight in scorers.items()],
            }
        ],
    }


class EndpointPicker(Section):
    """The Gateway API Inference Extension's endpoint picker (EPP), one per InferencePool: the upstream
    image, with the Deployment, Service, ServiceAccount, Role and config its own `inferencepool` chart
    renders. A gateway routing to a BatchedModel's InferencePool asks it which pod serves each request."""

    enabled: bool = False
    """Deploy a picker for each of `endpointPicker.pools`. Needs the InferencePool and
    InferenceObjective CRDs (the picker watches both)."""
    pools: list[EndpointPickerPool] = Field(
        default_factory=list, examples=[[{"name": "llama", "namespace": "ml"}]]
    )
    """The InferencePools (BatchedModels with `spec.routing: inferencePool`) to deploy a picker for."""
    image: EndpointPickerImage = Field(default_factory=EndpointPickerImage)
    """The picker's image."""
    image_pull_secrets: list[dict[str, Any]] = Field(default_factory=_list)
    """Secrets for pulling the picker image from a private registry, e.g. `[{name: my-registry}]`."""
    flags: dict[str, str | int | bool] = Field(default_factory=_picker_flags)
    """Flags of every picker (`--<key>=<value>`), besides those the chart sets (`--pool-name`,
    `--pool-namespace`, `--config-file`, `--grpc-port`, `--grpc-health-port`, `--metrics-port`).
    `metrics-endpoint-auth: false` and `tracing: false` as the upstream chart sets them (the picker's own
    metrics open to its NetworkPolicy's monitoring namespaces; no OpenTelemetry collector assumed). The
    picker reads the `vllm:*` names the runtime exports by default (`vllm:kv_cache_usage_perc` since
    v1.5.0)."""
    config: dict[str, Any] = Field(default_factory=_picker_config)
    """The picker's EndpointPickerConfig (its `--config-file`): the scorers and their weights, and its
    flow control. The scorers are the upstream chart's (queue depth, KV-cache use, prefix-cache
    affinity) plus LoRA affinity, which sends an adapter's requests where it is loaded. Flow control is
    off, as upstream ships it (experimental): `featureGates: [flowControl]` turns it on, and then the
    picker holds a request while the pool has no Ready pod or every pod is saturated (5 waiting or 80%
    of the KV cache, or metrics older than 200 ms), up to `flowControl.defaultRequestTTL` (600 s, then
    503) and `flowControl.maxRequests` held (10,000, past it 429): what carries a burst while a model
    with `minReplicas: 0` scales from zero (without it such a model's requests get 503 at zero). The
    gateway's timeout on the route must exceed the TTL, or it gives up first."""
    replicas: int = Field(default=1, ge=1)
    """Picker pods per pool. One is what upstream recommends (the prefix-cache scorer remembers the
    prompts it routed in memory); above 1 they elect an active one (`--ha-enable-leader-election`)."""
    resources: dict[str, Any] = Field(
        default_factory=lambda: {
            "requests": {"cpu": "200m", "memory": "256Mi"},
            "limits": {"cpu": "2", "memory": "1Gi"},
        }
    )
    """Compute resources of the picker container (a Kubernetes ResourceRequirements)."""
    pod_security_context: dict[str, Any] = Field(
        default_factory=lambda: {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "runAsGroup": 65532,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
    )
    """Security context of the picker pods (a Kubernetes PodSecurityContext)."""
    security_context: dict[str, Any] = Field(
        default_factory=lambda: {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
    )
    """Security context of the picker container (a Kubernetes SecurityContext)."""
    ext_proc_from: list[dict[str, Any]] = Field(default_factory=_list)
    """Who may call a picker's ext_proc port (9002), as NetworkPolicyPeers: the gateway's proxies, e.g.
    `[{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: gateway-system}}}]`. Empty: any
    source (the picker's NetworkPolicy still closes every other port but metrics)."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels the picker pods must run on."""
    tolerations: list[dict[str, Any]] = Field(default_factory=_list)
    """Tolerations of the picker pods."""
    affinity: dict[str, Any] = Field(default_factory=_map)
    """Affinity of the picker pods (a Kubernetes Affinity)."""


class Values(Section):
    """Values of the carpool chart."""

    name_override: str = ""
    """Replaces the chart name in object names."""
    fullname_override: str = ""
    """Replaces the whole `<release>-<chart>` prefix of object names."""
    common_labels: dict[str, str] = Field(default_factory=dict)
    """Labels added to every object the chart creates."""
    watch_namespaces: list[str] = Field(default_factory=list, examples=[["ml-serving", "team-a"]])
    """Namespaces whose BatchedModels the operator serves. Empty: every namespace, with cluster-wide
    RBAC. Set: only these, with a Role and RoleBinding in each (least privilege)."""
    operator: Operator = Field(default_factory=Operator)
    """The operator Deployment."""
    runtime_image: RuntimeImage = Field(default_factory=RuntimeImage)
    """The runtime pods' images, chosen by the operator per BatchedModel."""
    service_account: ServiceAccount = Field(default_factory=ServiceAccount)
    """The operator's ServiceAccount."""
    rbac: Rbac = Field(default_factory=Rbac)
    """RBAC for the operator."""
    prometheus_adapter: PrometheusAdapter = Field(default_factory=PrometheusAdapter)
    """Custom metrics API rules for prometheus-adapter (HPA autoscaling on queue depth)."""
    service_monitor: ServiceMonitor = Field(default_factory=ServiceMonitor)
    """Scrape the operator (Prometheus Operator)."""
    pod_monitor: PodMonitor = Field(default_factory=PodMonitor)
    """Scrape the runtime pods (Prometheus Operator)."""
    prometheus_rule: PrometheusRule = Field(default_factory=PrometheusRule)
    """Recording rules and alerts (Prometheus Operator)."""
    grafana_dashboard: GrafanaDashboard = Field(default_factory=GrafanaDashboard)
    """The Grafana dashboard."""
    monitoring_namespaces: list[Annotated[str, Field(pattern=DNS_LABEL_PATTERN)]] = Field(
        default_factory=lambda: ["monitoring"]
    )
    """Namespaces Prometheus scrapes from. The NetworkPolicies admit them to the metrics ports: the
    operator's (below) and every runtime pod's (the operator's `--metrics-namespace`). Empty: none."""
    network_policy: NetworkPolicy = Field(default_factory=NetworkPolicy)
    """The operator's NetworkPolicy."""
    endpoint_picker: EndpointPicker = Field(default_factory=EndpointPicker)
    """Endpoint pickers for BatchedModels routed through an InferencePool (`spec.routing:
    inferencePool`)."""
