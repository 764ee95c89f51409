"""Ends keep-alive connections once the server drains, so that clients stop reusing them before it exits.

Without it, a client whose request was answered during the drain sends its next request on the same
connection; if the drain has just finished, the server closes that connection as it exits and the client
sees it dropped without an answer (and cannot know the request never ran). With `Connection: close` on
every response after SIGTERM, the next request opens a new connection: it is refused with 503 while the
server still listens, or not connected once it has gone, both of which a client or load balancer retries.

Connections idle at SIGTERM (a client's pool keeps them between requests) carry no response to mark, and
HTTP/1.1 has no way to end one without a race: a client may be sending its next request on it at the
moment the server closes it, and that request is then lost (neither side can tell whether it ran; clients
retry only idempotent methods, and POST is not one). So the drain keeps them open for a grace
(`server.drain_keep_alive_s`, as Envoy's and Istio's drain duration): a request that arrives on one is
answered, with `Connection: close`, and the client's next request opens a new connection, which
kube-proxy sends to a pod still in the Service (this one has left its EndpointSlice before SIGTERM:
preStop). The grace ends early once every such connection has carried its request or been closed by its
client; only a connection still idle after it is closed (`end_keep_alive`), and only a client silent on
it for the whole grace can race that close. A connection busy at SIGTERM closes after its response, and
its request, read before the drain began, is answered (`READ_BEFORE_DRAIN`), though its handler may run
only after: uvicorn schedules the handler of a request it has read for a later turn of the event loop,
and the drain may start in between (a pooled client's request arriving with SIGTERM).

A connection idle by uvicorn's account may already carry the client's next request: its bytes in the
socket's receive buffer, not yet read because the event loop was busy, or read in part (the parser has
begun a message). Closing it would reset the connection under a request sent before SIGTERM, which the
client sees as a connection dropped without an answer (seen in CI on a loaded host, 2026-11-28). Such a
connection is left open: its request is answered, with `Connection: close`.

A request can still be sent on an idle connection after that check and before the client has read the
server's FIN (a pooled client checked the connection a moment earlier). Closing the socket with its bytes
unread would answer them with a reset, and the client would see its connection dropped mid-request
(`ReadError`; seen in CI, 2026-12-02). So an idle connection whose FIN is sent lingers, as nginx's and
Apache's lingering close do: what arrives is read and dropped until the client closes its side (or
`LINGER_S` pass, or the server exits), and the client reads a clean end of stream before any answer,
which HTTP clients take for an idle connection the server closed (the request was never read).

At the front's exit, closing its listening socket would reset the connections the kernel has queued on
it and nothing has accepted, each maybe with a request in it (a client that reconnected as the drain
ended; seen in CI, 2026-12-06): `close_listeners_quietly` stops new handshakes, takes those in, and lets
every connection end as above before the socket closes.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import ctypes
import fcntl
import os
import socket
import struct
import termios
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Protocol

from starlette.types import Message

from carpool.runtime.api.frontend import READ_BEFORE_DRAIN, Frontend
from carpool.runtime.wire import EngineState

_ENDING = (EngineState.DRAINING, EngineState.STOPPED)

LINGER_S = 5.0
"""How long a closed idle connection keeps reading (and dropping) what its client still sends, at most
(nginx's `lingering_timeout`): a client that read the FIN closes its side at once."""

LINGER_AT_EXIT_S = 1.0
"""How long a lingering connection holds the front's exit, at most: a request that raced the FIN was sent
within moments of it (a pooled client checks the connection just before it sends, and finds it closed
after), and a client that keeps an idle pooled connection without using it may not close it for minutes."""


def is_draining(service: Frontend) -> bool:
    return service.state in _ENDING


def with_connection_close(message: Message) -> Message:
    """A copy of an `http.response.start` message whose headers say `Connection: close`."""
    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
    return {**message, "headers": [*headers, (b"connection", b"close")]}


class HasFileno(Protocol):
    def fileno(self) -> int: ...


class Connection(Protocol):
    """One of uvicorn's connection protocols (`Server.server_state.connections`)."""

    def shutdown(self) -> None: ...


def hold_idle(connections: Iterable[Connection]) -> list[Connection]:
    """At the drain's start: mark each request already read (`READ_BEFORE_DRAIN`), end each busy
    connection's keep-alive (closed once its response is sent), and keep each idle one open. Returns the
    idle connections: a request that arrives on one of them is answered (`_answer_next`), with
    `Connection: close`, until `release_held` closes what is still idle."""
    held: list[Connection] = []
    for connection in list(connections):
        _mark_read(connection)
        if _idle(connection) and hasattr(connection, "cycle"):
            _answer_next(connection)
            held.append(connection)
        else:
            connection.shutdown()
    return held


async def release_held(held: Sequence[Connection], connections: set[Connection], timeout_s: float) -> None:
    """Wait until no connection `hold_idle` kept is still open and idle (its client has sent its next
    request on it, which closes it after the answer, or closed it), or `timeout_s`; then close the held
    connections still idle (`end_keep_alive`). A request that has begun arriving on a held connection is
    answered (`hold_idle` marked it). A connection opened since is left alone: its request is refused
    (503, `Connection: close`, then it closes), and closing it here would race that request, which its
    client may be sending right then (a client that reconnected on the last held connection's answer:
    "Server disconnected without sending a response", make test of 2026-12-06); one still idle at the
    front's exit ends there (`close_listeners_quietly`)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if not any(c in connections and _idle(c) and _lingering(c) is None for c in held):
            break
        await asyncio.sleep(0.01)
    end_keep_alive([c for c in held if c in connections], drain_start=False)


def end_keep_alive(connections: Iterable[Connection], drain_start: bool = True) -> None:
    """Close each idle connection now, and each busy one once its response is sent (uvicorn's
    `shutdown()` of a connection: it closes the transport if no request is under way, else turns the
    request's keep-alive off). A connection on which a request has begun arriving is left open (closing
    it would reset it under the request), and closes after its answer. At the `drain_start`, each request
    already read is marked as such (`READ_BEFORE_DRAIN` in its scope: the one under way, and any pipelined
    behind it), and one arriving is answered (it was sent before the drain began); later (the end of
    `release_held`), only those on the connections held are (`hold_idle` marked them), the rest refused."""
    for connection in list(connections):
        if drain_start:
            _mark_read(connection)
        if not _end(connection) and drain_start:
            _answer_next(connection)


class _AnsweredInDrain:
    """The ASGI app of a connection the drain answers on: marks each request that arrives on it
    (`READ_BEFORE_DRAIN`), before anything else reads its scope (uvicorn's proxy headers may rewrite its
    `client`), and hands it on."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, object], receive: object, send: object) -> None:
        scope[READ_BEFORE_DRAIN] = True
        await self.app(scope, receive, send)


def _answer_next(connection: object) -> None:
    """Have the requests that arrive on `connection` from now on answered in the drain: uvicorn's HTTP
    protocols run each request they read on their `app`, which this wraps."""
    app = getattr(connection, "app", None)
    if app is not None and not isinstance(app, _AnsweredInDrain):
        connection.app = _AnsweredInDrain(app)  # type: ignore[attr-defined]


def _mark_read(connection: Connection) -> None:
    """Mark each request the server has read on `connection` and not answered yet as read before the
    drain: the one under way, and any pipelined behind it."""
    current = getattr(connection, "cycle", None)  # uvicorn's HTTP protocols; none on a WebSocket
    queued = [cycle for cycle, _ in getattr(connection, "pipeline", ())]
    for cycle in (current, *queued):
        if cycle is not None and not cycle.response_complete:
            cycle.scope[READ_BEFORE_DRAIN] = True


def _idle(connection: Connection) -> bool:
    """No request under way on `connection` (one may have begun arriving: `_request_arriving`)."""
    current = getattr(connection, "cycle", None)
    return current is None or bool(current.response_complete)


def _end(connection: Connection) -> bool:
    """End one connection's keep-alive (see `end_keep_alive`); False where a request is arriving on it
    (left open: its request is read and answered, with `Connection: close`)."""
    idle = _idle(connection)
    if idle and _request_arriving(connection, getattr(connection, "cycle", None)):
        return False
    if idle and hasattr(connection, "cycle") and _send_fin(connection):
        _linger(connection)
    else:
        connection.shutdown()
    return True


async def close_listeners_quietly(
    listeners: Iterable[HasFileno], connections: set[Connection], timeout_s: float = LINGER_S
) -> None:
    """Before the front closes its listening socket at exit: stop taking new connections, answer those
    the kernel has already taken, and wait for every connection to end, so that none is reset.

    Closing a listening socket resets every connection in its accept queue: the kernel completed their
    handshakes, their clients sent requests, and nothing ever read them (`ReadError` in a client that
    reconnected as the drain ended: seen in CI, 2026-12-06). Nor can the front close a connection whose
    client is still sending (a lingering one, an accepted one not read yet). So, first, a filter on the
    listening socket drops new connections' handshake packets (a client's SYN is retried a second later
    and then meets a closed port: refused at connect, which every client retries; a Service has sent no
    new connection here since preStop), while the event loop accepts what is queued; each connection then
    ends as in the drain: a request read is answered (503: the drain is over), an idle connection gets
    its FIN and lingers until its client closes. Waits until the accept queues are empty and every
    connection has closed or lingered `LINGER_AT_EXIT_S`, or `timeout_s`."""
    listeners = list(listeners)
    for listener in listeners:
        refuse_new_connections(listener)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (now := loop.time()) < deadline:
        queued = sum(_accept_queue(listener) for listener in listeners)
        open_ = 0
        for connection in list(connections):
            lingering = _lingering(connection)
            if lingering is None:
                _end(connection)
                open_ += 1
            elif now - lingering.since < LINGER_AT_EXIT_S:
                open_ += 1
        if not queued and not open_:
            return
        await asyncio.sleep(0.005)


_DROP_EVERY_PACKET = struct.pack("HBBI", 0x06, 0, 0, 0)  # classic BPF: `ret #0`
"""A socket filter that accepts no packet: on a listening socket, no new handshake completes."""

_SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)


