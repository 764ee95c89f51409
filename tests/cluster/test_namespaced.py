"""A namespaced install (`helm install --set watchNamespaces=...`): the chart grants a Role in each
watched namespace and only cluster-scoped reads in its ClusterRole; the operator, run with that release's
flags and ServiceAccount, reconciles a BatchedModel there with no 403 (a missing grant shows as one in
its log, or as a write the API server refused in the audit log)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest

from tests.cluster.api import Api, condition, run, wait_for
from tests.cluster.conftest import CHART, SLOW_RETRY_SECONDS, Operator, Release, start_operator
from tests.cluster.controlplane import ControlPlane
from tests.cluster.objects import batched_model, kubectl_apply, wait_for_children

REFUSED = re.compile(r"\b403\b|forbidden", re.IGNORECASE)


@pytest.fixture
def namespaced_operator(
    control_plane: ControlPlane, api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> Iterator[Operator]:
    """A second release watching only `namespace`, and its operator in place of the session's
    cluster-wide one (which would reconcile the namespace too); the session's comes back afterwards."""
    release_namespace = f"carpool-ns-{uuid.uuid4().hex[:6]}"
    name = "carpool-ns"
    run(
        "helm", "install", name, CHART, "-n", release_namespace, "--create-namespace",
        "--set", f"watchNamespaces[0]={namespace}",
        "--set", f"operator.slowRetryPeriodSeconds={SLOW_RETRY_SECONDS:g}", "--wait=false", env=admin_env,
    )  # fmt: skip
    deployment = api.get("Deployment", release_namespace, f"{name}-operator")
    assert deployment is not None, "the chart made no operator Deployment"
    pod = deployment["spec"]["template"]["spec"]
    account = pod["serviceAccountName"]
    token = run(
        "kubectl", "create", "token", account, "-n", release_namespace, "--duration=1h", env=admin_env
    ).stdout.strip()
    kubeconfig = control_plane.write_kubeconfig(f"operator-{release_namespace}", token=token)
    release = Release(release_namespace, account, kubeconfig, list(pod["containers"][0].get("args") or []))
    assert f"--namespace={namespace}" in release.operator_args, release.operator_args
    operator.stop()
    started: Operator | None = None
    try:
        started = start_operator(
            control_plane, release, release.operator_args, f"operator-{release_namespace}"
        )
        yield started
    finally:
        if started is not None:
            started.stop()
        run("helm", "uninstall", name, "-n", release_namespace, "--wait=false", env=admin_env)
        api.delete("Namespace", None, release_namespace)
        operator.start()


def test_a_namespaced_install_reconciles_its_namespace_with_no_403(
    control_plane: ControlPlane,
    api: Api,
    admin_env: dict[str, str],
    namespaced_operator: Operator,
    namespace: str,
) -> None:
    since = len(control_plane.audit_events())
    kubectl_apply(admin_env, batched_model("scoped", namespace))
    wait_for_children(api, namespace, "scoped")
    ready = wait_for(
        "the status written", lambda: condition(api.get("BatchedModel", namespace, "scoped"), "Ready")
    )
    assert ready["reason"] != "Forbidden", ready
    refused = []
    for event in control_plane.audit_events()[since:]:
        user = dict(event.get("user") or {})  # type: ignore[call-overload]
        answer = dict(event.get("responseStatus") or {})  # type: ignore[call-overload]
        if user.get("username") == namespaced_operator.user and answer.get("code") == 403:
            refused.append(f"{event['verb']} {event.get('requestURI')}")
    assert refused == []
    logged = [line for line in namespaced_operator.logs(10**6).splitlines() if REFUSED.search(line)]
    assert logged == [], "\n".join(logged[:10])
