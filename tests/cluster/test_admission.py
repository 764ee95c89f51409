"""Admission webhooks in front of the operator's children, each a real HTTPS server of the test's on the
pod network, registered as a cluster registers one: the server listens on a pod IP of its own
(tests/cluster/podnet.py) with a serving certificate from the tier's PKI for its Service's name
(`<service>.<namespace>.svc`), published as the endpoint of a selector-less Service, and the webhook
configuration names that Service (`clientConfig.service`) with the CA as its `caBundle`. The API server
runs with `--enable-aggregator-routing`, so it dials the EndpointSlice's address, as it dials a webhook
pod's in a cluster.

A mutating webhook that does what a service mesh and a policy engine do (an image pinned to its digest,
an annotation, a sidecar container) to every Deployment in the test's namespace, and for one model also
rewrites a value the operator sets (the grace period): the operator converges (no write of a Deployment,
nor an Event, over two of its longest retry periods (2 x 60 s), counted in the audit log, while events keep
coming), keeps the sidecar, the digest and the annotation, and reports the rewritten value as
`Degraded=True FieldOverridden` with a Warning Event.

A validating webhook (a policy engine such as Kyverno or Gatekeeper) that denies the operator's
Deployment, then allows it: the API server answers the apply with 400 `admission webhook "..." denied the
request`. That is no spec error (the same spec passes once the policy changes): the status says
`AdmissionDenied` and a Warning Event carries the webhook's message while it lasts, the operator retries
with back-off, and the Deployment is created once the webhook allows it, without a spec change.
"""

from __future__ import annotations

import base64
import json
import ssl
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from carpool.operator.reconcile import RETRY_DELAY_SECONDS, slow_retries
from tests.cluster.api import Api, condition, run, wait_for
from tests.cluster.conftest import SLOW_RETRY_SECONDS, Operator, operator_metric
from tests.cluster.controlplane import ControlPlane
from tests.cluster.objects import batched_model, kubectl_apply, warnings
from tests.cluster.podnet import PodNetwork, published

LONGEST_RETRY_SECONDS = max(RETRY_DELAY_SECONDS, slow_retries(SLOW_RETRY_SECONDS).longest)
"""The longest the operator under test waits before trying a model again on its own (not an admission
denial's back-off: this webhook denies nothing), with the release's slow retry period."""

DENIAL = "deployments need an approved image (example policy)"
DIGEST = "sha256:" + "5e" * 32
SIDECAR = {"name": "mesh-proxy", "image": "registry.example/mesh/proxy:2"}
OVERRIDDEN = "overridden"
"""The model whose grace period the mutating webhook rewrites (a value the operator must set)."""


class Policy:
    """What the webhook answers; `deny` is switched by the test."""

    def __init__(self, deny: bool) -> None:
        self.deny = deny
        self.reviewed: list[str] = []


def _mutations(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON Patch the mutating webhook answers: digest, annotation, sidecar (each once)."""
    pod = deployment["spec"]["template"]["spec"]
    ops: list[dict[str, Any]] = [
        {
            "op": "replace",
            "path": f"/spec/template/spec/containers/{i}/image",
            "value": f"{c['image']}@{DIGEST}",
        }
        for i, c in enumerate(pod["containers"])
        if "@sha256:" not in c["image"]
    ]
    if not any(c["name"] == SIDECAR["name"] for c in pod["containers"]):
        ops.append({"op": "add", "path": "/spec/template/spec/containers/-", "value": SIDECAR})
    if "annotations" not in deployment["metadata"]:
        ops.append({"op": "add", "path": "/metadata/annotations", "value": {}})
    ops.append({"op": "add", "path": "/metadata/annotations/policy.example.com~1checked", "value": "true"})
    if deployment["metadata"]["name"] == OVERRIDDEN:
        ops.append({"op": "add", "path": "/spec/template/spec/terminationGracePeriodSeconds", "value": 5})
    return ops


def _handler(policy: Policy) -> type[BaseHTTPRequestHandler]:
    class Webhook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            review: dict[str, Any] = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            request = review["request"]
            policy.reviewed.append(f"{request['operation']} {request['kind']['kind']} {request.get('name')}")
            response: dict[str, Any] = {"uid": request["uid"], "allowed": not policy.deny}
            if policy.deny:
                response["status"] = {"message": DENIAL}
            elif self.path.startswith("/mutate"):  # the API server adds ?timeout=...
                patch = json.dumps(_mutations(request["object"])).encode()
                response |= {"patchType": "JSONPatch", "patch": base64.b64encode(patch).decode()}
            body = json.dumps(
                {**{k: review[k] for k in ("apiVersion", "kind")}, "response": response}
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    return Webhook


def _webhook(
    control_plane: ControlPlane, admin_env: dict[str, str], namespace: str, kind: str, policy: Policy
) -> Iterator[Policy]:
    """Serve `policy` over HTTPS on a pod IP, behind a Service of `namespace`, and register it as a `kind`
    (Validating or Mutating) webhook for the Deployments of `namespace`; all go away afterwards."""
    name = f"{kind.lower()}-{namespace}"
    network = PodNetwork()
    address = network.claim()
    try:
        names = (f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.cluster.local")
        pair = control_plane.pki.issue_serving(f"webhook-{namespace}", names, (address,))
        server = ThreadingHTTPServer((address, 0), _handler(policy))
    except BaseException:
        network.release_all()
        raise
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(pair.cert), str(pair.key))
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, name="webhook", daemon=True).start()
    path = "/mutate" if kind == "Mutating" else "/validate"
    config = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": f"{kind}WebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": f"{kind.lower()}.carpool.test",
                "clientConfig": {
                    "service": {"name": name, "namespace": namespace, "port": 443, "path": path},
                    "caBundle": base64.b64encode(control_plane.pki.ca.cert.read_bytes()).decode(),
                },
                "rules": [
                    {
                        "apiGroups": ["apps"],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": ["deployments"],
                    }
                ],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 5,
            }
        ],
    }
    try:
        port = server.server_address[1]
        endpoint = published(namespace, name, address, port, "tests.cluster.test-admission")
        kubectl_apply(admin_env, {"apiVersion": "v1", "kind": "List", "items": [*endpoint, config]})
        yield policy
    finally:
        run("kubectl", "delete", f"{kind.lower()}webhookconfiguration", name, "--wait=false", env=admin_env)
        server.shutdown()
        network.release_all()


@pytest.fixture
def denying_webhook(
    control_plane: ControlPlane, admin_env: dict[str, str], namespace: str
) -> Iterator[Policy]:
    yield from _webhook(control_plane, admin_env, namespace, "Validating", Policy(deny=True))


@pytest.fixture
def mutating_webhook(
    control_plane: ControlPlane, admin_env: dict[str, str], namespace: str
) -> Iterator[Policy]:
    yield from _webhook(control_plane, admin_env, namespace, "Mutating", Policy(deny=False))


def _deployment_writes(control_plane: ControlPlane, operator: Operator, namespace: str) -> int:
    """The operator's writes of Deployments and Events in the namespace (a Warning posted on every
    reconcile is a write loop too)."""
    count = 0
    for event in control_plane.audit_events():
        ref = dict(event.get("objectRef") or {})  # type: ignore[call-overload]
        user = dict(event.get("user") or {})  # type: ignore[call-overload]
        ours = user.get("username") == operator.user and ref.get("namespace") == namespace
        written = ref.get("resource") == "deployments" and not ref.get("subresource")
        count += ours and (written or ref.get("resource") == "events")
    return count


def test_a_mutating_webhooks_changes_are_kept_and_writes_stop(
    control_plane: ControlPlane,
    api: Api,
    admin_env: dict[str, str],
    operator: Operator,
    namespace: str,
    mutating_webhook: Policy,
) -> None:
    for name in ("meshed", OVERRIDDEN):
        kubectl_apply(admin_env, batched_model(name, namespace))

    def mutated(name: str) -> dict[str, Any]:
        found = api.get("Deployment", namespace, name) or {}
        pod = found.get("spec", {}).get("template", {}).get("spec", {})
        containers = {c["name"]: c for c in pod.get("containers", [])}
        if (
            set(containers) != {"runtime", SIDECAR["name"]}
            or "@sha256:" not in containers["runtime"]["image"]
        ):
            raise AssertionError(f"containers {containers}; webhook saw {mutating_webhook.reviewed[-3:]}")
        assert found["metadata"]["annotations"]["policy.example.com/checked"] == "true"
        return found

    for name in ("meshed", OVERRIDDEN):
        wait_for(f"the {name} Deployment as the webhook left it", lambda name=name: mutated(name))  # type: ignore[misc]

    def overridden() -> dict[str, Any]:
        found = condition(api.get("BatchedModel", namespace, OVERRIDDEN), "Degraded")
        if not found or found["reason"] != "FieldOverridden":
            raise AssertionError(f"Degraded is {found}")
        return found

    found = wait_for("Degraded=True FieldOverridden", overridden, timeout=60)
    assert "terminationGracePeriodSeconds" in found["message"], found
    wait_for(
        "a Warning Event naming the rewritten field",
        lambda: any(
            "terminationGracePeriodSeconds" in e["message"] for e in warnings(api, namespace, OVERRIDDEN)
        ),
    )
    meshed = condition(api.get("BatchedModel", namespace, "meshed"), "Degraded") or {}
    assert meshed.get("reason") != "FieldOverridden", meshed

    # Converged: no write of either Deployment (nor an Event) over two of the operator's longest retry
    # periods (a requeue after a failed apply or a conflict), while events keep coming.
    window = 2 * LONGEST_RETRY_SECONDS

    def quiet() -> bool:
        before = _deployment_writes(control_plane, operator, namespace)
        for name in ("meshed", OVERRIDDEN):  # an event on each Deployment: each reconciles its owner
            touch = {"metadata": {"labels": {"example.com/touched": str(int(time.time()))}}}
            api.patch("Deployment", namespace, name, touch)
        time.sleep(window)  # the window under test: writes counted across it, not a wait for a state
        return _deployment_writes(control_plane, operator, namespace) == before

    wait_for("the operator's writes of the Deployments to stop", quiet, timeout=3 * window, every=0)
    for name in ("meshed", OVERRIDDEN):
        mutated(name)


def test_a_webhook_denial_is_reported_and_retried_until_it_allows_without_a_spec_change(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str, denying_webhook: Policy
) -> None:
    invalid = operator_metric(operator, "carpool_operator_reconciles_total", {"result": "invalid"})
    kubectl_apply(admin_env, batched_model("gated", namespace))

    def denied() -> dict[str, Any] | None:
        found = condition(api.get("BatchedModel", namespace, "gated"), "Degraded")
        if not found or found["reason"] != "AdmissionDenied":
            raise AssertionError(f"Degraded is {found}; webhook saw {denying_webhook.reviewed[-3:]}")
        return found

    found = wait_for("Degraded=True AdmissionDenied", denied, timeout=60)
    assert found["status"] == "True" and DENIAL in found["message"], found
    wait_for(
        "a Warning Event with the webhook's message",
        lambda: any(DENIAL in e["message"] for e in warnings(api, namespace, "gated")),
    )
    generation = (api.get("BatchedModel", namespace, "gated") or {})["metadata"]["generation"]
    tries = len(denying_webhook.reviewed)
    wait_for("the operator to try again", lambda: len(denying_webhook.reviewed) > tries, timeout=60)

    denying_webhook.deny = False
    wait_for("the Deployment, once allowed", lambda: api.get("Deployment", namespace, "gated"), timeout=90)
    wait_for(
        "Degraded no longer AdmissionDenied",
        lambda: (
            (c := condition(api.get("BatchedModel", namespace, "gated"), "Degraded"))
            and c["reason"] != "AdmissionDenied"
        ),
        timeout=30,
    )
    assert (api.get("BatchedModel", namespace, "gated") or {})["metadata"]["generation"] == generation
    # A denial is a reason to try again (kopf's TemporaryError, with back-off), never a spec error: kopf
    # retries no PermanentError, and the retries seen above could come from the children's events alone.
    assert operator_metric(operator, "carpool_operator_reconciles_total", {"result": "invalid"}) == invalid