def refuse_new_connections(listener: HasFileno) -> bool:
    """Attach a drop-every-packet filter to a listening socket (Linux; no privilege needed): connections
    already accepted or queued are untouched (their packets reach their own sockets), new handshakes never
    complete. Whether it was attached."""
    program = ctypes.create_string_buffer(_DROP_EVERY_PACKET)
    fprog = struct.pack("HL", 1, ctypes.addressof(program))  # struct sock_fprog: length, pointer
    try:
        with socket.socket(fileno=os.dup(listener.fileno())) as duplicate:
            duplicate.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)
    except (OSError, ValueError, TypeError):
        return False
    return True


def _accept_queue(listener: HasFileno) -> int:
    """Connections in a listening socket's accept queue (Linux reports it in TCP_INFO's `tcpi_unacked`
    for a listener); 0 where it cannot be read."""
    try:
        with socket.socket(fileno=os.dup(listener.fileno())) as duplicate:
            info = duplicate.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except (OSError, ValueError, TypeError):
        return 0
    return int(struct.unpack_from("I", info, 24)[0]) if len(info) >= 28 else 0


def _lingering(connection: object) -> _Lingering | None:
    """The connection's `_Lingering` protocol, if its FIN was sent and it lingers."""
    transport = getattr(connection, "transport", None)
    protocol = transport.get_protocol() if transport is not None else None
    return protocol if isinstance(protocol, _Lingering) else None


