"""A TCP proxy between one operator replica and the API server, which a test can black-hole or slow down.

It forwards bytes as they are (the TLS session is the replica's with the API server: the proxy sees only
ciphertext), connecting upstream from a loopback address of its own (`source`, e.g. 127.0.0.11), so the
API server's audit log names the replica each request came from in `sourceIPs`.

- `blackhole()`: bytes in either direction are read and dropped, connections stay open and new ones are
  accepted: what a replica sees when a network partition, a dead load balancer or a stuck API server
  replica swallows its requests (no RST, no answer; only its own timeouts end a request).
- `delay(seconds)`: each chunk from the replica reaches the API server that much later (a slow link).
- `restore()`: forward again (connections that lost bytes fail their TLS and are replaced by the client).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class TcpProxy:
    def __init__(self, target: tuple[str, int], source: str = "127.0.0.1") -> None:
        self.target = target
        self.source = source
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._blackholed = False
        self._delay = 0.0
        self._closed = False
        threading.Thread(target=self._accept, name=f"proxy:{self.port}", daemon=True).start()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def blackhole(self) -> None:
        self._blackholed = True

    def delay(self, seconds: float) -> None:
        self._delay = seconds

    def restore(self) -> None:
        self._blackholed = False
        self._delay = 0.0

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()
            self._sockets.clear()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, source_address=(self.source, 0))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            for source, sink, outbound in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(source, sink, outbound), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, outbound: bool) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if self._blackholed:
                    continue  # swallowed
                if outbound and self._delay:
                    time.sleep(self._delay)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)
