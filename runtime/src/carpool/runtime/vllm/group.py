"""A LeaderWorkerSet worker's health and drain: it follows its leader (run by the worker's supervisor).

A worker (`model.node_rank` > 0) runs its share of the model's ranks and serves no API, but the group only
serves while every rank is there, so the worker's pod answers the kubelet for the group as its leader sees
it, on the API port (`server.port`, where the leader's probes go too):

- `/v2/health/ready`: 200 only while the worker's engine process runs AND the leader's own
  `/v2/health/ready` answers 200 (probed at `LWS_LEADER_ADDRESS`, `model.leader_address`, every
  `PROBE_PERIOD_S`). A worker never reports ready before its leader has loaded and warmed the group up,
  and turns unready with it (drain, failure).
- `/v2/health/live`: 200 while the worker's engine process runs. The engine's progress (a hung collective)
  is the leader's to judge (its step age, `generation.step_timeout_s`): the leader's liveness fails, the
  kubelet restarts it, and the LeaderWorkerSet recreates the whole group.

A worker follows one leader: the server instance that first answered at `LWS_LEADER_ADDRESS` (the
`instance` its readiness answer names, one per start of the leader's runtime). A group rolled or
recreated gets a new leader pod under the same DNS name, which may be answering (loading, 503) while this
worker still drains; a probe of the name that reaches another instance counts as the leader gone, so the
old worker does not hold its ranks (and GPUs) for the new leader until its drain bound.

Drain: on SIGTERM a worker does not stop its ranks at once; the leader is still answering the requests
it accepted and needs every rank for each step. The worker keeps running until the leader's API no longer
answers at all (its process has exited: connection refused, or its address is gone), or until its own
drain bound (`server.drain_timeout_s` plus a margin, within the pod's terminationGracePeriodSeconds),
whichever comes first; then its ranks are stopped. A leader that answers 503 (draining) still counts as
there. The decisions are the pure functions here (`worker_ready`, `leader_gone`, `stop_ranks`); the
supervisor (`server.Supervisor`) and the HTTP server below do the I/O.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from carpool.runtime.config import RuntimeConfig, TLSConfig
from carpool.runtime.vllm.args import leader_address

log = logging.getLogger(__name__)

READY_PATH = "/v2/health/ready"
LIVE_PATH = "/v2/health/live"
PROBE_PERIOD_S = 2.0
"""How often the worker asks its leader whether it is ready (and, draining, whether it is still there)."""
PROBE_TIMEOUT_S = 2.0


class LeaderAnswer:
    """What one probe of the leader's /v2/health/ready got."""

    READY = "ready"  # 200
    UNREADY = "unready"  # any other HTTP status: loading, warming up, draining, failed
    GONE = "gone"  # no HTTP answer at all: the leader's process is not there


def worker_ready(engine_alive: bool, leader: str) -> bool:
    """Readiness of a worker: its ranks run and its leader serves."""
    return engine_alive and leader == LeaderAnswer.READY


def leader_gone(answers: list[str], needed: int = 2) -> bool:
    """The leader is gone once its last `needed` probes got no HTTP answer (one lost connection alone is
    not enough: a leader that is draining still answers, 503)."""
    return len(answers) >= needed and all(answer == LeaderAnswer.GONE for answer in answers[-needed:])


def stop_ranks(answers: list[str], now: float, deadline: float) -> bool:
    """A draining worker stops its ranks when its leader is gone or its own drain bound has passed."""
    return leader_gone(answers) or now >= deadline


def leader_url(config: RuntimeConfig, environ: Mapping[str, str], path: str = READY_PATH) -> str:
    """The leader's health endpoint: the same port and scheme as this pod's (the group shares a config)."""
    host = leader_address(config.model, environ)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    scheme = "https" if config.server.tls is not None else "http"
    return f"{scheme}://{host}:{config.server.port}{path}"


