"""Operator replicas on a Lease (`--leader-elect`, as the chart runs them with `operator.replicas` > 1)
against the real API server, under each way a leader can go: SIGKILL, SIGTERM (release), SIGSTOP (a
stalled process), a network partition (a TCP proxy between that replica and the API server, black-holed),
two standbys competing, and a 409 on the Lease.

Each replica reaches the API server through a proxy of its own (tests/cluster/tcpproxy.py) connecting
from its own loopback address, so the API server's audit log says which replica made each write
(`sourceIPs`). The bar, from the audit log: no interval in which two replicas write (`assert_one_writer`),
and a replica that lost its lease writes nothing after its renew deadline. While the leader changes hands
the test keeps deleting the model's Service (`churn`), so whichever replica leads has writing to do.

The replicas run with a short lease (TIMING: 8 s, renew deadline 5 s, retry 1 s, set through the chart's
`operator.leaderElection` values) so the tier stays quick; the operator's defaults are controller-runtime's
(15, 10, 2), and the README's numbers follow from either.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml

from carpool.operator.leader import DEFAULT_TIMING, Timing
from tests.cluster.api import Api, run, wait_for
from tests.cluster.conftest import (
    CHART,
    OPERATOR_DEPLOYMENT,
    Operator,
    Release,
    operator_metric,
    start_operator,
)
from tests.cluster.controlplane import ControlPlane, kubeconfig
from tests.cluster.objects import batched_model, kubectl_apply, wait_for_children
from tests.cluster.tcpproxy import TcpProxy

TIMING = Timing(lease_duration=8, renew_deadline=5, retry_period=1)
MODEL = "elected"
WRITES = ("create", "update", "patch", "delete", "deletecollection")


@dataclass
class Replica:
    name: str
    operator: Operator
    proxy: TcpProxy

    @property
    def source(self) -> str:
        return self.proxy.source

    @property
    def pid(self) -> int:
        return int(self.operator.process.popen.pid)

    def leading(self) -> bool:
        try:
            return operator_metric(self.operator, "carpool_operator_leader") == 1
        except OSError:
            return False  # exited, or stopped with its metrics port unanswered

    def reconciles(self) -> float:
        return operator_metric(self.operator, "carpool_operator_reconciles_total")

    def exited(self) -> int | None:
        return self.operator.process.popen.poll()


def _stamp(value: str) -> float:
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


@dataclass
class Write:
    source: str
    resource: str
    verb: str
    code: int
    received: float
    completed: float


@dataclass
class Election:
    control_plane: ControlPlane
    api: Api
    release: Release
    args: list[str]
    namespace: str
    lease: tuple[str, str]
    replicas: list[Replica] = field(default_factory=list)
    _names: Iterator[int] = field(default_factory=itertools.count)

    def start(self) -> Replica:
        index = next(self._names)
        host, port = self.control_plane.server.removeprefix("https://").split(":")
        proxy = TcpProxy((host, int(port)), source=f"127.0.0.{11 + index}")
        token = run(
            "kubectl", "create", "token", self.release.service_account, "-n", self.release.namespace,
            "--duration=1h", env=self.control_plane.env(),
        ).stdout.strip()  # fmt: skip
        path = self.control_plane.folder / f"replica-{index}.kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig(proxy.url, self.control_plane.pki.ca.cert, token=token)))
        path.chmod(0o600)
        operator = start_operator(
            self.control_plane,
            self.release,
            self.args,
            f"replica-{index}",
            POD_ID=f"r{index}",
            KUBECONFIG=str(path),
        )
        replica = Replica(f"r{index}", operator, proxy)
        self.replicas.append(replica)
        return replica

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.exited() is None]

    def leader(self, timeout: float = TIMING.take_over + 5) -> Replica:
        """The one replica that leads (waits for one; fails if two did at any poll meanwhile)."""
        both: list[list[str]] = []

        def one() -> Replica | None:
            leading = [r for r in self.live() if r.leading()]
            if len(leading) > 1:
                both.append([r.name for r in leading])  # not an AssertionError: wait_for retries those
            return leading[0] if len(leading) == 1 else None

        found = wait_for("one replica to lead", one, timeout=timeout)
        assert not both, f"two replicas led at once: {both}"
        return found

    def lease_spec(self) -> dict[str, Any]:
        lease = self.api.get("Lease", *self.lease) or {}
        return dict(lease.get("spec") or {})

    def writes(self, since: int = 0) -> list[Write]:
        """The replicas' writes the API server audited after audit event `since`."""
        sources = {r.source for r in self.replicas}
        found = []
        for event in self.control_plane.audit_events()[since:]:
            source = (event.get("sourceIPs") or [""])[0]  # type: ignore[index]
            if source not in sources or event.get("verb") not in WRITES:
                continue
            ref: dict[str, Any] = event.get("objectRef") or {}  # type: ignore[assignment]
            found.append(
                Write(
                    source,
                    str(ref.get("resource")),
                    str(event["verb"]),
                    int((event.get("responseStatus") or {}).get("code") or 0),  # type: ignore[attr-defined]
                    _stamp(str(event["requestReceivedTimestamp"])),
                    _stamp(str(event["stageTimestamp"])),
                )
            )
        return found

    def work(self, since: int, replica: Replica) -> list[Write]:
        """`replica`'s writes but those of the Lease (a standby's attempts, a leader's renewals)."""
        return [w for w in self.writes(since) if w.source == replica.source and w.resource != "leases"]

    def assert_one_writer(self, since: int) -> None:
        """No interval in which two replicas write: each replica's writes (but the Lease's) span an
        interval, from the first received to the last answered, and no two intervals overlap."""
        spans: dict[str, tuple[float, float]] = {}
        for w in self.writes(since):
            if w.resource == "leases":
                continue
            first, last = spans.get(w.source, (w.received, w.completed))
            spans[w.source] = (min(first, w.received), max(last, w.completed))
        ordered = sorted(spans.items(), key=lambda item: item[1][0])
        for (a, (_, a_last)), (b, (b_first, _)) in itertools.pairwise(ordered):
            assert a_last < b_first, f"{a} and {b} wrote at once: {spans}"

    def audit_mark(self) -> int:
        return len(self.control_plane.audit_events())


