"""What the cluster tier cannot enforce, and what it checks instead.

- **NetworkPolicy is not enforced in any tier.** No CNI runs here (the kubelet stand-in gives pods
  addresses on the host, tests/cluster/podnet.py), so nothing drops a packet a policy does not admit.
  This tier checks the policy the API server stores: the one the operator renders with the chart's own
  flags admits the chart's monitoring namespaces on the metrics port, and only those.
- **The scrape path is not the one a cluster has.** Prometheus runs as a host process (the autoscaling
  test's, tests/cluster/metrics_api.py), not in a pod of a monitoring namespace, so the policy's scrape
  rule is never on its path.
"""

from __future__ import annotations

import yaml

from tests.cluster.api import Api
from tests.cluster.conftest import CHART, Operator
from tests.cluster.objects import batched_model, kubectl_apply, wait_for_children

NAME_LABEL = "kubernetes.io/metadata.name"


def test_the_runtime_policy_admits_the_charts_monitoring_namespaces_to_the_metrics_port(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    monitoring = yaml.safe_load((CHART / "values.yaml").read_text())["monitoringNamespaces"]
    assert monitoring, "the chart's default values name no monitoring namespace"
    kubectl_apply(admin_env, batched_model("policed", namespace))
    policy = wait_for_children(api, namespace, "policed", kinds=("NetworkPolicy",))["NetworkPolicy"]
    # The scrape rule: every source a namespace, by name (the serving rule's default source is the
    # model's own namespace's pods, a podSelector).
    scrape = [
        rule
        for rule in policy["spec"]["ingress"]
        if all(set(p) == {"namespaceSelector"} for p in rule["from"])
    ]
    admitted = sorted(
        peer["namespaceSelector"]["matchLabels"][NAME_LABEL] for rule in scrape for peer in rule["from"]
    )
    assert admitted == sorted(monitoring), policy["spec"]
    assert [port["port"] for rule in scrape for port in rule["ports"]] == [8000], policy["spec"]
