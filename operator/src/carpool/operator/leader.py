"""Leader election over a `coordination.k8s.io/v1` Lease, as controller-runtime does it (client-go's
`tools/leaderelection`), for operators run with several replicas (`carpool operator --leader-elect`).

Why not kopf's peering: it is a priority pause, not a lease. Each replica posts a keep-alive with its
priority and pauses while it sees a live peer of a higher one; nothing fences a replica that stopped
hearing the others (its own keep-alive expiring does not pause it), replicas started together both work
until they have seen each other, and a killed leader's keep-alive pauses the others for its whole
lifetime (60 s). A Lease is one object updated with optimistic concurrency (its resourceVersion): at
most one replica holds it, and a holder that cannot renew stops before anyone else may take it.

The timing (`Timing`) is controller-runtime's default: lease duration 15 s, renew deadline 10 s, retry
period 2 s (`--leader-elect-lease-duration`, `--leader-elect-renew-deadline`, `--leader-elect-retry-period`,
named as kube-controller-manager names them).
- A standby tries every retry period and takes the lease once its holder has not renewed it for the
  lease duration, as the standby itself observed: its own monotonic clock since it last saw the record
  change (client-go's `observedTime`): clocks of different machines are never compared, only the *rate*
  at which they run matters. After a SIGKILL of the leader a standby takes over within
  retry + duration + retry (19 s) of the leader's last renewal (`Timing.take_over`).
- The leader renews every retry period. Every attempt (the GET and the PUT of the Lease, on a connection
  pool of its own: `Kube(user_agent=...)` in run.py) is cut off when the renew deadline passes, counted
  from the start of the last attempt that renewed (`write_time_left`); an attempt that fails for any
  reason (an API error, a timeout, a bug) is retried until then. The renew deadline (10 s) is shorter
  than the lease duration (15 s) a standby waits from a moment *after* that renewal reached the API
  server, so the leader stops before any standby may start, as long as no clock runs more than 1.5 times
  as fast as another (client-go's documented tolerance: the ratio of lease duration to renew deadline).
- The leader's writes are fenced by the same deadline (`Fence`, checked by `Kube` and by kopf's own API
  client before each write, and bounding each write's time): a replica that was stalled (SIGSTOP, a
  frozen VM) or cut off from the API server writes nothing once resumed, even before its renewer runs.
  On losing the lease the process exits at once, non-zero (controller-runtime's "leader election lost"),
  and its Deployment restarts it as a standby.
- On a clean shutdown (SIGTERM) the leader closes the fence, waits for its writes in flight, and releases
  the lease as client-go's `ReleaseOnCancel` does (no holder, `leaseDurationSeconds: 1`): a standby
  takes over at its next retry instead of after the lease duration.

The decisions (`next_spec`, `lease_valid`, `write_time_left`, `released_spec`) are pure and unit-tested
with the clock passed in; `LeaderElector` does the I/O through `Kube`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

from carpool.operator.kube import Kube, KubeError, ObjectRef
from carpool.operator.metrics import LEADER

LEASE_NAME = "carpool-operator"

logger = logging.getLogger("carpool.operator.leader")


@dataclass(frozen=True)
class Timing:
    """Seconds, as controller-runtime's manager options (`LeaseDuration`, `RenewDeadline`, `RetryPeriod`)."""

    lease_duration: float = 15.0
    """How long a standby waits, from when it saw the holder's last renewal, before taking the lease."""
    renew_deadline: float = 10.0
    """How long the leader goes on without a successful renewal before it stops writing and exits."""
    retry_period: float = 2.0
    """Between attempts, for the leader and for standbys."""

    def __post_init__(self) -> None:
        # client-go's NewLeaderElector checks: LeaseDuration > RenewDeadline > JitterFactor * RetryPeriod.
        if not self.lease_duration > self.renew_deadline > 1.2 * self.retry_period > 0:
            raise ValueError(
                "leader election needs lease duration > renew deadline > 1.2 x retry period > 0, got "
                f"{self.lease_duration:g} s, {self.renew_deadline:g} s, {self.retry_period:g} s"
            )
        if self.lease_duration != int(self.lease_duration) or self.lease_duration < 1:
            raise ValueError(
                f"the lease duration is whole seconds (leaseDurationSeconds): {self.lease_duration:g}"
            )

    @property
    def take_over(self) -> float:
        """The longest a standby waits after the leader's last renewal (a SIGKILL) before it holds the
        lease: a retry period to see that renewal, the lease duration, a retry period to try again."""
        return self.retry_period + self.lease_duration + self.retry_period


DEFAULT_TIMING = Timing()


def micro_time(now: datetime.datetime) -> str:
    """A Kubernetes MicroTime (RFC 3339 with microseconds, UTC)."""
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_valid(spec: Mapping[str, Any] | None, *, observed_at: float, clock: float) -> bool:
    """Whether another holder's lease still binds this replica: it has a holder and changed less than its
    `leaseDurationSeconds` ago by this replica's clock (`observed_at`, when this replica last saw the
    record change; `clock`, now, on the same monotonic clock). client-go's `isLeaseValid`."""
    current = spec or {}
    if not current.get("holderIdentity"):
        return False
    duration = float(current.get("leaseDurationSeconds") or 0)
    return clock < observed_at + duration