def _send_fin(connection: object) -> bool:
    """End an idle HTTP connection's sending side now, in the turn of the check above: the transport's own
    close comes a turn of the event loop later, and meanwhile a pooled client may pick the connection and
    send on it (the request then meets the close: lost, seen once in 2,144 requests of the cluster tier's
    scale-down). With the FIN sent at once, a client that checks a pooled connection before reusing it
    (httpcore, urllib3 and Go's transport do) finds it closed and opens another. Through a duplicate of
    the socket's descriptor: uvloop's transport socket refuses `shutdown()`; a shutdown acts on the
    connection whichever descriptor asks, and closing the duplicate leaves the transport's own open. Not
    while the transport still holds bytes of the last response: its own close sends them first. Whether
    the FIN was sent."""
    transport = getattr(connection, "transport", None)
    sock = _socket(connection)
    if transport is None or sock is None or transport.get_write_buffer_size():
        return False
    try:
        with socket.socket(fileno=os.dup(sock.fileno())) as duplicate:
            duplicate.shutdown(socket.SHUT_WR)
    except (OSError, ValueError, TypeError):
        return False
    return True


class _Lingering(asyncio.Protocol):
    """The protocol of an idle connection after its FIN: drops what arrives and closes the transport once
    the client closes its side, or after `LINGER_S`. uvicorn's own protocol still owns the connection:
    its `connection_lost` runs when the transport closes (it leaves the server's connections then), and
    its `shutdown()` at the server's exit closes the transport as before."""

    def __init__(self, owner: asyncio.BaseProtocol, transport: asyncio.Transport) -> None:
        self._owner = owner
        loop = asyncio.get_running_loop()
        self.since = loop.time()
        self._timer = loop.call_later(LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # a request sent after the FIN: never read, and the client sees the FIN as its answer

    def eof_received(self) -> bool:
        return False  # the client has closed its side: close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._timer.cancel()
        self._owner.connection_lost(exc)


def _linger(connection: object) -> None:
    """Hand an idle connection whose FIN is sent to `_Lingering` (falls back to uvicorn's close)."""
    transport = getattr(connection, "transport", None)
    try:
        transport.set_protocol(_Lingering(connection, transport))  # type: ignore[union-attr, arg-type]
        with contextlib.suppress(RuntimeError, AttributeError):
            transport.resume_reading()  # type: ignore[union-attr]
    except (AttributeError, RuntimeError, NotImplementedError):
        connection.shutdown()  # type: ignore[attr-defined]


def _request_arriving(connection: object, current: object) -> bool:
    """Whether an idle connection carries the start of a request: bytes the parser has begun (httptools
    calls `on_message_begin`, which makes a new scope, at a message's first byte), or bytes still in the
    socket's receive buffer."""
    scope = getattr(connection, "scope", None)
    if scope is not None and (current is None or scope is not getattr(current, "scope", None)):
        return True
    sock = _socket(connection)
    if sock is None:
        return False
    try:
        return unread_bytes(sock) > 0
    except OSError:
        return False


def _socket(connection: object) -> HasFileno | None:
    """The socket under a uvicorn connection's transport (None: no transport, or none exposed)."""
    transport = getattr(connection, "transport", None)
    sock: HasFileno | None = transport.get_extra_info("socket") if transport is not None else None
    return sock


def unread_bytes(sock: HasFileno) -> int:
    """Bytes in a socket's receive buffer that nothing has read yet (FIONREAD)."""
    pending = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, pending)
    return pending[0]
