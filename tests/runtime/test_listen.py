"""The fronts' listening sockets (`server.bind`): new connections spread over every front, and a port
another process holds fails the start instead of sharing its connections. Real sockets on loopback."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest
from bench.server import free_port

from carpool.runtime.config import RuntimeConfig
from carpool.runtime.server import bind

HOST = "127.0.0.1"


def config(port: int) -> RuntimeConfig:
    return RuntimeConfig.model_validate({"server": {"host": HOST, "port": port}})


@contextmanager
def closing_all(sockets: list[socket.socket]) -> Iterator[list[socket.socket]]:
    try:
        yield sockets
    finally:
        for sock in sockets:
            sock.close()


def accepted(sock: socket.socket) -> int:
    """Connections waiting on `sock`, accepted (and closed) until none is left."""
    sock.setblocking(False)
    count = 0
    while True:
        try:
            conn, _ = sock.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1


def test_new_connections_spread_over_every_fronts_socket() -> None:
    """With one socket shared by the fronts, the first front to accept takes every waiting connection (the
    accept race that left one of four fronts at a third of another's load); with one socket per front the
    kernel hashes each connection onto one of them. 200 connections over 4 sockets: 50 each expected, and a
    socket with fewer than 20 is 5 standard deviations out."""
    port = free_port()
    with closing_all(bind(config(port), 4)) as sockets, ExitStack() as clients:
        for _ in range(200):
            clients.enter_context(socket.create_connection((HOST, port), timeout=10))
        counts = [accepted(sock) for sock in sockets]
    assert sum(counts) == 200
    assert min(counts) >= 20, counts


def test_a_port_another_process_holds_fails_the_start_even_with_so_reuseport() -> None:
    port = free_port()
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind((HOST, port))
        other.listen()
        with pytest.raises(OSError) as raised:
            bind(config(port), 2)
    assert raised.value.errno == errno.EADDRINUSE