def next_spec(
    spec: Mapping[str, Any] | None,
    identity: str,
    *,
    now: str,
    observed_at: float,
    clock: float,
    duration: float = DEFAULT_TIMING.lease_duration,
) -> dict[str, Any] | None:
    """The Lease spec that makes (or keeps) `identity` the holder for `duration` seconds, or None while
    another holder's lease is still valid (`lease_valid`)."""
    current = dict(spec or {})
    holder = current.get("holderIdentity") or ""
    if holder != identity and lease_valid(current, observed_at=observed_at, clock=clock):
        return None
    if holder != identity:
        current["acquireTime"] = now
        # client-go counts every change of holder, a take-over of a released lease included.
        current["leaseTransitions"] = int(current.get("leaseTransitions") or 0) + (1 if spec else 0)
    current.update(holderIdentity=identity, leaseDurationSeconds=int(duration), renewTime=now)
    return current


def released_spec(spec: Mapping[str, Any], *, now: str) -> dict[str, Any]:
    """The spec that gives the lease up (client-go's `release`): no holder, a one-second duration, the
    times set to now, the transitions kept; a standby takes it at its next attempt."""
    return {
        **spec,
        "holderIdentity": "",
        "leaseDurationSeconds": 1,
        "acquireTime": now,
        "renewTime": now,
    }


def write_time_left(renewed_at: float | None, *, renew_deadline: float, clock: float) -> float:
    """Seconds this replica may still write (and try to renew): until the renew deadline, counted from
    the start of the last attempt that renewed (`renewed_at`; None: not leading). 0 when past it."""
    if renewed_at is None:
        return 0.0
    return max(0.0, renewed_at + renew_deadline - clock)


class LeadershipLost(Exception):
    """The lease could not be renewed within the renew deadline, or the renewer failed."""


class NotLeading(KubeError):
    """A write refused because this replica does not (or no longer) hold the Lease."""

    def __init__(self, what: str) -> None:
        super().__init__(0, f"{what}: not written, this replica does not hold the leader-election Lease")


class Fence:
    """The write path's guard: open while this replica's lease is valid by its own clock, closed for
    good once it is lost or released. `Kube` and kopf's API client (`guard_kopf_writes`) ask it before
    each write and bound the write's time by `left()`, and it counts the writes in flight so a release
    waits for them."""

    def __init__(self, left: Callable[[], float]) -> None:
        self._left = left
        self._closed = False
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def left(self) -> float:
        return 0.0 if self._closed else self._left()

    def close(self) -> None:
        self._closed = True

    @contextlib.asynccontextmanager
    async def write(self, what: str) -> AsyncIterator[float]:
        """Around one write: raises `NotLeading` when the fence is closed, else yields the seconds left,
        which the write must not outlast (the caller's timeout)."""
        left = self.left()
        if left <= 0:
            raise NotLeading(what)
        self._inflight += 1
        self._idle.clear()
        try:
            async with asyncio.timeout(left):
                yield left
        except TimeoutError:
            raise NotLeading(f"{what} (cut off at the renew deadline)") from None
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    async def drained(self, within: float) -> bool:
        """Wait (at most `within` seconds) until no write is in flight."""
        try:
            async with asyncio.timeout(within):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True


