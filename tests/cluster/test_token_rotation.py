"""Bound service-account tokens that rotate under a running operator.

On a cluster the kubelet rewrites a pod's projected token before it expires, and the old token stops
being accepted when it expires. Here the operator runs with a kubeconfig whose user has a `tokenFile`
(as client-go reads it, and as a pod's token file is read: `carpool.operator.token`). The tokens come
from the TokenRequest API, each bound to a Secret of its own (`kubectl create token --bound-object-kind
Secret`): deleting that Secret makes the API server refuse the token at once (401), as its expiry would.
The TokenRequest API's shortest lifetime is 10 minutes, too long for this tier; revocation by the bound
object ends a token at the moment the test chooses. The rotation is the kubelet's: the new token written
to a new file and swapped in with a rename (its atomic writer swaps a symlink).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.cluster.api import Api, run, wait_for
from tests.cluster.conftest import Operator, Release, operator_metric, start_operator
from tests.cluster.controlplane import ControlPlane, kubeconfig
from tests.cluster.objects import batched_model, kubectl_apply, wait_for_children


def _bound_token(api: Api, admin_env: dict[str, str], release: Release) -> tuple[str, str]:
    """A new Secret in the release's namespace and a token of the operator's ServiceAccount bound to it."""
    secret = f"token-binding-{uuid.uuid4().hex[:6]}"
    api.create(
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret, "namespace": release.namespace}}
    )
    token = run(
        "kubectl", "create", "token", release.service_account, "-n", release.namespace,
        "--bound-object-kind=Secret", f"--bound-object-name={secret}", "--duration=1h",
        env=admin_env,
    ).stdout.strip()  # fmt: skip
    return secret, token


def _write(path: Path, token: str) -> None:
    """The kubelet's way: write beside, then rename over (readers see the old or the new, never half)."""
    beside = path.with_name(f".{path.name}.{uuid.uuid4().hex[:6]}")
    beside.write_text(token)
    os.replace(beside, path)


@pytest.fixture
def rotating(
    control_plane: ControlPlane, api: Api, admin_env: dict[str, str], release: Release, operator: Operator
) -> Iterator[tuple[Operator, Path, str]]:
    """An operator on a token file, in place of the session's (which would reconcile the same models)."""
    token_file = control_plane.folder / f"token-{uuid.uuid4().hex[:6]}"
    secret, token = _bound_token(api, admin_env, release)
    _write(token_file, token)
    config = kubeconfig(control_plane.server, control_plane.pki.ca.cert)
    config["users"] = [{"name": "user", "user": {"tokenFile": str(token_file)}}]
    path = control_plane.folder / f"{token_file.name}.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    on_file = Release(release.namespace, release.service_account, path, release.operator_args)
    operator.stop()
    started: Operator | None = None
    try:
        started = start_operator(control_plane, on_file, release.operator_args, f"operator-{token_file.name}")
        yield started, token_file, secret
    finally:
        if started is not None:
            started.stop()
        operator.start()


def test_the_operator_follows_a_rotated_token_without_a_restart(
    control_plane: ControlPlane,
    api: Api,
    admin_env: dict[str, str],
    release: Release,
    rotating: tuple[Operator, Path, str],
    namespace: str,
) -> None:
    running, token_file, first_secret = rotating
    pid = running.process.popen.pid
    kubectl_apply(admin_env, batched_model("m", namespace))
    wait_for_children(api, namespace, "m")

    # The kubelet rotates the token; the old one is then refused.
    _, second = _bound_token(api, admin_env, release)
    _write(token_file, second)
    api.request("DELETE", f"/api/v1/namespaces/{release.namespace}/secrets/{first_secret}")
    since = len(control_plane.audit_events())
    kubectl_apply(admin_env, batched_model("m", namespace, batching={"maxBatchSize": 8}))

    def applied() -> bool:
        config = api.get("ConfigMap", namespace, "m-runtime") or {}
        return "max_batch_size: 8" in str((config.get("data") or {}).get("runtime.yaml"))

    wait_for("the spec change applied with the new token", applied, timeout=60)
    assert running.process.popen.pid == pid and running.process.popen.poll() is None
    # The reconciler's own requests never went out with the revoked token.
    assert (
        operator_metric(running, "carpool_operator_reconcile_errors_total", {"reason": "Unauthorized"}) == 0
    )
    writes = [
        (dict(e.get("responseStatus") or {}).get("code"), e.get("requestURI"))  # type: ignore[call-overload]
        for e in control_plane.audit_events()[since:]
        if dict(e.get("user") or {}).get("username") == running.user  # type: ignore[call-overload]
        and dict(e.get("objectRef") or {}).get("resource") == "configmaps"  # type: ignore[call-overload]
    ]
    assert writes and all(int(code or 0) < 400 for code, _ in writes), writes
