"""A LeaderWorkerSet worker follows its leader: ready only with it, and on SIGTERM its ranks stay until
the leader has drained (`carpool.runtime.vllm.group`, `server.Supervisor`).

The decisions are pure functions; the probes and the worker's health endpoints are tested over real HTTP
on this machine. The leader is a stand-in HTTP server answering /v2/health/ready as a carpool leader does
(200 serving, 503 loading or draining, nothing once its process is gone): a real leader needs vLLM's
engine, which the group test in tests/cluster runs. The supervisor's drain is run with a real child
process in the place of vLLM's worker process, and real signals.
"""

from __future__ import annotations

import json
import multiprocessing
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from carpool.runtime.server import Supervisor
from carpool.runtime.vllm.group import (
    LeaderAnswer,
    LeaderWatch,
    WorkerHealthServer,
    identify_leader,
    leader_gone,
    leader_url,
    probe_leader,
    stop_ranks,
    worker_ready,
)
from tests.runtime.factories import runtime_config

GONE, READY, UNREADY = LeaderAnswer.GONE, LeaderAnswer.READY, LeaderAnswer.UNREADY


def test_a_worker_is_ready_only_while_its_ranks_run_and_its_leader_serves() -> None:
    assert worker_ready(True, READY)
    assert not worker_ready(True, UNREADY)  # the leader loads, warms up or drains
    assert not worker_ready(True, GONE)
    assert not worker_ready(False, READY)  # its own ranks have ended


def test_a_draining_leader_is_still_there_and_one_lost_probe_is_not_gone() -> None:
    assert not leader_gone([READY, UNREADY, UNREADY])  # 503 while draining: it still needs the ranks
    assert not leader_gone([UNREADY, GONE])
    assert not leader_gone([GONE, UNREADY])
    assert leader_gone([UNREADY, GONE, GONE])
    assert not stop_ranks([UNREADY, UNREADY], now=10.0, deadline=20.0)
    assert stop_ranks([UNREADY, GONE, GONE], now=10.0, deadline=20.0)
    assert stop_ranks([UNREADY], now=20.0, deadline=20.0)  # the drain bound: no longer than the pod's grace


def test_the_leaders_address_comes_from_the_leader_worker_set() -> None:
    config = runtime_config(model={"name": "m", "nodes": 2, "node_rank": 1, "pipeline_parallel_size": 2})
    environ = {"LWS_LEADER_ADDRESS": "m-lws-0.m-lws.ns"}
    assert leader_url(config, environ) == "http://m-lws-0.m-lws.ns:8000/v2/health/ready"
    v6 = runtime_config(
        model={"name": "m", "nodes": 2, "pipeline_parallel_size": 2, "leader_address": "fd00::1"},
        server={"port": 9000},
    )
    assert leader_url(v6, {}) == "http://[fd00::1]:9000/v2/health/ready"


class Leader:
    """Stand-in for the leader's API port: /v2/health/ready answers `status` (None: the port is closed)."""

    def __init__(self) -> None:
        self.status = 503
        self.instance: str | None = None
        """What its answer names as `instance` (None: an answer without it, as from a runtime not started
        by the supervisor)."""
        self.closed = False
        leader = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps({} if leader.instance is None else {"instance": leader.instance}).encode()
                self.send_response(leader.status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.httpd.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}/v2/health/ready"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def exit(self) -> None:
        if not self.closed:
            self.closed = True
            self.httpd.shutdown()
            self.httpd.server_close()


@contextmanager
def leader() -> Iterator[Leader]:
    stand_in = Leader()
    try:
        yield stand_in
    finally:
        if stand_in.thread.is_alive():
            stand_in.exit()


def test_the_probe_tells_serving_unready_and_gone_apart() -> None:
    with leader() as lead:
        assert probe_leader(lead.url) == UNREADY
        lead.status = 200
        assert probe_leader(lead.url) == READY
        lead.exit()
        assert probe_leader(lead.url) == GONE  # refused: the leader's process is not there
    assert probe_leader("http://no-such-host.invalid:8000/v2/health/ready") == GONE