class LeaderElector:
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        identity: str,
        *,
        name: str = LEASE_NAME,
        timing: Timing = DEFAULT_TIMING,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Coroutine[Any, Any, None]] = asyncio.sleep,
    ) -> None:
        self.kube = kube
        """A client of the Lease's own (its own connection pool), never the reconcilers'."""
        self.ref = ObjectRef("coordination.k8s.io/v1", "Lease", namespace, name)
        self.identity = identity
        self.timing = timing
        self._clock = clock
        self._sleep = sleep
        self._seen: tuple[Any, float] = (None, clock())
        """(the last lease spec seen, when it was first seen so on this replica's clock)"""
        self._renewed_at: float | None = None
        """When the last attempt that acquired or renewed the lease started (None: not leading)."""
        self._acquired = False
        """Whether this replica took the lease (and has not released it)."""
        self.fence = Fence(self.write_time_left)

    @property
    def leading(self) -> bool:
        return self.write_time_left() > 0

    def write_time_left(self) -> float:
        return write_time_left(
            self._renewed_at, renew_deadline=self.timing.renew_deadline, clock=self._clock()
        )

    def _observe(self, spec: Mapping[str, Any] | None) -> None:
        if spec != self._seen[0]:
            self._seen = (dict(spec) if spec is not None else None, self._clock())

    async def try_acquire_or_renew(self) -> bool:
        """One attempt (client-go's `tryAcquireOrRenew`): GET, then create or PUT with the read's
        resourceVersion. False when another holder's lease is valid or the write was a 409; other API
        errors are the caller's."""
        started = self._clock()
        now = micro_time(datetime.datetime.now(datetime.UTC))
        lease = await self.kube.get(self.ref)
        if lease is None:
            spec = next_spec(
                None,
                self.identity,
                now=now,
                observed_at=0.0,
                clock=started,
                duration=self.timing.lease_duration,
            )
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
            self._renewed_at = started
            return True
        self._observe(lease.get("spec"))
        spec = next_spec(
            lease.get("spec"),
            self.identity,
            now=now,
            observed_at=self._seen[1],
            clock=self._clock(),
            duration=self.timing.lease_duration,
        )
        if spec is None:
            return False
        try:
            # The read's resourceVersion rides along: a replica that wrote meanwhile makes this a 409.
            updated = await self.kube.replace({**lease, "spec": spec})
        except KubeError as exc:
            if exc.status == 409:
                logger.info(f"Lease {self.ref.namespace}/{self.ref.name}: 409, written meanwhile; retrying")
                return False
            raise
        self._observe(updated.get("spec"))
        self._renewed_at = started
        return True

    async def _attempt(self, limit: float | None) -> bool:
        """One attempt, cut off after `limit` seconds; any failure is logged and is a failed attempt."""
        try:
            async with asyncio.timeout(limit):
                return await self.try_acquire_or_renew()
        except TimeoutError:
            logger.warning(f"Lease {self.ref.namespace}/{self.ref.name}: no answer within {limit:.1f} s")
        except KubeError as exc:
            logger.warning(f"Lease {self.ref.namespace}/{self.ref.name}: {exc}")
        except Exception:
            logger.exception(f"Lease {self.ref.namespace}/{self.ref.name}: attempt failed")
        return False

    async def acquire(self) -> None:
        """Wait until this replica holds the lease (each attempt bounded by the renew deadline)."""
        logger.info(f"Waiting for lease {self.ref.namespace}/{self.ref.name} as {self.identity}")
        while not await self._attempt(self.timing.renew_deadline):
            await self._sleep(self.timing.retry_period)
        self._acquired = True
        LEADER.set(1)
        logger.info(f"Became the leader (lease {self.ref.namespace}/{self.ref.name}, {self.identity})")

    async def hold(self) -> None:
        """Renew every retry period until cancelled; raise `LeadershipLost` once the renew deadline
        passed without a renewal. Each attempt is cut off at that deadline."""
        try:
            while True:
                await self._sleep(self.timing.retry_period)
                while True:
                    left = self.write_time_left()
                    if left <= 0:
                        raise LeadershipLost(
                            f"lease {self.ref.namespace}/{self.ref.name} not renewed within the renew "
                            f"deadline ({self.timing.renew_deadline:g} s)"
                        )
                    if await self._attempt(left):
                        break
                    await self._sleep(min(self.timing.retry_period, self.write_time_left()))
        except asyncio.CancelledError:
            raise  # a clean stop: `release` follows
        except BaseException:
            self._lost()
            raise

    def _lost(self) -> None:
        self.fence.close()
        self._renewed_at = None
        LEADER.set(0)

    async def release(self, within: float | None = None) -> bool:
        """Give the lease up (a clean shutdown), so a standby takes it at its next attempt. The fence is
        closed first; the caller waits for writes in flight before (`Fence.drained`)."""
        holding = self._acquired
        self._lost()
        if not holding:
            return False
        limit = within if within is not None else self.timing.renew_deadline
        try:
            async with asyncio.timeout(limit):
                lease = await self.kube.get(self.ref)
                if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                    return False
                self._acquired = False
                now = micro_time(datetime.datetime.now(datetime.UTC))
                await self.kube.replace({**lease, "spec": released_spec(lease["spec"], now=now)})
        except (KubeError, TimeoutError) as exc:
            logger.warning(f"Could not release lease {self.ref.namespace}/{self.ref.name}: {exc!r}")
            return False
        logger.info(f"Released lease {self.ref.namespace}/{self.ref.name}")
        return True


def guard_kopf_writes(
    guard: Callable[[str], contextlib.AbstractAsyncContextManager[float]],
) -> Callable[[], None]:
    """Pass every write kopf itself makes (its finalizers and bookkeeping annotations, the Events it
    posts) through `guard` (`Fence.write`), as `Kube` does for carpool's own. Wraps kopf's one request
    function (`kopf._cogs.clients.api.request`, which its `post`, `patch` and `delete` call); a test
    (tests/operator/test_leader.py) fails if it moves. Returns the undo."""
    from kopf._cogs.clients import api as kopf_api

    original = kopf_api.request

    async def request(method: str, url: str, **kwargs: Any) -> Any:
        if method.upper() == "GET":
            return await original(method, url, **kwargs)
        async with guard(f"{method.upper()} {url}"):
            return await original(method, url, **kwargs)

    kopf_api.request = request

    def undo() -> None:
        kopf_api.request = original

    return undo
