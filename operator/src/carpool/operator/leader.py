"""Leader election over a `coordination.k8s.io/v1` Lease, as controller-runtime does it (client-go's
`leaderelection`), for operators run with several replicas (`carpool operator --leader-elect`).

Why not kopf's peering: it is a priority pause, not a lease. Each replica posts a keep-alive with its
priority and pauses while it sees a live peer of a higher one; nothing fences a replica that stopped
hearing the others (its own keep-alive expiring does not pause it), replicas started together both work
until they have seen each other, and a killed leader's keep-alive pauses the others for its whole
lifetime (60 s). A Lease is one object updated with optimistic concurrency (its resourceVersion): at
most one replica holds it, and a holder that cannot renew stops before anyone else may take it.

The timing is controller-runtime's default: lease duration 15 s, renew deadline 10 s, retry period 2 s.
- A standby retries every 2 s and takes the lease once its holder has not renewed it for 15 s, as the
  standby itself observed (its own monotonic clock since it last saw the record change, as client-go
  does: clocks of different nodes are never compared). After a SIGKILL of the leader the other replica
  takes over within 19 s of the leader's last renewal: it sees that renewal up to one retry period late,
  waits the 15 s lease from then, and tries again up to one retry period after that (`TAKE_OVER_SECONDS`).
- The leader renews every 2 s; when it has not renewed for 10 s (the API server unreachable, a long
  pause) it stops working and the process exits (controller-runtime's "leader election lost"): 10 s is
  shorter than the 15 s a standby waits, so two replicas never work at once.
- On a clean shutdown (SIGTERM) the leader releases the lease (no holder), so the next takes over at
  its next retry instead of after 15 s.

`next_spec` is the decision (pure, unit-tested); `LeaderElector` does the I/O through `Kube`.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from carpool.operator.kube import Kube, KubeError, ObjectRef
from carpool.operator.metrics import LEADER

LEASE_DURATION_SECONDS = 15
RENEW_DEADLINE_SECONDS = 10.0
RETRY_PERIOD_SECONDS = 2.0
LEASE_NAME = "carpool-operator"
TAKE_OVER_SECONDS = RETRY_PERIOD_SECONDS + LEASE_DURATION_SECONDS + RETRY_PERIOD_SECONDS
"""The longest a standby waits after the leader's last renewal before it holds the lease."""

logger = logging.getLogger("carpool.operator.leader")


def micro_time(now: datetime.datetime) -> str:
    """A Kubernetes MicroTime (RFC 3339 with microseconds, UTC)."""
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def next_spec(
    spec: Mapping[str, Any] | None, identity: str, *, now: str, observed_at: float, clock: float
) -> dict[str, Any] | None:
    """The Lease spec that makes (or keeps) `identity` the holder, or None while another holder's lease
    is still valid: it changed less than its duration ago by this replica's clock (`observed_at`, when
    this replica last saw the record change; `clock`, now on the same monotonic clock)."""
    current = dict(spec or {})
    holder = current.get("holderIdentity") or ""
    duration = float(current.get("leaseDurationSeconds") or LEASE_DURATION_SECONDS)
    if holder and holder != identity and clock < observed_at + duration:
        return None
    if holder != identity:
        current["acquireTime"] = now
        current["leaseTransitions"] = int(current.get("leaseTransitions") or 0) + (1 if holder else 0)
    current.update(holderIdentity=identity, leaseDurationSeconds=LEASE_DURATION_SECONDS, renewTime=now)
    return current


class LeadershipLost(Exception):
    """The lease could not be renewed within the renew deadline, or another replica holds it now."""


class LeaderElector:
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        identity: str,
        *,
        name: str = LEASE_NAME,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Coroutine[Any, Any, None]] = asyncio.sleep,
    ) -> None:
        self.kube = kube
        self.ref = ObjectRef("coordination.k8s.io/v1", "Lease", namespace, name)
        self.identity = identity
        self._clock = clock
        self._sleep = sleep
        self._seen: tuple[Any, float] = (None, clock())
        """(the last lease spec seen, when it was first seen so on this replica's clock)"""
        self.leading = False

    def _observe(self, spec: Mapping[str, Any] | None) -> None:
        if spec != self._seen[0]:
            self._seen = (dict(spec) if spec is not None else None, self._clock())

    async def try_acquire_or_renew(self) -> bool:
        """One attempt (client-go's `tryAcquireOrRenew`); API errors are the caller's."""
        now = micro_time(datetime.datetime.now(datetime.UTC))
        lease = await self.kube.get(self.ref)
        if lease is None:
            spec = next_spec(None, self.identity, now=now, observed_at=0.0, clock=self._clock())
            body = {
                "apiVersion": self.ref.api_version,
                "kind": self.ref.kind,
                "metadata": {"name": self.ref.name, "namespace": self.ref.namespace},
                "spec": spec,
            }
            try:
                created = await self.kube.create(body)
            except KubeError as exc:
                if exc.status == 409:  # another replica created it first
                    return False
                raise
            self._observe(created.get("spec"))
            return True
        self._observe(lease.get("spec"))
        spec = next_spec(
            lease.get("spec"), self.identity, now=now, observed_at=self._seen[1], clock=self._clock()
        )
        if spec is None:
            return False
        try:
            # The read's resourceVersion rides along: a replica that wrote meanwhile makes this a 409.
            updated = await self.kube.replace({**lease, "spec": spec})
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise
        self._observe(updated.get("spec"))
        return True

    async def _attempt(self) -> bool:
        try:
            return await self.try_acquire_or_renew()
        except KubeError as exc:
            logger.warning(f"Lease {self.ref.namespace}/{self.ref.name}: {exc}")
            return False

    async def acquire(self) -> None:
        """Wait until this replica holds the lease."""
        logger.info(f"Waiting for lease {self.ref.namespace}/{self.ref.name} as {self.identity}")
        while not await self._attempt():
            await self._sleep(RETRY_PERIOD_SECONDS)
        self.leading = True
        LEADER.set(1)
        logger.info(f"Became the leader (lease {self.ref.namespace}/{self.ref.name}, {self.identity})")

    async def hold(self) -> None:
        """Renew every retry period; raise `LeadershipLost` when no renewal succeeded for the renew
        deadline."""
        renewed = self._clock()
        while True:
            await self._sleep(RETRY_PERIOD_SECONDS)
            if await self._attempt():
                renewed = self._clock()
            elif self._clock() - renewed >= RENEW_DEADLINE_SECONDS:
                self.leading = False
                LEADER.set(0)
                raise LeadershipLost(
                    f"lease {self.ref.namespace}/{self.ref.name} not renewed for {RENEW_DEADLINE_SECONDS:g} s"
                )

    async def release(self) -> None:
        """Give the lease up (a clean shutdown), so a standby takes it at its next retry."""
        if not self.leading:
            return
        self.leading = False
        LEADER.set(0)
        try:
            lease = await self.kube.get(self.ref)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            spec = {**lease["spec"], "holderIdentity": "", "leaseDurationSeconds": 1}
            await self.kube.replace({**lease, "spec": spec})
        except KubeError as exc:
            logger.warning(f"Could not release lease {self.ref.namespace}/{self.ref.name}: {exc}")
