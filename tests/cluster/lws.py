"""The LeaderWorkerSet controller (sigs.k8s.io/lws) on the tier's control plane, as a cluster admin would
install it, but from the binary `make cluster-bin` built from its Go module and the manifests that module
ships (config/crd/bases, config/webhook), read from the Go module cache.

Its manager runs as a local process with the admin's kubeconfig. Its webhooks are not optional: the pod
webhook gives each pod of a group its labels (group and worker index) and the `LWS_LEADER_ADDRESS`,
`LWS_GROUP_SIZE` and `LWS_WORKER_INDEX` variables, and the LeaderWorkerSet webhook defaults and validates
the object. So they are served on loopback with a certificate from the tier's CA, and registered with the
API server by URL (`clientConfig.url`, with the CA as `caBundle`) instead of through a Service, since
nothing here routes to a Service. LWS's own certificate rotation (`internalCertManagement`) is off.
"""

from __future__ import annotations

import base64
import shutil
import time
from pathlib import Path
from typing import Any

import yaml

from tests.cluster import build
from tests.cluster.api import Api, run, wait_for
from tests.cluster.controlplane import ControlPlane, Process, StartError, free_port

CRD_NAME = "leaderworkersets.leaderworkerset.x-k8s.io"
POD_SELECTOR = {"matchExpressions": [{"key": "leaderworkerset.sigs.k8s.io/name", "operator": "Exists"}]}
"""The pod webhooks see only pods of a LeaderWorkerSet (as LWS's kustomize patch sets them)."""


def _webhooks(manifests: Path, port: int, ca: Path) -> list[dict[str, Any]]:
    """LWS's webhook configurations, pointed at the manager on loopback."""
    bundle = base64.b64encode(ca.read_bytes()).decode()
    documents = [doc for doc in yaml.safe_load_all(manifests.read_text()) if doc]
    for document in documents:
        document["metadata"]["name"] = f"lws-{document['metadata']['name']}"
        for hook in document["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": bundle}
            if any("pods" in rule["resources"] for rule in hook["rules"]):
                hook["objectSelector"] = POD_SELECTOR
    return documents


def start_leader_worker_sets(plane: ControlPlane, api: Api) -> tuple[Process, float]:
    """Install the CRD, start the manager, register its webhooks; returns the process and the seconds it
    took. Raises `StartError` when `make cluster-bin` has not built it."""
    started = time.monotonic()
    folder = build.locate(build.LWS)
    if folder is None:
        raise StartError("the LeaderWorkerSet controller is not built: run `make cluster-bin` first")
    source = build.upstream_dir(build.LWS)
    env = plane.env()
    crds = sorted((source / "config" / "crd" / "bases").glob("*.yaml"))
    # Server-side: the CRD (pod templates inlined) is too large for kubectl's last-applied annotation.
    for crd in crds:
        run("kubectl", "apply", "--server-side", "-f", str(crd), env=env)

    work = plane.folder / "lws"
    certs = work / "certs"
    certs.mkdir(parents=True, exist_ok=True)
    serving = plane.pki.issue_serving("lws-webhook", ("localhost",), ("127.0.0.1",))
    shutil.copy(serving.cert, certs / "tls.crt")
    shutil.copy(serving.key, certs / "tls.key")
    port, health = free_port(), free_port()
    config = work / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "config.lws.x-k8s.io/v1alpha1",
                "kind": "Configuration",
                "leaderElection": {"leaderElect": False},
                "internalCertManagement": {"enable": False},
                "webhook": {"host": "127.0.0.1", "port": port, "certDir": str(certs)},
                "metrics": {"bindAddress": "0"},
                "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
            }
        )
    )
    log = work / "manager.log"
    manager = plane.start_process(
        "lws-manager",
        [str(folder / build.LWS_COMMAND), f"--config={config}", "--zap-log-level=info"],
        env=env,
        log=log,
    )
    deadline = time.monotonic() + 60
    plane.wait_healthy(manager, f"http://127.0.0.1:{health}/readyz", None, deadline)
    wait_for(f"the {CRD_NAME} CRD to be established", lambda: _established(api, CRD_NAME), timeout=60)
    for hooks in _webhooks(source / "config" / "webhook" / "manifests.yaml", port, plane.pki.ca.cert):
        run("kubectl", "apply", "--server-side", "-f", "-", env=env, stdin=yaml.safe_dump(hooks))
    return manager, time.monotonic() - started


def _established(api: Api, name: str) -> bool:
    crd = api.get("CustomResourceDefinition", None, name)
    conditions = ((crd or {}).get("status") or {}).get("conditions") or []
    return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)
