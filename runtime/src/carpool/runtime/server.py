"""`carpool serve`: the supervisor of a runtime pod's processes.

    supervisor (this module; PID 1 in the container)
    ├── engine process   model, scheduler, warm-up, busy loop        (`engine.process.main`) x model.processes
    └── front processes  HTTP, validation, tokenization, streaming   (`api.process.main`) x server.workers

The supervisor binds one listening socket per front on the API port (SO_REUSEPORT) and hands each front
its own: the kernel spreads new connections evenly over the fronts (see `bind`). Fronts and engine
processes talk over ZeroMQ IPC sockets in a private folder (see `wire`). The supervisor also points
PROMETHEUS_MULTIPROC_DIR at a fresh folder so that any front's /metrics covers every process (see
`metrics`).

Lifecycle: SIGTERM (or SIGINT) is passed to every child: the fronts refuse new requests and answer the
accepted ones, the engine finishes their work and stops once every front is done; the supervisor exits
0. Whatever is still running `server.drain_timeout_s` later (plus a margin) is killed. If the engine or a
front dies on its own, or the model fails to load, the others are stopped and the supervisor exits 1,
so Kubernetes restarts the pod; meanwhile the fronts answer 503 and fail liveness (see `api.client`).

A LeaderWorkerSet worker (`model.node_rank` > 0) runs only vLLM's worker process (its share of the ranks)
and, on a thread, the worker's health endpoints, which follow its leader (`vllm.group`). On SIGTERM it
keeps its ranks running until its leader has gone (the leader still needs them for the requests it drains)
or the drain bound has passed, and only then passes the signal on.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
import uuid
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from types import FrameType

from carpool.runtime.config import EngineKind, RuntimeConfig
from carpool.runtime.logs import configure
from carpool.runtime.native import NativeFront, NativeFrontMissing, bind_upstreams
from carpool.runtime.native import settings as native_settings
from carpool.runtime.native import wanted as native_wanted
from carpool.runtime.vllm.group import (
    LeaderWatch,
    WorkerHealthServer,
    client_context,
    identify_leader,
    leader_gone,
    leader_url,
    server_context,
    stop_ranks,
)
from carpool.runtime.vllm.launch import Choice, EngineProcess, decide
from carpool.runtime.wire import INSTANCE_ENV, Addresses

log = logging.getLogger(__name__)

Child = BaseProcess | EngineProcess | NativeFront
"""A process the supervisor starts and watches."""

STOP_MARGIN_S = 5.0
"""Beyond the drain timeout, how long children get to exit before they are killed."""


def available_cpus() -> float:
    """CPUs this process may use: the cgroup v2 quota where one is set, else the affinity mask."""
    cpus = float(len(os.sched_getaffinity(0)))
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()  # noqa: SIM115
        if quota != "max":
            cpus = min(cpus, int(quota) / int(period))
    except (OSError, ValueError):
        pass
    return cpus


def resolve_workers(setting: int | str, cpus: float | None = None) -> int:
    """`server.workers`: a number, or `auto`: one front where there are at most 2 CPUs (the engine needs
    the other), else half the CPUs up to 4 (the engine's threads and the model need the rest)."""
    if isinstance(setting, int):
        return setting
    cpus = available_cpus() if cpus is None else cpus
    return 1 if cpus <= 2 else max(1, min(4, int(cpus // 2)))


LISTEN_BACKLOG = 2048
"""Connections each front's socket queues before it accepts them (uvicorn's default)."""


def bind(config: RuntimeConfig, fronts: int) -> list[socket.socket]:
    """One listening socket per front, all on the API port with SO_REUSEPORT: the kernel hashes each new
    connection (its addresses and ports) onto one of them, so connections spread evenly over the fronts
    whatever each front is doing.

    A single socket shared by every front (uvicorn's own multiprocess layout, and carpool's before issue
    37) leaves the choice to an accept race: every front's event loop wakes on a new connection, and the
    first to run accepts every connection waiting (asyncio accepts up to its backlog at once), so a burst
    of keep-alive clients lands mostly on whichever fronts were idle at the moment: 0.92, 0.92, 0.60 and
    0.29 cores on four fronts under 128 clients (an H100 run, 2026-11-27).

    The port is first bound alone, without SO_REUSEPORT, and released: a port another process holds, even
    one that set SO_REUSEPORT itself, fails the start (EADDRINUSE) instead of silently sharing its
    connections. The sockets listen at once, so a connection made while the fronts start waits for them."""
    host, port = config.server.host, config.server.port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
    sockets: list[socket.socket] = []
    try:
        for _ in range(fronts):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            sock.listen(LISTEN_BACKLOG)
            sock.set_inheritable(True)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class Supervisor:
    """Starts the engine and the fronts, passes signals on, and decides the exit code."""

    def __init__(self, config: RuntimeConfig, engine_factory: str | None = None) -> None:
        self.config = config
        self.engine_factory = engine_factory
        self.workers = resolve_workers(config.server.workers)
        self.folder = tempfile.mkdtemp(prefix="carpool-")
        self.native = native_wanted(config)
        """The native front's executable, where it owns the port and the last front slot (the Python
        fronts then take Unix sockets); None where the Python fronts serve the port."""
        slots = self.workers + 1 if self.native is not None else self.workers
        self.addresses = Addresses.in_folder(self.folder, slots, config.model.processes)
        self.stopping_at: float | None = None
        self.forced = False
        self.failed = False
        self.engines: list[Child] = []
        self.fronts: list[Child] = []
        self.killed: list[Child] = []
        self.leader: LeaderWatch | None = None
        """A LeaderWorkerSet worker's view of its leader (None in a pod that serves)."""
        self.health: WorkerHealthServer | None = None
        self.leaving_at: float | None = None
        """A worker told to stop: until when it waits for its leader to go before stopping its ranks."""

    def run(self) -> int:
        metrics_dir = os.path.join(self.folder, "metrics")
        os.mkdir(metrics_dir)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # read by the children at import
        # This start of the runtime, named in every front's readiness answer: a LeaderWorkerSet worker
        # tells its own leader from a new one under the same name (vllm/group.py).
        os.environ[INSTANCE_ENV] = uuid.uuid4().hex
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._start()
            self._watch()
        finally:
            if self.health is not None:
                self.health.stop()
            if self.leader is not None:
                self.leader.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            os.environ.pop(INSTANCE_ENV, None)
            shutil.rmtree(self.folder, ignore_errors=True)
        return 1 if self.failed else 0

    def _start(self) -> None:
        from carpool.runtime.api.process import main as front_main
        from carpool.runtime.engine.process import main as engine_main

        spawn = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or threads
        data = self.config.model_dump(mode="json")
        choice = (
            Choice(EngineKind.CARPOOL, None, "engine factory") if self.engine_factory else decide(self.config)
        )
        log.info("engine: %s (%s)", choice.engine.value, choice.reason)
        if choice.python is not None and self.config.model.node_rank > 0:
            worker = EngineProcess(choice.python, self.config, self.addresses, command="worker")
            worker.start()
            self.engines.append(worker)
            self.workers = 0  # a LeaderWorkerSet worker runs its share of the model; the leader serves
            tls = self.config.server.tls
            client = client_context(tls)
            self.leader = LeaderWatch(
                leader_url(self.config, os.environ), lambda url: identify_leader(url, context=client)
            )
            self.leader.start()
            self.health = WorkerHealthServer(
                self.config.server.host,
                self.config.server.port,
                self.leader,
                worker.is_alive,
                server_context(tls),
            )
            self.health.start()
            log.info(
                "vLLM worker %d of %d: engine pid %d",
                self.config.model.node_rank,
                self.config.model.nodes,
                worker.pid,
            )
            return
        executable = self.native
        if executable is not None and choice.python is not None:
            raise NativeFrontMissing(
                "server.native_front serves models on carpool's engine only: this model runs on vLLM's "
                "engine (model.engine); turn server.native_front off"
            )
        if executable is not None:
            sockets = bind_upstreams(self.folder, self.workers, LISTEN_BACKLOG)
            sockets.extend(bind(self.config, 1))
        else:
            sockets = bind(self.config, self.workers)
        try:
            if choice.python is not None:  # vLLM's engine, in vLLM's environment: one process
                vllm_engine = EngineProcess(choice.python, self.config, self.addresses)
                vllm_engine.start()
                self.engines.append(vllm_engine)
            for index in range(self.addresses.engines if choice.python is None else 0):
                engine = spawn.Process(
                    target=engine_main,
                    args=(data, self.addresses, self.engine_factory, index),
                    name="carpool-engine" if index == 0 else f"carpool-engine-{index}",
                )
                engine.start()
                self.engines.append(engine)
            for index in range(self.workers):
                front = spawn.Process(
                    target=front_main,
                    args=(data, self.addresses, index, sockets[index]),
                    name=f"carpool-front-{index}",
                )
                front.start()
                self.fronts.append(front)
            if executable is not None:
                payload = native_settings(self.config, self.addresses, self.folder, self.workers)
                door = NativeFront(executable, payload, sockets[-1])
                door.start()
                self.fronts.append(door)
        finally:
            for sock in sockets:
                sock.close()  # the fronts hold their own copies
        log.info(
            "serving on %s:%d: engine pid(s) %s, %d front(s) %s",
            self.config.server.host,
            self.config.server.port,
            [engine.pid for engine in self.engines],
            self.workers,
            [front.pid for front in self.fronts],
        )

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if self.stopping_at is not None:
            if sig == signal.SIGINT:
                self.forced = True
            return
        if self.leader is not None and sig == signal.SIGTERM:
            if self.leaving_at is None:
                self.leaving_at = time.monotonic() + self.config.drain_timeout() + STOP_MARGIN_S
                log.info("received SIGTERM: keeping this worker's ranks until the leader has drained")
            return
        log.info("received %s: draining the fronts and the engine", signal.Signals(sig).name)
        self._stop(signal.SIGTERM)

    def _stop(self, sig: int) -> None:
        if self.stopping_at is None:
            self.stopping_at = time.monotonic() + self.config.drain_timeout() + STOP_MARGIN_S
        for process in self._children():
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, sig)

    def _children(self) -> list[Child]:
        return [*self.engines, *self.fronts]

    def _watch(self) -> None:
        from prometheus_client import multiprocess

        running = {p.sentinel: p for p in self._children()}
        while running:
            timeout = None if self.stopping_at is None else max(0.0, self.stopping_at - time.monotonic())
            ended = wait(list(running), timeout=0.5 if timeout is None else min(0.5, timeout))
            for sentinel in ended:
                process = running.pop(sentinel)  # type: ignore[arg-type]
                process.join()
                if process.pid is not None:
                    multiprocess.mark_process_dead(process.pid)  # type: ignore[no-untyped-call]
                self._ended(process)
            self._leave_when_leader_gone()
            if self.forced or (self.stopping_at is not None and time.monotonic() >= self.stopping_at):
                for process in running.values():
                    log.warning("%s (pid %s) did not stop in time: killing it", process.name, process.pid)
                    self.killed.append(process)
                    process.kill()

    def _leave_when_leader_gone(self) -> None:
        """A worker told to stop: stop its ranks once its leader is gone or the drain bound has passed."""
        if self.leader is None or self.leaving_at is None or self.stopping_at is not None:
            return
        if stop_ranks(self.leader.answers, time.monotonic(), self.leaving_at):
            gone = leader_gone(self.leader.answers)
            log.info(
                "the leader %s: stopping this worker's ranks", "is gone" if gone else "did not go in time"
            )
            self._stop(signal.SIGTERM)

    def _ended(self, process: Child) -> None:
        code = process.exitcode
        if self.leaving_at is not None:  # a draining worker's ranks may end with their leader
            log.info("%s stopped (exit %s) after SIGTERM", process.name, code)
            return
        if self.stopping_at is not None and (code == 0 or self.failed or process in self.killed):
            log.info("%s stopped (exit %s)", process.name, code)
            return
        self.failed = True
        if process in self.engines:
            log.error("the engine process exited with %s (%s): stopping the pod (exit 1)", code, process.name)
        else:
            log.error("%s exited with %s: stopping the pod (exit 1)", process.name, code)
        self._stop(signal.SIGTERM)
        for engine in self.engines:
            if engine is not process and engine.is_alive():
                engine.kill()  # it would wait for that front's goodbye, or serve a pod that is going


def run(config: RuntimeConfig, engine_factory: str | None = None) -> int:
    """Serve until drained or failed; returns the process exit code. `engine_factory` names a callable
    (`module:attribute`, config -> engine) to serve instead of the transformers engines."""
    configure(config.server.log_level, config.server.log_format)
    return Supervisor(config, engine_factory).run()