@contextlib.contextmanager
def churn(api: Api, namespace: str) -> Iterator[None]:
    """Delete the model's Service every half second (as the cluster admin), so a leader has to write."""
    stop = threading.Event()
    client = Api(api._server, api._context)

    def loop() -> None:
        while not stop.wait(0.5):
            client.delete("Service", namespace, MODEL)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)
        client.close()


@pytest.fixture(scope="module")
def election(
    control_plane: ControlPlane, api: Api, admin_env: dict[str, str], release: Release, operator: Operator
) -> Iterator[Election]:
    """The chart upgraded to two replicas (its Lease Role and `--leader-elect` flags); replica processes
    with those flags (and TIMING) in place of the session's single operator, which comes back afterwards;
    a namespace with one BatchedModel the leader keeps."""

    def upgrade(count: int, timing: Timing) -> list[str]:
        election = "operator.leaderElection"
        run(
            "helm", "upgrade", "carpool", CHART, "-n", release.namespace, "--reuse-values",
            "--set", f"operator.replicas={count}",
            "--set", f"{election}.leaseDurationSeconds={timing.lease_duration:g}",
            "--set", f"{election}.renewDeadlineSeconds={timing.renew_deadline:g}",
            "--set", f"{election}.retryPeriodSeconds={timing.retry_period:g}",
            "--wait=false", env=admin_env,
        )  # fmt: skip
        deployment = api.get("Deployment", release.namespace, OPERATOR_DEPLOYMENT) or {}
        return list(deployment["spec"]["template"]["spec"]["containers"][0]["args"])

    args = upgrade(2, TIMING)
    assert "--leader-elect" in args, args
    options = dict(a.removeprefix("--").split("=", 1) for a in args if "=" in a)
    lease = (
        options.get("leader-election-namespace", release.namespace),
        options.get("leader-election-id", ""),
    )
    assert lease[1], args
    # The replicas run with the timings the chart passes (operator.leaderElection).
    timing = Timing(
        float(options["leader-elect-lease-duration"]),
        float(options["leader-elect-renew-deadline"]),
        float(options["leader-elect-retry-period"]),
    )
    assert timing == TIMING, args
    operator.stop()
    namespace = f"t-{uuid.uuid4().hex[:8]}"
    api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    election = Election(control_plane, api, release, args, namespace, lease)
    try:
        election.start()
        election.start()
        election.leader()
        kubectl_apply(admin_env, batched_model(MODEL, namespace))
        wait_for_children(api, namespace, MODEL)
        yield election
    finally:
        for replica in election.replicas:
            with contextlib.suppress(OSError):
                os.kill(replica.pid, signal.SIGCONT)
            replica.operator.stop()
            replica.proxy.close()
        api.delete("Namespace", None, namespace)
        upgrade(1, DEFAULT_TIMING)
        operator.start()


