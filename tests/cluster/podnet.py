"""Pod IPs for the kubelet stand-in (tests/cluster/kubelet.py): one address of its own per pod, on this host.

Why not 127.0.0.N: the API server refuses loopback addresses in EndpointSlices and Endpoints
(`ValidateEndpointIP`: "may not be in the loopback range"), so the EndpointSlice controller could never
publish such a pod. So each pod gets an address of 198.18.0.0/15, the range RFC 2544 sets aside for
benchmarking networks (never routed on the internet, rarely used on a host), added to the loopback
interface as a /32: traffic to it stays on this host, as traffic to 127.0.0.1 does.

`ip addr add` needs CAP_NET_ADMIN (root, or `sudo -n` without a password, as on CI runners). It is also
the claim: adding an address another run has already added fails ("Address already assigned"), so
two test sessions on one machine never hand out the same pod IP. Every address is removed when its pod
goes (and at the end of the session, whatever is left).
"""

from __future__ import annotations

import ipaddress
import os
import random
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

POD_RANGE = ipaddress.ip_network("198.18.0.0/15")
DEVICE = "lo"


class PodNetworkError(RuntimeError):
    pass


def _ip_command() -> list[str]:
    ip = shutil.which("ip") or "/usr/sbin/ip"
    if os.geteuid() == 0:
        return [ip]
    sudo = shutil.which("sudo")
    if sudo is None:
        raise PodNetworkError(
            "the kubelet stand-in gives each pod an address on the loopback interface (`ip addr add`), "
            "which needs root or passwordless sudo; neither is available"
        )
    return [sudo, "-n", ip]


class PodNetwork:
    """Claims and releases pod IPs (thread-safe)."""

    def __init__(self) -> None:
        self._ip = _ip_command()
        self._held: set[str] = set()
        self._lock = threading.Lock()
        self._random = random.Random()

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self._ip, *args], capture_output=True, text=True, check=False, timeout=30)

    def claim(self) -> str:
        """A fresh pod IP, added to the loopback interface; raises if none could be claimed."""
        last = ""
        for _ in range(50):
            # Skip the network and broadcast-looking .0 and .255 of each /24.
            offset = self._random.randrange(1, POD_RANGE.num_addresses - 1)
            address = str(POD_RANGE.network_address + offset)
            if address.endswith((".0", ".255")):
                continue
            done = self._run("addr", "add", f"{address}/32", "dev", DEVICE)
            if done.returncode == 0:
                with self._lock:
                    self._held.add(address)
                return address
            last = done.stderr.strip()
            if "already assigned" not in last and "File exists" not in last:
                break
        raise PodNetworkError(f"could not add a pod IP to {DEVICE} (`ip addr add`): {last}")

    def release(self, address: str) -> None:
        with self._lock:
            if address not in self._held:
                return
            self._held.discard(address)
        self._run("addr", "del", f"{address}/32", "dev", DEVICE)

    def release_all(self) -> None:
        with self._lock:
            held = list(self._held)
        for address in held:
            self.release(address)


HOSTS = Path("/etc/hosts")
CLUSTER_DOMAIN = "cluster.local"


def dns_names(pod: dict[str, Any]) -> list[str]:
    """The names cluster DNS gives a pod with `hostname` and `subdomain` (the subdomain a headless
    Service of its namespace, as LeaderWorkerSet makes for its groups): fully qualified, and as a pod
    of that namespace reaches it through its resolver's search path (`<hostname>.<subdomain>.<namespace>`,
    what `LWS_LEADER_ADDRESS` holds). None for other pods (their names are not in DNS). This stand-in
    does not check that the headless Service exists."""
    spec = pod.get("spec") or {}
    hostname, subdomain = spec.get("hostname"), spec.get("subdomain")
    if not hostname or not subdomain:
        return []
    short = f"{hostname}.{subdomain}.{pod['metadata']['namespace']}"
    return [f"{short}.svc.{CLUSTER_DOMAIN}", short]


class HostsFile:
    """Pod DNS names as lines of this host's /etc/hosts, each marked with the pod's UID and this process,
    so that processes on this host (the pods) resolve them as they would through cluster DNS. The file is
    rewritten in place (a container's /etc/hosts is often a bind mount, which a rename cannot replace),
    the new text written before the old tail is cut, so a reader never meets an empty file."""

    def __init__(self, path: Path = HOSTS) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._mark = f"# carpool-kubelet-stand-in pid={os.getpid()}"

    def _rewrite(self, keep: Any, added: list[str]) -> None:
        with self._lock, self.path.open("r+") as hosts:
            lines = [line for line in hosts.read().splitlines() if keep(line)]
            text = "\n".join([*lines, *added]) + "\n"
            hosts.seek(0)
            hosts.write(text)
            hosts.truncate()

    def add(self, uid: str, address: str, names: list[str]) -> None:
        self._rewrite(lambda line: True, [f"{address} {' '.join(names)} {self._mark} uid={uid}"])

    def remove(self, uid: str) -> None:
        self._rewrite(lambda line: not line.endswith(f"{self._mark} uid={uid}"), [])

    def remove_all(self) -> None:
        self._rewrite(lambda line: self._mark + " " not in line, [])


def published(namespace: str, name: str, address: str, port: int, manager: str) -> list[dict[str, Any]]:
    """A selector-less Service `name` (port 443, named https) and the EndpointSlice that lists `address`:
    `port` as its one ready endpoint, written by `manager` (the field `managed-by` says who keeps it, as
    the EndpointSlice controller leaves such slices alone). How a server of the test's, listening on a
    pod IP, becomes what a cluster's clients reach by Service name: the API server, with
    `--enable-aggregator-routing`, dials the slice's address for an APIService or a webhook."""
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"ports": [{"name": "https", "port": 443, "targetPort": port, "protocol": "TCP"}]},
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": f"{name}-pod",
                "namespace": namespace,
                "labels": {
                    "kubernetes.io/service-name": name,
                    "endpointslice.kubernetes.io/managed-by": manager,
                },
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
            "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
        },
    ]
