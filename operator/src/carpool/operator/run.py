"""Runs the operator process: logging, metrics endpoint, namespace scope, peering, liveness.

`carpool operator` parses flags into `OperatorOptions` and calls `run_operator`; the handler tests call
it too (with a fixed connection and a stop flag), so they run the same process set-up as production.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import threading
from dataclasses import dataclass, field

import kopf

from carpool.operator.reconcile import OperatorState
from carpool.operator.resources.networkpolicy import DEFAULT_METRICS_NAMESPACES


@dataclass
class OperatorOptions:
    namespaces: list[str] = field(default_factory=list)
    """Namespaces to serve (globs allowed); empty means the whole cluster."""
    standalone: bool = False
    """Skip peering (a single operator replica, or tests)."""
    peering_name: str = "carpool"
    """The KopfPeering (or ClusterKopfPeering) object replicas use to elect the active one."""
    priority: int = 0
    """Peering priority: the replica with the highest priority works, the others wait. 0 (the default,
    and kopf's) derives a distinct negative one per replica (`peering_priority`); any other value is
    used as it is."""
    liveness_port: int | None = 8080
    """Port of the liveness endpoint (`/healthz`); None turns it off."""
    metrics_port: int | None = 9090
    """Port of the Prometheus endpoint (`/metrics`); None turns it off."""
    metrics_namespaces: tuple[str, ...] = DEFAULT_METRICS_NAMESPACES
    """Namespaces whose pods may scrape the runtime pods' /metrics (their NetworkPolicy admits them)."""
    log_format: str = "json"
    """`json`, `plain` or `full`."""
    verbose: bool = False
    debug: bool = False


PRIORITY_SPAN = 2**31 - 1
"""Derived priorities lie in [-PRIORITY_SPAN, -1]."""


def peering_priority(replica_id: str | None = None) -> int:
    """A peering priority for this replica, distinct among replicas and stable across its restarts.

    kopf pauses a replica only for a live peer with a *higher* priority, and pauses every replica when
    peers share the highest one (a warning, then nobody serves the cluster). Chart replicas all start
    with the same flags, so each takes its priority from a hash of its identity: `POD_ID` (the pod
    name, which is also kopf's peer identity), else hostname and process id. A restarted container
    keeps its pod name and so its priority. Derived priorities are negative, so an operator started with
    a positive priority (kopf's `--dev` uses 666), e.g. on a developer's workstation, still pauses the
    deployed ones. Two replicas collide with a chance of about 1 in 2**31.
    """
    key = replica_id or os.environ.get("POD_ID") or f"{socket.gethostname()}/{os.getpid()}"
    digest = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return -1 - digest % PRIORITY_SPAN


_FORMATS = {"json": kopf.LogFormat.JSON, "plain": kopf.LogFormat.PLAIN, "full": kopf.LogFormat.FULL}


def configure_logging(options: OperatorOptions) -> None:
    kopf.configure(
        verbose=options.verbose,
        debug=options.debug,
        log_format=_FORMATS[options.log_format],
        log_refkey="object",
    )


async def run_operator(
    options: OperatorOptions,
    *,
    connection: kopf.ConnectionInfo | None = None,
    stop_flag: asyncio.Event | threading.Event | None = None,
    ready_flag: asyncio.Event | threading.Event | None = None,
) -> None:
    """Run until stopped (a signal, or `stop_flag`)."""
    import carpool.operator.handlers  # noqa: F401  (registers the handlers)
    from carpool.operator.watchguard import guard_watches

    guard_watches()  # an API error ends one watch stream, never a watcher (see watchguard)

    if options.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(options.metrics_port)
        logging.getLogger("carpool.operator").info(f"Metrics on :{options.metrics_port}/metrics")
    liveness = f"http://0.0.0.0:{options.liveness_port}/healthz" if options.liveness_port else None
    await kopf.operator(
        clusterwide=not options.namespaces,
        namespaces=options.namespaces,
        standalone=options.standalone,
        # A peering name makes peering mandatory (its CRDs must exist), so standalone names none.
        peering_name=None if options.standalone else options.peering_name,
        # Replicas with equal priorities would all pause (see `peering_priority`): 0 means "derive one".
        priority=options.priority or peering_priority(),
        liveness_endpoint=liveness,
        memo=kopf.Memo(
            carpool=OperatorState(connection=connection, metrics_namespaces=options.metrics_namespaces)
        ),
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )
