"""Load on a Service of the cluster tier, sent where its EndpointSlices say (no kube-proxy runs here).

`Endpoints` polls the API server for the Service's EndpointSlices and keeps the ready addresses (and the
pod each one belongs to, from its `targetRef`): a terminating pod's endpoint turns not ready at once, a
new pod's appears when its readiness probe passes. `Traffic` runs closed-loop clients on the bench load
generator's HTTP/1.1 client (bench/loadgen.py `Connection`), each request to the next ready endpoint in
turn, as kube-proxy spreads connections; a client drops its connection to an endpoint that left. Every
request is recorded with the pod it went to and how it ended: answered (its status), refused (the
connection could not be opened: the pod never saw it) or lost (written and never answered).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from bench.corpus import corpus
from bench.loadgen import Connection, ProtocolError, embedding_payloads

from tests.cluster.api import Api

REQUEST_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Outcome:
    pod: str
    address: str
    sent: float
    done: float
    status: int | None
    error: str | None = None


@dataclass
class Endpoints:
    """The ready endpoints of `service`, as its EndpointSlices list them, refreshed by a thread."""

    api: Api
    namespace: str
    service: str
    port_name: str = "http"
    ready: dict[str, tuple[str, int]] = field(default_factory=dict)
    """address -> (pod name, port)."""
    first_ready: dict[str, float] = field(default_factory=dict)
    """pod name -> time.monotonic() when its endpoint was first seen ready."""
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
        for slice_ in answer.json().get("items") or []:
            ports = [p["port"] for p in slice_.get("ports") or [] if p.get("name") == self.port_name]
            for endpoint in slice_.get("endpoints") or []:
                if not ports or not (endpoint.get("conditions") or {}).get("ready"):
                    continue
                pod = (endpoint.get("targetRef") or {}).get("name", "?")
                for address in endpoint["addresses"]:
                    ready[address] = (pod, ports[0])
        now = time.monotonic()
        for pod, _ in ready.values():
            self.first_ready.setdefault(pod, now)
        self.ready = ready

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.refresh()
            except Exception as exc:  # keep following; the test reads `errors`
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def start(self) -> Endpoints:
        self.refresh()
        threading.Thread(target=self._loop, name=f"endpoints-{self.service}", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()


@dataclass
class Traffic:
    """Closed-loop embedding requests over the ready endpoints; `clients` may change while it runs."""

    endpoints: Endpoints
    clients: int
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        texts = corpus(256)
        host = f"{self.endpoints.service}.{self.endpoints.namespace}.svc"
        self._payloads = embedding_payloads(texts, host, 8000)
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
                    running[slot] = asyncio.create_task(self._client(slot))
            await asyncio.sleep(0.1)
        await asyncio.gather(*running.values())

    async def _client(self, slot: int) -> None:
        connections: dict[str, Connection] = {}
        try:
            while not self._stop.is_set() and slot < self.clients:
                ready = self.endpoints.ready
                for address in [a for a in connections if a not in ready]:
                    connections.pop(address).close()
                if not ready:
                    await asyncio.sleep(0.1)
                    continue
                addresses = sorted(ready)
                turn = next(self._turn)
                address = addresses[turn % len(addresses)]
                pod, port = ready[address]
                payload = self._payloads[(turn * 7 + slot) % len(self._payloads)]
                sent = time.monotonic()
                conn = connections.get(address)
                if conn is None or conn.closed:
                    try:
                        conn = connections[address] = await asyncio.wait_for(
                            Connection.open(address, port), 10
                        )
                    except (OSError, TimeoutError) as exc:
                        self.outcomes.append(
                            Outcome(pod, address, sent, time.monotonic(), None, f"refused: {exc!r}")
                        )
                        await asyncio.sleep(0.1)
                        continue
                try:
                    status, _ = await asyncio.wait_for(conn.exchange(payload.data), REQUEST_TIMEOUT_S)
                except (OSError, asyncio.IncompleteReadError, ProtocolError, TimeoutError) as exc:
                    conn.close()
                    self.outcomes.append(
                        Outcome(pod, address, sent, time.monotonic(), None, f"lost: {exc!r}")
                    )
                    continue
                self.outcomes.append(Outcome(pod, address, sent, time.monotonic(), status))
        finally:
            for conn in connections.values():
                conn.close()

    def statuses(self) -> Counter[str]:
        """How every request ended: its status code, `refused` or `lost`."""
        return Counter(
            str(o.status) if o.status is not None else (o.error or "?").split(":")[0] for o in self.outcomes
        )

    def answered_by(self) -> Counter[str]:
        return Counter(o.pod for o in self.outcomes if o.status == 200)

    def first_sent(self, pod: str) -> float | None:
        return min((o.sent for o in self.outcomes if o.pod == pod), default=None)
