"""The BatchedModel's Service for the drain test: closed-loop clients spread round-robin over the ready
endpoints, as kube-proxy spreads connections, on the bench load generator's HTTP/1.1 client.

Every request is recorded with the pod it went to and how it ended, so a drain can be judged request
by request: answered (any status), refused (the connection could not be opened: the pod never saw the
request) or lost (written on an open connection and never answered; the bar is zero).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from bench.loadgen import Connection, Payload, ProtocolError, embedding_payloads

from tests.e2e.pods import HOST, LocalPod


@dataclass(frozen=True)
class Outcome:
    pod: str
    sent: float
    done: float
    status: int | None
    error: str | None = None
    """"refused" (no connection) or "lost: <exception>" (no answer on an open connection)."""


@dataclass
class Service:
    pods: list[LocalPod]
    texts: list[str]
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.endpoints = [pod.name for pod in self.pods]
        self._payloads: dict[str, list[Payload]] = {
            pod.name: embedding_payloads(self.texts, HOST, pod.port) for pod in self.pods
        }
        self._ports = {pod.name: pod.port for pod in self.pods}
        self._turn = itertools.count()

    def remove(self, pod: LocalPod) -> None:
        """The endpoint controller takes a terminating pod out of the Service: no new requests go there."""
        self.endpoints = [name for name in self.endpoints if name != pod.name]

    def answered_by(self, pod: LocalPod) -> list[Outcome]:
        return [o for o in self.outcomes if o.pod == pod.name and o.status is not None]

    async def run(self, clients: int, stop: asyncio.Event) -> None:
        await asyncio.gather(*(self._client(slot, stop) for slot in range(clients)))

    async def _client(self, slot: int, stop: asyncio.Event) -> None:
        connections: dict[str, Connection] = {}
        try:
            while not stop.is_set() and self.endpoints:
                turn = next(self._turn)
                name = self.endpoints[turn % len(self.endpoints)]
                payloads = self._payloads[name]
                payload = payloads[(turn * 7 + slot) % len(payloads)]
                sent = time.monotonic()
                conn = connections.get(name)
                if conn is None or conn.closed:
                    try:
                        conn = connections[name] = await Connection.open(HOST, self._ports[name])
                    except OSError:
                        self.outcomes.append(Outcome(name, sent, time.monotonic(), None, "refused"))
                        continue
                try:
                    status, _ = await asyncio.wait_for(conn.exchange(payload.data), 120)
                except (OSError, asyncio.IncompleteReadError, ProtocolError, TimeoutError) as exc:
                    conn.close()
                    self.outcomes.append(Outcome(name, sent, time.monotonic(), None, f"lost: {exc!r}"))
                    continue
                self.outcomes.append(Outcome(name, sent, time.monotonic(), status))
        finally:
            for conn in connections.values():
                conn.close()
