"""A kubelet stand-in: one Node whose pods run as local processes, so the cluster tier's pods really run.

What it does, as a kubelet does:
- registers its Node (capacity and allocatable: cpu, memory, pods and the extended resource
  `nvidia.com/gpu`; a Ready condition it refreshes; a taint of its own, so that only pods that
  tolerate it are scheduled here and the other tests keep their pods pending), and lifts the
  `node.kubernetes.io/not-ready` taint the API server's admission put on it (the node-lifecycle
  controller's part, which this control plane does not run);
- runs every pod the scheduler binds to it: the pod's init containers to completion, then its one
  container (tests/e2e/pods.py `LocalPod`: the container's command, args and literal env, each volume a
  folder of the pod, ConfigMap volumes filled from the API server), with the pod's own IP
  (tests/cluster/podnet.py) where the runtime binds the container's ports;
- gives a pod with `hostname` and `subdomain` its DNS names, as cluster DNS does for a headless
  Service's pods (`<hostname>.<subdomain>.<namespace>[.svc.cluster.local]`, which LeaderWorkerSet's
  `LWS_LEADER_ADDRESS` names): a line of this host's /etc/hosts while the pod runs (podnet.py);
- expands `$(NAME)` in the container's env, command and args from the variables listed before it;
- runs the startup, readiness and liveness probes as declared (tests/e2e/pods.py `Kubelet`) and writes
  the pod's status: `podIP`, phase, the Ready and ContainersReady conditions from the readiness probe,
  the container's state, restarts (restartPolicy Always, with the kubelet's back-off) and its
  `lastState.terminated` with the termination message (the file the container wrote, else with
  `FallbackToLogsOnError` the log's tail);
- on deletion: the preStop exec hook (run as a local command), SIGTERM, the rest of the grace period,
  SIGKILL, then the final status and the pod's removal (`gracePeriodSeconds: 0`, with its UID as a
  precondition); meanwhile the readiness probe goes on and the Ready condition follows it, as the
  kubelet's does for a terminating pod (the endpoint's `serving` condition is read from it).

What a kubelet does that this does not: no container runtime, image, cgroup, namespace or user (no
resource limits enforced, `securityContext` ignored, processes run as this user), no volumes but
folders (a PersistentVolumeClaim or Secret volume is an empty folder), no liveness restarts
(a failing liveness probe is recorded, not acted on), one container per pod (it renews the Node's
Lease in kube-node-lease every 5 s, so the node-lifecycle controller keeps the Node Ready), no
eviction, no static pods, no `kubectl logs`/`exec`. It talks to the API server with the test's admin
client, not as `system:node:<name>` (the Node authorizer is not on here).
"""

from __future__ import annotations

import contextlib
import datetime
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.cluster.api import Api
from tests.cluster.nodelease import delete_node_lease, renew_node_lease
from tests.cluster.podnet import HostsFile, PodNetwork, dns_names
from tests.e2e.pods import Kubelet as Prober
from tests.e2e.pods import LocalPod, PodTemplate

NODE_TAINT = {"key": "carpool.dev/local-kubelet", "value": "true", "effect": "NoSchedule"}
TOLERATION = {"key": NODE_TAINT["key"], "operator": "Equal", "value": "true", "effect": "NoSchedule"}
"""What a pod needs to be scheduled onto the stand-in's Node."""
STRATEGIC = "application/strategic-merge-patch+json"
MAX_BACKOFF_S = 300.0
FALLBACK_LOG_LINES = 80
FALLBACK_LOG_BYTES = 2048


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def node_manifest(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}},
        "spec": {"taints": [NODE_TAINT]},
    }


def node_status(capacity: dict[str, str]) -> dict[str, Any]:
    stamp = now()
    return {
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "the tests/cluster kubelet stand-in is running",
                    "lastHeartbeatTime": stamp,
                    "lastTransitionTime": stamp,
                }
            ],
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": "stand-in",
                "kubeProxyVersion": "",
                "containerRuntimeVersion": "local-process://",
                "kernelVersion": "",
                "osImage": "",
                "bootID": "",
                "machineID": "",
                "systemUUID": "",
            },
        }
    }


def termination_message(pod: LocalPod, container: dict[str, Any], exit_code: int) -> str:
    """What the kubelet puts in `lastState.terminated.message`."""
    path = Path(pod.env.get("CARPOOL_TERMINATION_LOG", ""))
    written = path.read_text(errors="replace").strip() if path.is_file() else ""
    if written or exit_code == 0 or container.get("terminationMessagePolicy") != "FallbackToLogsOnError":
        return written
    tail = "\n".join(pod.log_lines()[-FALLBACK_LOG_LINES:])
    return tail[-FALLBACK_LOG_BYTES:]