def client_context(tls: TLSConfig | None) -> ssl.SSLContext | None:
    """For probing the leader over HTTPS: its certificate is not checked (the probe carries no secret
    and reads nothing but the status, as the kubelet's HTTPS probes do); this pod's own certificate is
    presented, for a leader that requires client certificates (`server.tls.client_ca_file`)."""
    if tls is None:
        return None
    context = ssl._create_unverified_context()
    context.load_cert_chain(tls.cert_file, tls.key_file)
    return context


def server_context(tls: TLSConfig | None) -> ssl.SSLContext | None:
    """The worker's health endpoints speak HTTPS where the leader's do: the probes name one scheme."""
    if tls is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tls.cert_file, tls.key_file)
    return context


def probe_leader(url: str, timeout: float = PROBE_TIMEOUT_S, context: ssl.SSLContext | None = None) -> str:
    """One probe of the leader's /v2/health/ready: READY, UNREADY or GONE."""
    return identify_leader(url, timeout, context)[0]


def identify_leader(
    url: str, timeout: float = PROBE_TIMEOUT_S, context: ssl.SSLContext | None = None
) -> tuple[str, str | None]:
    """One probe of the leader's /v2/health/ready: READY, UNREADY or GONE, and the `instance` its answer
    names (None where it names none, or gave no answer)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as response:
            return (
                LeaderAnswer.READY if response.status == 200 else LeaderAnswer.UNREADY,
                _instance(response.read()),
            )
    except urllib.error.HTTPError as error:
        return LeaderAnswer.UNREADY, _instance(error.read())
    except (OSError, ValueError):  # refused, reset, timed out, no such host
        return LeaderAnswer.GONE, None


def _instance(body: bytes) -> str | None:
    try:
        found = json.loads(body).get("instance")
    except (ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


@dataclass
class LeaderWatch:
    """The worker's view of its leader, kept by a thread that probes it every `period_s`."""

    url: str
    probe: Callable[[str], tuple[str, str | None]] = identify_leader
    period_s: float = PROBE_PERIOD_S
    keep: int = 8

    def __post_init__(self) -> None:
        self.answers: list[str] = []
        self.instance: str | None = None
        """The leader this worker follows: the instance that answered first (see the module's docstring)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="carpool-leader-watch", daemon=True)

    @property
    def last(self) -> str:
        return self.answers[-1] if self.answers else LeaderAnswer.UNREADY

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=PROBE_TIMEOUT_S + self.period_s)

    def _run(self) -> None:
        before = None
        while not self._stop.is_set():
            answer = self._probe_once()
            self.answers = [
                *self.answers[-(self.keep - 1) :],
                answer,
            ]  # one assignment: readers see a whole list
            if answer != before:
                log.info("leader %s: %s", self.url, answer)
                before = answer
            self._stop.wait(self.period_s)

    def _probe_once(self) -> str:
        answer, instance = self.probe(self.url)
        if instance is None:
            return answer
        if self.instance is None:
            self.instance = instance
            log.info("leader %s is instance %s: following it", self.url, instance)
        elif instance != self.instance:
            return LeaderAnswer.GONE  # another leader under the name: this worker's leader has left
        return answer


class WorkerHealthServer:
    """The worker's /v2/health/ready and /v2/health/live, on a thread of the supervisor."""

    def __init__(
        self,
        host: str,
        port: int,
        watch: LeaderWatch,
        engine_alive: Callable[[], bool],
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.watch = watch
        self.engine_alive = engine_alive
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status, body = server.answer(self.path)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                return  # the kubelet probes every few seconds: no line each

        class Server(ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            daemon_threads = True

        self.httpd = Server((host, port), Handler)
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, name="carpool-worker-health", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def answer(self, path: str) -> tuple[int, dict[str, object]]:
        alive = self.engine_alive()
        if path == LIVE_PATH:
            return (200 if alive else 503), {"live": alive, "role": "worker"}
        if path == READY_PATH:
            ready = worker_ready(alive, self.watch.last)
            return (200 if ready else 503), {"ready": ready, "role": "worker", "leader": self.watch.last}
        return 404, {"error": f"no such path {path!r}: a worker serves {READY_PATH} and {LIVE_PATH}"}

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