@pytest.fixture
def pair(election: Election) -> tuple[Replica, Replica]:
    """Two live replicas, the first of them the leader (a test's casualties replaced by new standbys)."""
    while len(election.live()) < 2:
        election.start()
    leader = election.leader()
    (standby,) = [r for r in election.live() if r is not leader][:1]
    assert not standby.leading()
    return leader, standby


def _service_restored(election: Election) -> bool:
    return election.api.get("Service", election.namespace, MODEL) is not None


def _exit_code(replica: Replica, timeout: float) -> int | None:
    """The replica's exit code once it exits, None if it still runs after `timeout` seconds."""
    try:
        return replica.operator.process.popen.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def _wait_exit(replica: Replica, timeout: float) -> int:
    try:
        return replica.operator.process.popen.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{replica.name} still running:\n{replica.operator.logs()}") from None


def test_one_of_two_replicas_reconciles_and_the_other_takes_over_after_a_sigkill(
    election: Election, pair: tuple[Replica, Replica]
) -> None:
    leader, standby = pair
    assert election.api.delete("Service", election.namespace, MODEL) == 200
    wait_for("the Service restored", lambda: _service_restored(election))
    assert leader.reconciles() > 0
    assert (standby.reconciles(), standby.leading()) == (0, False), standby.operator.logs()

    mark = election.audit_mark()
    with churn(election.api, election.namespace):
        killed = time.monotonic()
        os.kill(leader.pid, signal.SIGKILL)
        _wait_exit(leader, 10)
        # Within the documented time from the kill, which is at most that from the leader's last renewal.
        wait_for("the standby to take the Lease over", standby.leading, timeout=TIMING.take_over + 2)
        took = time.monotonic() - killed
        wait_for("a write by the new leader", lambda: election.work(mark, standby) or None)
    sys.stderr.write(f"\ntake-over after SIGKILL: {took:.1f} s (documented: within {TIMING.take_over:g} s)\n")
    wait_for("the new leader's reconciles counted", lambda: standby.reconciles() > 0)
    election.assert_one_writer(mark)


def test_sigterm_releases_the_lease_and_the_standby_leads_at_its_next_retry(
    election: Election, pair: tuple[Replica, Replica]
) -> None:
    leader, standby = pair
    before = election.lease_spec()
    mark = election.audit_mark()
    with churn(election.api, election.namespace):
        wait_for("a write by the leader", lambda: election.work(mark, leader) or None)
        leader.operator.stop()  # SIGTERM
        assert leader.exited() == 0, leader.operator.logs()
        released = time.monotonic()
        # client-go's ReleaseOnCancel: the standby need not wait out the lease, only its next retry.
        wait_for("the standby to lead", standby.leading, timeout=TIMING.retry_period + 2)
        took = time.monotonic() - released
        wait_for("a write by the new leader", lambda: election.work(mark, standby) or None)
    sys.stderr.write(f"\ntake-over after SIGTERM: {took:.1f} s (a retry period: {TIMING.retry_period:g} s)\n")
    after = election.lease_spec()
    assert after["holderIdentity"] == standby.name
    assert after["leaseTransitions"] == before["leaseTransitions"] + 1
    assert "Released lease" in leader.operator.logs(200)
    election.assert_one_writer(mark)


def _renewals(election: Election, since: int, replica: Replica) -> list[Write]:
    return [
        w
        for w in election.writes(since)
        if w.source == replica.source and w.resource == "leases" and w.code == 200
    ]


def _last_renewal(election: Election, since: int, replica: Replica) -> float:
    renewals = _renewals(election, since, replica)
    assert renewals, f"{replica.name} renewed nothing"
    return renewals[-1].received


def _first_acquisition(election: Election, since: int, replica: Replica) -> float:
    taken = [
        w
        for w in election.writes(since)
        if w.source == replica.source and w.resource == "leases" and w.code in (200, 201)
    ]
    assert taken, f"{replica.name} never took the lease"
    return taken[0].received


