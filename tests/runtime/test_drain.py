"""SIGTERM under load on a real server process: readiness turns 503, accepted work finishes, exit 0."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from bench.server import free_port

from carpool.runtime.api import draining
from carpool.runtime.api.draining import unread_bytes
from carpool.runtime.wire import EngineState
from tests.runtime.conftest import serve, wait_for
from tests.runtime.factories import runtime_config
from tests.runtime.fakes import ScriptedEngine, ScriptedGenerator, expected_embedding, factory
from tests.runtime.lora_helpers import tiny_generator

pytestmark = pytest.mark.slow

TEXT = "Requests share a ride: the runtime groups them into batches so the model does in one pass " * 3


@contextlib.contextmanager
def carpool_serve(
    *flags: str, ready_timeout_s: float
) -> Iterator[tuple[subprocess.Popen[str], httpx.Client]]:
    """`carpool serve` on a free loopback port with `flags`, once ready: the process (its log on stdout)
    and a probe client on its URL. Killed on the way out if the test left it running.

    The probe opens a new connection for every request, as the kubelet's probes do (and as a client new
    to the pod does), so that it is refused once the drain begins (a pooled connection open at SIGTERM
    would carry one more request, answered). What the drain does to pooled connections is tested on its
    own below."""
    port = free_port()
    command = [sys.executable, "-m", "carpool.cli", "serve", "--server.host", "127.0.0.1"]
    server = subprocess.Popen(
        [*command, "--server.port", str(port), *flags],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        fresh = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5, limits=fresh) as probe:

            def ready() -> bool:
                try:
                    return probe.get("/v2/health/ready").status_code == 200
                except httpx.TransportError:
                    return False

            wait_for(ready, timeout=ready_timeout_s, what="server ready")
            yield server, probe
    finally:
        if server.poll() is None:
            server.kill()


@dataclass
class Outcome:
    sent: float
    done: float
    status: int | None
    error: str | None = None


def first_refusal(
    probe: httpx.Client, path: str, body: dict[str, Any], timeout: float = 30.0
) -> httpx.Response:
    """A new request's answer once the front refuses it. Readiness turns 503 when the engine reports
    DRAINING, which may come a moment before this front's own drain begins (the supervisor signals each
    process; on a loaded host the front's turn can come later): until then a new request is still
    answered (200), after it refused (503). Anything else fails the test."""
    deadline = time.monotonic() + timeout
    while True:
        response = probe.post(path, json=body)
        if response.status_code != 200:
            return response
        if time.monotonic() > deadline:
            raise AssertionError(f"new requests to {path} still answered {timeout:.0f} s after SIGTERM")


def test_sigterm_drains_every_accepted_request_and_exits_zero() -> None:
    flags = ["--server.drain-timeout-s", "60", "--batching.max-batch-size", "8"]
    flags += ["--warmup.batch-sizes", "1", "--warmup.sequence-lengths", "16"]
    with carpool_serve(*flags, ready_timeout_s=120) as (server, probe):
        url = str(probe.base_url)
        outcomes: list[Outcome] = []
        lock = threading.Lock()
        stop = threading.Event()

        def client() -> None:
            with httpx.Client(base_url=url, timeout=60) as http:
                while not stop.is_set():
                    sent = time.monotonic()
                    try:
                        status: int | None = http.post("/v1/embeddings", json={"input": TEXT}).status_code
                        error = None
                    except httpx.TransportError as exc:
                        status, error = None, type(exc).__name__
                    with lock:
                        outcomes.append(Outcome(sent, time.monotonic(), status, error))
                    if status != 200:
                        return

        clients = [threading.Thread(target=client) for _ in range(16)]
        for thread in clients:
            thread.start()
        wait_for(lambda: len(outcomes) >= 16, timeout=60, what="load running")
        sigterm_at = time.monotonic()
        server.send_signal(signal.SIGTERM)
        # Readiness turns 503 while the accepted requests are still being answered.
        wait_for(lambda: probe.get("/v2/health/ready").status_code == 503, timeout=10, what="not ready")
        assert probe.get("/v2/health/live").status_code == 200
        refused = first_refusal(probe, "/v1/embeddings", {"input": "late"})
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        assert int(refused.headers["retry-after"]) >= 1
        exit_code = server.wait(timeout=60)
        stop.set()
        for thread in clients:
            thread.join(timeout=60)
        log = server.stdout.read() if server.stdout else ""
    assert exit_code == 0, log
    before = [o for o in outcomes if o.sent < sigterm_at]
    # Sent before SIGTERM: answered 200, or explicitly refused with 503 if it reached the server after the
    # signal; never a dropped connection.
    assert all(o.status in (200, 503) for o in before), [o for o in before if o.status not in (200, 503)]
    finished_during_drain = [o for o in before if o.status == 200 and o.done > sigterm_at]
    assert finished_during_drain, "no request was in flight at SIGTERM: the test proved nothing"
    # Sent after the signal: answered if it got in before the server saw the signal (delivery is not
    # instant), else refused with 503, or never read by the server: refused at connect, or closed unread
    # (RemoteProtocolError: no byte of any response) when it raced the exit of a server with nothing left
    # in flight. Responses after SIGTERM carry `Connection: close` (test_api), which keeps that race to
    # the last moment; a request the server had started would have held the exit back (in flight).
    after = [o for o in outcomes if o.sent >= sigterm_at]
    unread = ("ConnectError", "RemoteProtocolError")
    dropped = [o for o in after if not (o.status in (200, 503) or o.error in unread)]
    assert not dropped, dropped
    assert "draining" in log


def test_sigterm_during_streaming_generation_finishes_every_stream(tmp_path: Path) -> None:
    """Streams under way at SIGTERM run to their end (every token, then [DONE]) before the pod exits 0.
    carpool's own engine (`auto` would take vLLM's where .venv-vllm exists: tests/vllm drains that one),
    on a tiny random Llama: what is checked is the serving path, not the text."""
    model = tiny_generator(tmp_path / "tiny", seed=2)  # greedy: no end-of-text in 480 tokens
    flags = ["--model.source", str(model), "--model.task", "generate", "--model.engine", "carpool"]
    flags += ["--server.drain-timeout-s", "120"]
    flags += ["--generation.max-model-len", "512", "--generation.kv-cache-tokens", "2048"]
    flags += ["--batching.default-timeout-s", "600"]  # the drain ends the streams, never a deadline
    max_tokens = 480
    with carpool_serve(*flags, "--warmup.enabled", "false", ready_timeout_s=240) as (server, probe):
        url = str(probe.base_url)
        started = threading.Semaphore(0)
        streams: list[list[tuple[float, str]]] = []

        def stream(prompt: str) -> None:
            lines: list[tuple[float, str]] = []
            streams.append(lines)
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            with (
                httpx.Client(base_url=url, timeout=120) as http,
                http.stream("POST", "/v1/completions", json=body) as response,
            ):
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line:
                        lines.append((time.monotonic(), line))
                        if len(lines) == 1:
                            started.release()

        prompts = [f"Write a long story about ship number {k}:" for k in range(3)]
        threads = [threading.Thread(target=stream, args=(p,)) for p in prompts]
        for thread in threads:
            thread.start()
        for _ in threads:
            assert started.acquire(timeout=120), "a stream did not start"
        sigterm_at = time.monotonic()
        server.send_signal(signal.SIGTERM)
        wait_for(lambda: probe.get("/v2/health/ready").status_code == 503, timeout=10, what="not ready")
        late = first_refusal(probe, "/v1/completions", {"prompt": "late", "max_tokens": 4})
        assert late.status_code == 503
        for thread in threads:
            thread.join(timeout=120)
        exit_code = server.wait(timeout=60)
        log = server.stdout.read() if server.stdout else ""
    assert exit_code == 0, log
    for lines in streams:
        assert lines[-1][1] == "data: [DONE]", lines[-3:]
        chunks = [json.loads(line.removeprefix("data: ")) for _, line in lines[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
        # It was still streaming when the drain began, and went on to its last token.
        assert any(at > sigterm_at for at, _ in lines[:-1]), "the stream had ended before SIGTERM"
        assert sum(1 for c in chunks if c["choices"][0]["text"]) > 1


def test_a_generation_counts_in_flight_and_holds_the_drain_from_arrival_before_tokenization() -> None:
    """A request whose prompt is still being tokenized (a chat template, a long prompt) is already
    accepted: it shows in `carpool_inflight_requests`, and a drain started then waits for its answer."""
    engine = ScriptedGenerator()
    config = runtime_config(
        model={"name": "fake", "task": "generate"},
        server={"drain_timeout_s": 60},
        warmup={"enabled": False},
    )
    with serve(config, factory(engine), as_front=True) as server, ThreadPoolExecutor(1) as pool:
        codec = server.service._codec()
        tokenizing, release = threading.Event(), threading.Event()
        encode = codec.encode

        def slow_encode(text: str) -> list[int]:
            tokenizing.set()
            release.wait(timeout=60)
            return encode(text)

        codec.encode = slow_encode  # type: ignore[method-assign]
        body = {"prompt": "hello world", "max_tokens": 3}
        answer = pool.submit(server.client.post, "/v1/completions", json=body)
        try:
            assert tokenizing.wait(timeout=30), "the prompt never reached the tokenizer"
            assert server.metric("carpool_inflight_requests", model="fake") == 1.0
            front: Any = server.server
            front.handle_exit(signal.SIGTERM, None)  # what the front process does on SIGTERM
            wait_for(lambda: server.service.draining, what="draining")
            assert server.client.get("/v2/health/ready").status_code == 503
            assert not front.should_exit, "the drain finished with a request still being tokenized"
        finally:
            release.set()
        result = answer.result(timeout=30)
        assert result.status_code == 200, result.text
        assert result.json()["usage"]["completion_tokens"] == 3
        wait_for(lambda: front.should_exit, what="the drain finishing")


def _keep_alive_connection(url: str) -> socket.socket:
    """A raw HTTP/1.1 connection to `url` that has had one request answered and stays open (what a
    client's connection pool holds between requests)."""
    address = httpx.URL(url)
    connection = socket.create_connection((address.host, address.port or 80), timeout=10)
    connection.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: carpool\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += connection.recv(4096)
    head, body = answer.split(b"\r\n\r\n", 1)
    head = head.lower()
    assert head.startswith(b"http/1.1 200") and b"connection: close" not in head, head
    # The whole body too: uvicorn writes the head and the body separately, and a body read later would
    # look like an answer on a connection that should see only the server's FIN.
    (length,) = [
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.startswith(b"content-length:")
    ]
    while len(body) < length:
        body += connection.recv(4096)
    return connection


def _post_embeddings(connection: socket.socket, text: str) -> None:
    """Send an embeddings request for `text` on a raw connection (its answer is the caller's to read)."""
    body = json.dumps({"input": text}).encode()
    connection.sendall(
        b"POST /v1/embeddings HTTP/1.1\r\nHost: carpool\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )


def _read_to_the_end(connection: socket.socket) -> bytes:
    """What the server sends on a raw connection until it closes it (then closed here too); a reset fails
    the test: the server dropped the connection under a request it never answered."""
    answer = b""
    try:
        while chunk := connection.recv(65536):
            answer += chunk
    except OSError as error:
        raise AssertionError(f"the connection was reset under its request: {error!r}") from error
    finally:
        connection.close()
    return answer


def test_an_idle_pooled_connection_carries_one_more_request_in_the_drain_then_closes_after_grace() -> None:
    """Pooled connections idle at SIGTERM stay open for `server.drain_keep_alive_s`: the next request a
    client sends on one is answered (not refused, not lost to a close racing it), with `Connection: close`,
    so its next goes through the Service to a pod still serving; one its client leaves idle gets the
    server's FIN once the grace is over, while a request in flight still holds the drain."""
    engine = ScriptedGenerator()
    grace_s = 1.0
    config = runtime_config(
        model={"name": "fake", "task": "generate"},
        server={"drain_timeout_s": 60, "drain_keep_alive_s": grace_s},
        warmup={"enabled": False},
    )
    with serve(config, factory(engine), as_front=True) as server, ThreadPoolExecutor(1) as pool:
        used, left = _keep_alive_connection(server.url), _keep_alive_connection(server.url)
        codec = server.service._codec()
        tokenizing, release = threading.Event(), threading.Event()
        encode = codec.encode

        def slow_encode(text: str) -> list[int]:
            tokenizing.set()
            release.wait(timeout=60)
            return encode(text)

        codec.encode = slow_encode  # type: ignore[method-assign]
        answer = pool.submit(server.client.post, "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        try:
            assert tokenizing.wait(timeout=30), "the prompt never reached the tokenizer"
            front: Any = server.server
            front.handle_exit(signal.SIGTERM, None)  # what the front process does on SIGTERM
            wait_for(lambda: server.service.draining, what="draining")
            began = time.monotonic()
            # (A request that needs no tokenizing: the one in flight holds the tokenizer.) On a new
            # connection it is refused; on the held one, answered.
            assert server.client.get("/v1/models", headers={"connection": "close"}).status_code == 503
            # Through a proxy on the pod (a mesh's sidecar connects from loopback and says whom for):
            # uvicorn takes the request's client from X-Forwarded-For, and it is still answered.
            used.sendall(b"GET /v1/models HTTP/1.1\r\nHost: carpool\r\nX-Forwarded-For: 10.1.2.3\r\n\r\n")
            reply = _read_to_the_end(used)
            head, _, payload = reply.partition(b"\r\n\r\n")
            assert head.lower().startswith(b"http/1.1 200"), reply[:300]
            assert b"connection: close" in head.lower(), head
            assert json.loads(payload)["data"][0]["id"] == "fake"
            left.settimeout(30)
            try:
                closed = left.recv(4096) == b""  # the server's FIN: the end of the stream
            except TimeoutError:
                closed = False
            waited = time.monotonic() - began
            # Still draining (a request in flight): the close came from the grace's end, not the exit.
            assert not front.should_exit
            assert closed, "the idle keep-alive connection stayed open after the grace"
            assert waited >= grace_s * 0.9, f"the idle connection was closed {waited:.2f} s into the grace"
        finally:
            release.set()
            used.close()
            left.close()
        result = answer.result(timeout=30)
        # The request in flight at SIGTERM is answered, and its connection is not kept for another.
        assert result.status_code == 200, result.text
        assert result.headers["connection"] == "close"


def test_the_keep_alive_grace_ends_once_every_idle_connection_has_carried_its_request_or_closed() -> None:
    """The grace holds the drain only while a connection idle at SIGTERM is still open and unused: once its
    client has sent its request (answered, then closed) or closed it, the front exits, long before a
    grace of a minute."""
    engine = ScriptedEngine()
    config = runtime_config(
        model={"name": "fake"},
        server={"drain_timeout_s": 120, "drain_keep_alive_s": 60},
        warmup={"enabled": False},
    )
    with serve(config, factory(engine), as_front=True) as server:
        used, dropped = _keep_alive_connection(server.url), _keep_alive_connection(server.url)
        server.client.close()  # the fixture's pooled client holds a connection too
        front: Any = server.server
        front.handle_exit(signal.SIGTERM, None)
        wait_for(lambda: server.service.draining, what="draining")
        _post_embeddings(used, "the last one")
        assert _read_to_the_end(used).lower().startswith(b"http/1.1 200")
        assert not front.should_exit, "the drain ended with an idle connection still held open"
        dropped.close()
        wait_for(lambda: front.should_exit, timeout=20, what="the drain ending once no connection was held")


def test_a_request_before_the_fronts_own_drain_is_answered_though_the_engine_began_draining_first() -> None:
    """The supervisor passes SIGTERM to every process, and the engine's DRAINING may reach a front before the
    front's own signal: a request arriving then, on a pooled connection the front's drain has not closed
    yet, is answered (the engine serves until this front says goodbye), and with `Connection: close`, so
    the client's next request goes through the Service to another pod; not refused with 503."""
    engine = ScriptedGenerator()
    config = runtime_config(
        model={"name": "fake", "task": "generate"},
        server={"drain_timeout_s": 60},
        warmup={"enabled": False},
    )
    with serve(config, factory(engine), as_front=True) as server:
        server.core.request_drain()
        wait_for(lambda: server.service.client.state is EngineState.DRAINING, what="the engine draining")
        assert not server.service.draining
        answer = server.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert answer.status_code == 200, answer.text
        assert answer.headers["connection"] == "close"
        assert server.client.get("/v2/health/ready").status_code == 503


def test_a_request_read_before_the_drain_began_is_answered_though_its_handler_runs_after() -> None:
    """uvicorn reads a request and runs its handler on a later turn of the event loop; a drain can begin in
    between (a pooled client's request arriving with SIGTERM, on a loaded pod). The server had read it on
    a connection the drain could not close, so it is answered, with `Connection: close`, not refused with
    the drain's 503. Here the handler is held back until the drain has begun."""
    engine = ScriptedEngine()
    config = runtime_config(model={"name": "fake"}, server={"drain_timeout_s": 60}, warmup={"enabled": False})
    with serve(config, factory(engine), as_front=True) as server, ThreadPoolExecutor(1) as pool:
        route = ("POST", "/v1/embeddings")
        handler = server.app.endpoints[route]
        read, drain_began = threading.Event(), threading.Event()

        async def runs_after_the_drain_begins(scope: Any, receive: Any, send: Any) -> None:
            read.set()
            await asyncio.get_running_loop().run_in_executor(None, drain_began.wait, 60)
            await handler(scope, receive, send)

        server.app.endpoints[route] = runs_after_the_drain_begins
        answer = pool.submit(server.client.post, "/v1/embeddings", json={"input": "read before the drain"})
        assert read.wait(timeout=30), "the request never reached the server"
        front: Any = server.server
        front.handle_exit(signal.SIGTERM, None)  # what the front process does on SIGTERM
        wait_for(lambda: server.service.draining, what="draining")
        drain_began.set()
        result = answer.result(timeout=60)
        assert result.status_code == 200, result.text
        assert result.headers["connection"] == "close"
        assert result.json()["data"][0]["embedding"] == expected_embedding("read before the drain")
        wait_for(lambda: front.should_exit, what="the drain finishing")


def test_a_request_arriving_on_an_idle_pooled_connection_as_the_drain_begins_is_answered_not_reset() -> None:
    """A pooled client sends its next request on a keep-alive connection just before SIGTERM, and the
    server's event loop, busy, has not read it yet when the drain begins: the connection looks idle, but
    closing it would reset it under a request sent before the signal (the client sees the connection
    dropped without an answer; seen in CI). It is answered, with `Connection: close`. Here the server's
    loop is held while the request's bytes land in its socket, and the drain begins before it reads them."""
    engine = ScriptedEngine()
    config = runtime_config(model={"name": "fake"}, server={"drain_timeout_s": 60}, warmup={"enabled": False})
    with serve(config, factory(engine), as_front=True) as server:
        front: Any = server.server
        idle = _keep_alive_connection(server.url)
        held, sent = threading.Event(), threading.Event()

        def hold_the_loop_then_drain() -> None:
            held.set()
            assert sent.wait(timeout=30)
            # The request's bytes are in the server's receive buffer, unread: wait until they are.
            (connection,) = front.server_state.connections
            sock = connection.transport.get_extra_info("socket")
            deadline = time.monotonic() + 10
            while not unread_bytes(sock) and time.monotonic() < deadline:
                time.sleep(0.01)
            # What SIGTERM does (`handle_exit` schedules it), from the loop itself: the drain starts in
            # this callback, before the loop handles the socket's read event.
            front._start_drain()

        front._loop.call_soon_threadsafe(hold_the_loop_then_drain)
        assert held.wait(timeout=30)
        _post_embeddings(idle, "sent before SIGTERM")
        sent.set()
        answer = _read_to_the_end(idle)
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.lower().startswith(b"http/1.1 200"), answer[:300]
        assert b"connection: close" in head.lower(), head
        assert json.loads(payload)["data"][0]["embedding"] == expected_embedding("sent before SIGTERM")
        wait_for(lambda: front.should_exit, what="the drain finishing")


def test_a_request_sent_on_a_pooled_connection_just_after_its_fin_meets_a_clean_close_not_a_reset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pooled client checks its idle connection, finds it open, and sends its next request just as the
    drain sends that connection's FIN: the request's bytes arrive after the drain looked for them. The
    server must not close the socket with them unread (the kernel would answer with a reset, and the
    client would see its connection dropped mid-request: seen in CI); it reads and drops them until the
    client closes its side, so the client reads a clean end of stream and no answer (an idle connection
    the server closed: the request was never read, and clients retry it elsewhere). A client that never
    closes is let go after `LINGER_S`. Here the server's loop is held from the FIN until the bytes are in
    its socket, so the transport's close, a turn later, meets them."""
    monkeypatch.setattr(draining, "LINGER_S", 1.0)
    engine = ScriptedEngine()
    # No grace: the idle connection's FIN leaves at the drain's start, as it does when a grace ends.
    server_config = {"drain_timeout_s": 60, "drain_keep_alive_s": 0}
    config = runtime_config(model={"name": "fake"}, server=server_config, warmup={"enabled": False})
    with serve(config, factory(engine), as_front=True) as server:
        front: Any = server.server
        idle = _keep_alive_connection(server.url)
        drained, sent = threading.Event(), threading.Event()

        def drain_then_hold_the_loop_until_the_request_lands() -> None:
            (connection,) = front.server_state.connections
            sock = connection.transport.get_extra_info("socket")
            front._start_drain()  # what SIGTERM does: the idle connection gets its FIN here
            drained.set()
            assert sent.wait(timeout=30)
            deadline = time.monotonic() + 10
            while not unread_bytes(sock) and time.monotonic() < deadline:
                time.sleep(0.01)

        front._loop.call_soon_threadsafe(drain_then_hold_the_loop_until_the_request_lands)
        assert drained.wait(timeout=30)
        _post_embeddings(idle, "sent as the FIN left")
        sent.set()
        try:
            answer = idle.recv(65536)
            for _ in range(2):  # the transport's close, a turn or two of the loop later, has happened
                asyncio.run_coroutine_threadsafe(asyncio.sleep(0), front._loop).result(timeout=10)
            after = idle.recv(65536)
            idle.send(b"more")  # on a reset connection: ECONNRESET or EPIPE
            later = idle.recv(65536)
        except OSError as error:
            raise AssertionError(f"the connection was reset under the request: {error!r}") from error
        assert (answer, after, later) == (b"", b"", b""), (answer, after, later)
        # The client keeps its end open: the server lets go of the connection after LINGER_S.
        wait_for(
            lambda: not front.server_state.connections, timeout=10, what="the lingering connection closed"
        )
        idle.close()
        assert engine.batches == [], "a request sent after the FIN was run"
        wait_for(lambda: front.should_exit, what="the drain finishing")


def test_a_connection_queued_as_the_drained_front_exits_gets_an_answer_not_a_reset() -> None:
    """A client reconnects just as the drain ends (its last answer said `Connection: close`): the kernel
    completes the handshake and queues the connection, the client sends its request, and the front, with
    nothing left in flight, exits. Closing the listening socket would reset that connection under the
    request (`ReadError` in CI); the front takes it in first, and it is refused with the drain's 503 and
    Retry-After. Here the front's loop is held at the start of its shutdown until the request is in."""
    engine = ScriptedEngine()
    config = runtime_config(model={"name": "fake"}, server={"drain_timeout_s": 60}, warmup={"enabled": False})
    with serve(config, factory(engine), as_front=True) as server:
        front: Any = server.server
        shutdown = front.shutdown
        held, sent = threading.Event(), threading.Event()

        async def held_until_a_request_is_queued(sockets: Any = None) -> None:
            held.set()
            assert sent.wait(timeout=30)
            wait_for(lambda: _received_unread(port, late.getsockname()[1]) > 0, what="the request queued")
            await shutdown(sockets)

        front.shutdown = held_until_a_request_is_queued
        front.handle_exit(signal.SIGTERM, None)  # what the front process does on SIGTERM
        assert held.wait(timeout=30), "the drained front never began its shutdown"
        port = int(server.url.rsplit(":", 1)[1])
        late = socket.create_connection(("127.0.0.1", port), timeout=30)
        _post_embeddings(late, "sent as the drain ended")
        sent.set()
        answer = _read_to_the_end(late)
        head = answer.partition(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"http/1.1 503"), answer[:300]
        assert b"retry-after:" in head and b"connection: close" in head, head
        assert engine.batches == [], "a request that came after the drain was run"


def _received_unread(port: int, peer_port: int) -> int:
    """Bytes waiting in the receive queue of the server's end (local `port`) of the loopback connection
    from `peer_port`, accepted or not (the kernel's table: /proc/net/tcp)."""
    local, remote = f"0100007F:{port:04X}", f"0100007F:{peer_port:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == local and fields[2] == remote:
            return int(fields[4].split(":")[1], 16)
    return 0
