"""Load on a Service of the cluster tier, through its ClusterIP (kube-proxy, tests/cluster/kubeproxy.py).

`Traffic` runs closed-loop client sessions, each with an `httpx.AsyncClient` of its own, as an
application instance holds one OpenAI SDK client: a pool of keep-alive HTTP/1.1 connections to
`http://<ClusterIP>:<port>`, reused from one request to the next (and a pause between requests, when
asked: then the connection sits idle in the pool). Where a connection goes is kube-proxy's choice, made
once per connection (a random ready endpoint), and a pooled connection stays with its pod while that pod
leaves the Service and drains: the traffic of a real cluster, with nothing of the test choosing pods. A
session ends after `session_requests` requests (SESSION_REQUESTS) and another starts, as users come and
go (without that, connections opened while one pod served would never reach the pods added later). No
retries: every error a client sees is recorded, with its kind (refused: the connection could not be
opened; lost: the request was written and no answer came, a reset among them).

`Endpoints` polls the API server for the Service's EndpointSlices (the real EndpointSlice controller's),
keeps the ready addresses and the pod each belongs to (its `targetRef`), and checks, for every pod the
slices list as not ready, that it answered no request while it was so (its own `carpool_requests_total`,
read from the pod before the slices are read again: kube-proxy sends nothing to an endpoint that is not
ready). `answered(pod)` reads what a pod counted.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx
from bench.corpus import corpus
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.api import Api

REQUEST_TIMEOUT_S = 120.0
SESSION_REQUESTS = 20
"""Requests per client session (its own connection pool), before it closes and a new one starts."""


@dataclass(frozen=True)
class Outcome:
    sent: float
    done: float
    status: int | None
    error: str | None = None
    """Why no answer came (`refused: ...`, `lost: ...`), or the body of an answer other than 200."""


def requests_answered(address: str, port: int, status: str | None = None) -> int | None:
    """What the pod at `address` counted in `carpool_requests_total` (of `status`, else every status), from
    its own /metrics; 0 when nothing listens there (it cannot have answered), None when it did not say."""
    try:
        answer = httpx.get(f"http://{address}:{port}/metrics", timeout=5)
    except httpx.ConnectError:
        return 0
    except httpx.TransportError:
        return None
    if answer.status_code != 200:
        return None
    total = 0.0
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            if sample.name == "carpool_requests_total" and status in (None, sample.labels.get("status")):
                total += sample.value
    return int(total)


@dataclass
class Endpoints:
    """The endpoints of `service`, as its EndpointSlices list them, refreshed by a thread."""

    api: Api
    namespace: str
    service: str
    port_name: str = "http"
    ready: dict[str, tuple[str, int]] = field(default_factory=dict)
    """address -> (pod name, port)."""
    not_ready: dict[str, tuple[str, int]] = field(default_factory=dict)
    first_ready: dict[str, float] = field(default_factory=dict)
    """pod name -> time.monotonic() when its endpoint was first seen ready."""
    checked_not_ready: set[str] = field(default_factory=set)
    """The pods found to have answered nothing while their endpoint was not ready."""
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def refresh(self) -> None:
        answer = self.api.request(
            "GET",
            f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices",
            params={"labelSelector": f"kubernetes.io/service-name={self.service}"},
        )
        answer.raise_for_status()
        ready: dict[str, tuple[str, int]] = {}
        not_ready: dict[str, tuple[str, int]] = {}
        for slice_ in answer.json().get("items") or []:
            ports = [p["port"] for p in slice_.get("ports") or [] if p.get("name") == self.port_name]
            for endpoint in slice_.get("endpoints") or []:
                if not ports:
                    continue
                pod = (endpoint.get("targetRef") or {}).get("name", "?")
                into = ready if (endpoint.get("conditions") or {}).get("ready") else not_ready
                for address in endpoint["addresses"]:
                    into[address] = (pod, ports[0])
        now = time.monotonic()
        for pod, _ in ready.values():
            self.first_ready.setdefault(pod, now)
        self.ready, self.not_ready = ready, not_ready

    def _check_not_ready(self) -> None:
        """Read what each pod not yet ready has answered, then the slices again: a pod still listed not
        ready was not ready when it was read, so it must have answered nothing."""
        counted = {
            address: (pod, requests_answered(address, port))
            for address, (pod, port) in self.not_ready.items()
            if pod not in self.first_ready
        }
        self.refresh()
        for address, (pod, count) in counted.items():
            if address in self.not_ready and count is not None:
                if count:
                    self.errors.append(f"{pod} answered {count} requests before its endpoint was ready")
                else:
                    self.checked_not_ready.add(pod)

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self._check_not_ready()
            except Exception as exc:  # keep following; the test reads `errors`
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def start(self) -> Endpoints:
        self.refresh()
        threading.Thread(target=self._loop, name=f"endpoints-{self.service}", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def answered(self, pod: str) -> int | None:
        """The 200s that `pod` (ready now) counted, or None if it is not ready or did not say."""
        for address, (name, port) in self.ready.items():
            if name == pod:
                return requests_answered(address, port, "200")
        return None


@dataclass
class Traffic:
    """Closed-loop embedding requests to `url` (a Service's ClusterIP), by `clients` sessions at a time, each
    pausing `think_s` between its requests; both may change while it runs."""

    url: str
    host: str
    """The Host header: the Service's DNS name, as an in-cluster client sends it."""
    clients: int
    think_s: float = 0.0
    session_requests: int = SESSION_REQUESTS
    outcomes: list[Outcome] = field(default_factory=list)
    sessions: int = 0
    connections: int = 0
    """TCP connections the sessions opened."""
    reconnects: list[float] = field(default_factory=list)
    """When a session opened a connection after its first (time.monotonic()): the server had ended the one
    before (`Connection: close`, or closed while idle), as a drain does; nothing else does here (the pause
    between requests is far below httpx's keep-alive expiry, 5 s, and uvicorn's, 30 s)."""
    closing: int = 0
    """Answers that said `Connection: close` (a draining pod's)."""

    def __post_init__(self) -> None:
        self._bodies = [{"input": text} for text in corpus(256)]
        self._turn = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="traffic", daemon=True)

    def start(self) -> Traffic:
        self._thread.start()
        return self

    def stop(self, timeout: float = REQUEST_TIMEOUT_S + 30) -> None:
        """Stop sending; wait for every request in flight to end (answered or not)."""
        self._stop.set()
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the load generator did not stop"

    async def _run(self) -> None:
        running: dict[int, asyncio.Task[None]] = {}
        while not self._stop.is_set():
            for slot in range(self.clients):
                if slot not in running or running[slot].done():
                    running[slot] = asyncio.create_task(self._session(slot))
            await asyncio.sleep(0.1)
        await asyncio.gather(*running.values())

    def _going_on(self, slot: int) -> bool:
        return not self._stop.is_set() and slot < self.clients

    async def _session(self, slot: int) -> None:
        """One client's session: its own pool (`retries=0`: every error is seen), `session_requests` requests
        on it, then closed, as users come and go; the next session's connection is kube-proxy's new pick."""
        self.sessions += 1
        opened = 0

        async def trace(event: str, info: dict[str, object]) -> None:
            nonlocal opened
            if event == "connection.connect_tcp.complete":
                opened += 1
                self.connections += 1
                if opened > 1:
                    self.reconnects.append(time.monotonic())

        transport = httpx.AsyncHTTPTransport(retries=0)
        async with httpx.AsyncClient(
            base_url=self.url, transport=transport, timeout=REQUEST_TIMEOUT_S, headers={"host": self.host}
        ) as http:
            for _ in range(self.session_requests):
                if not self._going_on(slot):
                    return
                await self._request(http, slot, trace)
                if self.think_s and self._going_on(slot):
                    await asyncio.sleep(self.think_s)

    async def _request(
        self, http: httpx.AsyncClient, slot: int, trace: Callable[[str, dict[str, object]], Awaitable[None]]
    ) -> None:
        turn = next(self._turn)
        body = self._bodies[(turn * 7 + slot) % len(self._bodies)]
        sent = time.monotonic()
        try:
            answer = await http.post("/v1/embeddings", json=body, extensions={"trace": trace})
        except httpx.ConnectError as exc:
            self.outcomes.append(Outcome(sent, time.monotonic(), None, f"refused: {exc!r}"))
            await asyncio.sleep(0.1)
            return
        except httpx.TransportError as exc:
            self.outcomes.append(Outcome(sent, time.monotonic(), None, f"lost: {exc!r}"))
            return
        said = None if answer.status_code == 200 else answer.text[:300]
        self.outcomes.append(Outcome(sent, time.monotonic(), answer.status_code, said))
        if answer.headers.get("connection", "").lower() == "close":
            self.closing += 1

    def statuses(self) -> Counter[str]:
        """How every request ended: its status code, `refused` or `lost`."""
        return Counter(
            str(o.status) if o.status is not None else (o.error or "?").split(":")[0] for o in self.outcomes
        )
