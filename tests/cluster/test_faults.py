"""Faults of the control plane the operator lives through: kube-apiserver stopped and started again, and
etcd compacted past every revision the operator's watches had seen (each watch resumes with 410 Gone and
lists again). Afterwards the operator process still runs, a deleted child comes back and a spec change is
applied, within 60 s each.

The second test restarts the API server while the operator's ClusterRoleBinding is missing (RBAC rolled
out late, or by hand): every watch reconnects, lists and is refused (403). kopf retries a refused request
nine times over about a minute, then ends the watcher and never starts it again; with
`carpool.operator.watchguard` the stream backs off and lists again, and once the binding is back the
operator hears its children and BatchedModels again. The binding stays away until the guard has seen a
refusal (past kopf's own retries), which makes this the tier's slowest fault test (about 80 s).

What no test here can force is that the operator happens to reconcile while the server is down (it has
nothing to do then); the log lines and metric labels of each API failure are asserted in
tests/operator/test_api_failures.py, and the watch streams' survival of API errors in
tests/operator/test_watchguard.py.
"""

from __future__ import annotations

import re

from tests.cluster.api import Api, wait_for
from tests.cluster.conftest import Operator, operator_metric
from tests.cluster.controlplane import ControlPlane
from tests.cluster.objects import batched_model, kubectl_apply, wait_for_children

RECOVERY_SECONDS = 60.0
REFUSED_PAST_RETRIES = re.compile(r"Watch of .* failed \(Forbidden|Watcher for .* has failed")
"""The guard's line (carpool.operator.watchguard), or kopf's when a watcher ends for good."""


def _runtime_config(api: Api, namespace: str, name: str) -> str:
    found = api.get("ConfigMap", namespace, f"{name}-runtime") or {}
    return str((found.get("data") or {}).get("runtime.yaml", ""))


def test_after_an_api_server_restart_and_an_etcd_compaction_the_operator_converges(
    control_plane: ControlPlane, api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    kubectl_apply(admin_env, batched_model("steady", namespace))
    wait_for_children(api, namespace, "steady")
    logged = len(operator.logs(100_000).splitlines())

    control_plane.stop_apiserver()
    try:
        # The operator notices: its watches reconnect and their requests fail.
        wait_for(
            "the operator's requests to fail while the API server is down",
            lambda: "failed" in "\n".join(operator.logs(100_000).splitlines()[logged:]),
            timeout=60,
        )
        control_plane.compact_etcd()
    finally:
        control_plane.start_apiserver()
    api.reconnect()
    assert operator.process.popen.poll() is None, operator.logs()

    assert api.delete("Service", namespace, "steady") == 200
    kubectl_apply(admin_env, batched_model("steady", namespace, batching={"maxBatchSize": 7}))
    wait_for(
        "the deleted Service re-created",
        lambda: api.get("Service", namespace, "steady"),
        timeout=RECOVERY_SECONDS,
    )
    wait_for(
        "the spec change applied",
        lambda: "max_batch_size: 7" in _runtime_config(api, namespace, "steady"),
        timeout=RECOVERY_SECONDS,
    )
    assert operator.process.popen.poll() is None, operator.logs()


def _new_lines(operator: Operator, since: int) -> list[str]:
    return operator.logs(10**7).splitlines()[since:]


def test_watches_refused_for_a_while_listen_again_once_the_rbac_is_back(
    control_plane: ControlPlane, api: Api, admin_env: dict[str, str], operator: Operator, namespace: str
) -> None:
    kubectl_apply(admin_env, batched_model("refused", namespace))
    wait_for_children(api, namespace, "refused")
    (binding,) = [
        b
        for b in api.list("ClusterRoleBinding")
        if any(s.get("name") == operator.user.rsplit(":", 1)[1] for s in b.get("subjects") or [])
    ]
    name = binding["metadata"]["name"]
    refused_before = operator_metric(operator, "carpool_operator_watch_errors_total", {"reason": "Forbidden"})
    since = len(operator.logs(10**7).splitlines())
    assert api.delete("ClusterRoleBinding", None, name) == 200
    try:
        control_plane.stop_apiserver()  # ends every watch: each lists again, as the operator's account
        control_plane.start_apiserver()
        api.reconnect()
        wait_for(
            "a watch refused past kopf's own retries",
            lambda: any(REFUSED_PAST_RETRIES.search(line) for line in _new_lines(operator, since)),
            timeout=120,
            every=1,
        )
    finally:
        restored = {k: v for k, v in binding.items() if k != "metadata"}
        restored["metadata"] = {"name": name, "labels": binding["metadata"].get("labels") or {}}
        restored |= {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding"}
        api.create(restored)
    assert operator_metric(operator, "carpool_operator_watch_errors_total", {"reason": "Forbidden"}) > (
        refused_before
    )

    assert api.delete("Service", namespace, "refused") == 200
    kubectl_apply(admin_env, batched_model("refused", namespace, batching={"maxBatchSize": 9}))
    wait_for("the deleted Service re-created", lambda: api.get("Service", namespace, "refused"), timeout=60)
    wait_for(
        "the spec change applied",
        lambda: "max_batch_size: 9" in _runtime_config(api, namespace, "refused"),
        timeout=RECOVERY_SECONDS,
    )
    assert operator.process.popen.poll() is None, operator.logs()