def test_the_watch_follows_the_leader_that_answered_first_not_a_new_one_under_its_name() -> None:
    """A rolled group's new leader takes the old one's DNS name while the old worker drains: an answer
    from another instance of the runtime under that name reads as the worker's own leader gone."""
    with leader() as lead:
        lead.status = 200
        lead.instance = "first"
        watch = LeaderWatch(lead.url, period_s=0.05)
        watch.start()
        try:
            wait_for(lambda: watch.last == READY, "the leader was never seen ready")
            assert watch.instance == "first"
            lead.status, lead.instance = 503, "second"  # the new leader, loading, where the old one was
            wait_for(lambda: leader_gone(watch.answers), "the old leader was never seen gone")
            lead.instance = "first"  # (the same one again: there after all)
            wait_for(lambda: watch.last == UNREADY, "the old leader was not seen again")
        finally:
            watch.stop()


def test_the_probe_reads_the_instance_from_either_answer() -> None:
    with leader() as lead:
        lead.instance = "abc"
        assert identify_leader(lead.url) == (UNREADY, "abc")
        lead.status = 200
        assert identify_leader(lead.url) == (READY, "abc")
        lead.instance = None
        assert identify_leader(lead.url) == (READY, None)
        lead.exit()
        assert identify_leader(lead.url) == (GONE, None)


def get(url: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def wait_for(condition: object, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_the_workers_readiness_follows_its_leader_over_http() -> None:
    alive = [True]
    with leader() as lead:
        watch = LeaderWatch(lead.url, period_s=0.05)
        watch.start()
        health = WorkerHealthServer("127.0.0.1", 0, watch, lambda: alive[0])
        health.start()
        base = f"http://127.0.0.1:{health.port}"
        try:
            wait_for(lambda: watch.answers, "the leader was never probed")
            assert get(base + "/v2/health/ready")[0] == 503  # the leader is still loading
            assert get(base + "/v2/health/live")[0] == 200
            lead.status = 200
            wait_for(lambda: get(base + "/v2/health/ready")[0] == 200, "the worker never turned ready")
            lead.status = 503  # the leader drains: the group leaves the Service's endpoints together
            wait_for(lambda: get(base + "/v2/health/ready")[0] == 503, "the worker stayed ready")
            lead.status = 200
            wait_for(lambda: get(base + "/v2/health/ready")[0] == 200, "the worker never turned ready")
            alive[0] = False  # its ranks ended
            assert get(base + "/v2/health/ready") == (
                503,
                {"ready": False, "role": "worker", "leader": READY},
            )
            assert get(base + "/v2/health/live")[0] == 503
            assert get(base + "/metrics")[0] == 404
        finally:
            health.stop()
            watch.stop()


def _ranks(started: Any) -> None:
    """The stand-in for vLLM's worker process: runs until SIGTERM."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    started.set()
    stop.wait(60)


@pytest.fixture
def worker_supervisor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Supervisor]:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))  # as `Supervisor.run` sets it
    config = runtime_config(
        model={"name": "m", "nodes": 2, "node_rank": 1, "pipeline_parallel_size": 2},
        server={"drain_timeout_s": 600},
    )
    supervisor = Supervisor(config)
    spawn = multiprocessing.get_context("spawn")
    started = spawn.Event()
    ranks = spawn.Process(target=_ranks, args=(started,), name="carpool-engine")
    ranks.start()
    assert started.wait(60), "the stand-in ranks did not start"
    supervisor.engines.append(ranks)
    try:
        yield supervisor
    finally:
        ranks.kill()
        ranks.join()


def test_on_sigterm_a_worker_keeps_its_ranks_until_its_leader_is_gone(worker_supervisor: Supervisor) -> None:
    supervisor = worker_supervisor
    (ranks,) = supervisor.engines
    with leader() as lead:
        lead.status = 200
        supervisor.leader = LeaderWatch(lead.url, period_s=0.05)
        supervisor.leader.start()
        watching = threading.Thread(target=supervisor._watch, daemon=True)
        try:
            wait_for(lambda: supervisor.leader is not None and supervisor.leader.last == READY, "no probe")
            supervisor._on_signal(signal.SIGTERM, None)  # the pod is deleted: both pods get SIGTERM
            watching.start()
            lead.status = 503  # the leader drains its accepted requests, for minutes: it needs the ranks
            probes = len(supervisor.leader.answers)
            wait_for(lambda: len(supervisor.leader.answers) >= probes + 4, "the leader is not probed")
            assert ranks.is_alive() and supervisor.stopping_at is None
            lead.exit()  # the leader has drained and exited: now the ranks go
            watching.join(timeout=30)
            assert not watching.is_alive(), "the worker's ranks were not stopped after the leader went"
            assert ranks.exitcode == 0  # stopped by SIGTERM (their own handler), not killed
            assert not supervisor.failed
        finally:
            supervisor.leader.stop()