def test_a_stalled_leader_is_waited_out_and_writes_nothing_once_resumed(
    election: Election, pair: tuple[Replica, Replica]
) -> None:
    """SIGSTOP (a frozen process or VM): the standby takes over only once the lease expired by its own
    clock; the stalled replica, resumed, writes nothing (its renew deadline long past) and exits."""
    leader, standby = pair
    mark = election.audit_mark()
    with churn(election.api, election.namespace):
        wait_for("a write by the leader", lambda: election.work(mark, leader) or None)
        os.kill(leader.pid, signal.SIGSTOP)
        try:
            wait_for("the standby to lead", standby.leading, timeout=TIMING.take_over + 2)
            wait_for("a write by the new leader", lambda: election.work(mark, standby) or None)
        finally:
            os.kill(leader.pid, signal.SIGCONT)
        # Resumed with its watch streams full of events to reconcile, while the Service keeps being
        # deleted: it must not write, and it exits (the writes are judged first, from the audit log).
        code = _exit_code(leader, TIMING.renew_deadline + 5)
    renewed = _last_renewal(election, 0, leader)
    acquired = _first_acquisition(election, mark, standby)
    assert acquired - renewed >= TIMING.lease_duration, (renewed, acquired)
    late = [w for w in election.work(mark, leader) if w.received > renewed + TIMING.renew_deadline]
    assert not late, late
    election.assert_one_writer(mark)
    assert code == 1, f"the resumed replica: exit code {code}\n{leader.operator.logs()}"
    assert "Leader election lost" in leader.operator.logs(300), leader.operator.logs()


def test_a_leader_cut_off_from_the_api_server_stops_before_the_standby_starts(
    election: Election, pair: tuple[Replica, Replica]
) -> None:
    """A partition that swallows the leader's requests (no answer, no reset): its attempts are cut off at
    the renew deadline and it exits before the lease expires for the standby; when the partition heals
    nothing of it reaches the API server."""
    leader, standby = pair
    mark = election.audit_mark()
    with churn(election.api, election.namespace):
        wait_for("a write by the leader", lambda: election.work(mark, leader) or None)
        leader.proxy.blackhole()
        try:
            wait_for("the standby to lead", standby.leading, timeout=TIMING.take_over + 2)
            assert leader.exited() == 1, f"the cut-off leader still runs:\n{leader.operator.logs()}"
            wait_for("a write by the new leader", lambda: election.work(mark, standby) or None)
        finally:
            leader.proxy.restore()
    assert "Leader election lost" in leader.operator.logs(300), leader.operator.logs()
    renewed = _last_renewal(election, 0, leader)
    assert _first_acquisition(election, mark, standby) - renewed >= TIMING.lease_duration
    late = [w for w in election.work(mark, leader) if w.received > renewed + TIMING.renew_deadline]
    assert not late, late
    election.assert_one_writer(mark)


SLOW_LINK = 1.5 * TIMING.retry_period
"""Seconds each chunk from a competing standby takes to reach the API server. Longer than a retry period,
so whichever standby tries second reads the expired lease before the first one's write arrives."""


