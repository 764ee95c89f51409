"""Runs the operator process: logging, metrics endpoint, namespace scope, peering, liveness.

`carpool operator` parses flags into `OperatorOptions` and calls `run_operator`; the handler tests call
it too (with a fixed connection and a stop flag), so they run the same process set-up as production.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field

import kopf

from carpool.operator.reconcile import OperatorState


@dataclass
class OperatorOptions:
    namespaces: list[str] = field(default_factory=list)
    """Namespaces to serve (globs allowed); empty means the whole cluster."""
    standalone: bool = False
    """Skip peering (a single operator replica, or tests)."""
    peering_name: str = "carpool"
    """The KopfPeering (or ClusterKopfPeering) object replicas use to elect the active one."""
    priority: int = 0
    """Peering priority: the replica with the highest priority works, the others wait."""
    liveness_port: int | None = 8080
    """Port of the liveness endpoint (`/healthz`); None turns it off."""
    metrics_port: int | None = 9090
    """Port of the Prometheus endpoint (`/metrics`); None turns it off."""
    log_format: str = "json"
    """`json`, `plain` or `full`."""
    verbose: bool = False
    debug: bool = False


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
        priority=options.priority,
        liveness_endpoint=liveness,
        memo=kopf.Memo(carpool=OperatorState(connection=connection)),
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )
