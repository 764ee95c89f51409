"""A validating admission webhook (a policy engine such as Kyverno or Gatekeeper) that denies the operator's
Deployment, then allows it: the API server answers the apply with 400 `admission webhook "..." denied the
request`. That is no spec error (the same spec passes once the policy changes): the status says
`AdmissionDenied` and a Warning Event carries the webhook's message while it lasts, the operator retries
with back-off, and the Deployment is created once the webhook allows it, without a spec change.

The webhook is a real HTTPS server of the test's, with a serving certificate from the tier's PKI, which the
API server calls by URL on loopback (`clientConfig.url`; a webhook in a cluster is usually a Service on the
pod network, which changes nothing for the operator).
"""

from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.cluster.api import Api, condition, run, wait_for
from tests.cluster.conftest import Operator
from tests.cluster.controlplane import ControlPlane
from tests.cluster.objects import batched_model, kubectl_apply, warnings

DENIAL = "deployments need an approved image (example policy)"


class Policy:
    """What the webhook answers; `deny` is switched by the test."""

    def __init__(self) -> None:
        self.deny = True
        self.reviewed: list[str] = []


def _handler(policy: Policy) -> type[BaseHTTPRequestHandler]:
    class Webhook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            review: dict[str, Any] = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            request = review["request"]
            policy.reviewed.append(f"{request['operation']} {request['kind']['kind']} {request.get('name')}")
            response: dict[str, Any] = {"uid": request["uid"], "allowed": not policy.deny}
            if policy.deny:
                response["status"] = {"message": DENIAL}
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


@pytest.fixture
def denying_webhook(
    control_plane: ControlPlane, api: Api, admin_env: dict[str, str], namespace: str
) -> Iterator[Policy]:
    policy = Policy()
    pair = control_plane.pki.issue_serving("webhook", ("localhost",), ("127.0.0.1",))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(policy))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(pair.cert), str(pair.key))
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, name="webhook", daemon=True).start()
    name = f"deny-deployments-{namespace}"
    import base64

    config = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": "deny.carpool.test",
                "clientConfig": {
                    "url": f"https://127.0.0.1:{server.server_address[1]}/validate",
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
    kubectl_apply(admin_env, config)
    try:
        yield policy
    finally:
        run("kubectl", "delete", "validatingwebhookconfiguration", name, "--wait=false", env=admin_env)
        server.shutdown()


def test_a_webhook_denial_is_reported_and_retried_until_it_allows_without_a_spec_change(
    api: Api, admin_env: dict[str, str], operator: Operator, namespace: str, denying_webhook: Policy
) -> None:
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
