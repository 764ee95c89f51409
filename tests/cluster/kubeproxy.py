"""kube-proxy in the cluster tier: Services' ClusterIPs work on this host, as on a node.

kube-proxy is built from the same k8s.io/kubernetes module as the control plane (tests/cluster/build.py)
and runs here in iptables mode (nftables where the host has `nft` but no `iptables`), as the user
`system:kube-proxy` (its certificate from tests/cluster/pki.py; the API server's default
ClusterRoleBinding `system:node-proxier` grants what it reads), for the kubelet stand-in's Node
(`--hostname-override`), with the pod network as its cluster CIDR. It watches Services and the
EndpointSlices the real controller manager keeps, and programs the host's network namespace: the one
where the stand-in's pods listen (on their own addresses, tests/cluster/podnet.py) and where the tests'
clients run. A connection to a ClusterIP:port is then DNATed to one ready endpoint, chosen per connection,
and stays with it (conntrack) while the endpoint leaves the Service: the traffic of a real cluster,
keep-alive connections to terminating pods included.

What it changes on the host, and how it is undone: its own chains (KUBE-*) in the nat and filter tables,
removed by `kube-proxy --cleanup` (and the empty KUBE-FIREWALL chain that leaves) when the fixture stops.
The host's conntrack limits and timeouts are left as they are (`--conntrack-*` 0), localhost NodePorts
are off, so `route_localnet` is not touched, and NodePorts open only on the Node's address. Its health
and metrics ports are free loopback ports. Needs root or `sudo -n` (as the pod network does) and the
iptables (or nft) command: tests/cluster/ensure-iptables.sh installs Debian's `iptables`.

One kube-proxy per host: two would overwrite each other's KUBE-SERVICES chain (and two test sessions
hand out the same ClusterIPs, from SERVICE_CLUSTER_IP_RANGE). A lock file makes a second session wait
for the first one's kube-proxy to stop.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tests.cluster import build
from tests.cluster.controlplane import ControlPlane, Process, StartError, free_port

LOCK = Path(tempfile.gettempdir()) / "carpool-kube-proxy.lock"
LOCK_TIMEOUT_S = 900.0
START_TIMEOUT_S = 60.0


def proxy_mode() -> str:
    """iptables where the command exists (kube-proxy's default), else nftables; raises if neither."""
    if shutil.which("iptables"):
        return "iptables"
    if shutil.which("nft"):
        return "nftables"
    raise StartError(
        "kube-proxy needs the iptables (or nft) command: install Debian's `iptables` (make cluster-tools)"
    )


def _privileged() -> list[str]:
    if os.geteuid() == 0:
        return []
    sudo = shutil.which("sudo")
    if sudo is None:
        raise StartError("kube-proxy programs the host's netfilter tables: it needs root or sudo -n")
    return [sudo, "-n"]


def _lock() -> IO[str]:
    handle = LOCK.open("a")
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            if time.monotonic() > deadline:
                handle.close()
                held = f"another test session's kube-proxy held {LOCK} for {LOCK_TIMEOUT_S:.0f} s"
                raise StartError(held) from None
            time.sleep(1)


def cleanup(command: list[str]) -> None:
    """`kube-proxy --cleanup`, then the KUBE-FIREWALL chain it leaves behind (jumped to from INPUT and
    OUTPUT), where it is empty, as it is with localhost NodePorts off."""
    subprocess.run([*command, "--cleanup"], capture_output=True, check=False, timeout=60)
    privileged = command[: command.index(next(c for c in command if c.endswith("kube-proxy")))]
    for tool in ("iptables", "ip6tables"):
        if shutil.which(tool) is None:
            continue
        rules = subprocess.run(
            [*privileged, tool, "-S", "KUBE-FIREWALL"], capture_output=True, text=True, check=False
        )
        if rules.returncode != 0 or len(rules.stdout.splitlines()) != 1:
            continue  # absent, or holding rules of someone else's
        for chain in ("INPUT", "OUTPUT"):
            subprocess.run(
                [*privileged, tool, "-D", chain, "-j", "KUBE-FIREWALL"], capture_output=True, check=False
            )
        subprocess.run([*privileged, tool, "-X", "KUBE-FIREWALL"], capture_output=True, check=False)


@dataclass
class KubeProxy:
    process: Process
    command: list[str]
    lock: IO[str]

    def stop(self) -> None:
        """Stop kube-proxy, remove its rules from the host (`--cleanup`), release the host."""
        try:
            self.process.stop()
            cleanup(self.command)
        finally:
            self.lock.close()


def start(plane: ControlPlane, node: str, cluster_cidr: str) -> KubeProxy:
    """kube-proxy for `node`, healthy (its rules synced once) when this returns."""
    kubernetes = build.locate(build.KUBERNETES, plane.k8s_version)
    if kubernetes is None or not (kubernetes / "kube-proxy").is_file():
        raise StartError("kube-proxy is not built: run `make cluster-bin` first")
    mode = proxy_mode()
    command = [*_privileged(), str(kubernetes / "kube-proxy"), f"--proxy-mode={mode}"]
    pki = plane.pki
    config = plane.write_kubeconfig("kube-proxy", cert=pki.kube_proxy.cert, key=pki.kube_proxy.key)
    health = free_port()
    argv = [
        *command,
        f"--kubeconfig={config}",
        f"--hostname-override={node}",
        "--nodeport-addresses=primary",
        f"--cluster-cidr={cluster_cidr}",
        f"--healthz-bind-address=127.0.0.1:{health}",
        f"--metrics-bind-address=127.0.0.1:{free_port()}",
        # Leave the host's conntrack table and its timeouts as they are.
        "--conntrack-max-per-core=0",
        "--conntrack-tcp-timeout-established=0",
        "--conntrack-tcp-timeout-close-wait=0",
        "--iptables-localhost-nodeports=false",
        "--iptables-min-sync-period=0",
    ]
    lock = _lock()
    try:
        cleanup(command)  # what an earlier session that was killed may have left
        process = plane.start_process("kube-proxy", argv)
    except BaseException:
        lock.close()
        raise
    proxy = KubeProxy(process, command, lock)
    try:
        plane.wait_healthy(
            process, f"http://127.0.0.1:{health}/healthz", None, time.monotonic() + START_TIMEOUT_S
        )
    except BaseException:
        proxy.stop()
        raise
    return proxy
