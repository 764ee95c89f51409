"""Runs the operator process: logging, metrics endpoint, namespace scope, peering, liveness.

`carpool operator` parses flags into `OperatorOptions` and calls `run_operator`; the handler tests call
it too (with a fixed connection and a stop flag), so they run the same process set-up as production.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kopf

from carpool.operator.leader import Timing
from carpool.operator.reconcile import SLOW_RETRY_SECONDS, OperatorState, slow_retries
from carpool.operator.resources.networkpolicy import DEFAULT_METRICS_NAMESPACES
from carpool.operator.spec import DEFAULT_IMAGE


@dataclass
class OperatorOptions:
    namespaces: list[str] = field(default_factory=list)
    """Namespaces to serve (globs allowed); empty means the whole cluster."""
    standalone: bool = False
    """Skip peering (a single operator replica, or tests)."""
    leader_election: bool = False
    """Several replicas: only the holder of a Lease works (`leader.py`; kopf then runs standalone)."""
    leader_election_namespace: str | None = None
    """Namespace of the Lease; None: `POD_NAMESPACE`, else the service account's namespace."""
    leader_election_id: str = "carpool-operator"
    """Name of the Lease (one per installation)."""
    leader_election_timing: Timing = field(default_factory=Timing)
    """Lease duration, renew deadline, retry period (controller-runtime's defaults: 15, 10, 2 s)."""
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
    runtime_image: str = DEFAULT_IMAGE
    """The runtime image pods run unless their BatchedModel names one; the operator derives the `-cpu`
    and `-vllm` tags from it (the chart's `runtime.image`)."""
    slow_retry_s: float = SLOW_RETRY_SECONDS
    """Seconds before a model whose child the API server refused, or whose API is missing, is tried again
    on its own (a name conflict: half of it); `reconcile.slow_retries`."""
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
    state = OperatorState(
        connection=connection,
        metrics_namespaces=options.metrics_namespaces,
        runtime_image=options.runtime_image,
        retries=slow_retries(options.slow_retry_s),
    )
    if options.leader_election:
        await _run_elected(options, state, liveness)
        return
    await kopf.operator(
        clusterwide=not options.namespaces,
        namespaces=options.namespaces,
        standalone=options.standalone,
        # A peering name makes peering mandatory (its CRDs must exist), so standalone names none.
        peering_name=None if options.standalone else options.peering_name,
        # Replicas with equal priorities would all pause (see `peering_priority`): 0 means "derive one".
        priority=options.priority or peering_priority(),
        liveness_endpoint=liveness,
        memo=kopf.Memo(carpool=state),
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )


async def _standby_liveness(port: int | None) -> Any:
    """A `/healthz` answering 200 while this replica waits for the Lease (None without a port)."""
    if port is None:
        return None
    from aiohttp import web

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"standby": True})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    return runner


SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def _lease_namespace(options: OperatorOptions) -> str:
    if options.leader_election_namespace:
        return options.leader_election_namespace
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE) as handle:
            return handle.read().strip()
    except OSError:
        raise SystemExit(
            "--leader-elect needs the Lease's namespace: --leader-election-namespace or POD_NAMESPACE"
        ) from None


async def _run_elected(
    options: OperatorOptions,
    state: OperatorState,
    liveness: str | None,
    exit_now: Callable[[int], None] = os._exit,
) -> None:
    """Wait for the Lease, then run kopf (standalone) while renewing it (leader.py).

    A standby answers `/healthz` itself while it waits (kopf serves it once the lease is held), so the
    liveness probe does not restart a healthy standby. The Lease has a client (connection pool) of its
    own; the reconcilers' client and kopf's own writes pass the elector's fence. When the renewer ends
    for any reason (the renew deadline passed, or a bug) the process exits at once, non-zero, as
    controller-runtime's manager does on "leader election lost": no handler, requeued reconcile or
    kopf task of this replica outlives its leadership, and the Deployment restarts it as a standby.
    On a clean stop (SIGTERM) the fence closes, writes in flight finish, and the lease is released.
    """
    import uuid

    from carpool.operator import FIELD_MANAGER
    from carpool.operator.kube import Kube
    from carpool.operator.leader import LeaderElector, LeadershipLost, guard_kopf_writes

    log = logging.getLogger("carpool.operator")
    info = state.connection or kopf.login_with_service_account(settings=kopf.OperatorSettings())
    info = info or kopf.login_with_kubeconfig(settings=kopf.OperatorSettings())
    if info is None:
        raise SystemExit("--leader-elect: no credentials for the Kubernetes API")
    state.kube.connect(info)
    identity = os.environ.get("POD_ID") or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    lease_kube = Kube(user_agent=f"{FIELD_MANAGER}/leader-election")
    lease_kube.connect(info)
    elector = LeaderElector(
        lease_kube,
        _lease_namespace(options),
        identity,
        name=options.leader_election_id,
        timing=options.leader_election_timing,
    )
    state.kube.write_guard = elector.fence.write
    unguard = guard_kopf_writes(elector.fence.write)
    standby = await _standby_liveness(options.liveness_port)
    try:
        await elector.acquire()
    finally:
        if standby is not None:
            await standby.cleanup()

    stopping = False

    async def renew() -> None:
        try:
            await elector.hold()
            raise LeadershipLost("the lease renewal ended")  # never returns while leading
        except asyncio.CancelledError as exc:
            if stopping:
                raise
            lost: BaseException = exc  # cancelled by anything but this replica's own shutdown
        except BaseException as exc:  # LeadershipLost, or the renewer itself broke: leadership ends
            lost = exc
        elector.fence.close()
        log.error(f"Leader election lost: {lost!r}; exiting")
        logging.shutdown()  # flush the log before the process ends
        exit_now(1)

    renewing = asyncio.create_task(renew(), name="lease renewal")
    try:
        await kopf.operator(
            clusterwide=not options.namespaces,
            namespaces=options.namespaces,
            standalone=True,
            liveness_endpoint=liveness,
            memo=kopf.Memo(carpool=state),
        )
    finally:
        # client-go's ReleaseOnCancel: whatever the lease protects ends before the lease is given up.
        elector.fence.close()
        for pending in list(state.requeued.values()):
            pending.cancel()
        if not await elector.fence.drained(options.leader_election_timing.renew_deadline):
            log.warning("Writes still in flight at the renew deadline; releasing the lease anyway")
        stopping = True
        renewing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewing
        await elector.release()
        unguard()
        await state.kube.close()
        await lease_kube.close()
