"""Faults of the control plane the operator lives through: kube-apiserver stopped and started again, and
etcd compacted past every revision the operator's watches had seen (each watch resumes with 410 Gone and
lists again). Afterwards the operator process still runs, a deleted child comes back and a spec change is
applied, within 60 s each.

What no test here can force is that the operator happens to reconcile while the server is down (it has
nothing to do then); the log lines and metric labels of each API failure are asserted in
tests/operator/test_api_failures.py, and the watch streams' survival of API errors in
tests/operator/test_watchguard.py.
"""

from __future__ import annotations

from tests.cluster.api import Api, wait_for
from tests.cluster.conftest import Operator
from tests.cluster.controlplane import ControlPlane
from tests.cluster.objects import batched_model, kubectl_apply, wait_for_children

RECOVERY_SECONDS = 60.0


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