def test_two_standbys_competing_for_a_lost_lease_make_one_leader(
    election: Election, pair: tuple[Replica, Replica]
) -> None:
    """Two standbys that see the lease expire together both try to take it, each with the resourceVersion
    of its own read: the API server takes one write and answers the other 409, and only the first leads.

    So that they compete every time, not only when their retries happen to cross: both are stopped
    (SIGSTOP) while the leader renews, the leader is killed, and both are resumed at once behind slowed
    links (SLOW_LINK). Each then reads the leader's last renewal at the same moment, as a change, so the
    lease expires by both clocks together and their retries stay in step (a standby stopped in the middle
    of an attempt falls a retry period behind, less than SLOW_LINK): both read the expired lease before
    either write arrives, and both write."""
    leader, _ = pair
    third = election.start()
    standbys = [r for r in election.live() if r is not leader]
    assert len(standbys) == 2 and not any(r.leading() for r in standbys)
    mark = election.audit_mark()
    try:
        with churn(election.api, election.namespace):
            for standby in standbys:
                os.kill(standby.pid, signal.SIGSTOP)
            stopped = election.audit_mark()
            # A renewal the stopped standbys have not seen: each reads the lease as changed on resuming.
            wait_for(
                "a renewal while the standbys are stopped",
                lambda: _renewals(election, stopped, leader) or None,
            )
            os.kill(leader.pid, signal.SIGKILL)
            _wait_exit(leader, 10)
            for standby in standbys:
                standby.proxy.delay(SLOW_LINK)
            for standby in standbys:
                os.kill(standby.pid, signal.SIGCONT)
            # Both see the expiry a lease duration after resuming; an attempt is a slow read and a slow write.
            new = election.leader(timeout=TIMING.lease_duration + 2 * (TIMING.retry_period + 3 * SLOW_LINK))
            for standby in standbys:
                standby.proxy.restore()
            wait_for("a write by the new leader", lambda: election.work(mark, new) or None)
    finally:
        for standby in standbys:
            with contextlib.suppress(OSError):
                os.kill(standby.pid, signal.SIGCONT)
            standby.proxy.restore()
    (other,) = [r for r in standbys if r is not new]
    assert not other.leading() and other.reconciles() == 0, other.operator.logs()
    assert election.lease_spec()["holderIdentity"] == new.name
    lease_writes = [w for w in election.writes(mark) if w.resource == "leases"]
    taken = [w for w in lease_writes if w.source in {r.source for r in standbys} and w.code == 200]
    assert {w.source for w in taken} == {new.source}, taken  # one take-over, then its renewals
    # They competed: the other's write of the same lease, refused.
    assert [w for w in lease_writes if w.source == other.source and w.code == 409], lease_writes
    assert not election.work(mark, other)
    election.assert_one_writer(mark)
    if third is not new:
        third.operator.stop()  # back to a pair


def test_a_409_on_the_lease_is_retried_and_the_leader_keeps_it(
    election: Election, pair: tuple[Replica, Replica]
) -> None:
    """Another client writes the Lease between the leader's GET and PUT (here the admin, labelling it
    while the leader's link is slowed so the two always cross): the PUT is answered 409, and the leader
    retries within its renew deadline instead of giving up or taking the lease anew."""
    leader, standby = pair
    before = election.lease_spec()
    mark = election.audit_mark()
    stop = threading.Event()
    client = Api(election.api._server, election.api._context)
    labelled: list[int] = []
    # The labelling stops at the leader's first 409 (its log says so at once; the audit log is read
    # later): labels that went on while the test reads the audit log would make every retry a 409 too,
    # until the leader rightly gave up at its renew deadline (seen on a loaded host, 2026-11-28).
    log = leader.operator.process.log
    logged_before = log.stat().st_size

    def leader_logged_a_409() -> bool:
        with log.open("rb") as handle:
            handle.seek(logged_before)
            return b": 409, written meanwhile" in handle.read()

    def label() -> None:
        for count in itertools.count():
            if stop.wait(0.05) or leader_logged_a_409():
                return
            answer = client.patch("Lease", *election.lease, {"metadata": {"labels": {"poked": str(count)}}})
            labelled.append(answer.status_code)

    def conflicts() -> list[Write]:
        return [
            w
            for w in election.writes(mark)
            if w.source == leader.source and w.resource == "leases" and w.code == 409
        ]

    thread = threading.Thread(target=label, daemon=True)
    thread.start()
    # 0.1 s on each request the leader sends: a label (one every 50 ms) lands between its GET and its PUT,
    # while a retry still fits the renew deadline (with 0.3 s, under the suite's load, the retries after
    # the 409 ran out of it and the leader rightly gave up, 2026-11-28).
    leader.proxy.delay(0.1)
    try:
        first = wait_for(
            "a 409 on the leader's renewal", lambda: conflicts() or None, timeout=TIMING.renew_deadline
        )[0]
    finally:
        stop.set()
        thread.join(5)
        client.close()
    assert set(labelled) == {200}, labelled
    try:
        wait_for(
            "a renewal after the 409",
            lambda: _last_renewal(election, mark, leader) > first.received,
            timeout=TIMING.renew_deadline,
        )
    finally:
        leader.proxy.restore()
    assert leader.exited() is None and leader.leading() and not standby.leading()
    after = election.lease_spec()
    assert (after["holderIdentity"], after["leaseTransitions"]) == (leader.name, before["leaseTransitions"])
