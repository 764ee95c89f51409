"""The API failures the operator tells apart (`reconcile.api_failure`: a log line, a metric label, a delay
before retrying), each produced by the real API server or a real proxy in front of it and read through the
operator's own client (`kube.Kube`), not built by hand:

- 401: a token the API server does not accept (the server's authenticators refuse it).
- 429 with Retry-After: API Priority and Fairness rejecting a flow over its priority level's concurrency
  (a FlowSchema for one ServiceAccount, a PriorityLevelConfiguration of one share that rejects instead of
  queueing), as a cluster under load throttles a client.
- unreachable: a TCP proxy in front of the API server that swallows every byte (tests/cluster/tcpproxy.py),
  and a port nothing listens on (connection refused).

tests/operator/test_api_failures.py covers what the operator does next (requeues, conditions) on kmock.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import uuid
from collections.abc import Iterator

import httpx
import kopf
import pytest
import yaml
from prometheus_client import REGISTRY

from carpool.operator.kube import Kube, KubeError, ObjectRef
from carpool.operator.reconcile import RETRY_DELAY_SECONDS, api_failure
from tests.cluster.api import Api, run, wait_for
from tests.cluster.controlplane import ControlPlane, free_port
from tests.cluster.tcpproxy import TcpProxy

REF = ObjectRef("v1", "ConfigMap", "default", "absent")


def _errors(reason: str) -> float:
    return REGISTRY.get_sample_value("carpool_operator_reconcile_errors_total", {"reason": reason}) or 0.0


def _connection(server: str, control_plane: ControlPlane, token: str) -> kopf.ConnectionInfo:
    return kopf.ConnectionInfo(server=server, ca_path=str(control_plane.pki.ca.cert), token=token)


async def _get(info: kopf.ConnectionInfo, limit: float | None = None) -> KubeError:
    kube = Kube()
    kube.connect(info)
    try:
        await kube._call("GET", REF.path(), limit=limit)
    except KubeError as exc:
        return exc
    finally:
        await kube.close()
    raise AssertionError("the API server answered")


def _failure(exc: KubeError, caplog: pytest.LogCaptureFixture) -> tuple[float, str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        delay = api_failure(exc, logging.getLogger("test"))
    return delay, caplog.records[-1].getMessage()


def test_a_token_the_api_server_refuses_is_a_401(
    control_plane: ControlPlane, caplog: pytest.LogCaptureFixture
) -> None:
    before = _errors("Unauthorized")
    exc = asyncio.run(_get(_connection(control_plane.server, control_plane, "not-a-token")))
    assert (exc.status, exc.reason) == (401, "Unauthorized"), exc
    delay, line = _failure(exc, caplog)
    assert "refused the operator's credentials (401" in line and delay == RETRY_DELAY_SECONDS
    assert _errors("Unauthorized") == before + 1


@pytest.fixture
def throttled(control_plane: ControlPlane, api: Api, admin_env: dict[str, str]) -> Iterator[str]:
    """A ServiceAccount whose requests API Priority and Fairness admits one share of concurrency, and
    rejects (429) rather than queues beyond it; its token."""
    name = f"throttled-{uuid.uuid4().hex[:6]}"
    user = f"system:serviceaccount:default:{name}"
    api.create(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": "default"}}
    )
    level = {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
        "kind": "PriorityLevelConfiguration",
        "metadata": {"name": name},
        "spec": {
            "type": "Limited",
            "limited": {
                "nominalConcurrencyShares": 1,
                "lendablePercent": 0,
                "borrowingLimitPercent": 0,
                "limitResponse": {"type": "Reject"},
            },
        },
    }
    schema = {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
        "kind": "FlowSchema",
        "metadata": {"name": name},
        "spec": {
            "priorityLevelConfiguration": {"name": name},
            "matchingPrecedence": 100,
            "distinguisherMethod": {"type": "ByUser"},
            "rules": [
                {
                    "subjects": [{"kind": "User", "user": {"name": user}}],
                    "resourceRules": [
                        {
                            "verbs": ["*"],
                            "apiGroups": ["*"],
                            "resources": ["*"],
                            "namespaces": ["*"],
                            "clusterScope": True,
                        }
                    ],
                }
            ],
        },
    }
    run("kubectl", "apply", "-f", "-", env=admin_env, stdin=yaml.safe_dump_all([level, schema]))
    token = run("kubectl", "create", "token", name, "-n", "default", env=admin_env).stdout.strip()
    try:
        # The API server takes new FlowSchemas up through an informer: until then this user's requests go
        # to a default level with plenty of room (a flood came back without a 429 on a loaded host). APF
        # names the priority level that classified a request in a response header: wait for ours.
        uid = run(
            "kubectl",
            "get",
            "prioritylevelconfiguration",
            name,
            "-o",
            "jsonpath={.metadata.uid}",
            env=admin_env,
        ).stdout.strip()
        context = ssl.create_default_context(cafile=str(control_plane.pki.ca.cert))
        with httpx.Client(base_url=control_plane.server, verify=context, timeout=10) as http:

            def classified() -> bool | None:
                answer = http.get(REF.path(), headers={"Authorization": f"Bearer {token}"})
                return answer.headers.get("X-Kubernetes-PF-PriorityLevel-UID") == uid or None

            wait_for("API Priority and Fairness to classify the user's requests at its level", classified, 60)
        yield token
    finally:
        for kind in ("flowschema", "prioritylevelconfiguration"):
            run("kubectl", "delete", kind, name, "--wait=false", env=admin_env, check=False)
        api.delete("ServiceAccount", "default", name)


async def _flood(info: kopf.ConnectionInfo, count: int) -> list[KubeError]:
    kube = Kube()
    kube.connect(info)
    try:
        answers = await asyncio.gather(*(kube.get(REF) for _ in range(count)), return_exceptions=True)
    finally:
        await kube.close()
    return [a for a in answers if isinstance(a, KubeError)]


def test_api_priority_and_fairness_throttling_is_a_429_with_its_retry_after(
    control_plane: ControlPlane, throttled: str, caplog: pytest.LogCaptureFixture
) -> None:
    info = _connection(control_plane.server, control_plane, throttled)
    rejected: list[KubeError] = []
    for _ in range(10):  # rounds of concurrent reads: one share admits only a few at once
        rejected = [e for e in asyncio.run(_flood(info, 400)) if e.status == 429]
        if rejected:
            break
    assert rejected, "API Priority and Fairness rejected none of the reads"
    exc = rejected[0]
    assert exc.reason == "TooManyRequests" and exc.retry_after is not None and exc.retry_after >= 1, exc
    delay, line = _failure(exc, caplog)
    assert "throttled the operator (429" in line and delay == exc.retry_after


def test_an_api_server_behind_a_black_hole_or_a_closed_port_is_unreachable(
    control_plane: ControlPlane, caplog: pytest.LogCaptureFixture
) -> None:
    host, port = control_plane.server.removeprefix("https://").split(":")
    proxy = TcpProxy((host, int(port)))
    try:
        proxy.blackhole()
        exc = asyncio.run(_get(_connection(proxy.url, control_plane, "any"), limit=2))
        assert (exc.status, exc.reason) == (0, "ApiUnreachable"), exc
        delay, line = _failure(exc, caplog)
        assert "Kubernetes API unreachable" in line and delay == RETRY_DELAY_SECONDS
    finally:
        proxy.close()
    exc = asyncio.run(_get(_connection(f"https://127.0.0.1:{free_port()}", control_plane, "any")))
    assert (exc.status, exc.reason) == (0, "ApiUnreachable") and "Cannot connect" in exc.message, exc
