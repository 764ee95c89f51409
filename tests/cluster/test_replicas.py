"""Two operator replicas, as the chart runs them with `operator.replicas: 2` (`--leader-elect`): exactly
one reconciles (the other's reconcile counter stays at zero), and when the leader is killed (SIGKILL: no
release of the Lease) the other takes over within the documented time: 19 s after the leader's last renewal
(`carpool.operator.leader.TAKE_OVER_SECONDS`: a retry period to see the renewal, the 15 s lease, a retry
period to try again)."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator

import pytest

from carpool.operator.leader import TAKE_OVER_SECONDS
from tests.cluster.api import Api, run, wait_for
from tests.cluster.conftest import (
    CHART,
    OPERATOR_DEPLOYMENT,
    Operator,
    Release,
    operator_metric,
    start_operator,
)
from tests.cluster.controlplane import ControlPlane
from tests.cluster.objects import batched_model, kubectl_apply, wait_for_children


def _reconciles(replica: Operator) -> float:
    return operator_metric(replica, "carpool_operator_reconciles_total")


def _leader(replica: Operator) -> bool:
    return operator_metric(replica, "carpool_operator_leader") == 1


@pytest.fixture
def replicas(
    control_plane: ControlPlane, api: Api, admin_env: dict[str, str], release: Release, operator: Operator
) -> Iterator[list[Operator]]:
    """The chart upgraded to two replicas (its Lease Role and `--leader-elect` flags), and two operator
    processes with those flags in place of the session's single one, which comes back afterwards."""

    def upgrade(count: int) -> list[str]:
        run(
            "helm", "upgrade", "carpool", CHART, "-n", release.namespace, "--reuse-values",
            "--set", f"operator.replicas={count}", "--wait=false", env=admin_env,
        )  # fmt: skip
        deployment = api.get("Deployment", release.namespace, OPERATOR_DEPLOYMENT) or {}
        return list(deployment["spec"]["template"]["spec"]["containers"][0]["args"])

    args = upgrade(2)
    assert "--leader-elect" in args, args
    operator.stop()
    started: list[Operator] = []
    try:
        for index in range(2):
            started.append(
                start_operator(control_plane, release, args, f"replica-{index}", POD_ID=f"r{index}")
            )
        yield started
    finally:
        for replica in started:
            replica.stop()
        upgrade(1)
        operator.start()


def test_one_of_two_replicas_reconciles_and_the_other_takes_over_after_a_sigkill(
    api: Api, admin_env: dict[str, str], replicas: list[Operator], namespace: str
) -> None:
    leader = wait_for(
        "one replica to hold the Lease", lambda: next((r for r in replicas if _leader(r)), None)
    )
    (standby,) = [r for r in replicas if r is not leader]
    kubectl_apply(admin_env, batched_model("elected", namespace))
    wait_for_children(api, namespace, "elected")
    assert api.delete("Service", namespace, "elected") == 200
    wait_for("the Service restored", lambda: api.get("Service", namespace, "elected"))
    assert _reconciles(leader) > 0
    assert (_reconciles(standby), _leader(standby)) == (0, False), standby.logs()

    killed = time.monotonic()
    os.kill(leader.process.popen.pid, signal.SIGKILL)
    leader.process.popen.wait(10)
    # Within the documented time from the kill, which is at most that from the leader's last renewal.
    wait_for("the standby to take the Lease over", lambda: _leader(standby), timeout=TAKE_OVER_SECONDS + 1)
    took = time.monotonic() - killed
    sys.stderr.write(f"\ntake-over after SIGKILL: {took:.1f} s (documented: within {TAKE_OVER_SECONDS} s)\n")
    assert api.delete("Service", namespace, "elected") == 200
    wait_for("the Service restored by the new leader", lambda: api.get("Service", namespace, "elected"))
    assert _reconciles(standby) > 0
