"""A hollow node: a Node whose kubelet marks the pods bound to it running, without running them.

Kubernetes' own scale tests do the same with kubemark's "hollow nodes" (a kubelet with a fake container
runtime) and KWOK: what they test is the control plane and the controllers, and a pod's process would
only cost memory. Here it serves the tests of what a cluster's first month does to a BatchedModel (a
node lost, a drain, 100 models), where the operator's and the controllers' behaviour is the subject and
the runtime inside the pod is not (the runtime's own pods run as processes in tests/cluster/kubelet.py).

What it does, as a kubelet does:
- registers its Node (capacity: cpu, memory, pods, `nvidia.com/gpu`; a Ready condition), with a taint of
  the test's own, so that only pods that tolerate it land here;
- heart-beats as the kubelet does since Kubernetes 1.17: it renews the Node's Lease in `kube-node-lease`
  every `heartbeat_s` and writes the Node's status (its Ready condition's `lastHeartbeatTime`) as well;
  the node-lifecycle controller reads either. The heartbeat has a thread of its own, as the kubelet's
  node-lease controller runs apart from its pod workers: writing a hundred pods' statuses on a busy host
  takes longer than the node-monitor grace period, and a heartbeat queued behind them had the node
  marked NotReady (and every pod with it) in the 100-model scale test;
- marks every pod bound to it `Running`, its containers running and Ready (or not ready, where a test says
  so with `set_ready`), with an address of its own (never bound to an interface: nothing connects). What
  it last wrote is compared with the server's copy too, as the kubelet's status manager does, so a pod
  status someone else changed (the node-lifecycle controller marking pods not ready while the node was
  NotReady) is written back once the node reports again;
- on a pod's deletion, reports it terminated and removes it (`gracePeriodSeconds: 0`, its UID as a
  precondition), as a kubelet does once the container has stopped.

`lose()` is the node dying: no heartbeat, no pod sync, nothing removed (the Node, its Lease and its pods
stay as they were), as a kubelet that lost power leaves them. `restart_all()` is every pod's container
restarting at once (a status storm: not ready with a restart counted, then ready again).
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import threading
from typing import Any

from tests.cluster.api import Api
from tests.cluster.kubelet import STRATEGIC, node_status, now
from tests.cluster.nodelease import delete_node_lease, renew_node_lease

ADDRESSES = ipaddress.ip_network("100.64.0.0/10")
"""Pod IPs of hollow pods (RFC 6598 shared address space; never bound here, nothing connects to them)."""
_addresses = itertools.count(1)
_address_lock = threading.Lock()


def _next_address() -> str:
    with _address_lock:
        return str(ADDRESSES[next(_addresses)])


def pool_taint(pool: str) -> dict[str, str]:
    return {"key": "carpool.dev/hollow-pool", "value": pool, "effect": "NoSchedule"}


def pool_toleration(pool: str) -> dict[str, str]:
    return {"key": "carpool.dev/hollow-pool", "operator": "Equal", "value": pool, "effect": "NoSchedule"}


class HollowNode:
    """Registers `name` in `pool` and marks the pods bound to it running until `stop()` or `lose()`."""

    def __init__(
        self,
        api: Api,
        name: str,
        pool: str,
        capacity: dict[str, str],
        *,
        heartbeat_s: float = 2.0,
        sync_s: float = 0.5,
    ) -> None:
        self.api = api
        self.name = name
        self.pool = pool
        self.capacity = capacity
        self.heartbeat_s = heartbeat_s
        self.sync_s = sync_s
        self.errors: list[str] = []
        self.unready: set[str] = set()
        """Names of pods whose container is reported running but not ready."""
        self._pods: dict[str, dict[str, Any]] = {}
        """uid -> the status last written."""
        self._restarts: dict[str, int] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    # -- the Node and its heartbeat -------------------------------------------------------------------

    def start(self) -> HollowNode:
        self.api.create(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": self.name,
                    "labels": {
                        "kubernetes.io/hostname": self.name,
                        "kubernetes.io/os": "linux",
                        "carpool.dev/hollow-pool": self.pool,
                    },
                },
                "spec": {"taints": [pool_taint(self.pool)]},
            }
        )
        self._heartbeat()
        self._threads = [
            threading.Thread(target=self._beat, name=f"hollow-{self.name}-heartbeat", daemon=True),
            threading.Thread(target=self._loop, name=f"hollow-{self.name}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        return self

    def _heartbeat(self) -> None:
        error = renew_node_lease(self.api, self.name)
        if error:
            self.errors.append(error)
        status = node_status(self.capacity)
        status["status"]["conditions"][0]["message"] = "the tests/cluster hollow node is running"
        answer = self.api.patch("Node", None, self.name, status, subresource="status")
        if answer.status_code >= 400:
            self.errors.append(f"node status: {answer.status_code} {answer.text}")

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._heartbeat()
            except Exception as exc:  # keep going; the test reads `errors`
                self.errors.append(f"heartbeat: {type(exc).__name__}: {exc}")

    def _loop(self) -> None:
        while not self._stop.wait(self.sync_s):
            try:
                self.sync()
            except Exception as exc:  # keep going; the test reads `errors`
                self.errors.append(f"sync: {type(exc).__name__}: {exc}")

    # -- pods -----------------------------------------------------------------------------------------

    def bound_pods(self) -> list[dict[str, Any]]:
        answer = self.api.request(
            "GET", "/api/v1/pods", params={"fieldSelector": f"spec.nodeName={self.name}"}
        )
        answer.raise_for_status()
        return list(answer.json().get("items") or [])

    def _status(self, pod: dict[str, Any], ready: bool, previous: dict[str, Any] | None) -> dict[str, Any]:
        uid = pod["metadata"]["uid"]
        stamp = now()
        before = {c["type"]: c for c in (previous or {}).get("conditions") or []}

        def condition(kind: str, value: bool) -> dict[str, Any]:
            text = "True" if value else "False"
            old = before.get(kind)
            since = stamp if old is None or old["status"] != text else old["lastTransitionTime"]
            return {"type": kind, "status": text, "lastTransitionTime": since}

        address = (previous or {}).get("podIP") or _next_address()
        started = (previous or {}).get("startTime") or stamp
        restarts = self._restarts.get(uid, 0)
        return {
            "phase": "Running",
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": address,
            "podIPs": [{"ip": address}],
            "startTime": started,
            "conditions": [
                condition("PodReadyToStartContainers", True),
                condition("Initialized", True),
                condition("ContainersReady", ready),
                condition("Ready", ready),
            ],
            "initContainerStatuses": [
                {
                    "name": c["name"],
                    "image": c.get("image", ""),
                    "imageID": "",
                    "ready": True,
                    "restartCount": 0,
                    "state": {"terminated": {"exitCode": 0, "reason": "Completed", "finishedAt": started}},
                }
                for c in pod["spec"].get("initContainers") or []
            ],
            "containerStatuses": [
                {
                    "name": c["name"],
                    "image": c.get("image", ""),
                    "imageID": "",
                    "containerID": f"hollow://{uid}/{c['name']}",
                    "ready": ready,
                    "started": True,
                    "restartCount": restarts,
                    "state": {"running": {"startedAt": stamp if previous is None else started}},
                }
                for c in pod["spec"]["containers"]
            ],
        }

    def _write(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        meta = pod["metadata"]
        answer = self.api.patch(
            "Pod",
            meta["namespace"],
            meta["name"],
            {"status": status},
            subresource="status",
            content_type=STRATEGIC,
        )
        if answer.status_code == 404:
            return
        if answer.status_code >= 400:
            self.errors.append(f"status of {meta['name']}: {answer.status_code} {answer.text}")
            return
        self._pods[meta["uid"]] = status

    def _finish(self, pod: dict[str, Any]) -> None:
        """The container stopped (it had nothing to drain): final status, then the pod's removal."""
        meta = pod["metadata"]
        terminated = {"terminated": {"exitCode": 0, "reason": "Completed", "finishedAt": now()}}
        status = {
            "phase": "Succeeded",
            "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now()}],
            "containerStatuses": [
                {
                    "name": c["name"],
                    "image": c.get("image", ""),
                    "imageID": "",
                    "ready": False,
                    "restartCount": self._restarts.get(meta["uid"], 0),
                    "state": terminated,
                }
                for c in pod["spec"]["containers"]
            ],
        }
        self._write(pod, status)
        answer = self.api.request(
            "DELETE",
            f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
            json={"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}},
        )
        if answer.status_code not in (200, 404, 409):
            self.errors.append(f"delete {meta['name']}: {answer.status_code} {answer.text}")
        self._pods.pop(meta["uid"], None)

    def sync(self) -> None:
        with self._lock:
            for pod in self.bound_pods():
                meta = pod["metadata"]
                if meta.get("deletionTimestamp"):
                    self._finish(pod)
                    continue
                if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    continue
                previous = self._pods.get(meta["uid"])
                status = self._status(pod, meta["name"] not in self.unready, previous)
                wanted = _essence(status)
                if (
                    previous is None
                    or _essence(previous) != wanted
                    or _essence(pod.get("status") or {}) != wanted
                ):
                    self._write(pod, status)

    def set_ready(self, pod_name: str, ready: bool) -> None:
        """Report the pod's container running and ready, or running and not ready (its readiness probe
        failing: a model still loading, a runtime that lost its GPU)."""
        (self.unready.discard if ready else self.unready.add)(pod_name)

    def restart_all(self) -> int:
        """Every container restarts once: not ready with its restart counted, then (next sync) ready again.
        Returns how many pods restarted."""
        with self._lock:
            pods = [p for p in self.bound_pods() if not p["metadata"].get("deletionTimestamp")]
            for pod in pods:
                uid = pod["metadata"]["uid"]
                self._restarts[uid] = self._restarts.get(uid, 0) + 1
                self._write(pod, self._status(pod, False, self._pods.get(uid)))
        return len(pods)

    # -- the end --------------------------------------------------------------------------------------

    def lose(self) -> None:
        """The node dies: no more heartbeats, no pod is synced or removed; the Node stays."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def stop(self) -> None:
        """Stop and delete the Node (the pod garbage collector removes pods bound to a Node that is gone)."""
        self.lose()
        with contextlib.suppress(Exception):
            self.api.delete("Node", None, self.name)
        with contextlib.suppress(Exception):
            delete_node_lease(self.api, self.name)


_OWN = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")
"""The pod conditions a kubelet writes (and this node compares with the server's)."""


def _essence(status: dict[str, Any]) -> tuple[Any, ...]:
    """What a change of is worth writing (not the timestamps)."""
    return (
        status.get("phase"),
        # The kubelet's conditions only: the scheduler's PodScheduled is not the node's to write.
        tuple(sorted((c["type"], c["status"]) for c in status.get("conditions") or [] if c["type"] in _OWN)),
        tuple((c["ready"], c["restartCount"]) for c in status.get("containerStatuses") or []),
    )