@dataclass
class RunningPod:
    """One pod on the Node: its process, its probes and the status last written."""

    body: dict[str, Any]
    local: LocalPod
    address: str
    prober: Prober | None = None
    restarts: int = 0
    started_at: str = ""
    state: dict[str, Any] = field(default_factory=dict)
    """The container's state now (`running`, `waiting` or `terminated`, as the API spells it)."""
    last_state: dict[str, Any] = field(default_factory=dict)
    written: dict[str, Any] = field(default_factory=dict)
    deleting: threading.Event = field(default_factory=threading.Event)
    gone: threading.Event = field(default_factory=threading.Event)

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])

    @property
    def namespace(self) -> str:
        return str(self.body["metadata"]["namespace"])

    @property
    def uid(self) -> str:
        return str(self.body["metadata"]["uid"])


class StandInKubelet:
    """Registers `node` and runs the pods bound to it until `stop()`."""

    def __init__(
        self,
        api: Api,
        node: str,
        workdir: Path,
        capacity: dict[str, str],
        claims: dict[str, Path] | None = None,
    ) -> None:
        """`claims`: PersistentVolumeClaims by name -> the folder that stands for the volume (others are
        an empty folder per pod)."""
        self.api = api
        self.node = node
        self.workdir = workdir
        self.capacity = capacity
        self.claims = claims or {}
        self.network = PodNetwork()
        self.hosts = HostsFile()
        self.pods: dict[str, RunningPod] = {}
        self.history: list[RunningPod] = []
        """Every pod it ran, in start order (the tests read their logs and probe results)."""
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- the Node -----------------------------------------------------------------------------------

    def register(self) -> None:
        self.api.create(node_manifest(self.node))
        self._heartbeat()
        # The TaintNodesByCondition admission plugin tainted the new Node `node.kubernetes.io/not-ready`;
        # the node-lifecycle controller lifts that once the Node is Ready, and it does not run here.
        answer = self.api.patch("Node", None, self.node, {"spec": {"taints": [NODE_TAINT]}})
        assert answer.status_code == 200, answer.text

    def _heartbeat(self) -> None:
        answer = self.api.patch("Node", None, self.node, node_status(self.capacity), subresource="status")
        if answer.status_code >= 400:
            self.errors.append(f"node status: {answer.status_code} {answer.text}")

    def start(self) -> StandInKubelet:
        self.register()
        thread = threading.Thread(target=self._sync_loop, name=f"kubelet-{self.node}", daemon=True)
        self._threads.append(thread)
        thread.start()
        lease = threading.Thread(target=self._lease_loop, name=f"kubelet-lease-{self.node}", daemon=True)
        self._threads.append(lease)
        lease.start()
        return self

    def _lease_loop(self) -> None:
        """The Node's Lease, renewed every 5 s apart from the pod sync (which a slow pod start can hold
        up), so the node-lifecycle controller never takes this Node for lost."""
        while not self._stop.is_set():
            error = renew_node_lease(self.api, self.node)
            if error:
                self.errors.append(error)
            self._stop.wait(5)

    def _bound_pods(self) -> list[dict[str, Any]]:
        answer = self.api.request(
            "GET", "/api/v1/pods", params={"fieldSelector": f"spec.nodeName={self.node}"}
        )
        answer.raise_for_status()
        return list(answer.json().get("items") or [])

    def _sync_loop(self) -> None:
        last_heartbeat = time.monotonic()
        while not self._stop.wait(0.5):
            try:
                self._sync()
                if time.monotonic() - last_heartbeat > 10:
                    self._heartbeat()
                    last_heartbeat = time.monotonic()
            except Exception as exc:  # keep syncing; the test reads `errors`
                self.errors.append(f"sync: {type(exc).__name__}: {exc}")

    def _sync(self) -> None:
        for body in self._bound_pods():
            uid = body["metadata"]["uid"]
            running = self.pods.get(uid)
            if running is None:
                if body["metadata"].get("deletionTimestamp"):
                    continue
                if (body.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    continue
                self._admit(body)
            elif body["metadata"].get("deletionTimestamp") and not running.deleting.is_set():
                running.body = body
                running.deleting.set()

    # -- one pod ------------------------------------------------------------------------------------

    def _template(self, body: dict[str, Any]) -> PodTemplate:
        spec = body["spec"]
        (container,) = spec["containers"]
        namespace = body["metadata"]["namespace"]
        config_maps: dict[str, dict[str, str]] = {}
        for volume in spec.get("volumes") or []:
            if "configMap" in volume:
                name = volume["configMap"]["name"]
                found = self.api.get("ConfigMap", namespace, name)
                assert found is not None, f"ConfigMap {namespace}/{name} of pod {body['metadata']['name']}"
                config_maps[name] = dict(found.get("data") or {})
        return PodTemplate(
            name=body["metadata"]["name"],
            namespace=namespace,
            labels=dict(body["metadata"].get("labels") or {}),
            container=container,
            init_containers=list(spec.get("initContainers") or []),
            volumes=list(spec.get("volumes") or []),
            config_maps=config_maps,
            termination_grace_s=int(spec.get("terminationGracePeriodSeconds", 30)),
        )

    def _admit(self, body: dict[str, Any]) -> None:
        address = self.network.claim()
        folder = self.workdir / body["metadata"]["namespace"]
        local = LocalPod(
            self._template(body), body["metadata"]["name"], folder, address=address, claims=self.claims
        )
        local.env["CARPOOL_TERMINATION_LOG"] = str(local.dir / "termination-log")
        running = RunningPod(body, local, address)
        names = dns_names(body)
        if names:
            self.hosts.add(running.uid, address, names)
        self.pods[running.uid] = running
        self.history.append(running)
        thread = threading.Thread(
            target=self._run_pod, args=(running,), name=f"pod-{running.name}", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def _patch_status(self, running: RunningPod, status: dict[str, Any]) -> None:
        if status == running.written:
            return
        answer = self.api.patch(
            "Pod",
            running.namespace,
            running.name,
            {"status": status},
            subresource="status",
            content_type=STRATEGIC,
        )
        if answer.status_code == 404:
            return
        if answer.status_code >= 400:
            self.errors.append(f"status of {running.name}: {answer.status_code} {answer.text}")
            return
        running.written = status

    def _status(
        self, running: RunningPod, *, phase: str, state: dict[str, Any], ready: bool
    ) -> dict[str, Any]:
        container = running.local.template.container
        stamp = now()
        previous = {c["type"]: c for c in running.written.get("conditions") or []}

        def condition(kind: str, value: bool) -> dict[str, Any]:
            text = "True" if value else "False"
            old = previous.get(kind)
            since = stamp if old is None or old["status"] != text else old["lastTransitionTime"]
            return {"type": kind, "status": text, "lastTransitionTime": since}

        initialized = (
            phase != "Pending"
            or "waiting" not in state
            or state["waiting"].get("reason") != "PodInitializing"
        )
        status: dict[str, Any] = {
            "phase": phase,
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": running.address,
            "podIPs": [{"ip": running.address}],
            "startTime": running.started_at or stamp,
            "conditions": [
                condition("PodReadyToStartContainers", True),
                condition("Initialized", initialized),
                condition("ContainersReady", ready),
                condition("Ready", ready),
            ],
            "containerStatuses": [
                {
                    "name": container["name"],
                    "image": container.get("image", ""),
                    "imageID": "",
                    "containerID": f"local://{running.local.proc.pid}" if running.local.proc else "",
                    "ready": ready,
                    "started": "running" in state,
                    "restartCount": running.restarts,
                    "state": state,
                    "lastState": running.last_state,
                }
            ],
        }
        return status

    def _run_pod(self, running: RunningPod) -> None:
        try:
            self._lifecycle(running)
        except Exception as exc:  # a pod's failure is reported, not raised in a thread
            self.errors.append(f"pod {running.name}: {type(exc).__name__}: {exc}")
        finally:
            self.hosts.remove(running.uid)
            self.network.release(running.address)
            running.gone.set()

    def _lifecycle(self, running: RunningPod) -> None:
        local = running.local
        running.started_at = now()
        waiting = {"waiting": {"reason": "PodInitializing"}}
        self._patch_status(running, self._status(running, phase="Pending", state=waiting, ready=False))
        local.run_init_containers()
        backoff_until = 0.0
        while not running.deleting.is_set() and not self._stop.is_set():
            if local.proc is None or local.proc.poll() is not None:
                if local.proc is not None:
                    self._record_exit(running)
                    backoff = min(MAX_BACKOFF_S, 10.0 * 2 ** (running.restarts - 1))
                    backoff_until = time.monotonic() + backoff
                    crash = {"waiting": {"reason": "CrashLoopBackOff", "message": f"back-off {backoff:.0f}s"}}
                    self._patch_status(
                        running, self._status(running, phase="Running", state=crash, ready=False)
                    )
                    local.proc = None
                if time.monotonic() < backoff_until:
                    running.deleting.wait(0.5)
                    continue
                local.start()
                running.prober = Prober(local)
                running.prober.start()
                running.state = {"running": {"startedAt": now()}}
            ready = bool(
                running.prober and running.prober.ready_now and local.proc and local.proc.poll() is None
            )
            self._patch_status(
                running, self._status(running, phase="Running", state=running.state, ready=ready)
            )
            running.deleting.wait(0.5)
        self._terminate(running)

    def _record_exit(self, running: RunningPod) -> None:
        local = running.local
        assert local.proc is not None
        code = int(local.proc.returncode)
        local.kill_container()  # what the main process left running ends with the container
        if running.prober is not None:
            running.prober.stop()
        running.last_state = {
            "terminated": {
                "exitCode": code,
                "reason": "Completed" if code == 0 else "Error",
                "message": termination_message(local, local.template.container, code),
                "startedAt": running.state["running"]["startedAt"],
                "finishedAt": now(),
                "containerID": f"local://{local.proc.pid}",
            }
        }
        running.restarts += 1

    def _report_readiness(self, running: RunningPod, done: threading.Event) -> None:
        """While a deleted pod's container runs (preStop, then its drain), its Ready condition follows its
        readiness probe, as the kubelet keeps probing a terminating pod: the EndpointSlice controller
        lists the endpoint `serving` while the pod still answers ready, and no longer once it does not
        (the runtime's readiness turns 503 when SIGTERM starts its drain). kube-proxy sends traffic to a
        serving terminating endpoint where a Service has no ready one left (KEP-1669)."""
        while not done.wait(0.5):
            local = running.local
            ready = bool(
                running.prober and running.prober.ready_now and local.proc and local.proc.poll() is None
            )
            self._patch_status(
                running, self._status(running, phase="Running", state=running.state, ready=ready)
            )

    def _terminate(self, running: RunningPod) -> None:
        """preStop, SIGTERM, the rest of the grace period, SIGKILL; final status; delete with grace 0."""
        local = running.local
        metadata = running.body["metadata"]
        grace = float(metadata.get("deletionGracePeriodSeconds", local.template.termination_grace_s))
        deadline = time.monotonic() + grace
        code: int | None = None
        if local.proc is not None and local.proc.poll() is None:
            reported = threading.Event()
            reporter = threading.Thread(
                target=self._report_readiness,
                args=(running, reported),
                name=f"terminating-{running.name}",
                daemon=True,
            )
            reporter.start()
            hook = ((local.template.container.get("lifecycle") or {}).get("preStop") or {}).get("exec")
            if hook:
                local.mark(f"preStop {hook['command']}")
                with contextlib.suppress(subprocess.TimeoutExpired):
                    subprocess.run(
                        hook["command"], timeout=max(0.0, deadline - time.monotonic()), check=False
                    )
            local.mark("SIGTERM")
            code = local.stop(max(1.0, deadline - time.monotonic()))
            reported.set()
            reporter.join()
        elif local.proc is not None:
            code = local.proc.returncode
            local.kill_container()
        elif "terminated" in running.last_state:  # deleted during a crash loop's back-off
            code = int(running.last_state["terminated"]["exitCode"])
        if running.prober is not None:
            running.prober.stop()
        exit_code = 137 if code is None else code
        terminated = {
            "terminated": {
                "exitCode": exit_code,
                "reason": "Completed" if exit_code == 0 else "Error",
                "message": termination_message(local, local.template.container, exit_code),
                "finishedAt": now(),
            }
        }
        phase = "Succeeded" if exit_code == 0 else "Failed"
        self._patch_status(running, self._status(running, phase=phase, state=terminated, ready=False))
        self.api.http.request(
            "DELETE",
            f"/api/v1/namespaces/{running.namespace}/pods/{running.name}",
            json={"gracePeriodSeconds": 0, "preconditions": {"uid": running.uid}},
        )
        self.pods.pop(running.uid, None)

    # -- the end ------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every pod's process (SIGTERM, then SIGKILL), delete the Node, release the pod IPs."""
        self._stop.set()
        for running in list(self.pods.values()):
            running.deleting.set()
        for thread in self._threads:
            thread.join(timeout=60)
        for running in self.history:
            if running.local.proc is not None and running.local.proc.poll() is None:
                running.local.stop(10)
        with contextlib.suppress(Exception):
            self.api.delete("Node", None, self.node)
        with contextlib.suppress(Exception):
            delete_node_lease(self.api, self.node)
        self.hosts.remove_all()
        self.network.release_all()
