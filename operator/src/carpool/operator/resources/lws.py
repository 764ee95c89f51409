"""The LeaderWorkerSet of a model split over several nodes (`spec.model.nodes` > 1), named `<name>-lws`.

One replica of such a model is a group of `nodes` pods (sigs.k8s.io/lws, API leaderworkerset.x-k8s.io/v1):
a leader, which runs carpool's fronts and vLLM's scheduler and serves the API, and `nodes - 1` workers,
which run their share of the model's ranks and serve nothing. vLLM's ranks find each other at the leader's
address: the LeaderWorkerSet's pod webhook sets `LWS_LEADER_ADDRESS`, `LWS_GROUP_SIZE` and
`LWS_WORKER_INDEX` in every pod, and the operator passes the index on as the runtime's
`model.node_rank` (`CARPOOL_MODEL__NODE_RANK`), as vLLM's own LeaderWorkerSet example passes
`--node-rank $(LWS_WORKER_INDEX) --master-addr $(LWS_LEADER_ADDRESS)`.

- The group is the unit: `restartPolicy: RecreateGroupOnPodRestart` restarts all of it when one pod
  fails (vLLM's collective cannot lose a rank and go on), `replicas` counts groups, and the scale
  subresource (`.spec.replicas`, selector `.status.hpaPodSelector`, the leaders) lets the HPA and KEDA
  scale whole groups on the leaders' queue depth.
- `startupPolicy: LeaderCreated`: workers start with their leader, so the ranks load the model side by
  side; the leader's startup probe covers the group's loading and warm-up.
- Rollouts count groups, with the Deployment's rules (`rollout`): by default with GPUs one group at a
  time and none added (`maxSurge: 0, maxUnavailable: 1`): a group holds whole nodes of GPUs.

The pods are the Deployment's (`deployment.pod_template`): the same config, volumes, security context
and Secrets; the leader's carry the probes and ports and are selected by the Service (`carpool.dev/role:
leader`), the workers' have neither.
"""

from __future__ import annotations

from typing import Any

from carpool.operator.resources.deployment import pod_template
from carpool.operator.resources.labels import (
    LEADER,
    LWS_API_VERSION,
    LWS_KIND,
    WORKER,
    leader_worker_set_name,
    standard_labels,
)
from carpool.operator.resources.rollout import strategy
from carpool.operator.spec import BatchedModelSpec

API_VERSION = LWS_API_VERSION
KIND = LWS_KIND


def leader_worker_set(
    spec: BatchedModelSpec, name: str, config_hash: str, drain_seconds: float
) -> dict[str, Any]:
    """The LeaderWorkerSet. With autoscaling on, `spec.replicas` is left out: the autoscaler owns it."""
    body: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": leader_worker_set_name(name), "labels": standard_labels(name)},
        "spec": {
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": strategy(spec)["rollingUpdate"],
            },
            "leaderWorkerTemplate": {
                "size": spec.model.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": pod_template(spec, name, config_hash, drain_seconds, LEADER),
                "workerTemplate": pod_template(spec, name, config_hash, drain_seconds, WORKER),
            },
        },
    }
    if not spec.autoscaling.enabled:
        body["spec"]["replicas"] = spec.replicas
    return body
